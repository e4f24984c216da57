"""Sampling transforms applied identically to the target and the drafts (pure functions)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling: invalid {self} (temperature >= 0, top_k >= 0, 0 < top_p <= 1)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """(..., V) logits to the (..., V) distribution actually sampled from: temperature, then top-k,
    then top-p (smallest set whose mass reaches top_p), renormalised. Greedy gives the one-hot argmax."""
    logits = logits.float()
    if sampling.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token id from a (V,) distribution (inverse CDF; faster than multinomial for one draw)."""
    cdf = probs.float().cumsum(0)
    u = float(torch.rand((), generator=generator)) * float(cdf[-1])  # a CPU generator works for any device
    return min(int(torch.searchsorted(cdf, torch.tensor(u, device=cdf.device), right=True)), probs.shape[0] - 1)


def pick(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None) -> int:
    """Next token from (V,) logits: argmax when greedy, else a sample of `probabilities`."""
    if sampling.greedy:
        return int(logits.argmax())
    return sample(probabilities(logits, sampling), generator)
