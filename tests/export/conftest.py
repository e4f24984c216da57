"""Tiny targets and heads for the export tests. The target's sizes are all distinct (H 48, I 80,
V 112, hd 16 so nH·hd = 64, nKV·hd = 32, 2H = 96) so a transposed or swapped tensor cannot pass a
shape check by accident."""
from __future__ import annotations

import pytest
import torch

from heads.eagle import EagleConfig, EagleHead
from heads.medusa import MedusaConfig, MedusaHeads
from tests.tiny import tiny_target

SIZES = dict(hidden_size=48, intermediate_size=80, vocab_size=112, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16)


def make_target(seed: int = 0, **overrides):
    return tiny_target(seed, **{**SIZES, **overrides})


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Non-trivial values everywhere (Medusa's zero-init weights would make round trips vacuous)."""
    generator = torch.Generator().manual_seed(seed)
    for parameter in module.parameters():
        parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return module


def make_eagle(target, **options):
    config = EagleConfig.from_target(target, **options)
    return randomize(EagleHead(config)), config


def make_medusa(target, **options):
    config = MedusaConfig.from_target(target, **{"num_heads": 3, "num_layers": 2, **options})
    return randomize(MedusaHeads(config)), config


@pytest.fixture
def target():
    return make_target()
