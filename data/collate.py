"""Batching: right-padded collation and a length-grouped batch order."""
from __future__ import annotations

import random
from typing import Sequence

import torch


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows with `input_ids` / `loss_mask` to the longest row. Returns int64 tensors
    input_ids (B, T), attention_mask (B, T) and loss_mask (B, T); padding has attention_mask 0
    and loss_mask 0, so any pad_id works. loss_mask marks tokens to predict (labels): score the
    logits at t-1 against input_ids[t] where loss_mask[t] = 1."""
    if not rows:
        raise ValueError("collate: empty batch")
    longest = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)  # (B, T)
    loss_mask = torch.zeros((len(rows), longest), dtype=torch.long)  # (B, T)
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        if len(row["loss_mask"]) != n:
            raise ValueError(f"collate: row {row.get('id', b)!r} has {n} input_ids but {len(row['loss_mask'])} mask values")
        input_ids[b, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.as_tensor(row["loss_mask"], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def length_grouped_batches(lengths: Sequence[int], batch_size: int, seed: int,
                           group_batches: int = 32) -> list[list[int]]:
    """Row indices in batches of rows of similar length (little padding), order shuffled by seed:
    shuffle, cut into groups of `group_batches * batch_size`, sort each group by length, cut into
    batches, shuffle the batches. Every index appears exactly once."""
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size} must be > 0")
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    group = batch_size * group_batches
    batches = []
    for start in range(0, len(order), group):
        members = sorted(order[start:start + group], key=lambda i: lengths[i], reverse=True)
        batches += [members[i:i + batch_size] for i in range(0, len(members), batch_size)]
    rng.shuffle(batches)
    return batches
