"""Run the real training loop (train.loop.train_heads) on the tiny target, as one rank of a
torchrun group or alone, for the multi-process tests.

    torchrun --standalone --nproc_per_node 2 tests/scale/loop_worker.py --runs \\
        '[{"dir": "runs/ddp"}, {"dir": "runs/zero2", "deepspeed": 2}, {"dir": "runs/r", "resume": "ckpt"}]'

Each run: dir (trainer.output_dir), optionally deepspeed (ZeRO stage), resume (a checkpoint).
ZeRO-3 runs partition every weight (stage3_param_persistence_threshold 0; DeepSpeed's default keeps
tensors under 1e5 elements, i.e. all of the tiny head, whole on every process).
Every row has the same length and loss mask, so per-process mean losses average to the global mean
and 1 process with batch 4 matches 2 processes with batch 2 (the loop's global batch is
batch_size x processes); EAGLE's input noise is off because it is seeded per rank.
accelerate's process-wide state is reset between runs (test-only; saves ~8 s of imports a run).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from types import SimpleNamespace  # noqa: E402

GLOBAL_BATCH, STEPS = 4, 4


def main() -> None:
    import torch
    from accelerate.state import AcceleratorState

    from tests.tiny import tiny_target
    from tests.train.loop_fixtures import tiny_job, tiny_rows
    from train.distributed import make_accelerator
    from train.loop import train_heads

    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = SimpleNamespace(train=tiny_rows(16, 0, 16, 17), eval=tiny_rows(4, 1, 16, 17), stats={})
    for run in json.loads(args.runs):
        job = tiny_job(run["dir"], run.get("kind", "eagle"), max_steps=STEPS, batch_size=GLOBAL_BATCH // world,
                       eval_every=2, save_every=2, log_every=1, keep_last=5, mixed_precision="no",
                       learning_rate=1e-2, resume=run.get("resume", "never"))
        job.heads.eagle.input_noise = 0.0
        if run.get("deepspeed") is not None:
            job.deepspeed.enabled, job.deepspeed.zero_stage = True, run["deepspeed"]
        if run.get("deepspeed") == 3:
            job.deepspeed.config_file = os.path.join(run["dir"] + f".ds-{os.getpid()}.json")
            os.makedirs(os.path.dirname(job.deepspeed.config_file), exist_ok=True)
            with open(job.deepspeed.config_file, "w") as handle:
                json.dump({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                 "stage3_gather_16bit_weights_on_model_save": True}}, handle)
        AcceleratorState._reset_state(reset_partial_state=True)
        train_heads(job, tiny_target(), data, accelerator=make_accelerator(job.trainer, job.deepspeed))


if __name__ == "__main__":
    main()
