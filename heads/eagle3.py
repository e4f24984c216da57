"""EAGLE-3 draft model: several target layers fused by `fc`, one decoder layer over
`cat(input_layernorm(embed(x)), hidden_norm(h))`, its own norm and lm_head over a draft vocabulary.

Step 0 reads h = fc(cat(aux_1..aux_n)) (B, T, n·Ht -> D), the target's residual streams at
`aux_layer_ids` (transformers' `hidden_states` numbering: id i is the stream *entering* decoder
layer i, vLLM's convention). Step k > 0 reads the layer's own pre-norm output as h. The EAGLE-3.1
options (speculators' names and weights, FORMATS.md): `norm_before_fc` RMS-normalises cat(aux) as
one vector before fc (`input_norm`), `fc_norm` each aux stream on its own (`fc_norm.{i}`), and
`norm_output` feeds norm(out) back at step k > 0 instead of out (`feedback`). The draft
logits cover Vd ids; draft id i is target id `i + d2t[i]`, and `t2d` (V,) marks the target ids in
the draft vocabulary. The embedding is the target's (frozen) and is passed in, never owned.
Native state-dict keys follow the SGLang / EAGLE-repo layout (`midlayer.*`, FORMATS.md).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from heads.eagle import MLP, Attention, RMSNorm, ridge_solution, rope_inv_freq


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """[2, L//2, L-3]: low, middle and high streams, as vLLM and speculators default them."""
    return [2, num_layers // 2, num_layers - 3]


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's V
    draft_vocab_size: int  # Vd <= V
    target_hidden_size: int  # Ht, width of each aux stream
    aux_layer_ids: list[int] = field(default_factory=list)  # hidden_states[i] = stream entering layer i
    target_num_layers: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    qkv_bias: bool = False
    qk_norm: bool = False
    norm_before_residual: bool = False  # True: the residual is hidden_norm(h) instead of h
    norm_before_fc: bool = False  # True: fc reads input_norm(cat(aux)), one RMSNorm over n·Ht
    fc_norm: bool = False  # True: fc reads cat(fc_norm[i](aux_i)), one RMSNorm per stream
    norm_output: bool = False  # True: step k > 0 reads norm(out) of step k-1 instead of out
    target_name: str = ""
    target_fingerprint: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.aux_layer_ids:
            raise ValueError("Eagle3Config.aux_layer_ids is empty: EAGLE-3 reads at least one target layer")
        if self.target_num_layers and any(not 0 <= i < self.target_num_layers for i in self.aux_layer_ids):
            raise ValueError(f"Eagle3Config.aux_layer_ids={self.aux_layer_ids} must lie in "
                             f"[0, {self.target_num_layers}) (hidden_states[i] enters decoder layer i)")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("Eagle3Config.norm_before_fc and fc_norm are exclusive: one RMSNorm over all aux "
                             "streams, or one per stream; set one of them")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"Eagle3Config.draft_vocab_size={self.draft_vocab_size} must lie in "
                             f"[1, vocab_size={self.vocab_size}]")

    @classmethod
    def from_target(cls, target, draft_vocab_size: int | None = None, aux_layer_ids=None,
                    **options) -> "Eagle3Config":
        """Shape the draft after a FrozenTarget: the decoder layer copies its sizes and RoPE;
        `aux_layer_ids` None takes default_aux_layer_ids; `options` override other fields."""
        from heads.eagle import EagleConfig

        base = EagleConfig.from_target(target).to_dict()
        base.pop("fc_bias")
        L = target.num_layers
        values = dict(
            base,
            # The engines' EAGLE-3 drafts are Llama layers: no q/k norm and no q/k/v bias, even
            # behind a Qwen-style target that has them.
            qkv_bias=False,
            qk_norm=False,
            draft_vocab_size=min(draft_vocab_size or target.vocab_size, target.vocab_size),
            target_hidden_size=target.hidden_size,
            aux_layer_ids=list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(L),
            target_num_layers=L,
        )
        values.update(options)
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)


class Eagle3DecoderLayer(nn.Module):
    """Layer 0 of EAGLE-3: attention reads cat(input_layernorm(e), hidden_norm(h)) (2D columns)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        D = config.hidden_size
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(D, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(D, config.rms_norm_eps)
        self.self_attn = Attention(config, input_size=2 * D)
        self.mlp = MLP(config)
        self.post_attention_layernorm = RMSNorm(D, config.rms_norm_eps)

    def forward(self, embeds, hidden, cos, sin, attention_mask, past_key_values):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # (B, T, 2D), embedding first
        attn, kv = self.self_attn(x, cos, sin, attention_mask, past_key_values)
        x = residual + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        D, Vd, V = config.hidden_size, config.draft_vocab_size, config.vocab_size
        n, Ht = len(config.aux_layer_ids), config.target_hidden_size
        self.fc = nn.Linear(n * Ht, D, bias=False)
        if config.norm_before_fc:
            self.input_norm = RMSNorm(n * Ht, config.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(Ht, config.rms_norm_eps) for _ in range(n))
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self.lm_head = nn.Linear(D, Vd, bias=False)
        # Identity maps until set_draft_vocab: draft id i = target id i.
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(V) < Vd)
        inv_freq, self.attention_scaling = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """position_ids (B, T) -> cos, sin (B, 1, T, hd)."""
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # (B, T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def fc_inputs(self, aux: torch.Tensor) -> torch.Tensor:
        """aux (B, T, n·Ht) -> what fc reads (B, T, n·Ht): aux itself, or RMS-normalised as one
        vector (norm_before_fc) or stream by stream (fc_norm)."""
        if self.config.norm_before_fc:
            return self.input_norm(aux)
        if self.config.fc_norm:
            streams = aux.split(self.config.target_hidden_size, dim=-1)
            return torch.cat([norm(stream) for norm, stream in zip(self.fc_norm, streams, strict=True)], dim=-1)
        return aux

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """aux (B, T, n·Ht), the target streams at aux_layer_ids concatenated in that order -> h (B, T, D)."""
        return self.fc(self.fc_inputs(aux))

    def feedback(self, out: torch.Tensor) -> torch.Tensor:
        """out (..., D) of step k -> step k+1's hidden input: out, or norm(out) under norm_output
        (the state `logits` scores, so every depth reads a state of the same scale)."""
        return self.norm(out) if self.config.norm_output else out

    def forward(
        self,
        input_embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: tuple[torch.Tensor, torch.Tensor] | None = None,
        use_cache: bool = False,
    ):
        """input_embeds (B, T, D) = embed(x_{t+1}); hidden (B, T, D) = project(aux_t) at step 0,
        feedback(the previous step's out) after; position_ids (B, T); attention_mask bool (B, 1, T, S) or None
        for causal; past_key_values (k, v) each (B, nKV, S - T, hd). Returns (out (B, T, D), (k, v)
        over S or None); `out` is pre-norm: feedback(out) is the next step's hidden, and logits(out)
        scores it."""
        cos, sin = self.rope(position_ids, hidden.dtype)
        out, kv = self.midlayer(input_embeds, hidden, cos, sin, attention_mask, past_key_values)
        return out, (kv if use_cache else None)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """out (..., D) -> draft logits (..., Vd)."""
        return self.lm_head(self.norm(out))

    def draft_ids(self) -> torch.Tensor:
        """(Vd,) the target ids of the draft vocabulary, ascending."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def to_target_ids(self, draft: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) -> target ids."""
        return draft + self.d2t[draft]


def vocab_maps(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted target ids (Vd,) -> (d2t int64 (Vd,), t2d bool (V,))."""
    ids = ids.to(torch.long).cpu()
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft vocabulary ids must be strictly ascending")
    if ids.numel() and not 0 <= int(ids[0]) <= int(ids[-1]) < vocab_size:
        raise ValueError(f"draft vocabulary ids must lie in [0, {vocab_size})")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d


@torch.no_grad()
def set_draft_vocab(head: Eagle3Head, ids: torch.Tensor) -> Eagle3Head:
    """Install the draft vocabulary: sorted target ids (Vd,), Vd = config.draft_vocab_size."""
    if ids.numel() != head.config.draft_vocab_size:
        raise ValueError(f"draft vocabulary has {ids.numel()} ids but draft_vocab_size="
                         f"{head.config.draft_vocab_size}")
    d2t, t2d = vocab_maps(ids, head.config.vocab_size)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    return head


def row_map(source: torch.Tensor, trained: torch.Tensor, penalty: float = 1e-4) -> torch.Tensor:
    """(D, D) float64 A minimising |source @ A - trained|² + penalty·(mean squared singular value
    of source)·|A|²: source and trained (N, D), the same ids' rows in the target's lm_head and in
    a trained head's."""
    x = source.double()
    gram = x.T @ x
    return ridge_solution(gram, x.T @ trained.double(), 1, penalty * float(torch.trace(gram)) / gram.shape[0])


@torch.no_grad()
def resize_draft_vocab(head: Eagle3Head, ids: torch.Tensor, target) -> tuple[int, int]:
    """Give a trained head the draft vocabulary `ids` (sorted target ids, any count): the lm_head
    rows of ids it already drafts are kept; the others start as the target's lm_head rows carried
    into the head's trained space by the linear map that best takes the target's rows of the kept
    ids to the head's (least squares). Unmapped target rows score the trained head's states
    differently from its own rows and win its argmax at most positions. The config's
    draft_vocab_size follows. Returns (rows kept, rows new)."""
    weight = head.lm_head.weight
    device = weight.device
    d2t, t2d = vocab_maps(ids, head.config.vocab_size)  # checks the ids before anything changes
    ids, old = ids.to(device=device, dtype=torch.long), head.draft_ids().to(device)
    old_row = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=device)
    old_row[old] = torch.arange(old.numel(), device=device)
    rows = old_row[ids]  # (Vd_new,) the old row of each id, -1 where new
    kept = rows >= 0
    source = target.lm_head.weight.detach().to(device)
    fresh = source[ids].to(weight)  # (Vd_new, D)
    if kept.any() and (~kept).any():
        fresh[~kept] = (source[ids[~kept]].double() @ row_map(source[ids[kept]], weight[rows[kept]])).to(weight)
    fresh[kept] = weight[rows[kept]]
    head.lm_head = nn.Linear(weight.shape[1], ids.numel(), bias=False, device=device, dtype=weight.dtype)
    head.lm_head.weight.copy_(fresh)
    head.d2t = d2t.to(head.d2t.device)  # buffers of a new length (registered names, so still buffers)
    head.t2d = t2d.to(head.t2d.device)
    head.config.draft_vocab_size = ids.numel()
    return int(kept.sum()), int((~kept).sum())


@torch.no_grad()
def init_from_target(head: Eagle3Head, target, ids: torch.Tensor | None = None) -> Eagle3Head:
    """Set the draft vocabulary (`ids`, sorted target ids; None keeps the current maps), then copy
    the target's lm_head rows of those ids and its final norm, so the draft starts scoring like the
    target's head. The decoder layer and fc keep their random init."""
    if ids is not None:
        set_draft_vocab(head, ids)
    rows = head.draft_ids().to(target.lm_head.weight.device)
    head.lm_head.weight.copy_(target.lm_head.weight[rows].to(head.lm_head.weight))
    head.norm.weight.copy_(target.final_norm.weight.to(head.norm.weight))
    return head


@torch.no_grad()
def set_fc_by_ridge(head: Eagle3Head, gram: torch.Tensor, cross: torch.Tensor, rows: int, penalty: float) -> None:
    """Start the head as a linear fit: fc = the ridge solution of fc(x_t) ~ y over `rows` pairs
    (x = fc_inputs(aux), the normalised streams under norm_before_fc / fc_norm; gram = Σ x xᵀ
    (n·Ht, n·Ht), cross = Σ x yᵀ (n·Ht, D), y the target's next state with its
    final norm's weight divided out), and the decoder layer's attention and MLP output projections
    zeroed, so that its output is project(aux_t) and `logits` scores it as the target scores its next
    position (the draft norm and lm_head start as the target's)."""
    from heads.eagle import ridge_solution

    head.fc.weight.copy_(ridge_solution(gram, cross, rows, penalty).T.to(head.fc.weight.dtype))
    head.midlayer.self_attn.o_proj.weight.zero_()
    head.midlayer.mlp.down_proj.weight.zero_()
