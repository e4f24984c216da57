"""A speculation policy per batch size, and the drafter that follows it.

Speculation spends spare compute to save memory-bound steps; as the batch grows the spare compute
goes, and past a crossover batch size a speculative step costs more than the tokens it adds. The
policy holds, per range of batch sizes, the draft size (EAGLE tree: total_tokens; a chain: its
depth; prompt lookup: its longest chain) of one drafter family that gave the most tokens/s in the
sweep, and 0 (plain decoding) where no size beat plain decoding. `PolicyDrafter` applies it step
by step from the batch size of the step (`DraftState.batch_size`); a batch-size sweep chooses
the policy (`eval.policy.choose_policy`). Engines take the same curve in their own terms: vLLM's
`num_speculative_tokens_per_batch_size` ([[min, max, k], ...]) and TensorRT-LLM's
`draft_len_schedule` ({largest batch size: draft length}; larger batches: 0).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from eval.runtime.drafters import Candidates, Drafter, DraftState

# The attribute each drafter family sizes its drafts with, and what an engine calls a draft length.
SIZE_ATTRIBUTES = {"eagle_tree": "total_tokens", "eagle_chain": "depth", "prompt_lookup": "num_draft"}


@dataclass
class SpeculationPolicy:
    """ranges: [{"min_batch", "max_batch" (None: and above), "size" (0: plain decoding),
    "draft_length" (tokens drafted along one path: what an engine calls the draft length)}],
    ascending and contiguous from batch size 1. family: the drafter family the sizes are for."""

    family: str
    ranges: list[dict] = field(default_factory=list)
    measured_on: dict | None = None

    def size_for(self, batch_size: int) -> int:
        for entry in self.ranges:
            if entry["min_batch"] <= batch_size and (entry["max_batch"] is None or batch_size <= entry["max_batch"]):
                return entry["size"]
        return 0

    def engine_terms(self) -> dict:
        """vLLM's num_speculative_tokens_per_batch_size and TensorRT-LLM's draft_len_schedule."""
        vllm, schedule = [], {}
        for entry in self.ranges:
            upper = entry["max_batch"]
            vllm.append([entry["min_batch"], upper if upper is not None else 1 << 20, entry["draft_length"]])
            if entry["draft_length"] and upper is not None:
                schedule[str(upper)] = entry["draft_length"]
        return {"vllm": {"num_speculative_tokens_per_batch_size": vllm},
                "tensorrt_llm": {"draft_len_schedule": schedule}}

    def to_dict(self) -> dict:
        return {"family": self.family, "ranges": [dict(r) for r in self.ranges], "measured_on": self.measured_on,
                **self.engine_terms()}

    @classmethod
    def from_dict(cls, values: Mapping) -> "SpeculationPolicy":
        return cls(values["family"], [dict(r) for r in values["ranges"]], values.get("measured_on"))


class PolicyDrafter:
    """A drafter following a `SpeculationPolicy`: each step sets the wrapped drafter's size
    attribute (SIZE_ATTRIBUTES[policy.family]) from the step's batch size, or takes a plain step
    (empty candidates) where the policy says 0. Features committed by plain steps are handed on
    at the next proposal, as `FallbackDrafter` does, so a stateful drafter catches up in one go.
    Lossless: the choice depends only on the batch size, never on the step's random draws."""

    def __init__(self, drafter: Drafter, policy: SpeculationPolicy):
        if policy.family not in SIZE_ATTRIBUTES:
            raise ValueError(f"speculation policy: unknown drafter family {policy.family!r} "
                             f"(one of {sorted(SIZE_ATTRIBUTES)})")
        self.drafter, self.policy = drafter, policy
        self.attribute = SIZE_ATTRIBUTES[policy.family]
        self.feature_layers = tuple(drafter.feature_layers)
        self._pending: dict[int, torch.Tensor] | None = None
        self._proposed = False

    def reset(self, prompt: torch.Tensor) -> None:
        self.drafter.reset(prompt)
        self._pending = None

    def propose(self, state: DraftState) -> Candidates:
        state = self._prepare(state)
        return self.drafter.propose(state) if self._proposed else Candidates.empty()

    def _prepare(self, state: DraftState) -> DraftState:
        """Decide the step from its batch size; the state with every feature not yet handed on."""
        if self._pending is not None:
            merged = {layer: torch.cat([self._pending[layer], features]) for layer, features in state.new_features.items()}
            state = dataclasses.replace(state, new_features=merged)
        size = self.policy.size_for(state.batch_size)
        self._proposed = size > 0
        self._pending = None if self._proposed else state.new_features
        if self._proposed:
            setattr(self.drafter, self.attribute, size)
        return state

    def accept(self, state: DraftState, accepted: list[int]) -> None:
        if self._proposed:
            self.drafter.accept(state, accepted)

    @staticmethod
    def propose_many(drafters: Sequence["PolicyDrafter"], states: Sequence[DraftState]) -> list[Candidates]:
        """One batch's proposals: its batch size picks one size for all; the wrapped drafters
        propose together where their class can (`propose_many`)."""
        inner = [d.drafter for d in drafters]
        batched = getattr(type(inner[0]), "propose_many", None)
        if batched is None or any(type(d) is not type(inner[0]) for d in inner):
            return [d.propose(s) for d, s in zip(drafters, states)]
        prepared = [d._prepare(s) for d, s in zip(drafters, states)]
        if not drafters[0]._proposed:
            return [Candidates.empty() for _ in drafters]
        return batched(inner, prepared)
