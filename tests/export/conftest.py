"""Tiny targets and heads for the export tests. The target's sizes are all distinct (H 48, I 80,
V 112, hd 16 so nH·hd = 64, nKV·hd = 32, 2H = 96) so a transposed or swapped tensor cannot pass a
shape check by accident."""
from __future__ import annotations

import pytest
import torch

from heads.eagle import EagleConfig, EagleHead
from heads.eagle3 import Eagle3Config, Eagle3Head, set_draft_vocab
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


def make_eagle3(target, draft_vocab_size: int | None = 40, seed: int = 2, **options):
    """A randomised EAGLE-3 head with a random sorted draft vocabulary of `draft_vocab_size` ids
    (None: the full vocabulary, identity maps)."""
    config = Eagle3Config.from_target(target, draft_vocab_size=draft_vocab_size, **options)
    head = randomize(Eagle3Head(config), seed)
    if config.draft_vocab_size < config.vocab_size:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randperm(config.vocab_size, generator=generator)[:config.draft_vocab_size].sort().values
        set_draft_vocab(head, ids)
    return head, config


def make_target3(seed: int = 0, **overrides):
    """Seven layers, so the default aux layers [2, L//2, L-3] = [2, 3, 4] are distinct."""
    return make_target(seed, **{"num_hidden_layers": 7, **overrides})


def make_medusa(target, **options):
    config = MedusaConfig.from_target(target, **{"num_heads": 3, "num_layers": 2, **options})
    return randomize(MedusaHeads(config)), config


@pytest.fixture
def target():
    return make_target()


@pytest.fixture
def target3():
    return make_target3()
