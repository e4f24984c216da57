"""Tiny jobs for loop tests: the tiny random target and in-memory rows (no files, no network)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from train.job import JobConfig


def tiny_rows(n: int, seed: int, min_len: int = 10, max_len: int = 24):
    import datasets

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        T = int(torch.randint(min_len, max_len, (1,), generator=g))
        ids = torch.randint(3, 128, (T,), generator=g).tolist()
        rows.append({"id": f"r{seed}-{i}", "input_ids": ids, "loss_mask": [0] * 3 + [1] * (T - 3), "length": T})
    return datasets.Dataset.from_list(rows)


def tiny_data(train: int = 32, held_out: int = 8):
    return SimpleNamespace(train=tiny_rows(train, 0), eval=tiny_rows(held_out, 1), stats={})


def tiny_job(output_dir, kind: str = "eagle", **trainer) -> JobConfig:
    job = JobConfig()
    job.heads.type = kind
    job.heads.medusa.num_heads = 2
    job.heads.eagle3.aux_layer_ids = [0, 1, 1]  # the tiny target has 2 layers: [2, L//2, L-3] does not fit
    job.logger.kind = "none"
    t = job.trainer
    t.output_dir = str(output_dir)
    t.max_steps, t.batch_size, t.learning_rate, t.warmup_ratio = 8, 4, 3e-3, 0.25
    t.eval_every, t.save_every, t.log_every, t.eval_batches, t.keep_last = 4, 4, 1, 1, 2
    for key, value in trainer.items():
        setattr(t, key, value)
    return job
