"""Tree attention: N new queries against a cached prefix plus the tree itself.

`tree_attention` dispatches to `reference` (plain PyTorch SDPA with a boolean mask; runs anywhere)
or `triton` (a kernel reading the tree mask as an int64 ancestor bitmask per node, N <= 64).
backend "auto" = triton on CUDA, reference elsewhere.
"""
from __future__ import annotations

import torch

from eval.runtime.attention.reference import reference_tree_attention

BACKENDS = ("auto", "reference", "triton")


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"runtime.attention: unknown backend {backend!r} (one of {BACKENDS})")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "reference"
    return backend


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_length: int,
    tree_mask: torch.Tensor | None,
    tree_bits: torch.Tensor | None = None,
    backend: str = "auto",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: (H, N, hd); k, v: (Hkv, S, hd) with the prefix in [0, prefix_length) and the N new keys
    right after it. tree_mask: (N, N) bool or None (causal); tree_bits: (N,) int64 ancestor bitmask
    of the same mask (computed when needed); bias: the reference path's additive form of the mask
    (`reference.additive_mask`), precomputed once per forward (optional). Returns (H, N, hd)."""
    if resolve_backend(backend, q.device) == "reference" or q.shape[1] > 64:
        return reference_tree_attention(q, k, v, prefix_length, tree_mask, bias)
    from eval.runtime.attention.triton_kernel import triton_tree_attention

    if tree_bits is None:
        tree_bits = mask_to_bits(tree_mask, q.shape[1], q.device)
    return triton_tree_attention(q, k, v, prefix_length, tree_bits)


def mask_to_bits(tree_mask: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """(N, N) bool mask (None = causal) to (N,) int64 bitmasks, N <= 64."""
    if tree_mask is None:
        tree_mask = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
    weights = torch.tensor([1 << j if j < 63 else -(1 << 63) for j in range(n)], dtype=torch.long, device=device)
    return (tree_mask.long() * weights).sum(dim=1)  # disjoint bits: the sum is the bitwise or
