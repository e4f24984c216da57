"""DFlash drafting (`heads.dflash.DflashHead`): a chain of up to B-1 tokens from one block forward.

With T committed tokens (root x_{T-1}), the context is c_s = hidden_norm(fc(aux_s)) of positions
s = 0..T-2, the ones in the target's cache (their aux streams come in `DraftState.new_features`).
The block [x_{T-1}, mask x (B-1)] at positions T-1..T+B-2 attends to the whole context and to
itself (both ways); slot j's output scores the draft x_{T-1+j}, so slots 1..depth give the chain.
This is training's alignment with the root as anchor (train/dflash_objective.py).

The context's K/V depend on c_s alone, so each layer's are computed once per committed position
and kept (`cache_context`, the default), only ever from the target's true features of committed
tokens: rejected drafts never enter it and nothing is rolled back. The cached path runs the lean
block forward (`eval.runtime.drafters.lean_dflash`: only the rows a proposal reads, weights laid out
as the target's). With cache_context=False every proposal runs the head module over the whole
prefix, the simple reference the lean path is tested against.

No slot reads a drafted token, so each draft comes from its slot's distribution alone: argmax when
greedy, else sampled with that distribution reported, which the runtime's rejection sampling keeps
lossless. A head with its own draft vocabulary scores its Vd ids (its lm_head); drafts map to
target ids through d2t, and a sampled draft's distribution is reported over the target vocabulary,
zero outside the draft vocabulary.
"""
from __future__ import annotations

import torch

from eval.runtime import linear_paths
from eval.runtime.drafters import Candidates, DraftState
from eval.runtime.drafters.lean_dflash import LeanDflash
from eval.runtime.model import LeanLlama, Linear
from eval.runtime.sampling import probabilities, sample
from heads.dflash import DflashHead, block_tokens


class DflashDrafter:
    """depth: drafted tokens per proposal, 1..B-1 (default B-1). greedy_drafts: argmax drafts at
    a temperature too (verified as one-hot drafts, still lossless)."""

    def __init__(self, head: DflashHead, lean: LeanLlama, depth: int | None = None, greedy_drafts: bool = False,
                 cache_context: bool = True):
        if not isinstance(head, DflashHead):
            raise ValueError(f"dflash drafter: needs a DflashHead, got {type(head).__name__}")
        B = head.config.block_size
        depth = B - 1 if depth is None else depth
        if not 1 <= depth <= B - 1:
            raise ValueError(f"dflash drafter: depth must lie in [1, {B - 1}] (block_size - 1), got {depth}")
        if head.config.vocab_size != lean.config.vocab_size:
            raise ValueError(f"dflash drafter: head vocabulary {head.config.vocab_size} != target's "
                             f"{lean.config.vocab_size}")
        self.head, self.lean, self.depth = head.eval(), lean, depth
        ids = head.draft_ids()  # the head's own vocabulary travels with it (d2t), as vLLM reads it
        self.vocab = None if ids is None else ids.detach().to("cpu", torch.long)
        self.greedy_drafts = greedy_drafts
        self.feature_layers = tuple(head.config.aux_layer_ids)
        parameter = next(head.parameters())
        self.dtype, self.device = parameter.dtype, parameter.device
        # the draft vocabulary's projection as a lean linear layer, each row count through the kernel
        # measured for the target's lm_head (`linear_paths.follow`)
        self.lm_head = Linear(head.lm_head.weight, pack=True) if self.vocab is not None else None
        self.runtime = LeanDflash(head, lean.config.max_seq_len) if cache_context else None
        sites = {**(self.runtime.linear_sites() if self.runtime is not None else {}),
                 **({"lm_head": [self.lm_head]} if self.lm_head is not None else {})}
        self.linear_paths = linear_paths.follow(sites, lean.linear_sites())
        self.reset(None)

    @property
    def cache_length(self) -> int:
        return self.runtime.length if self.runtime is not None else self.length

    def reset(self, prompt: torch.Tensor | None) -> None:
        self.length = 0
        if self.runtime is not None:
            self.runtime.reset()
        self.aux: list[torch.Tensor] = []  # cache_context=False: every committed position's aux streams

    def _committed_aux(self, state: DraftState) -> torch.Tensor:
        """(A, n·Ht) the aux streams of tokens[T-1-A : T-1], concatenated in fc's order."""
        layers = [layer % (state.num_layers + 1) for layer in self.feature_layers]
        return torch.cat([state.new_features[layer] for layer in layers], dim=-1).to(self.device, self.dtype)

    def _extend(self, aux: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The module path: add the new committed positions and recompute every layer's context K/V
        over the whole prefix."""
        self.aux.append(aux)
        self.length += aux.shape[0]
        positions = torch.arange(self.length, device=self.device)[None]
        return self.head.context_kv(self.head.project(torch.cat(self.aux)[None]), positions)

    @torch.no_grad()
    def block_logits(self, state: DraftState) -> torch.Tensor:
        """Commit the new positions' context, run the block once -> logits of slots 1..depth (depth, V)."""
        aux = self._committed_aux(state)
        length = state.tokens.shape[0]
        start = length - 1 - aux.shape[0]
        if start != self.cache_length:
            raise RuntimeError(f"dflash drafter: context holds {self.cache_length} positions, expected {start}")
        B = self.head.config.block_size
        tokens = block_tokens(state.tokens[-1:].to(self.device), B, self.head.config.mask_token_id)  # (1, B)
        if self.runtime is not None:
            self.runtime.commit(aux)
            embeds = self.lean.embedding[tokens[0, :2]]  # the anchor's and the mask token's
            normed = self.runtime.logits_input(self.runtime.block(embeds[0], embeds[1], self.depth))
        else:
            context = self._extend(aux)
            embeds = self.lean.embedding[tokens].to(self.dtype)  # (1, B, D)
            positions = torch.arange(length - 1, length - 1 + B, device=self.device)[None]
            normed = self.head.norm(self.head(embeds, positions, context)[0, 1: self.depth + 1])  # (depth, D)
        if self.lm_head is not None:  # (depth, Vd) over the head's own rows
            return self.lm_head(normed).float()
        return self.lean.lm_head(normed.to(self.lean.embedding.dtype)).float()

    @torch.no_grad()
    def propose(self, state: DraftState) -> Candidates:
        logits = self.block_logits(state)  # (depth, V), or (depth, Vd): column j is target id vocab[j]
        if state.sampling.greedy or self.greedy_drafts:
            return Candidates.chain(self._target_ids(logits.argmax(-1)).tolist())
        q = probabilities(logits, state.sampling)
        tokens = [int(sample(row, state.generator)) for row in q]
        if self.vocab is not None:  # the distribution over target ids, zero outside the draft vocabulary
            tokens = self._target_ids(torch.tensor(tokens)).tolist()
            q = q.new_zeros(q.shape[0], self.lean.config.vocab_size).index_copy_(1, self.vocab.to(q.device), q)
        return Candidates.chain(tokens, q, deterministic=False)

    def _target_ids(self, columns: torch.Tensor) -> torch.Tensor:
        return columns if self.vocab is None else self.vocab[columns.to(self.vocab.device)]

    def accept(self, state: DraftState, accepted: list[int]) -> None:
        pass  # the context grows from the target's features of committed tokens only


def dflash_chain(head, lean, depth, draft_vocab=None, greedy_drafts=False) -> DflashDrafter:
    """The registry's chain: `depth` capped at the head's block_size - 1 (one forward drafts at most
    that). The vocabulary is the head's own (`draft_vocab` is not read)."""
    return DflashDrafter(head, lean, depth=min(depth, head.config.block_size - 1), greedy_drafts=greedy_drafts)
