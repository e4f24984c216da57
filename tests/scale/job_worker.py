"""Run one whole job (train.pipeline.run_job) on the tiny chat model, as one rank of a torchrun
group or alone, for the multi-process job tests.

    torchrun --standalone --nproc_per_node 2 tests/scale/job_worker.py [--split] MODEL_DIR TMP RUN override...

--split: the target as a layer-split one, over three "devices" that are all the CPU (its device map
names them cpu:0, cpu:1, cpu:2, as transformers' hf_device_map names the GPUs of a real split), so
every stage of the job runs on a split target and the lean runtime moves activations at each boundary.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def split_on_cpu(load):
    """`load` (heads.target.load_target) whose target records a split: the embedding and the first
    half of the layers on cpu:0, the rest on cpu:1, the final norm and lm_head on cpu:2."""
    def load_split(config, *args, **kwargs):
        target = load(config, *args, **kwargs)
        layers = target.model.config.num_hidden_layers
        target.model.hf_device_map = {
            "model.embed_tokens": "cpu:0", "model.rotary_emb": "cpu:0",
            **{f"model.layers.{i}": f"cpu:{2 * i // layers}" for i in range(layers)},
            "model.norm": "cpu:2", "lm_head": "cpu:2"}
        assert target.is_split
        return target
    return load_split


def main() -> None:
    import logging

    import torch

    from tests.helpers import pipeline_job
    import train.pipeline
    from train.pipeline import run_job

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.set_num_threads(1)
    args = sys.argv[1:]
    if args[0] == "--split":
        args = args[1:]
        train.pipeline.load_target = split_on_cpu(train.pipeline.load_target)
    model_dir, tmp, run, *overrides = args
    run_job(pipeline_job(Path(model_dir), Path(tmp), run, 2, *overrides))


if __name__ == "__main__":
    main()
