"""A separate small draft model sharing the target's tokenizer, drafting a chain with a dynamic
length gamma. For the embedded default the draft is a truncated copy of the target (its first
layers plus its norm and lm_head: self-speculation), built by `self_speculation_drafter`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from eval.runtime.drafters import Candidates, DraftState
from eval.runtime.drafters.adaptive import DecayedRatio, ProbeSchedule
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import probabilities, sample

# Relative cost of a target forward over n tokens vs one decode step (n = 1, 2, ...): SmolLM2 fp32,
# lean forward (fused, packed), 1 thread, loaded shared machine (scripts/bench_decode.py: N=2 1.3,
# N=4 1.5, N=8 1.7), interpolated. Pass the curve measured on your machine.
DEFAULT_VERIFY_COST = (1.0, 1.3, 1.4, 1.5, 1.55, 1.6, 1.65, 1.7, 1.8)


@dataclass
class DynamicGamma:
    """Chooses the chain length from the rolling per-token acceptance rate alpha.

    With acceptance alpha, a chain of gamma drafts commits (1 - alpha^(gamma+1)) / (1 - alpha)
    tokens per step and costs verify_cost[gamma] + gamma * draft_cost target decode steps; gamma 0
    (no speculation, one plain decode step) commits 1 token for cost 1. The controller picks the
    gamma with the best tokens per cost, so speculation switches off when it stops paying; while
    off it probes with gamma=1 every `probe_every` steps to notice when drafts improve again
    (the same rolling estimate and probe schedule as `eval.runtime.drafters.adaptive.SpeculationGate`).
    """

    max_gamma: int = 8
    draft_cost: float = 0.3  # one draft forward / one target decode step
    verify_cost: Sequence[float] = DEFAULT_VERIFY_COST
    decay: float = 0.9  # weight of history in the rolling acceptance estimate
    probe_every: int = 16
    adaptive: bool = True
    initial_alpha: float = 0.6
    _alpha: DecayedRatio = field(init=False)
    _probe: ProbeSchedule = field(init=False)

    def __post_init__(self):
        self._alpha = DecayedRatio(self.initial_alpha, self.decay, prior_weight=2.0)
        self._probe = ProbeSchedule(self.probe_every)

    @property
    def alpha(self) -> float:
        return self._alpha.value

    def expected_speedup(self, gamma: int) -> float:
        a = min(self.alpha, 0.999)
        tokens = (1.0 - a ** (gamma + 1)) / (1.0 - a)
        cost_index = min(gamma, len(self.verify_cost) - 1)
        extra = max(gamma - cost_index, 0) * (self.verify_cost[-1] - self.verify_cost[-2])
        return tokens / (self.verify_cost[cost_index] + extra + gamma * self.draft_cost)

    def gamma(self) -> int:
        if not self.adaptive:
            return self.max_gamma
        best = max(range(self.max_gamma + 1), key=self.expected_speedup)
        return 1 if best == 0 and self._probe.due() else best

    def update(self, accepted: int, gamma: int) -> None:
        """A chain of `gamma` drafts had `accepted` accepted: a truncated-geometric observation."""
        if gamma == 0:
            return
        self._alpha.add(accepted, accepted + (accepted < gamma))


class DraftModelDrafter:
    """Chain drafting with a small causal LM (a `LeanLlama`) and its own KV cache.

    Greedy target: argmax drafts (deterministic). Sampling: drafts drawn from the draft's
    distribution under the same sampling transform, reported as draft_probs.
    The controller's acceptance estimate persists across prompts (it describes the model pair).
    """

    feature_layers: tuple[int, ...] = ()

    def __init__(self, draft: LeanLlama, controller: DynamicGamma | None = None, max_length: int | None = None):
        self.draft = draft
        self.controller = controller or DynamicGamma()
        self.cache = draft.new_cache(max_length)
        self._gamma = 0
        self._base = 0

    def reset(self, prompt: torch.Tensor) -> None:
        self.cache.truncate(0)

    def propose(self, state: DraftState) -> Candidates:
        gamma = self._gamma = self.controller.gamma()
        if gamma == 0:
            return Candidates.empty()
        feed = state.tokens[self.cache.length:]  # committed tokens the draft has not seen (>= the root)
        self._base = state.tokens.shape[0]
        tokens, rows = [], []
        step_input = torch.empty(1, dtype=torch.long)
        for i in range(gamma):
            logits = self.draft(feed, self.cache, logits="last").logits[-1]  # (V,)
            self.cache.commit()
            if state.sampling.greedy:
                token = int(logits.argmax())
            else:
                q = probabilities(logits, state.sampling)
                token = sample(q, state.generator)
                rows.append(q)
            tokens.append(token)
            if i + 1 < gamma:
                step_input[0] = token
                feed = step_input
        draft_probs = torch.stack(rows) if rows else None
        candidates = Candidates.chain(tokens, draft_probs, deterministic=state.sampling.greedy)
        candidates.info["gamma"] = gamma
        return candidates

    def accept(self, state: DraftState, accepted: list[int]) -> None:
        gamma = self._gamma
        if gamma == 0:
            return
        # The cache holds the committed tokens plus drafts 1..gamma-1; keep the accepted ones.
        self.cache.truncate(self._base + min(len(accepted), gamma - 1))
        self.controller.update(len(accepted), gamma)


def self_speculation_drafter(lean: LeanLlama, num_layers: int, controller: DynamicGamma | None = None,
                             max_length: int | None = None) -> DraftModelDrafter:
    """Draft with the target's first `num_layers` blocks plus its final norm and lm_head."""
    return DraftModelDrafter(lean.truncated(num_layers), controller, max_length)
