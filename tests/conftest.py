import os
import random

import pytest
import torch

# Keep the suite from fighting itself for the 2 cores of a CI machine.
torch.set_num_threads(int(os.environ.get("SPECHEADS_TEST_THREADS", "1")))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded SmolLM2 target (dequantized cache; ~30 s the first time on a machine)."""
    from heads.target import TargetConfig, load_target

    return load_target(TargetConfig(device="cpu"))
