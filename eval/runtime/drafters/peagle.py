"""P-EAGLE drafting (`heads.peagle.PeagleHead`): a chain of K tokens, or a tree over the same K
slots, from one head forward.

With T committed tokens (root x_{T-1}), the head's committed cache holds positions 0..T-2 as for
EAGLE-3 (position t: embed(x_{t+1}), fc(aux_t)). One forward feeds the positions that entered the
target's cache in the last verification, the last of which (position T-2: the root with the aux
streams of the token before it) is slot 0, followed by K-1 mask slots at positions T-1..T+K-3
(mask_token_id, fc(mask_hidden)), causal over the whole run. Slot d's output scores the draft
x_{T+d}. The committed rows are kept and the mask slots are drafted entries, which the next
forward drops: the committed cache always equals a fresh recompute, as for EAGLE
(eval/runtime/drafters/eagle.py, whose helpers this drafter shares).

No slot reads a drafted token, so every draft is drawn from its slot's distribution alone: argmax
when greedy, else sampled with that distribution reported, which the runtime's rejection sampling
keeps lossless. For the same reason a tree costs no more than the chain: depth d + 1 may branch
into slot d's top tokens whatever the parent (as a Medusa tree takes head d's ranked tokens), and
`PeagleTreeDrafter` picks those nodes per step by the product of the slots' probabilities along
each path (`slot_tree`). Its drafts are deterministic (top-k), verified with the EAGLE-2 rule, so
sampling stays lossless as for Medusa's and EAGLE-2's trees.
"""
from __future__ import annotations

import torch

from eval.runtime.drafters import Candidates, DraftState
from eval.runtime.drafters.eagle import EagleDrafter
from eval.runtime.drafters.lean_head import LeanEagleHead
from eval.runtime.medusa_trees import build_tree_from_accuracies, choices_to_parents
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import probabilities, sample
from heads.peagle import PeagleHead


class LeanPeagleHead(LeanEagleHead):
    """The lean EAGLE-3 runtime with P-EAGLE's one pass: commit rows and draft mask slots together."""

    @torch.no_grad()
    def commit_and_draft(self, embeds: torch.Tensor, features: torch.Tensor, slot_embeds: torch.Tensor,
                         slot_hidden: torch.Tensor) -> torch.Tensor:
        """One causal forward over n committed rows (embeds (n, D), features (n, F)) and then m
        drafted slots (slot_embeds, slot_hidden (m, D), the slots' hidden input as it is). Keeps
        the n rows committed and the m slots as drafted entries; returns the outputs of the last
        committed row and of the slots (m + 1, D)."""
        self.drafted = 0
        n, m = embeds.shape[0], slot_embeds.shape[0]
        hidden = torch.cat([self.head_inputs.project(features.to(self.device, self.dtype)),
                            slot_hidden.to(self.device, self.dtype)])
        positions = torch.arange(self.length, self.length + n + m, device=self.device)
        out = self._forward(torch.cat([embeds, slot_embeds]), hidden, positions, None)
        self.length, self.drafted = self.length + n, m
        return out[n - 1:]


class PeagleDrafter(EagleDrafter):
    """A chain of `depth` <= K tokens (default K, the head's speculative_tokens) from one forward.
    greedy_drafts: argmax drafts at a temperature too (verified as one-hot drafts, still lossless)."""

    lean_head = LeanPeagleHead
    propose_many = None  # one sequence at a time: EAGLE's batched drafting is step by step

    def __init__(self, head: PeagleHead, lean: LeanLlama, depth: int | None = None, greedy_drafts: bool = False):
        if not isinstance(head, PeagleHead):
            raise ValueError(f"peagle drafter: needs a PeagleHead, got {type(head).__name__}")
        K = head.config.speculative_tokens
        depth = K if depth is None else depth
        if not 1 <= depth <= K:
            raise ValueError(f"peagle drafter: depth must lie in [1, {K}] (the head's speculative_tokens), got {depth}")
        if head.config.norm_output:  # the lean runtime would norm the mask slots' hidden input
            raise ValueError("peagle drafter: a P-EAGLE head with norm_output is not supported")
        super().__init__(head, lean, mode="chain", depth=depth, greedy_drafts=greedy_drafts)
        with torch.no_grad():
            mask_hidden = head.mask_hidden.detach()[0].to(self.runtime.device, self.runtime.dtype)  # (1, n·Ht)
            self.slot_hidden = self.runtime.head_inputs.project(mask_hidden)  # (1, D): fc(mask_hidden)
        self.mask_token = head.config.mask_token_id

    @torch.no_grad()
    def slot_logits(self, state: DraftState) -> torch.Tensor:
        """Commit the rows new since the last verification and draft the mask slots in one forward:
        (depth, Vd) float logits, row d scoring the draft at depth d + 1."""
        features = self.committed_features(state)  # (A, F) for tokens[T-1-A : T-1]
        count, length = features.shape[0], state.tokens.shape[0]
        start = length - 1 - count
        if start != self.cache_length:
            raise RuntimeError(f"peagle drafter: head cache holds {self.cache_length} positions, expected {start}")
        slots = self.depth - 1
        out = self.runtime.commit_and_draft(self._embed(state.tokens[start + 1: length]), features,
                                            self._embed(torch.full((slots,), self.mask_token)),
                                            self.slot_hidden.expand(slots, -1))  # (depth, D)
        self.catch_up_output = out[0]
        return self.runtime.logits(out)  # (depth, Vd)

    @torch.no_grad()
    def propose(self, state: DraftState) -> Candidates:
        logits = self.slot_logits(state)  # (depth, Vd)
        if state.sampling.greedy or self.greedy_drafts:
            return Candidates.chain(self._token_ids(logits.argmax(-1)).tolist())
        q = probabilities(logits, state.sampling)  # (depth, Vd)
        tokens = [int(self._token_ids(torch.tensor(sample(row, state.generator)))) for row in q]
        return Candidates.chain(tokens, torch.stack([self._full_distribution(row) for row in q]), deterministic=False)


class PeagleTreeDrafter(PeagleDrafter):
    """A tree of total_tokens - 1 nodes over `depth` <= K slots (default K) from the chain's one
    forward, chosen per step by `slot_tree` from the slots' softmax at temperature 1 (the drafts are
    deterministic at any sampling temperature, as Medusa's and EAGLE-2's). A tree of n nodes reaches
    depth n at most (it is ancestor-closed), so only the first min(depth, n) slots are drafted: the
    4-token tree of a K = 4 head runs 3 slots, the 2-token tree one."""

    def __init__(self, head: PeagleHead, lean: LeanLlama, total_tokens: int = 8, depth: int | None = None):
        if total_tokens < 2:
            raise ValueError(f"peagle tree: total_tokens counts the root, so it must be >= 2, got {total_tokens}")
        super().__init__(head, lean, depth)
        self.total_tokens = total_tokens
        self.depth = min(self.depth, total_tokens - 1)  # slots past the deepest reachable node are never read

    @torch.no_grad()
    def propose(self, state: DraftState) -> Candidates:
        candidates = slot_tree(torch.softmax(self.slot_logits(state), dim=-1), self.total_tokens - 1)
        candidates.tokens = self._token_ids(candidates.tokens)
        return candidates


def slot_tree(probs: torch.Tensor, count: int) -> Candidates:
    """The `count` nodes with the largest path probability under independent slot distributions
    probs (depth, Vd): node path (i0, ..., id) takes slot d's i_d-th most likely column, and its
    probability is the product of probs[j, i_j]. Ancestor-closed, parents first; tokens are columns
    of probs. Ranks below `count` suffice: a node's better-ranked siblings outscore it, so a node
    of rank r comes with r siblings and its parent."""
    top = probs.topk(min(count, probs.shape[-1]), dim=-1)  # values, indices (depth, width)
    # The Medusa selection over rank accuracies is the same search: each slot's probability of its
    # r-th token stands in for head d's accuracy at rank r.
    choices = build_tree_from_accuracies(top.values.tolist(), count)
    slots = torch.tensor([len(path) - 1 for path in choices])  # (N,)
    ranks = torch.tensor([path[-1] for path in choices])  # (N,)
    return Candidates(top.indices[slots, ranks], torch.tensor(choices_to_parents(choices), dtype=torch.long))


def peagle_chain(head: PeagleHead, lean: LeanLlama, depth: int, draft_vocab: torch.Tensor | None = None,
                 greedy_drafts: bool = False) -> PeagleDrafter:
    """The kind's chain (eval/runtime/drafters/kinds.py): `depth` drafts, at most the head's K; the
    head drafts over its own vocabulary (d2t), so `draft_vocab` is not used."""
    return PeagleDrafter(head, lean, min(depth, head.config.speculative_tokens), greedy_drafts)


def peagle_tree(head: PeagleHead, lean: LeanLlama, depth: int, total_tokens: int) -> PeagleTreeDrafter:
    """The kind's tree: total_tokens (root included) over `depth` slots, at most the head's K."""
    return PeagleTreeDrafter(head, lean, total_tokens, min(depth, head.config.speculative_tokens))
