"""Static Medusa trees: a tree is a list of choice paths; path (i0, i1, ..., id) is the node at depth
d + 1 whose token is the i_j-th ranked token (0 = top-1) of head j along the way. Every prefix of a
node is a node. Pure functions plus the references' 63-node tree as data."""
from __future__ import annotations

import heapq
import json
from typing import Sequence

Choices = list[tuple[int, ...]]

# The 63-node tree of the Medusa references (`mc_sim_7b_63`, tuned for Vicuna-7B; top-10 per head).
MC_SIM_7B_63: Choices = [
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0),
    (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0),
    (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5),
    (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9),
    (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5),
    (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
]

NAMED_TREES = {"mc_sim_7b_63": MC_SIM_7B_63}


def normalize_choices(choices: Sequence[Sequence[int]]) -> Choices:
    """Sorted by (depth, path) so parents precede children; checks prefix closure and uniqueness."""
    paths = [tuple(int(i) for i in path) for path in choices]
    if not paths:
        raise ValueError("medusa tree: no choices")
    seen = set(paths)
    if len(seen) != len(paths):
        raise ValueError("medusa tree: duplicate choice paths")
    for path in paths:
        if not path or min(path) < 0:
            raise ValueError(f"medusa tree: invalid path {path}")
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"medusa tree: {path} has no parent {path[:-1]} (every prefix must be a node)")
    return sorted(paths, key=lambda p: (len(p), p))


def choices_to_parents(choices: Choices) -> list[int]:
    """Candidate parent indices (-1 = child of the root) of normalized choices."""
    index = {path: i for i, path in enumerate(choices)}
    return [-1 if len(path) == 1 else index[path[:-1]] for path in choices]


def parse_choices(spec: str | Sequence[Sequence[int]]) -> Choices:
    """A tree name from NAMED_TREES, a JSON list of paths, or a list of paths -> normalized choices."""
    if isinstance(spec, str):
        spec = NAMED_TREES[spec] if spec in NAMED_TREES else json.loads(spec)
    return normalize_choices(spec)


def expected_acceptance(choices: Sequence[Sequence[int]], per_head_rank_acc: list[list[float]]) -> float:
    """Expected accepted drafts per step: sum over nodes of the product of rank accuracies along
    the path (siblings are exclusive events; heads treated as independent)."""
    total = 0.0
    for path in choices:
        value = 1.0
        for depth, rank in enumerate(path):
            value *= per_head_rank_acc[depth][rank] if rank < len(per_head_rank_acc[depth]) else 0.0
        total += value
    return total


def build_tree_from_accuracies(per_head_topk_acc: list[list[float]], num_nodes: int) -> Choices:
    """Greedy tree of up to `num_nodes` nodes for a head whose head k ranks the true token at rank
    i with probability per_head_topk_acc[k][i] (exact rank, not cumulative): repeatedly add the
    node, among those whose parent is already in the tree, with the highest expected acceptance
    (the product of rank accuracies along its path). Ties go to the shallower, lower-rank node."""
    if num_nodes < 1 or not per_head_topk_acc or not per_head_topk_acc[0]:
        raise ValueError("build_tree_from_accuracies: need num_nodes >= 1 and accuracies for head 0")

    def push(path: tuple[int, ...], value: float) -> None:
        heapq.heappush(heap, (-value, len(path), path))

    heap: list = []
    for rank, accuracy in enumerate(per_head_topk_acc[0]):
        push((rank,), accuracy)
    chosen: Choices = []
    while heap and len(chosen) < num_nodes:
        negative, _, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < len(per_head_topk_acc):
            for rank, accuracy in enumerate(per_head_topk_acc[len(path)]):
                push(path + (rank,), -negative * accuracy)
    return normalize_choices(chosen)
