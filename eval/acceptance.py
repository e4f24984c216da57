"""Teacher-forced rank accuracies of Medusa heads along the target's own greedy continuations:
calibration builds the candidate Medusa trees from them (`eval.calibrate.medusa_choices`); the
drafters only propose."""
from __future__ import annotations

from typing import Sequence

import torch

from eval.runtime.drafters.medusa import MedusaDrafter


@torch.no_grad()
def measure_rank_accuracies(drafter: MedusaDrafter, sequences: Sequence[torch.Tensor], prompt_lengths: Sequence[int],
                            top: int = 10) -> list[list[float]]:
    """Per head k, the fraction of positions where the true next-(k+2) token is the head's i-th
    ranked token (i < top), over the generated part of each (T,) sequence (prompt + greedy
    continuation). Feeds `build_tree_from_accuracies`."""
    heads = drafter.num_used
    hits = torch.zeros(heads, top)
    counts = torch.zeros(heads)
    for sequence, prompt_length in zip(sequences, prompt_lengths):
        cache = drafter.lean.new_cache(sequence.shape[0])
        features = drafter.lean(sequence, cache, hidden_layers=(-1,), logits="none").hidden[
            drafter.lean.config.num_layers]  # (T, D)
        logits = drafter.head_logits(features)  # (K, T, V)
        for k in range(heads):
            rows = torch.arange(max(prompt_length - 1, 0), sequence.shape[0] - k - 2)
            if rows.numel() == 0:
                continue
            labels = sequence[rows + k + 2]
            chosen = logits[k, rows]  # (R, Vd)
            if drafter.vocab is not None:  # labels outside the subset can never be drafted
                position = torch.full((drafter.lean.config.vocab_size,), -1, dtype=torch.long)
                position[drafter.vocab] = torch.arange(drafter.vocab.shape[0])
                labels = position[labels]
                keep = labels >= 0
                chosen, labels = chosen[keep], labels[keep]
            ranks = (chosen > chosen.gather(1, labels[:, None])).sum(-1)  # (R',)
            hits[k] += torch.bincount(ranks[ranks < top], minlength=top)[:top].float()
            counts[k] += rows.numel()
    return (hits / counts.clamp_min(1)[:, None]).tolist()
