"""EAGLE drafting with a trained head over the target's embedding: `heads.eagle.EagleHead`
(EAGLE-1/2, logits through the target's lm_head) or `heads.eagle3.Eagle3Head` (EAGLE-3, its own
norm and lm_head over a draft vocabulary).

Alignment (as in training): the head input at position t is (embed(x_{t+1}), the target's features
at t): f_t, the final post-norm hidden state (EAGLE-1/2), or the residual streams entering the
head's `aux_layer_ids` layers, concatenated (EAGLE-3). Its output at t gives logits for x_{t+2}.
With T committed tokens (root x_{T-1}), the first draft x_T comes from the head's output at position
T-2, and a draft at tree depth d is fed at position T-2+d with its parent's output as hidden input.

The head runs as `LeanEagleHead` (preallocated K/V, fused and transposed weights) and keeps its own
KV cache of committed positions 0..T-2, always computed from the target's true features: each
`propose` first feeds the positions that entered the target's cache in the last verification (root
+ accepted path) with their target features, then drafts; draft entries never enter the committed
cache, so after any number of steps it equals a fresh recompute.

Draft vocabulary: an EAGLE-3 head's logits cover its Vd ids, mapped to target ids through d2t
before verification. For EAGLE-1/2, `draft_vocab` (optional, (Vd,) token ids, e.g. the most
frequent tokens of the training replies) restricts the target lm_head to those rows: on a CPU the
full lm_head read dominates a draft step. Verification stays lossless either way (drafts are only
proposals; sampled drafts report their distribution over the target vocabulary, zero outside the
draft vocabulary).

Modes: `chain` (depth tokens, argmax, or sampled with draft_probs when the target samples) and
`tree` (EAGLE-2 dynamic tree: top_k, depth, total_tokens; deterministic top-k drafts, verified with
the EAGLE-2 rule when sampling).
"""
from __future__ import annotations

from typing import Sequence

import torch

from eval.runtime import linear_paths
from eval.runtime.drafters import Candidates, DraftState, eagle_batch
from eval.runtime.drafters.eagle_tree import select_tree
from eval.runtime.drafters.lean_head import LeanEagleHead
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import probabilities, sample
from heads.eagle import EagleHead
from heads.eagle3 import Eagle3Head

MODES = ("chain", "tree")


class EagleDrafter:
    """feature_layers: (-1,) for an EAGLE-1/2 head, the head's aux_layer_ids for EAGLE-3.
    greedy_drafts: a chain drafts its argmax tokens at a temperature too (verified as one-hot
    drafts, still lossless), as vLLM's default `draft_sample_method: greedy` does."""

    lean_head = LeanEagleHead  # the head's lean runtime (a subclass may extend it)

    def __init__(self, head: EagleHead | Eagle3Head, lean: LeanLlama, mode: str = "tree", depth: int = 4,
                 top_k: int = 4, total_tokens: int = 16, draft_vocab: torch.Tensor | None = None,
                 greedy_drafts: bool = False):
        if mode not in MODES:
            raise ValueError(f"eagle drafter: mode must be one of {MODES}, got {mode!r}")
        if depth < 1 or top_k < 1 or total_tokens < 2:
            raise ValueError("eagle drafter: need depth >= 1, top_k >= 1, total_tokens >= 2")
        _check_head(head, lean)
        self.head, self.lean = head.eval(), lean
        self.mode, self.depth, self.top_k, self.total_tokens = mode, depth, top_k, total_tokens
        self.greedy_drafts = greedy_drafts
        self.dtype = next(head.parameters()).dtype
        lm_head = None if isinstance(head, Eagle3Head) else lean.lm_head
        self.runtime = self.lean_head(head, capacity=lean.config.max_seq_len, lm_head=lm_head, draft_vocab=draft_vocab)
        # the head's layers run each row count through the kernel measured for the target's same role
        self.linear_paths = linear_paths.follow(self.runtime.linear_sites(), lean.linear_sites())
        self.feature_layers = self.runtime.feature_layers
        self.vocab = self.runtime.vocab  # (Vd,) target ids of the draft logits' columns, or None
        self.catch_up_output: torch.Tensor | None = None

    @property
    def cache_length(self) -> int:
        return self.runtime.length

    @property
    def past(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed head cache (k, v), each (1, nKV, C, hd), as the head lays out its past."""
        return self.runtime.committed_kv

    def reset(self, prompt: torch.Tensor) -> None:
        self.runtime.reset()

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lean.embedding[tokens].to(self.dtype)

    def _token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Columns of the draft logits -> target token ids (EAGLE-3: i + d2t[i])."""
        return indices if self.vocab is None else self.vocab[indices]

    def _full_distribution(self, q: torch.Tensor) -> torch.Tensor:
        """(Vd,) draft distribution -> (V,) over target ids, zero outside the draft vocabulary."""
        if self.vocab is None:
            return q
        return q.new_zeros(self.lean.config.vocab_size).index_copy_(0, self.vocab, q)

    def committed_features(self, state: DraftState) -> torch.Tensor:
        """(A, F) the target's feature_layers for tokens[T-1-A : T-1], concatenated in order."""
        layers = [layer % (state.num_layers + 1) for layer in self.feature_layers]
        if len(layers) == 1:
            return state.new_features[layers[0]]
        return torch.cat([state.new_features[layer] for layer in layers], dim=-1)

    @torch.no_grad()
    def catch_up(self, state: DraftState) -> torch.Tensor:
        """Feed the newly committed positions with the target's features; returns the head's
        output at position T-2 (D,), which scores the first draft."""
        features = self.committed_features(state)  # (A, F) for tokens[T-1-A : T-1]
        count, length = features.shape[0], state.tokens.shape[0]
        start = length - 1 - count
        if start != self.cache_length:
            raise RuntimeError(f"eagle drafter: head cache holds {self.cache_length} positions, expected {start}")
        out = self.runtime.commit(self._embed(state.tokens[start + 1: length]), features)  # (A, D)
        self.catch_up_output = out[-1]  # (D,), kept for inspection
        return self.catch_up_output

    @torch.no_grad()
    def propose(self, state: DraftState) -> Candidates:
        feature = self.catch_up(state)
        if self.mode == "chain":
            return self._chain(state, feature)
        return select_tree(*self.expand(state, feature), self.total_tokens - 1)

    def accept(self, state: DraftState, accepted: list[int]) -> None:
        """Nothing to undo: drafts never enter the committed head cache."""

    @staticmethod
    @torch.no_grad()
    def propose_many(drafters: Sequence["EagleDrafter"], states: Sequence[DraftState]) -> list[Candidates]:
        """The proposals of several sequences' drafters (one configuration), drafted in batched head
        forwards (`eval.runtime.drafters.eagle_batch`)."""
        return eagle_batch.propose_many(drafters, states)

    def _chain(self, state: DraftState, feature: torch.Tensor) -> Candidates:
        length = state.tokens.shape[0]
        tokens, rows = [], []
        greedy = state.sampling.greedy or self.greedy_drafts
        for i in range(self.depth):
            logits = self.runtime.logits(feature[None])[0]  # (Vd,)
            if greedy:
                token = int(self._token_ids(logits.argmax()))
            else:
                q = probabilities(logits, state.sampling)  # (Vd,)
                token = int(self._token_ids(torch.tensor(sample(q, state.generator))))
                rows.append(self._full_distribution(q))
            tokens.append(token)
            if i + 1 < self.depth:
                embed = self._embed(torch.tensor([token]))  # (1, D)
                feature = self.runtime.draft(embed, feature[None], torch.tensor([length - 1 + i]))[0]
        return Candidates.chain(tokens, None if greedy else torch.stack(rows), deterministic=greedy)

    def expand(self, state: DraftState, feature: torch.Tensor) -> tuple[list[int], list[int], list[float], list[int]]:
        """EAGLE-2 expansion from the head's output at position T-2 `feature` (D,): expand the top_k best frontier nodes by
        their top_k children per depth (one batched head forward per depth, tree mask over the
        drafted entries), scoring nodes by cumulative draft log-probability. Returns every node's
        (tokens, parents, scores, depths); `select_tree` keeps the best total_tokens - 1."""
        top_k, length, committed = self.top_k, state.tokens.shape[0], self.cache_length
        logp = torch.log_softmax(self.runtime.logits(feature[None]), dim=-1)[0]  # (Vd,)
        scores, tokens = logp.topk(top_k)
        tokens = self._token_ids(tokens)
        node_tokens, node_scores = tokens.tolist(), scores.tolist()
        node_parents, node_depths = [-1] * top_k, [1] * top_k
        node_slot: dict[int, int] = {}  # node -> index of its entry among the drafted head K/V
        frontier = list(range(top_k))
        frontier_features = feature.expand(top_k, -1)  # (n, D): each frontier node's parent's output
        for depth in range(2, min(self.depth, self.total_tokens - 1) + 1):  # deeper levels cannot be kept
            n, drafted = len(frontier), len(node_slot)
            mask = torch.zeros(n, committed + drafted + n, dtype=torch.bool)
            mask[:, :committed] = True
            for row, node in enumerate(frontier):
                parent = node_parents[node]
                while parent >= 0:
                    mask[row, committed + node_slot[parent]] = True
                    parent = node_parents[parent]
                mask[row, committed + drafted + row] = True
                node_slot[node] = drafted + row
            embeds = self._embed(torch.tensor([node_tokens[i] for i in frontier]))  # (n, D)
            positions = torch.full((n,), length + depth - 3)
            out = self.runtime.draft(embeds, frontier_features, positions, mask)  # (n, D)
            logp = torch.log_softmax(self.runtime.logits(out), dim=-1)  # (n, Vd)
            child_scores, child_tokens = logp.topk(top_k, dim=-1)  # (n, K)
            child_tokens = self._token_ids(child_tokens)
            cumulative = torch.tensor([node_scores[i] for i in frontier])[:, None] + child_scores  # (n, K)
            first = len(node_tokens)
            for row, parent in enumerate(frontier):
                node_tokens.extend(child_tokens[row].tolist())
                node_scores.extend(cumulative[row].tolist())
                node_parents.extend([parent] * top_k)
                node_depths.extend([depth] * top_k)
            best = cumulative.flatten().topk(min(top_k, cumulative.numel())).indices  # (K,)
            frontier = [first + int(i) for i in best]
            frontier_features = out[best // top_k]
        return node_tokens, node_parents, node_scores, node_depths


def _check_head(head: EagleHead | Eagle3Head, lean: LeanLlama) -> None:
    c, t = head.config, lean.config
    problems = []
    if c.hidden_size != t.hidden_size:  # the head embeds with the target's embedding
        problems.append(f"hidden_size: head {c.hidden_size} vs target {t.hidden_size}")
    if c.vocab_size != t.vocab_size:
        problems.append(f"vocab_size: head {c.vocab_size} vs target {t.vocab_size}")
    if isinstance(head, Eagle3Head):
        if c.target_hidden_size != t.hidden_size:
            problems.append(f"target_hidden_size: head {c.target_hidden_size} vs target {t.hidden_size}")
        if any(not 0 <= layer < t.num_layers for layer in c.aux_layer_ids):
            problems.append(f"aux_layer_ids {c.aux_layer_ids}: the target has layers 0..{t.num_layers - 1}")
    elif lean.lm_head.bias is not None:
        problems.append("an lm_head with bias is not supported")
    if problems:
        raise ValueError("eagle drafter: head and target disagree: " + "; ".join(problems))
