"""Run one whole job (train.pipeline.run_job) on the tiny chat model, as one rank of a torchrun
group or alone, for the multi-process job tests.

    torchrun --standalone --nproc_per_node 2 tests/scale/job_worker.py MODEL_DIR TMP RUN override...
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    import logging

    import torch

    from tests.helpers import pipeline_job
    from train.pipeline import run_job

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.set_num_threads(1)
    model_dir, tmp, run, *overrides = sys.argv[1:]
    run_job(pipeline_job(Path(model_dir), Path(tmp), run, 2, *overrides))


if __name__ == "__main__":
    main()
