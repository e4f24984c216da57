"""Never speculate at a loss. Shared pieces of the adaptive controllers (a decayed rolling ratio, a
probe schedule), `SpeculationGate`, which compares the measured throughput of speculative steps
with plain decode steps, and `FallbackDrafter`, which puts a gate in front of any drafter.
`DynamicGamma` (draft_model.py) uses the same pieces to choose a draft-model chain length.

Lossless either way: a plain step is a speculative step with an empty tree, and each step's choice
depends only on the past (acceptance, timings), never on the step's own random draws, so greedy
output is unchanged and sampled output keeps the target's distribution.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from eval.runtime.drafters import Candidates, Drafter, DraftState


@dataclass
class DecayedRatio:
    """sum_i decay^i * numerator_i / sum_i decay^i * denominator_i (newest i = 0), starting from
    `prior_weight` pseudo-denominator at value `initial`, which decays like any observation
    (no prior: value is None until data)."""

    initial: float = 0.0
    decay: float = 0.9
    prior_weight: float = 2.0
    _numerator: float = field(init=False)
    _denominator: float = field(init=False)

    def __post_init__(self):
        self._numerator, self._denominator = self.prior_weight * self.initial, self.prior_weight

    def add(self, numerator: float, denominator: float = 1.0) -> None:
        self._numerator = self.decay * self._numerator + numerator
        self._denominator = self.decay * self._denominator + denominator

    def age(self) -> None:
        """A step went by without an observation: older observations weigh less against the next
        one, and the value stays as it is."""
        self._numerator *= self.decay
        self._denominator *= self.decay

    @property
    def value(self) -> float | None:
        return None if self._denominator <= 0 else self._numerator / self._denominator


@dataclass
class ProbeSchedule:
    """While speculation is off, some steps speculate anyway, so that better drafts (or a lighter
    machine) can switch it back on: the first after `first` idle steps, then at doubling intervals
    up to every `every`-th step (`first` None: every `every`-th step from the start). `reset` when
    speculation pays again. Backing off matters near break-even: a noisy dip switches the gate off,
    and at a fixed cadence each dip would cost `every` plain steps however good the drafts are."""

    every: int = 16
    first: int | None = None
    _idle: int = field(default=0, init=False)
    _interval: int = field(default=0, init=False)

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        self._idle = 0
        self._interval = min(self.first or self.every, self.every)

    def due(self) -> bool:
        """Call once per step that would not speculate: True when a probe is due."""
        self._idle += 1
        if self._idle >= self._interval:
            self._idle = 0
            self._interval = min(2 * self._interval, self.every)
            return True
        return False


@dataclass
class SpeculationGate:
    """Speculate while a speculative step commits more tokens per second than a plain step.

    tau: rolling tokens committed per speculative step (bonus token included; prior initial_tau).
    Speculative and plain step seconds: rolling wall time of each kind of step (drafting,
    verification and bookkeeping; a one-token target forward), the plain one starting from
    `plain_seconds` (measured at start). Speculation pays when tau beats cost = speculative /
    plain step seconds (the step's price in plain decode steps, at least 1: a speculative step
    does a plain step's work and more, so a lower reading is timing noise) by the relative
    `margin` (at break-even plain decoding wins: same speed, less work). While it does not pay,
    it probes after `probe_first` plain steps, then at doubling intervals up to every
    `probe_every`-th step. The state persists across prompts: it describes the drafter, the target
    and the machine. decay 0.95 (~40 steps of memory): with a shorter memory the rolling τ of a head
    near break-even dips below it often enough that whether an eval speculates depends on noise.

    Memory counts steps of the run, plain ones included (`DecayedRatio.age`), and a probe is two
    speculative steps: the first catches the drafter up on the plain steps' features, so
    `FallbackDrafter` does not time it, and the second is timed. Without both, the speculative
    step time measured just before switching off (the slowest stretch, since that is what switched
    it off) stayed the cost for the rest of the run, and a probe's τ alone rarely beat it.
    """

    plain_seconds: float
    initial_tau: float = 2.0
    probe_every: int = 16
    decay: float = 0.95
    margin: float = 0.02
    probe_first: int = 2
    tau: DecayedRatio = field(init=False)
    speculative: DecayedRatio = field(init=False)
    plain: DecayedRatio = field(init=False)
    probe: ProbeSchedule = field(init=False)

    def __post_init__(self):
        if self.plain_seconds <= 0 or self.probe_every < 1 or self.probe_first < 1:
            raise ValueError("speculation gate: need plain_seconds > 0, probe_every >= 1 and probe_first >= 1")
        self.tau = DecayedRatio(self.initial_tau, self.decay, prior_weight=1.0)
        self.speculative = DecayedRatio(0.0, self.decay, prior_weight=0.0)
        self.plain = DecayedRatio(self.plain_seconds, self.decay, prior_weight=1.0)
        self.probe = ProbeSchedule(self.probe_every, self.probe_first)
        self._confirm = False  # the step after a probe speculates too, and is timed

    @property
    def cost(self) -> float | None:
        """A speculative step's measured time in plain decode steps (None before the first)."""
        seconds = self.speculative.value
        return None if seconds is None else seconds / self.plain.value

    def pays(self) -> bool:
        cost = self.cost
        return cost is None or self.tau.value > max(cost, 1.0) * (1.0 + self.margin)

    def speculate(self) -> bool:
        """Decide the coming step: True = draft and verify a tree, False = plain decode step."""
        if self.pays():
            self.probe.reset()
            self._confirm = False
            return True
        if self._confirm:
            self._confirm = False
            return True
        self._confirm = self.probe.due()
        return self._confirm

    def record_speculative(self, tokens: int, seconds: float | None) -> None:
        """seconds None: acceptance only (a step whose time is not typical)."""
        self.tau.add(tokens)
        if seconds is not None:
            self.speculative.add(seconds)

    def record_plain(self, seconds: float) -> None:
        self.plain.add(seconds)
        self.tau.age()
        self.speculative.age()


class FallbackDrafter:
    """A drafter behind a `SpeculationGate`: each step either the wrapped drafter's tree or a plain
    decode step (empty candidates). The features of tokens committed by plain steps are handed on
    at the wrapped drafter's next proposal (its `DraftState.new_features` then spans every token
    since its last one), so a stateful drafter (EAGLE's head KV cache) catches up in one batched
    forward. Steps are timed from `propose` to the end of `accept`, except the first speculative
    step of a sequence (it includes the drafter's own prefill, e.g. EAGLE's head over the prompt)
    and the first after plain steps (it includes catching up on their features: timed as a typical
    step, such a probe inflates the measured cost and can keep speculation off for good)."""

    def __init__(self, drafter: Drafter, gate: SpeculationGate, clock: Callable[[], float] = time.perf_counter):
        self.drafter, self.gate, self.clock = drafter, gate, clock
        self.feature_layers = tuple(drafter.feature_layers)
        self._pending: dict[int, torch.Tensor] | None = None  # {layer: (A, D)} features not yet handed on
        self._proposed = self._nonempty = self._catching_up = False
        self._fresh = True  # no speculative step yet in this sequence
        self._start = 0.0

    def reset(self, prompt: torch.Tensor) -> None:
        self.drafter.reset(prompt)
        self._pending, self._fresh = None, True

    def propose(self, state: DraftState) -> Candidates:
        self._start = self.clock()
        self._catching_up = self._pending is not None  # plain steps since the last proposal
        if self._pending is not None:
            merged = {layer: torch.cat([self._pending[layer], features]) for layer, features in state.new_features.items()}
            state = dataclasses.replace(state, new_features=merged)
        self._proposed = self.gate.speculate()
        if not self._proposed:
            self._pending, self._nonempty = state.new_features, False
            return Candidates.empty()
        self._pending = None
        candidates = self.drafter.propose(state)
        self._nonempty = len(candidates) > 0
        return candidates

    def accept(self, state: DraftState, accepted: list[int]) -> None:
        if self._proposed:
            self.drafter.accept(state, accepted)
        seconds = self.clock() - self._start
        if self._nonempty:
            typical = not (self._fresh or self._catching_up)
            self.gate.record_speculative(len(accepted) + 1, seconds if typical else None)
            self._fresh = False
        else:
            self.gate.record_plain(seconds)
