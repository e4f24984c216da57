"""Which rows each process trains on, in a deterministic, resumable order.

Each epoch cuts the training rows into global batches of `batch_size * num_processes` rows of
similar length (seeded by seed + epoch); process r takes rows r, r+P, r+2P, ... of each global
batch. The position (epoch, batch index) is all a checkpoint needs to continue the same stream.
"""
from __future__ import annotations

import torch

from data.collate import collate, length_grouped_batches


def _lengths(rows) -> list[int]:
    columns = getattr(rows, "column_names", None) or []
    if "length" in columns:
        return list(rows["length"])
    return [len(rows[i]["input_ids"]) for i in range(len(rows))]


def _to_batch(rows, indices: list[int], pad_id: int, device) -> dict:
    picked = [rows[i] for i in indices]
    batch = {k: v.to(device) for k, v in collate(picked, pad_id).items()}
    batch["ids"] = [row.get("id", str(i)) for row, i in zip(picked, indices)]
    return batch


class BatchStream:
    """Endless per-process batches over `rows` (dicts with input_ids, loss_mask, id)."""

    def __init__(self, rows, batch_size: int, num_processes: int, rank: int, seed: int, pad_id: int, device):
        self.rows, self.batch_size, self.world, self.rank = rows, batch_size, num_processes, rank
        self.seed, self.pad_id, self.device = seed, pad_id, device
        self.lengths = _lengths(rows)
        if len(self.lengths) < batch_size * num_processes:
            raise ValueError(f"{len(self.lengths)} training rows cannot fill one global batch of "
                             f"trainer.batch_size={batch_size} x {num_processes} processes")
        self.epoch, self.index, self._order = 0, 0, None

    def _batches(self) -> list[list[int]]:
        if self._order is None or self._order[0] != self.epoch:
            size = self.batch_size * self.world
            batches = length_grouped_batches(self.lengths, size, self.seed + self.epoch)
            self._order = (self.epoch, [b for b in batches if len(b) == size])  # every process gets a full share
        return self._order[1]

    def batches_per_epoch(self) -> int:
        return len(self._batches())

    def next(self) -> dict:
        batches = self._batches()
        if self.index >= len(batches):
            self.epoch, self.index = self.epoch + 1, 0
            batches = self._batches()
        indices = batches[self.index][self.rank::self.world]
        self.index += 1
        return _to_batch(self.rows, indices, self.pad_id, self.device)

    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_position(self, position: dict) -> None:
        self.epoch, self.index = int(position["epoch"]), int(position["index"])


def eval_batches(rows, batch_size: int, num_processes: int, rank: int, max_batches: int, pad_id: int,
                 device) -> list[dict]:
    """This process's share of the first `max_batches` global held-out batches, in row order
    sorted by length (little padding). Collated once and kept: evaluation reuses them."""
    count = min(len(rows), max_batches * batch_size * num_processes)
    lengths = _lengths(rows)
    order = sorted(range(count), key=lambda i: lengths[i])
    mine = order[rank::num_processes]
    return [_to_batch(rows, mine[i:i + batch_size], pad_id, device) for i in range(0, len(mine), batch_size)]

