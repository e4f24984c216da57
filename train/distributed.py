"""Process-group and precision setup: the one place that builds the `Accelerator`.

The training loop calls `make_accelerator` and never touches torch.distributed directly, so the
same loop runs in one CPU process, under DDP, or under DeepSpeed.
"""
from __future__ import annotations

import torch

from train.config import DeepSpeedConfig, TrainerConfig


def resolve_mixed_precision(trainer: TrainerConfig) -> str:
    if trainer.mixed_precision != "auto":
        return trainer.mixed_precision
    return "bf16" if torch.cuda.is_available() else "no"


def make_accelerator(trainer: TrainerConfig, deepspeed: DeepSpeedConfig):
    from accelerate import Accelerator

    if deepspeed.enabled:
        raise NotImplementedError("DeepSpeed setup lands with the scale-out work")
    return Accelerator(
        gradient_accumulation_steps=trainer.grad_accumulation,
        mixed_precision=resolve_mixed_precision(trainer),
        cpu=not torch.cuda.is_available(),
    )
