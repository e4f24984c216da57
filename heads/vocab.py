"""Draft vocabularies: the token ids a draft head scores, chosen by frequency."""
from __future__ import annotations

import torch


def most_frequent_ids(counts: torch.Tensor, size: int) -> torch.Tensor:
    """(min(size, len(counts)),) sorted ids of the largest `counts` (V,), ties broken by the lower id."""
    order = torch.sort(-counts, stable=True).indices  # by count, then by id
    return order[: min(size, counts.shape[0])].sort().values
