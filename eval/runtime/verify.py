"""Verification of a drafted token tree against the target (pure functions).

Inputs are aligned with tree nodes: node 0 is the root (the last committed token), `tokens[i]` the
token of node i, row i of the target's logits/probabilities the target's next-token distribution
after the path root..i. Draft distributions are aligned with candidates: `draft_probs[i - 1]` is the
distribution node i was sampled from. Each function returns the accepted path and the next token
(the bonus/correction token drawn from the target at the path's end), so every step commits
len(accepted) + 1 tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eval.runtime.sampling import sample
from eval.runtime.tree import TreeLayout


@dataclass
class Verdict:
    accepted: list[int]  # tree node indices on the accepted path, root excluded, in order
    next_token: int


def children_lists(parents: list[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    return children


def verify_greedy(tree: TreeLayout, tokens: list[int], target_logits: torch.Tensor) -> Verdict:
    """Longest path whose tokens equal the target's argmax; next token = argmax at its end.
    target_logits: (N, V)."""
    best = target_logits.argmax(-1).tolist()
    children = children_lists(tree.parents.tolist())
    node, accepted = 0, []
    while True:
        match = next((c for c in children[node] if tokens[c] == best[node]), None)
        if match is None:
            return Verdict(accepted, best[node])
        accepted.append(match)
        node = match


def verify_sampled(
    tree: TreeLayout,
    tokens: list[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Lossless recursive rejection sampling over the tree (Leviathan/Chen for a chain).

    At each node the children are tried in order: child x with draft distribution q is accepted
    with probability min(1, p(x) / q(x)); on rejection p <- normalise(max(0, p - q)). With
    draft_probs None the drafts are deterministic (q = one-hot of x): accept with p(x), zero p(x)
    and renormalise on rejection — the EAGLE-2 rule. Siblings must be drawn independently from
    the same q (sampled drafts) or be deterministic. target_probs: (N, V); draft_probs: (N-1, V).
    """
    children = children_lists(tree.parents.tolist())
    node, accepted = 0, []
    while True:
        p = target_probs[node]
        for child in children[node]:
            x = tokens[child]
            q = None if draft_probs is None else draft_probs[child - 1]
            q_x = 1.0 if q is None else float(q[x])
            p_x = float(p[x])
            if q_x > 0 and float(torch.rand((), generator=generator)) * q_x < p_x:
                accepted.append(child)
                node = child
                break
            if q is None:
                p = p.clone()
                p[x] = 0.0
            else:
                p = (p - q).clamp_(min=0.0)
            total = float(p.sum())
            p = p / total if total > 0 else target_probs[node]
        else:
            return Verdict(accepted, sample(p, generator))


def verify_typical(
    tree: TreeLayout,
    tokens: list[int],
    target_probs: torch.Tensor,
    epsilon: float = 0.09,
    alpha: float = 0.3,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Medusa's typical acceptance — LOSSY (output no longer follows the target distribution):
    accept the first child x with p(x) > min(epsilon, alpha * exp(-H(p))); next token sampled
    from p at the path's end. target_probs: (N, V)."""
    children = children_lists(tree.parents.tolist())
    node, accepted = 0, []
    while True:
        p = target_probs[node]
        entropy = float(-(p * torch.log(p.clamp_min(1e-12))).sum())
        threshold = min(epsilon, alpha * math.exp(-entropy))
        match = next((c for c in children[node] if float(p[tokens[c]]) > threshold), None)
        if match is None:
            return Verdict(accepted, sample(p, generator))
        accepted.append(match)
        node = match
