"""EAGLE-2's tree selection: of every node an expansion drafted, keep the best by cumulative
draft log-probability. One pure function shared by the one-sequence drafter (`eagle.py`) and the
batched one (`eagle_batch.py`), so neither imports the other for it."""
from __future__ import annotations

import torch

from eval.runtime.drafters import Candidates


def select_tree(tokens: list[int], parents: list[int], scores: list[float], depths: list[int],
                count: int) -> Candidates:
    """The `count` best nodes by score (ties: shallower, earlier first; a child never outscores
    its parent, so the selection is ancestor-closed), in topological order, as Candidates."""
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))[:count]
    chosen = sorted(order, key=lambda i: (depths[i], i))
    index = {node: i for i, node in enumerate(chosen)}
    new_parents = []
    for node in chosen:
        parent = parents[node]
        if parent >= 0 and parent not in index:
            raise AssertionError(f"eagle tree: node {node} selected without its parent {parent}")
        new_parents.append(-1 if parent < 0 else index[parent])
    candidates = Candidates(torch.tensor([tokens[i] for i in chosen], dtype=torch.long),
                            torch.tensor(new_parents, dtype=torch.long))
    candidates.info["scores"] = [scores[i] for i in chosen]
    return candidates
