"""Medusa drafting with a static tree: the heads read the target's final feature of the token before
the root (position T-2), so head k (0-based) ranks candidates for x_{T+k}; node path (i0, ..., id)
takes the i_d-th ranked token of head d. Drafts are deterministic (top-k), so sampling stays
lossless with the EAGLE-2 rule; Medusa's typical acceptance is the runtime's LOSSY option
(`speculative_generate(verification="typical")`). `draft_vocab` ((Vd,) token ids) restricts the
heads' vocabulary projections to those rows (K full projections cost nearly a target step on a CPU).
Rank accuracies are then measured over the subset too."""
from __future__ import annotations

from typing import Sequence

import torch

from eval.runtime import linear_paths
from eval.runtime.drafters import Candidates, DraftState
from eval.runtime.medusa_trees import Choices, choices_to_parents, normalize_choices
from eval.runtime.model import LeanLlama, Linear
from heads.medusa import MedusaHeads


class MedusaDrafter:
    feature_layers: tuple[int, ...] = (-1,)

    def __init__(self, heads: MedusaHeads, lean: LeanLlama, choices: Sequence[Sequence[int]],
                 draft_vocab: torch.Tensor | None = None):
        self.choices: Choices = normalize_choices(choices)
        self.num_used = max(len(path) for path in self.choices)
        if self.num_used > heads.config.num_heads:
            raise ValueError(f"medusa tree has depth {self.num_used} > {heads.config.num_heads} heads")
        self.heads, self.lean = heads.eval(), lean
        self.head_dtype = next(heads.parameters()).dtype  # float32 behind a bf16 target too
        self.parents = torch.tensor(choices_to_parents(self.choices), dtype=torch.long)
        self.head_index = torch.tensor([len(path) - 1 for path in self.choices])  # (N,)
        self.rank_index = torch.tensor([path[-1] for path in self.choices])  # (N,)
        self.top = int(self.rank_index.max()) + 1
        # The vocabulary projections as the lean target's linear layers, each row count through the
        # kernel measured for the target's lm_head (`linear_paths.follow`); the shared full lm_head is
        # the target's own layer.
        self.vocab = None if draft_vocab is None else torch.as_tensor(draft_vocab, dtype=torch.long)
        if heads.config.share_lm_head:
            shared = lean.lm_head if self.vocab is None else \
                Linear(lean.lm_head.weight_t[:, self.vocab].t(), pack=True)  # (Vd, D) rows
            self.projections = [shared] * self.num_used
            own = [] if shared is lean.lm_head else [shared]
        else:
            rows = slice(None) if self.vocab is None else self.vocab
            own = self.projections = [Linear(heads.lm_head_weight(k).detach()[rows], pack=True)
                                      for k in range(self.num_used)]
        self.linear_paths = linear_paths.follow({"lm_head": own}, lean.linear_sites()) if own else {}

    def reset(self, prompt: torch.Tensor) -> None:
        pass

    @torch.no_grad()
    def head_logits(self, features: torch.Tensor) -> torch.Tensor:
        """(n, D) target features -> (K_used, n, Vd) float logits (Vd = V without draft_vocab)."""
        x = features[None].to(self.head_dtype)  # (1, n, D): the heads run in their own dtype
        return torch.stack([self.projections[k](self.heads.hidden_one(k, x)[0].to(self.projections[k].weight_t.dtype)).float()
                            for k in range(self.num_used)])

    @torch.no_grad()
    def propose(self, state: DraftState) -> Candidates:
        feature = state.new_features[state.num_layers][-1:]  # (1, D): token before the root
        ranked = self.head_logits(feature)[:, 0].topk(self.top, dim=-1).indices  # (K_used, top)
        tokens = ranked[self.head_index, self.rank_index]  # (N,)
        if self.vocab is not None:
            tokens = self.vocab[tokens]
        return Candidates(tokens, self.parents.clone())

    def accept(self, state: DraftState, accepted: list[int]) -> None:
        pass

    @staticmethod
    @torch.no_grad()
    def propose_many(drafters: Sequence["MedusaDrafter"], states: Sequence[DraftState]) -> list[Candidates]:
        """The proposals of several sequences' drafters (one tree and heads): one projection per
        head for the whole batch."""
        first = drafters[0]
        features = torch.cat([state.new_features[state.num_layers][-1:] for state in states])  # (B, D)
        ranked = first.head_logits(features).topk(first.top, dim=-1).indices  # (K_used, B, top)
        tokens = ranked[first.head_index, :, first.rank_index].t()  # (B, N)
        if first.vocab is not None:
            tokens = first.vocab[tokens]
        return [Candidates(row.clone(), first.parents.clone()) for row in tokens]
