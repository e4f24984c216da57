"""The EAGLE heads' decoder layer as a lean forward for drafting (the runtime twin of
`heads.eagle.EagleHead` and `heads.eagle3.Eagle3Head`, as `eval.runtime.model.LeanLlama` is the target's).

Drafting runs the head once per tree level on every speculative step, so its fixed costs count:
the module path (`nn.Linear`, K/V concatenated onto the past each call, RoPE recomputed per call)
cost ~3 ms per head forward on the 2-core CPU, a sizeable share of a ~45 ms target step. Here the
weights are laid out like the target's (`eval.runtime.model.Linear`: transposed for one-row GEMVs, oneDNN
packed for several rows, q|k|v and gate|up fused), RoPE comes from a precomputed table and the
K/V live in a preallocated buffer:

    [0, length)                       committed positions, fed with the target's true features
    [length, length + drafted)        this proposal's drafted entries (tree levels, chain steps)

`commit` appends positions to the committed part (and drops any drafted entries); `draft` appends
entries after the drafted ones under an explicit mask. Every position has at least one slot, so
positions stay below `length + drafted`, and the RoPE table grows with the K/V buffer.

What differs per head kind sits in one small object (`HeadInputs`): which target layers it reads,
how they become the layer's hidden input (`project`, at commit), how (embedding, hidden) become the
attention input and the residual, what a fed-back output becomes (`feedback`) and the draft logits
with their vocabulary. A draft step feeds the previous output back as the hidden input for both
kinds (EAGLE-1/2: f̂, EAGLE-3: the pre-norm output, or its norm under norm_output). Numerically it
is the heads' own forward (tested against both in float64 and fp32).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from eval.runtime.model import Linear, RMSNorm, _fused, _rotate
from heads.eagle import EagleHead
from heads.eagle3 import Eagle3Head

_GROW = 256  # K/V and RoPE tables grow by at least this many positions when full


def _linear(module) -> Linear:
    return Linear(module.weight, module.bias, pack=True)


def rope_table(inv_freq: torch.Tensor, scaling: float, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE for positions 0..size-1: (cos, signed sin), each (size, hd) in `dtype`, as `_rotate` reads them."""
    angles = torch.outer(torch.arange(size, dtype=torch.float32, device=inv_freq.device), inv_freq)
    cos, sin = angles.cos() * scaling, angles.sin() * scaling
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


class HeadInputs(Protocol):
    """feature_layers: target hidden layers read at commit (transformers numbering, -1 = final
    post-norm state), concatenated in this order. vocab: (Vd,) target ids of the draft logits'
    columns, ascending, or None when they are the whole target vocabulary in order."""

    feature_layers: tuple[int, ...]
    vocab: torch.Tensor | None

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """(n, F) target features -> (n, D) hidden input of a committed position."""

    def inputs(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, hidden (n, D) -> (attention input (n, D or 2D), residual (n, D))."""

    def feedback(self, out: torch.Tensor) -> torch.Tensor:
        """(n, D) outputs of the parents -> (n, D) hidden input of their drafted children."""

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """(n, D) layer outputs -> (n, Vd) float draft logits."""

    def linear_sites(self) -> dict[str, list[Linear]]:
        """The head's own linear layers here, by role (`LeanEagleHead.linear_sites`)."""


class Eagle1Inputs:
    """EAGLE-1/2: x = fc(cat(e, f)) is the attention input and the residual; logits through the
    target's lm_head `lm_head` (rows of `draft_vocab` only, when given; None: no logits)."""

    feature_layers = (-1,)

    def __init__(self, head: EagleHead, lm_head: Linear | None = None, draft_vocab: torch.Tensor | None = None):
        self.fc = _linear(head.fc)
        self.vocab = None if draft_vocab is None else torch.as_tensor(draft_vocab, dtype=torch.long)
        self.projection = lm_head
        if lm_head is not None and self.vocab is not None:  # (Vd, D) rows, packed for the multi-row tree levels
            self.projection = Linear(lm_head.weight_t[:, self.vocab].t(), pack=True)

    def project(self, features):
        return features  # f_t enters fc beside the embedding

    def inputs(self, embeds, hidden):
        x = self.fc(torch.cat((embeds, hidden), dim=-1))  # (n, D)
        return x, x

    def feedback(self, out):
        return out  # f̂ itself

    def linear_sites(self):
        # the target's own lm_head (full vocabulary) is the target's layer, not the head's
        own = self.projection is not None and self.vocab is not None
        return {"fc": [self.fc], **({"lm_head": [self.projection]} if own else {})}

    def logits(self, out):
        if self.projection is None:
            raise RuntimeError("lean eagle head: built without the target's lm_head, it has no logits")
        return self.projection(out.to(self.projection.weight_t.dtype)).float()


class Eagle3Inputs:
    """EAGLE-3: h = fc(cat(aux)) at commit, aux RMS-normed first as one vector (norm_before_fc) or
    stream by stream (fc_norm); the layer reads cat(input_layernorm(e), hidden_norm(h)) with
    residual h (or hidden_norm(h) when norm_before_residual); a drafted child reads its parent's out
    (norm(out) under norm_output); logits = lm_head(norm(out)) over the head's own draft vocabulary
    (draft id i = target id i + d2t[i])."""

    def __init__(self, head: Eagle3Head):
        c, layer = head.config, head.midlayer
        self.feature_layers = tuple(c.aux_layer_ids)
        self.fc, self.lm_head = _linear(head.fc), _linear(head.lm_head)
        self.input_norm = RMSNorm(layer.input_layernorm.weight, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(layer.hidden_norm.weight, c.rms_norm_eps)
        self.norm = RMSNorm(head.norm.weight, c.rms_norm_eps)
        self.norm_before_residual = c.norm_before_residual
        self.norm_output = c.norm_output
        # fc's input norms: one over all of aux, or one per stream of width Ht (none: aux as it is)
        self.stream_width = len(c.aux_layer_ids) * c.target_hidden_size if c.norm_before_fc else c.target_hidden_size
        self.fc_norms = ([RMSNorm(head.input_norm.weight, c.rms_norm_eps)] if c.norm_before_fc else
                         [RMSNorm(norm.weight, c.rms_norm_eps) for norm in head.fc_norm] if c.fc_norm else [])
        self.vocab = None if c.draft_vocab_size == c.vocab_size else head.draft_ids().detach().clone()

    def project(self, features):
        if self.fc_norms:
            streams = features.split(self.stream_width, dim=-1)
            features = torch.cat([norm(stream) for norm, stream in zip(self.fc_norms, streams, strict=True)], dim=-1)
        return self.fc(features)  # (n, n_aux * Ht) -> (n, D)

    def feedback(self, out):
        return self.norm(out) if self.norm_output else out

    def linear_sites(self):
        return {"fc": [self.fc], "lm_head": [self.lm_head]}

    def inputs(self, embeds, hidden):
        normed = self.hidden_norm(hidden)
        x = torch.cat((self.input_norm(embeds), normed), dim=-1)  # (n, 2D), embedding first
        return x, normed if self.norm_before_residual else hidden

    def logits(self, out):
        return self.lm_head(self.norm(out)).float()


class LeanEagleHead:
    """The lean runtime of an EagleHead (with the target's `lm_head`, optionally over `draft_vocab`,
    for logits) or an Eagle3Head (its own norm, lm_head and d2t)."""

    @torch.no_grad()
    def __init__(self, head: EagleHead | Eagle3Head, capacity: int = 1024, lm_head: Linear | None = None,
                 draft_vocab: torch.Tensor | None = None):
        c = head.config
        if isinstance(head, Eagle3Head):
            if lm_head is not None or draft_vocab is not None:
                raise ValueError("lean eagle head: an EAGLE-3 head drafts with its own lm_head over its own "
                                 "vocabulary (d2t); lm_head and draft_vocab must be None")
            self.head_inputs: HeadInputs = Eagle3Inputs(head)
            layer = head.midlayer
        else:
            self.head_inputs = Eagle1Inputs(head, lm_head, draft_vocab)
            layer = head.layers[0]
        self.feature_layers, self.vocab = self.head_inputs.feature_layers, self.head_inputs.vocab
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.dtype = head.fc.weight.dtype
        self.device = head.fc.weight.device
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _fused(_linear(attn.q_proj), _linear(attn.k_proj), _linear(attn.v_proj))
        self.o = _linear(attn.o_proj)
        self.gate_up = _fused(_linear(mlp.gate_proj), _linear(mlp.up_proj))
        self.down = _linear(mlp.down_proj)
        eps = c.rms_norm_eps
        self.post_norm = RMSNorm(layer.post_attention_layernorm.weight, eps)
        self.q_norm = RMSNorm(attn.q_norm.weight, eps) if c.qk_norm else None
        self.k_norm = RMSNorm(attn.k_norm.weight, eps) if c.qk_norm else None
        self.inv_freq, self.scaling = head.inv_freq.float(), float(head.attention_scaling)
        self.cos = self.sin = torch.empty(0, self.head_dim, dtype=self.dtype, device=self.device)
        self.k = self.v = torch.empty(self.kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
        self._reserve(capacity)
        self.length = 0
        self.drafted = 0

    def linear_sites(self) -> dict[str, list[Linear]]:
        """The linear layers by role, named as the target's (`LeanLlama.linear_sites`) where they play
        the same part: fc, the decoder layer's, and the draft vocabulary's projection (lm_head)."""
        return {"qkv_proj": [self.qkv], "o_proj": [self.o], "gate_up_proj": [self.gate_up], "down_proj": [self.down],
                **self.head_inputs.linear_sites()}

    def _reserve(self, size: int) -> None:
        if size > self.k.shape[1]:
            size = max(size, self.k.shape[1] + _GROW)
            k = torch.zeros(self.kv_heads, size, self.head_dim, dtype=self.dtype, device=self.device)
            v = torch.zeros_like(k)
            k[:, : self.k.shape[1]], v[:, : self.v.shape[1]] = self.k, self.v
            self.k, self.v = k, v
        if size > self.cos.shape[0]:
            self.cos, self.sin = rope_table(self.inv_freq, self.scaling, size, self.dtype)

    def reset(self) -> None:
        self.length = self.drafted = 0

    def truncate(self, length: int) -> None:
        """Forget committed positions from `length` on (and every drafted entry)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"lean eagle head: cannot truncate {self.length} positions to {length}")
        self.length, self.drafted = length, 0

    @property
    def committed_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v), each (1, nKV, length, hd): the committed cache in the heads' past layout."""
        return self.k[None, :, : self.length], self.v[None, :, : self.length]

    @torch.no_grad()
    def commit(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Feed positions length..length+n-1 (causal among themselves) and keep them; drafted
        entries are dropped first. embeds (n, D); features (n, F): the target's `feature_layers`
        concatenated. Returns the outputs (n, D) (EAGLE-1/2: f̂; EAGLE-3: pre-norm)."""
        self.drafted = 0
        n = embeds.shape[0]
        hidden = self.head_inputs.project(features.to(self.device, self.dtype))
        out = self._forward(embeds, hidden, torch.arange(self.length, self.length + n, device=self.device), None)
        self.length += n
        return out

    @torch.no_grad()
    def draft(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              mask: torch.Tensor | None = None) -> torch.Tensor:
        """Feed n drafted entries after the current ones; hidden (n, D): the parents' outputs (fed
        back as the head feeds them, `HeadInputs.feedback`). mask: (n, length + drafted + n) bool,
        True = may attend; None = everything before plus causal among the n. Returns the outputs (n, D)."""
        out = self._forward(embeds, self.head_inputs.feedback(hidden.to(self.device, self.dtype)), positions, mask)
        self.drafted += embeds.shape[0]
        return out

    @torch.no_grad()
    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """(n, D) outputs -> (n, Vd) float draft logits; column j is target id vocab[j] (or j)."""
        return self.head_inputs.logits(out)

    def rotated_qk(self, qkv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, H + 2 Hkv, hd) fused projections at `positions` (rows,) -> RoPE-rotated q
        (rows, H, hd) and k (rows, Hkv, hd), q/k-normed first where the head has those norms."""
        H, Hkv = self.heads, self.kv_heads
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # (rows, 1, hd)
        if self.q_norm is None:
            qk = _rotate(qkv[:, : H + Hkv], cos, sin)
            return qk[:, :H], qk[:, H:]
        q, k, _ = qkv.split((H, Hkv, Hkv), dim=1)
        return _rotate(self.q_norm(q), cos, sin), _rotate(self.k_norm(k), cos, sin)

    def _forward(self, embeds, hidden, positions, mask):
        n, H, Hkv, hd = embeds.shape[0], self.heads, self.kv_heads, self.head_dim
        start = self.length + self.drafted
        end = start + n
        self._reserve(end)  # positions < end (module docstring): the RoPE table covers them
        positions = positions.to(self.device)
        if mask is None and n > 1:
            mask = torch.ones(n, end, dtype=torch.bool, device=self.device).tril_(start)
        elif mask is not None:
            mask = mask.to(self.device)  # drafters build tree masks on the host
        # a split target's embeddings come from its first device, its features from its last (the head's)
        x, residual = self.head_inputs.inputs(embeds.to(self.device, self.dtype), hidden)
        qkv = self.qkv(x).view(n, H + 2 * Hkv, hd)
        q, k = self.rotated_qk(qkv, positions)
        self.k[:, start:end] = k.transpose(0, 1)
        self.v[:, start:end] = qkv[:, H + Hkv:].transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], self.k[None, :, :end], self.v[None, :, :end], attn_mask=mask,
            enable_gqa=H != Hkv,
        )  # (1, H, n, hd)
        x = residual + self.o(out[0].transpose(0, 1).reshape(n, H * hd))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)
