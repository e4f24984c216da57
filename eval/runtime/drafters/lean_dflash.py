"""The DFlash head as a lean block forward for drafting (the runtime twin of `heads.dflash.DflashHead`,
as `eval.runtime.drafters.lean_head` is the EAGLE heads').

A proposal runs one block [anchor, mask x (B-1)] over the committed context, and the module path
pays for all of it: B rows through every projection and the MLP, RoPE recomputed per call, K/V
concatenated onto the context each call. The block's structure makes most of that unneeded:

- The first layer's input rows are only two distinct vectors, the anchor's embedding and the mask
  token's, so its q/k/v projections (and q/k norms, which act per row before RoPE) run on those two
  rows; the B rows differ only by RoPE's position, applied after. Its values are the two rows'
  values, repeated.
- The last layer's output is read at slots 1..depth only, so its queries, attention output, o_proj
  and MLP run on those rows; keys and values still cover the whole block, which every query sees.
- Context K/V live per layer in a preallocated buffer, extended at commit (c = hidden_norm(fc(aux))
  enters every layer's k/v projection directly), and RoPE comes from a table.

Weights are laid out as the target's (`eval.runtime.model.Linear`, q|k|v, k|v and gate|up fused).
Numerically it is the module's forward over the same rows (tested in float64 and fp32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from eval.runtime.drafters.lean_head import _GROW, _linear, rope_table
from eval.runtime.model import Linear, RMSNorm, _fused, _rotate
from heads.dflash import DflashHead


class _Layer:
    def __init__(self, layer, eps: float):
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = _linear(attn.q_proj), _linear(attn.k_proj), _linear(attn.v_proj)
        self.qkv, self.kv = _fused(q, k, v), _fused(k, v)  # the block's rows; the context's
        self.o = _linear(attn.o_proj)
        self.gate_up, self.down = _fused(_linear(mlp.gate_proj), _linear(mlp.up_proj)), _linear(mlp.down_proj)
        self.input_norm = RMSNorm(layer.input_layernorm.weight, eps)
        self.post_norm = RMSNorm(layer.post_attention_layernorm.weight, eps)
        self.q_norm, self.k_norm = RMSNorm(attn.q_norm.weight, eps), RMSNorm(attn.k_norm.weight, eps)


class LeanDflash:
    """Context K/V per layer in (nKV, capacity, hd) buffers: [0, length) are committed positions."""

    @torch.no_grad()
    def __init__(self, head: DflashHead, capacity: int = 1024):
        c = head.config
        self.config = c
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.dtype, self.device = head.fc.weight.dtype, head.fc.weight.device
        self.fc = _linear(head.fc)
        self.hidden_norm = RMSNorm(head.hidden_norm.weight, c.rms_norm_eps)
        self.norm = RMSNorm(head.norm.weight, c.rms_norm_eps)
        self.layers = [_Layer(layer, c.rms_norm_eps) for layer in head.layers]
        self.inv_freq, self.scaling = head.inv_freq.float().to(self.device), float(head.attention_scaling)
        self.cos = self.sin = torch.empty(0, self.head_dim, dtype=self.dtype, device=self.device)
        empty = torch.empty(self.kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
        self.k, self.v = [empty] * len(self.layers), [empty] * len(self.layers)
        self._reserve(capacity)
        self.length = 0
        B = c.block_size
        self.block_offsets = torch.arange(B, device=self.device)
        self.spread = torch.ones(B, dtype=torch.long, device=self.device)  # block row -> the first layer's
        self.spread[0] = 0  # distinct input row: the anchor, then the mask token

    def linear_sites(self) -> dict[str, list[Linear]]:
        """The linear layers by role, named as the target's where they play the same part."""
        return {"qkv_proj": [layer.qkv for layer in self.layers] + [layer.kv for layer in self.layers],
                "o_proj": [layer.o for layer in self.layers],
                "gate_up_proj": [layer.gate_up for layer in self.layers],
                "down_proj": [layer.down for layer in self.layers], "fc": [self.fc]}

    def _reserve(self, size: int) -> None:
        if size > self.k[0].shape[1]:
            size = max(size, self.k[0].shape[1] + _GROW)
            for i, (k, v) in enumerate(zip(self.k, self.v)):
                grown_k = k.new_zeros(self.kv_heads, size, self.head_dim)
                grown_v = torch.zeros_like(grown_k)
                grown_k[:, : k.shape[1]], grown_v[:, : v.shape[1]] = k, v
                self.k[i], self.v[i] = grown_k, grown_v
        if size > self.cos.shape[0]:
            self.cos, self.sin = rope_table(self.inv_freq, self.scaling, size, self.dtype)

    def reset(self) -> None:
        self.length = 0

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (rows, heads, hd) at positions (rows,) -> rotated."""
        return _rotate(x, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))

    @torch.no_grad()
    def commit(self, aux: torch.Tensor) -> None:
        """Append the context of n committed positions: aux (n, n_aux * Ht), their target streams."""
        n, Hkv, hd = aux.shape[0], self.kv_heads, self.head_dim
        start, end = self.length, self.length + n
        self._reserve(end)
        context = self.hidden_norm(self.fc(aux.to(self.device, self.dtype)))  # (n, D)
        positions = torch.arange(start, end, device=self.device)
        for layer, k_cache, v_cache in zip(self.layers, self.k, self.v):
            k, v = layer.kv(context).view(n, 2 * Hkv, hd).split((Hkv, Hkv), dim=1)
            k_cache[:, start:end] = self._rope(layer.k_norm(k), positions).transpose(0, 1)
            v_cache[:, start:end] = v.transpose(0, 1)
        self.length = end

    @torch.no_grad()
    def block(self, anchor: torch.Tensor, mask: torch.Tensor, depth: int) -> torch.Tensor:
        """The block [anchor, mask x (B-1)] at positions length..length+B-1 over the committed
        context: anchor, mask (D,) embeddings. Returns the last layer's outputs at slots 1..depth
        (depth, D), pre-norm (`logits_input` norms them)."""
        B, H, Hkv, hd = self.config.block_size, self.heads, self.kv_heads, self.head_dim
        C = self.length
        self._reserve(C + B)
        positions = self.block_offsets + C
        x = torch.stack((anchor, mask)).to(self.device, self.dtype)  # the first layer's distinct rows
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, self.k, self.v)):
            last = i == len(self.layers) - 1
            out_rows = self.block_offsets[1: depth + 1] if last else self.block_offsets
            n = x.shape[0]
            q, k, v = layer.qkv(layer.input_norm(x)).view(n, H + 2 * Hkv, hd).split((H, Hkv, Hkv), dim=1)
            q, k = layer.q_norm(q), layer.k_norm(k)  # per row and head, before RoPE
            if n != B:  # the distinct rows spread over the block
                k, v = k[self.spread], v[self.spread]
                query_source = self.spread[out_rows]
            else:
                query_source = out_rows
            keys = torch.cat((k_cache[:, :C], self._rope(k, positions).transpose(0, 1)), dim=1)  # (Hkv, C + B, hd)
            values = torch.cat((v_cache[:, :C], v.transpose(0, 1)), dim=1)
            queries = self._rope(q[query_source], positions[out_rows]).transpose(0, 1)  # (H, r, hd)
            attn = F.scaled_dot_product_attention(queries[None], keys[None], values[None],
                                                  enable_gqa=H != Hkv)[0]  # (H, r, hd)
            r = out_rows.shape[0]
            residual = x[query_source]
            h = residual + layer.o(attn.transpose(0, 1).reshape(r, H * hd))
            gate, up = layer.gate_up(layer.post_norm(h)).chunk(2, dim=-1)
            x = h + layer.down(F.silu(gate) * up)
        return x

    def logits_input(self, out: torch.Tensor) -> torch.Tensor:
        """(rows, D) outputs -> the final norm's output, what the lm_head reads."""
        return self.norm(out)
