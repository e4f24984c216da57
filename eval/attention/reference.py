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


def reference_tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_length: int, tree_mask: torch.Tensor | None
) -> torch.Tensor:
    """Attention of N new queries against the cached prefix plus the N new keys.

    q: (H, N, hd); k, v: (Hkv, S, hd) cache buffers with the prefix in [0, prefix_length) and the
    new keys in [prefix_length, prefix_length + N); H a multiple of Hkv (GQA).
    tree_mask: (N, N) bool (True = may attend) or None for a causal chain. Returns (H, N, hd).
    """
    n = q.shape[1]
    keys = k[:, : prefix_length + n].unsqueeze(0)  # (1, Hkv, P + N, hd)
    values = v[:, : prefix_length + n].unsqueeze(0)
    gqa = q.shape[0] != k.shape[0]
    if tree_mask is None and (n == 1 or prefix_length == 0):
        out = F.scaled_dot_product_attention(q.unsqueeze(0), keys, values, is_causal=n > 1, enable_gqa=gqa)
        return out.squeeze(0)
    if tree_mask is None:
        tree_mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
    mask = full_mask(prefix_length, tree_mask)
    out = F.scaled_dot_product_attention(q.unsqueeze(0), keys, values, attn_mask=mask, enable_gqa=gqa)
    return out.squeeze(0)
