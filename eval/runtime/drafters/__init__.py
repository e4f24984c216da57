"""The drafter protocol: what every draft source (EAGLE, Medusa, prompt lookup, a draft model)
implements. The runtime (`eval.runtime.generate.speculative_generate`) never knows which one made a tree.

One generation, as the runtime drives it:

    drafter.reset(prompt)                      # before the prefill
    target prefill -> first token; state = DraftState(...)
    loop:
        candidates = drafter.propose(state)    # a tree of N drafted tokens hanging off the root
        target forward over [root] + candidates.tokens with the tree mask; verify
        state is advanced (tokens, position, new_features)
        drafter.accept(state, accepted)        # accepted: candidate indices on the accepted path

Invariant: the target's KV cache holds every committed token except the last one (the root,
`state.tokens[-1]`), whose K/V is computed by the next verification forward.

In a batch (`eval.runtime.batch_generate`) every sequence has its own drafter instance. A drafter class
may also define `propose_many(drafters, states) -> list[Candidates]` (a staticmethod): the
proposals of several of its instances at once, each what `drafter.propose(state)` gives (up to
floating-point near-ties), so the batch drafts in batched forwards (EAGLE).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import torch

from eval.runtime.sampling import SamplingConfig


@dataclass
class DraftState:
    """What a drafter may read when proposing.

    tokens: (T,) int64, every committed token (prompt + generated); tokens[-1] is the root.
    position: position id of the root = number of tokens in the target's KV cache = T - 1.
    new_features: {layer: (A, D)} the target's hidden states (transformers numbering; the
        drafter's `feature_layers`, negative indices resolved against `num_layers`) for the A
        tokens that entered the target's cache in the last forward, i.e. tokens[T-1-A : T-1]:
        the whole prompt after the prefill, root + accepted path after a step (behind a
        `FallbackDrafter`: every token since the drafter's last proposal). The EAGLE feature
        f_t is layer num_layers (the final post-norm state); new_features[L][-1] is the feature of
        the token before the root.
    num_layers: the target's layer count (to resolve feature layer indices).
    sampling: the sampling transform the target uses; sampled drafts must draw from
        `eval.runtime.sampling.probabilities(draft_logits, sampling)` and report those distributions.
    generator: the random generator the runtime uses (None = global RNG).
    step: verification steps done so far (0 right after the prefill).
    batch_size: sequences verified together in the coming step (1 at batch 1).
    """

    tokens: torch.Tensor
    position: int
    new_features: dict[int, torch.Tensor]
    num_layers: int
    sampling: SamplingConfig
    generator: torch.Generator | None = None
    step: int = 0
    batch_size: int = 1


@dataclass
class Candidates:
    """A drafted tree hanging off the root (the root itself is not included).

    tokens: (N,) int64 draft tokens.
    parents: (N,) int64: -1 = child of the root, else the index of an earlier candidate.
    draft_probs: (N, V) float or None: row i is the distribution candidate i was drawn from
        (after the sampling transform). Needed for lossless sampling with sampled drafts.
    deterministic: True when candidates were chosen deterministically (argmax / top-k); then
        verification treats each draft as a point mass (EAGLE-2 rule) and draft_probs is unused.
        Sampled drafts (deterministic=False) must give draft_probs, and siblings must be drawn
        independently from their parent's distribution.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    deterministic: bool = True
    info: dict = field(default_factory=dict)  # free-form per-step diagnostics (e.g. gamma)

    @staticmethod
    def empty() -> "Candidates":
        """No speculation this step: the runtime does a plain decode step."""
        return Candidates(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))

    @staticmethod
    def chain(tokens: Sequence[int] | torch.Tensor, draft_probs: torch.Tensor | None = None,
              deterministic: bool = True) -> "Candidates":
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        return Candidates(tokens, torch.arange(-1, tokens.shape[0] - 1), draft_probs, deterministic)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@runtime_checkable
class Drafter(Protocol):
    """feature_layers: target hidden layers the drafter wants in `DraftState.new_features`
    (transformers numbering, -1 = final post-norm state); () for none."""

    feature_layers: tuple[int, ...]

    def reset(self, prompt: torch.Tensor) -> None:
        """Start a new generation for prompt (T,) int64; drop all per-sequence state."""

    def propose(self, state: DraftState) -> Candidates:
        """Draft a tree for the next verification step."""

    def accept(self, state: DraftState, accepted: list[int]) -> None:
        """After verification: `accepted` are candidate indices on the accepted path (in order,
        maybe empty); `state` already holds the committed tokens, including the next root."""
