"""Token trees for verification: a tree is a parent index per node, and everything the target
forward and the verifier need derives from it in one pure function.

Node 0 is the root (the last committed token, not yet in the target's KV cache) with parent -1;
every other node's parent has a smaller index (topological order). A chain of n drafted tokens is
the tree with parents [-1, 0, 1, ..., n-1].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

MAX_BITMASK_NODES = 64  # one int64 ancestor bitmask per node


@dataclass(frozen=True)
class TreeLayout:
    """parents (N,) int64, root first (-1).
    mask (N, N) bool: mask[i, j] = node j is i or an ancestor of i (what node i may attend to).
    depths (N,) int64: root 0; position id of node i is prefix_length + depths[i].
    bits (N,) int64 or None (N > 64): bit j of bits[i] set iff mask[i, j] (for the Triton kernel).
    """

    parents: torch.Tensor
    mask: torch.Tensor
    depths: torch.Tensor
    bits: torch.Tensor | None

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents.tolist()) if p == node]


def build_tree(parents: Sequence[int] | torch.Tensor) -> TreeLayout:
    """Derive mask, depths and ancestor bitmask from parent indices (N,)."""
    parent_list = [int(p) for p in (parents.tolist() if torch.is_tensor(parents) else parents)]
    n = len(parent_list)
    if n == 0 or parent_list[0] != -1:
        raise ValueError("tree: node 0 must be the root with parent -1")
    ancestors = [0] * n  # Python-int bitmask of node i and its ancestors
    depths = [0] * n
    for i, p in enumerate(parent_list):
        if i > 0:
            if not 0 <= p < i:
                raise ValueError(f"tree: node {i} has parent {p}; parents must precede children")
            ancestors[i] = ancestors[p]
            depths[i] = depths[p] + 1
        ancestors[i] |= 1 << i
    mask = _bits_to_mask(ancestors, n)
    bits = None
    if n <= MAX_BITMASK_NODES:
        bits = torch.tensor([a - (1 << 64) if a >= 1 << 63 else a for a in ancestors], dtype=torch.long)
    return TreeLayout(torch.tensor(parent_list, dtype=torch.long), mask, torch.tensor(depths), bits)


def _bits_to_mask(ancestors: list[int], n: int) -> torch.Tensor:
    mask = torch.zeros(n, n, dtype=torch.bool)
    for start in range(0, n, 62):  # 62-bit chunks stay positive in int64
        width = min(62, n - start)
        chunk = torch.tensor([(a >> start) & ((1 << width) - 1) for a in ancestors], dtype=torch.long)
        mask[:, start:start + width] = (chunk[:, None] >> torch.arange(width)) & 1 == 1
    return mask


def chain_parents(num_drafted: int) -> list[int]:
    """Parents of root + a chain of `num_drafted` tokens."""
    return list(range(-1, num_drafted))


def candidate_parents_to_tree(candidate_parents: Sequence[int]) -> list[int]:
    """Drafter parents (-1 = child of the root, else an earlier candidate index) to tree parents
    with the root prepended as node 0."""
    return [-1] + [int(p) + 1 for p in candidate_parents]
