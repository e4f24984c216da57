"""Verification rules: greedy path selection, and a statistical proof that rejection sampling is
lossless (plus that the same test catches a broken sampler).

The statistical test uses a tiny "model" given by a table: p(x | prefix) over a 3-token vocabulary,
so the exact distribution of the first 3 generated tokens (27 outcomes) can be enumerated.
Speculative steps (chains and trees, sampled and deterministic drafts from a different table q,
also with q confined to a draft vocabulary smaller than the target's, as EAGLE-3's d2t makes it,
and P-EAGLE's parallel chains and trees, whose drafts do not condition on each other)
are run until 3 tokens exist; the empirical counts are compared to the exact distribution with a
chi-square test at significance 0.001 (seeds fixed, so the outcome is reproducible).
"""
import functools
import itertools

import pytest
import torch

from eval.runtime.sampling import SamplingConfig, probabilities, sample
from eval.runtime.tree import build_tree
from eval.runtime.verify import Verdict, verify_greedy, verify_sampled, verify_typical
from tests.helpers import broken_verify, chi_square_p_value

VOCAB, LENGTH, SAMPLES, SIGNIFICANCE = 3, 3, 3000, 1e-3


class TableModel:
    """p(. | prefix) drawn once per prefix from a Dirichlet, reproducibly from a seed."""

    def __init__(self, seed: int, concentration: float = 1.5):
        self.seed, self.concentration, self.table = seed, concentration, {}

    def __call__(self, prefix: tuple) -> torch.Tensor:
        if prefix not in self.table:
            generator = torch.Generator().manual_seed(hash((self.seed,) + prefix) % (2**31))
            gamma = torch._standard_gamma(torch.full((VOCAB,), self.concentration), generator=generator)
            self.table[prefix] = gamma / gamma.sum()
        return self.table[prefix]


class DraftVocabModel:
    """q restricted to a draft vocabulary: zero outside `ids`, renormalised (EAGLE-3's draft
    distribution over Vd < V tokens, seen over the target's ids)."""

    def __init__(self, q: TableModel, ids: list[int]):
        self.q, self.keep = q, torch.zeros(VOCAB).index_fill_(0, torch.tensor(ids), 1.0)

    def __call__(self, prefix: tuple) -> torch.Tensor:
        dist = self.q(prefix) * self.keep
        return dist / dist.sum()


class ParallelDraftModel:
    """P-EAGLE's drafts: the distribution of the draft d steps past the committed prefix depends on
    that prefix and d only, never on the tokens drafted before it (`committed` is set per step)."""

    def __init__(self, q: TableModel):
        self.q, self.committed = q, ()

    def __call__(self, prefix: tuple) -> torch.Tensor:
        return self.q(self.committed + (-1 - (len(prefix) - len(self.committed)),))  # a slot marker, not a token


def exact_distribution(p: TableModel) -> dict:
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        prob = 1.0
        for i in range(LENGTH):
            prob *= float(p(seq[:i])[seq[i]])
        out[seq] = prob
    return out


def draft_tree(q: TableModel, prefix: tuple, shape: list[int], sampled: bool, generator):
    """Children per depth `shape` (e.g. [2, 1]): sampled drafts draw siblings i.i.d. from q;
    deterministic drafts take q's top-k. Returns parents, tokens (root token -1), draft rows."""
    parents, tokens, rows, paths = [-1], [-1], [], {0: prefix}
    frontier = [0]
    for width in shape:
        next_frontier = []
        for node in frontier:
            dist = q(paths[node])
            picks = ([sample(dist, generator) for _ in range(width)] if sampled
                     else dist.topk(width).indices.tolist())
            for token in picks:
                parents.append(node)
                tokens.append(token)
                rows.append(dist)
                paths[len(tokens) - 1] = paths[node] + (token,)
                next_frontier.append(len(tokens) - 1)
        frontier = next_frontier
    return parents, tokens, torch.stack(rows), paths


_tree = functools.lru_cache(maxsize=None)(build_tree)


def speculative_sequence(p, q, shape, sampled, verify, generator) -> tuple:
    seq = ()
    while len(seq) < LENGTH:
        if isinstance(q, ParallelDraftModel):
            q.committed = seq
        parents, tokens, rows, paths = draft_tree(q, seq, shape, sampled, generator)
        tree = _tree(tuple(parents))
        target = torch.stack([p(paths[i]) for i in range(len(tokens))])
        verdict = verify(tree, tokens, target, rows if sampled else None, generator)
        seq = seq + tuple(tokens[i] for i in verdict.accepted) + (verdict.next_token,)
    return seq[:LENGTH]


def run_sampler(verify, shape, sampled, draft_vocab=None, parallel=False, seed=0) -> float:
    p, q = TableModel(seed=1), TableModel(seed=2, concentration=0.7)
    if draft_vocab is not None:
        q = DraftVocabModel(q, draft_vocab)
    if parallel:
        q = ParallelDraftModel(q)
    generator = torch.Generator().manual_seed(seed)
    counts: dict = {}
    for _ in range(SAMPLES):
        seq = speculative_sequence(p, q, shape, sampled, verify, generator)
        counts[seq] = counts.get(seq, 0) + 1
    return chi_square_p_value(counts, exact_distribution(p), SAMPLES)


CASES = {
    "chain_sampled": ([1, 1], True, None),
    "chain_deterministic": ([1, 1], False, None),
    "tree_sampled": ([2, 2], True, None),
    "tree_deterministic_topk": ([2, 2], False, None),
    # Token 1 is outside the draft vocabulary: q(1) = 0, it is only ever reached through the residual.
    "chain_sampled_draft_vocab": ([1, 1], True, [0, 2]),
    "tree_deterministic_topk_draft_vocab": ([2, 1], False, [0, 2]),
    # P-EAGLE: a chain whose every draft comes from its slot's distribution, drawn in one pass.
    "parallel_chain_sampled": ([1, 1], True, None, True),
    "parallel_chain_sampled_draft_vocab": ([1, 1], True, [0, 2], True),
    # P-EAGLE's tree: depth d branches into slot d's top-k under every parent, deterministic drafts.
    "parallel_tree_deterministic_topk": ([2, 2], False, None, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rejection_sampling_is_lossless(case):
    assert run_sampler(verify_sampled, *CASES[case]) > SIGNIFICANCE


@pytest.mark.parametrize("case", ["chain_sampled", "tree_deterministic_topk", "chain_sampled_draft_vocab",
                                  "parallel_chain_sampled", "parallel_tree_deterministic_topk"])
def test_broken_sampler_fails_the_same_test(case):
    assert run_sampler(broken_verify, *CASES[case]) < SIGNIFICANCE


def test_greedy_takes_longest_matching_path_and_bonus():
    #        0
    #      /   \
    #     1(5)  2(7)
    #     |     |  \
    #     3(9)  4(1) 5(3)
    tree = build_tree([-1, 0, 0, 1, 2, 2])
    tokens = [0, 5, 7, 9, 1, 3]
    logits = torch.zeros(6, 16)
    for node, best in {0: 7, 1: 9, 2: 3, 3: 0, 4: 0, 5: 11}.items():
        logits[node, best] = 1.0
    verdict = verify_greedy(tree, tokens, logits)
    assert verdict.accepted == [2, 5] and verdict.next_token == 11
    logits[0] = 0.0
    logits[0, 4] = 1.0  # no child matches: only the target's own token
    assert verify_greedy(tree, tokens, logits) == Verdict([], 4)


def test_deterministic_rule_accepts_with_target_probability():
    tree = build_tree([-1, 0])
    p = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    generator = torch.Generator().manual_seed(0)
    verdicts = [verify_sampled(tree, [0, 0], p, None, generator) for _ in range(4000)]
    rate = sum(bool(v.accepted) for v in verdicts) / len(verdicts)
    assert abs(rate - 0.25) < 0.03
    assert all(v.next_token == 1 for v in verdicts if not v.accepted)  # rejected token zeroed


def test_typical_acceptance_is_lossy_but_accepts_likely_tokens():
    tree = build_tree([-1, 0, 1])
    target = torch.tensor([[0.95, 0.05], [0.02, 0.98], [0.5, 0.5]])
    assert verify_typical(tree, [0, 0, 1], target).accepted == [1, 2]
    assert verify_typical(tree, [0, 1, 1], target).accepted == []


def test_sampling_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert probabilities(logits, SamplingConfig()).tolist() == [1.0, 0.0, 0.0, 0.0]
    top_k = probabilities(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert (top_k[2:] == 0).all() and abs(float(top_k.sum()) - 1) < 1e-6
    top_p = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.7))  # 0.64 + 0.24 >= 0.7
    assert (top_p[:2] > 0).all() and (top_p[2:] == 0).all()
    hot = probabilities(logits, SamplingConfig(temperature=2.0))
    torch.testing.assert_close(hot, torch.softmax(logits / 2, -1))
    with pytest.raises(ValueError):
        SamplingConfig(top_p=0.0)
