"""Medusa-1 heads: K heads, each L independent ResBlocks (x + SiLU(Wx + b), W zero-init) and an
lm_head initialised from the target's (or the target's own, shared and frozen).

Head k (0-based) predicts the token k+2 positions ahead of the feature's position (the target's
lm_head predicts k+1). The state dict is FasterDecoding's layout: `{h}.{l}.linear.weight|bias`,
`{h}.{L}.weight` (absent when share_lm_head).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MedusaConfig:
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    share_lm_head: bool = False
    target_name: str = ""
    target_fingerprint: dict = field(default_factory=dict)
    # Vd of the heads' draft vocabulary (buffer `draft_vocab`: sorted target ids that the loss and
    # the drafter score); 0: none stored, the full vocabulary (heads saved before it existed)
    draft_vocab_size: int = 0

    @classmethod
    def from_target(cls, target, **options) -> "MedusaConfig":
        values = dict(
            num_heads=4, num_layers=1, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
            target_name=target.name, target_fingerprint=target.fingerprint(),
        )
        values.update(options)
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # each head starts as the identity on the feature

    def forward(self, x):
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        for h in range(config.num_heads):
            # L *independent* blocks: a new ResBlock per layer (never one block repeated).
            blocks = [ResBlock(config.hidden_size) for _ in range(config.num_layers)]
            if not config.share_lm_head:
                blocks.append(nn.Linear(config.hidden_size, config.vocab_size, bias=False))
            self.add_module(str(h), nn.ModuleList(blocks))
        if config.draft_vocab_size:  # the first Vd ids until heads.vocab.set_draft_vocab installs the real ones
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size))

    def head(self, k: int) -> nn.ModuleList:
        return self._modules[str(k)]

    def lm_head_weight(self, k: int, shared: torch.Tensor | None = None) -> torch.Tensor:
        """(V, D) weight that turns head k's hidden state into logits."""
        if self.config.share_lm_head:
            if shared is None:
                raise ValueError("share_lm_head=True: pass the target's lm_head weight")
            return shared
        return self.head(k)[self.config.num_layers].weight

    def hidden_one(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) -> head k's hidden state (B, T, D)."""
        blocks = self.head(k)
        for layer in range(self.config.num_layers):
            x = blocks[layer](x)
        return x

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) target's final feature -> (K, B, T, D)."""
        return torch.stack([self.hidden_one(k, x) for k in range(self.config.num_heads)])

    forward = hidden  # DDP and friends call forward()

    def logits(self, x: torch.Tensor, lm_head_weight: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, D) -> (K, B, T, V). `lm_head_weight` (V, D): the target's, used iff share_lm_head."""
        return torch.stack([
            F.linear(self.hidden_one(k, x), self.lm_head_weight(k, lm_head_weight))
            for k in range(self.config.num_heads)
        ])


@torch.no_grad()
def init_from_target(heads: MedusaHeads, target) -> MedusaHeads:
    """Copy the target's lm_head into every head's own lm_head (no-op when shared)."""
    if not heads.config.share_lm_head:
        weight = target.lm_head.weight
        for k in range(heads.config.num_heads):
            heads.lm_head_weight(k).copy_(weight.to(heads.lm_head_weight(k).dtype))
    return heads
