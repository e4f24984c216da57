"""The EAGLE head's decoder layer as a lean forward for drafting (the runtime twin of
`heads.eagle.EagleHead`, as `eval.model.LeanLlama` is the target's).

Drafting runs the head once per tree level on every speculative step, so its fixed costs count:
the module path (`nn.Linear`, K/V concatenated onto the past each call, RoPE recomputed per call)
cost ~3 ms per head forward on the 2-core CPU, a sizeable share of a ~45 ms target step. Here the
weights are laid out like the target's (`eval.model.Linear`: transposed for one-row GEMVs, oneDNN
packed for several rows, q|k|v and gate|up fused), RoPE comes from a precomputed table and the
K/V live in a preallocated buffer:

    [0, length)                       committed positions, fed with the target's true features
    [length, length + drafted)        this proposal's drafted entries (tree levels, chain steps)

`commit` appends positions to the committed part (and drops any drafted entries); `draft` appends
entries after the drafted ones under an explicit mask. Every position has at least one slot, so
positions stay below `length + drafted`, and the RoPE table grows with the K/V buffer.
Numerically it is the head's own forward (tested against `EagleHead` in float64 and fp32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from eval.model import Linear, RMSNorm, _fused, _rotate
from heads.eagle import EagleHead

_GROW = 256  # K/V and RoPE tables grow by at least this many positions when full


class LeanEagleHead:
    @torch.no_grad()
    def __init__(self, head: EagleHead, capacity: int = 1024):
        c = head.config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.dtype = head.fc.weight.dtype
        self.device = head.fc.weight.device
        layer = head.layers[0]
        attn, mlp = layer.self_attn, layer.mlp

        def linear(module):
            return Linear(module.weight, module.bias, pack=True)

        self.fc = linear(head.fc)
        self.qkv = _fused(linear(attn.q_proj), linear(attn.k_proj), linear(attn.v_proj))
        self.o = linear(attn.o_proj)
        self.gate_up = _fused(linear(mlp.gate_proj), linear(mlp.up_proj))
        self.down = linear(mlp.down_proj)
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

    def _reserve(self, size: int) -> None:
        if size > self.k.shape[1]:
            size = max(size, self.k.shape[1] + _GROW)
            k = torch.zeros(self.kv_heads, size, self.head_dim, dtype=self.dtype, device=self.device)
            v = torch.zeros_like(k)
            k[:, : self.k.shape[1]], v[:, : self.v.shape[1]] = self.k, self.v
            self.k, self.v = k, v
        if size > self.cos.shape[0]:
            angles = torch.outer(torch.arange(size, dtype=torch.float32, device=self.device), self.inv_freq)
            cos, sin = angles.cos() * self.scaling, angles.sin() * self.scaling
            self.cos = torch.cat((cos, cos), dim=-1).to(self.dtype)
            self.sin = torch.cat((-sin, sin), dim=-1).to(self.dtype)  # signed for `_rotate`

    def reset(self) -> None:
        self.length = self.drafted = 0

    def truncate(self, length: int) -> None:
        """Forget committed positions from `length` on (and every drafted entry)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"lean eagle head: cannot truncate {self.length} positions to {length}")
        self.length, self.drafted = length, 0

    @property
    def committed_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v), each (1, nKV, length, hd): the committed cache in `EagleHead`'s past layout."""
        return self.k[None, :, : self.length], self.v[None, :, : self.length]

    @torch.no_grad()
    def commit(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Feed positions length..length+n-1 (causal among themselves) and keep them; drafted
        entries are dropped first. embeds, features: (n, D). Returns f̂ (n, D)."""
        self.drafted = 0
        n = embeds.shape[0]
        out = self._forward(embeds, features, torch.arange(self.length, self.length + n, device=self.device), None)
        self.length += n
        return out

    @torch.no_grad()
    def draft(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
              mask: torch.Tensor | None = None) -> torch.Tensor:
        """Feed n drafted entries after the current ones. mask: (n, length + drafted + n) bool,
        True = may attend; None = everything before plus causal among the n. Returns f̂ (n, D)."""
        out = self._forward(embeds, features, positions, mask)
        self.drafted += embeds.shape[0]
        return out

    def _forward(self, embeds, features, positions, mask):
        n, H, Hkv, hd = embeds.shape[0], self.heads, self.kv_heads, self.head_dim
        start = self.length + self.drafted
        end = start + n
        self._reserve(end)  # positions < end (module docstring): the RoPE table covers them
        positions = positions.to(self.device)
        if mask is None and n > 1:
            mask = torch.ones(n, end, dtype=torch.bool, device=self.device).tril_(start)
        elif mask is not None:
            mask = mask.to(self.device)  # drafters build tree masks on the host
        x = self.fc(torch.cat((embeds.to(self.dtype), features.to(self.dtype)), dim=-1))  # (n, D)
        qkv = self.qkv(x).view(n, H + 2 * Hkv, hd)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # (n, 1, hd)
        if self.q_norm is None:
            qk = _rotate(qkv[:, : H + Hkv], cos, sin)
            q, k = qk[:, :H], qk[:, H:]
        else:
            q, k, _ = qkv.split((H, Hkv, Hkv), dim=1)
            q, k = _rotate(self.q_norm(q), cos, sin), _rotate(self.k_norm(k), cos, sin)
        self.k[:, start:end] = k.transpose(0, 1)
        self.v[:, start:end] = qkv[:, H + Hkv:].transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], self.k[None, :, :end], self.v[None, :, :end], attn_mask=mask,
            enable_gqa=H != Hkv,
        )  # (1, H, n, hd)
        x = x + self.o(out[0].transpose(0, 1).reshape(n, H * hd))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)
