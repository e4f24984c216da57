"""Tree attention in plain PyTorch: the specification the Triton kernel is tested against."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def full_mask(prefix_length: int, tree_mask: torch.Tensor) -> torch.Tensor:
    """(N, prefix_length + N) bool: every new query sees the whole prefix, then the tree mask."""
    n = tree_mask.shape[0]
    mask = torch.ones(n, prefix_length + n, dtype=torch.bool, device=tree_mask.device)
    mask[:, prefix_length:] = tree_mask
    return mask


def additive_mask(prefix_length: int, tree_mask: torch.Tensor | None, n: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """(N, prefix_length + N) float mask (0 = may attend, -inf = not) for N > 1 new tokens; None
    tree_mask = causal. What SDPA makes of a boolean mask on every call: a forward builds it once
    for all layers (`bias` of `reference_tree_attention`)."""
    if tree_mask is None:
        tree_mask = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
    allowed = full_mask(prefix_length, tree_mask)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def reference_tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_length: int, tree_mask: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of N new queries against the cached prefix plus the N new keys.

    q: (H, N, hd); k, v: (Hkv, S, hd) cache buffers with the prefix in [0, prefix_length) and the
    new keys in [prefix_length, prefix_length + N); H a multiple of Hkv (GQA).
    tree_mask: (N, N) bool (True = may attend) or None for a causal chain. bias: the same mask as
    `additive_mask(prefix_length, tree_mask, ...)`, precomputed (optional). Returns (H, N, hd).
    """
    n = q.shape[1]
    keys = k[:, : prefix_length + n].unsqueeze(0)  # (1, Hkv, P + N, hd)
    values = v[:, : prefix_length + n].unsqueeze(0)
    gqa = q.shape[0] != k.shape[0]
    if bias is not None and n > 1:
        return F.scaled_dot_product_attention(q.unsqueeze(0), keys, values, attn_mask=bias, enable_gqa=gqa).squeeze(0)
    if tree_mask is None and (n == 1 or prefix_length == 0):
        out = F.scaled_dot_product_attention(q.unsqueeze(0), keys, values, is_causal=n > 1, enable_gqa=gqa)
        return out.squeeze(0)
    if tree_mask is None:
        tree_mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
    mask = full_mask(prefix_length, tree_mask)
    out = F.scaled_dot_product_attention(q.unsqueeze(0), keys, values, attn_mask=mask, enable_gqa=gqa)
    return out.squeeze(0)
