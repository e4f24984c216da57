"""Teacher-forced acceptance: how many drafts greedy verification would accept along the target's
own greedy continuations, walked as a run steps. Calibration measures it to choose the EAGLE-2
tree size and the Medusa tree (`eval.calibrate`); the drafters only propose."""
from __future__ import annotations

from typing import Sequence

import torch

from eval.runtime.clock import device_clock, module_device
from eval.runtime.drafters import Candidates, DraftState
from eval.runtime.drafters.eagle import EagleDrafter
from eval.runtime.drafters.eagle_tree import select_tree
from eval.runtime.drafters.medusa import MedusaDrafter
from eval.runtime.sampling import SamplingConfig


def greedy_accepted(candidates: Candidates, truth: list[int]) -> int:
    """Drafts greedy verification accepts when the target's greedy continuation after the root is
    `truth`: the longest root path whose tokens equal truth[0], truth[1], ..."""
    children: dict[int, dict[int, int]] = {}
    for node, (token, parent) in enumerate(zip(candidates.tokens.tolist(), candidates.parents.tolist())):
        children.setdefault(parent, {}).setdefault(token, node)
    node, accepted = -1, 0
    while accepted < len(truth) and truth[accepted] in children.get(node, {}):
        node = children[node][truth[accepted]]
        accepted += 1
    return accepted


def walk_acceptance(accepted: Sequence[int]) -> list[int]:
    """The steps a greedy speculative run takes over positions whose teacher-forced acceptance is
    `accepted` (accepted[i]: drafts accepted with the root at the i-th generated position): each
    step starts where the previous one's accepted drafts and bonus token end. Returns the
    accepted count of each step taken."""
    steps, position = [], 0
    while position < len(accepted):
        steps.append(accepted[position])
        position += accepted[position] + 1
    return steps


@torch.no_grad()
def measure_tree_acceptance(drafter: EagleDrafter, sequences: Sequence[torch.Tensor], prompt_lengths: Sequence[int],
                            budgets: Sequence[int]) -> dict:
    """Teacher-forced EAGLE-2 trees along greedy continuations (each (T,) sequence = prompt + the
    target's greedy output): at every generated position, one expansion with the drafter's
    settings (its total_tokens should be max(budgets)), the tree each total_tokens budget keeps
    (`select_tree`: a smaller tree is the score-order prefix of a larger one) and how many of its
    drafts greedy verification would accept.

    The mean over every position overstates what a run commits per step: a run spends one step on
    each hard position but skips over easy ones in a few long steps. So "accepted" is the mean over
    the steps a greedy run with each budget takes (`walk_acceptance`), which are exactly the
    runtime's steps; "accepted_per_position" keeps the plain mean.
    Returns {"accepted": {budget: mean accepted drafts per step}, "accepted_per_position",
    "steps" ({budget: steps walked}), "catch_up_seconds", "expand_seconds" (means per position,
    timed on the target's device clock), "levels" (expansion depth), "positions"}."""
    num_layers = drafter.lean.config.num_layers
    layers = sorted({layer % (num_layers + 1) for layer in drafter.feature_layers})
    levels = min(drafter.depth, drafter.total_tokens - 1)
    per_position = {budget: [] for budget in budgets}
    walked = {budget: [] for budget in budgets}
    catch_up_seconds = expand_seconds = 0.0
    clock = device_clock(module_device(drafter.lean))
    for sequence, prompt_length in zip(sequences, prompt_lengths):
        cache = drafter.lean.new_cache(sequence.shape[0])
        features = drafter.lean(sequence, cache, hidden_layers=layers, logits="none").hidden  # {layer: (T, D)}
        drafter.reset(sequence)
        accepted = {budget: [] for budget in budgets}
        for root in range(prompt_length, sequence.shape[0] - levels):  # committed tokens: sequence[: root + 1]
            new = {layer: features[layer][drafter.cache_length: root] for layer in layers}
            state = DraftState(sequence[: root + 1], root, new, num_layers, SamplingConfig())
            start = clock()
            feature = drafter.catch_up(state)
            middle = clock()
            nodes = drafter.expand(state, feature)
            catch_up_seconds += middle - start
            expand_seconds += clock() - middle
            truth = sequence[root + 1:].tolist()
            for budget in budgets:
                accepted[budget].append(greedy_accepted(select_tree(*nodes, budget - 1), truth))
        for budget in budgets:
            per_position[budget] += accepted[budget]
            walked[budget] += walk_acceptance(accepted[budget])
    positions = len(per_position[budgets[0]]) if budgets else 0

    def mean(values: list[int]) -> float:
        return sum(values) / max(len(values), 1)

    return {"accepted": {b: mean(walked[b]) for b in budgets},
            "accepted_per_position": {b: mean(per_position[b]) for b in budgets},
            "steps": {b: len(walked[b]) for b in budgets},
            "catch_up_seconds": catch_up_seconds / max(positions, 1),
            "expand_seconds": expand_seconds / max(positions, 1), "levels": levels, "positions": positions}


@torch.no_grad()
def measure_rank_accuracies(drafter: MedusaDrafter, sequences: Sequence[torch.Tensor], prompt_lengths: Sequence[int],
                            top: int = 10) -> list[list[float]]:
    """Per head k, the fraction of positions where the true next-(k+2) token is the head's i-th
    ranked token (i < top), over the generated part of each (T,) sequence (prompt + greedy
    continuation). Feeds `build_tree_from_accuracies`."""
    heads = drafter.num_used
    hits = torch.zeros(heads, top)
    counts = torch.zeros(heads)
    for sequence, prompt_length in zip(sequences, prompt_lengths):
        cache = drafter.lean.new_cache(sequence.shape[0])
        features = drafter.lean(sequence, cache, hidden_layers=(-1,), logits="none").hidden[
            drafter.lean.config.num_layers]  # (T, D)
        logits = drafter.head_logits(features)  # (K, T, V)
        for k in range(heads):
            rows = torch.arange(max(prompt_length - 1, 0), sequence.shape[0] - k - 2)
            if rows.numel() == 0:
                continue
            labels = sequence[rows + k + 2]
            chosen = logits[k, rows]  # (R, Vd)
            if drafter.vocab is not None:  # labels outside the subset can never be drafted
                position = torch.full((drafter.lean.config.vocab_size,), -1, dtype=torch.long)
                position[drafter.vocab] = torch.arange(drafter.vocab.shape[0])
                labels = position[labels]
                keep = labels >= 0
                chosen, labels = chosen[keep], labels[keep]
            ranks = (chosen > chosen.gather(1, labels[:, None])).sum(-1)  # (R',)
            hits[k] += torch.bincount(ranks[ranks < top], minlength=top)[:top].float()
            counts[k] += rows.numel()
    return (hits / counts.clamp_min(1)[:, None]).tolist()


@torch.no_grad()
def walk_tree_acceptance(drafters: Sequence[MedusaDrafter], sequences: Sequence[torch.Tensor],
                         prompt_lengths: Sequence[int]) -> list[list[int]]:
    """Per drafter (one heads, any trees), the drafts accepted at each step of a greedy run with its
    tree over each (T,) sequence (prompt + the target's greedy continuation): the tree proposed at
    every root (teacher-forced, one batched projection per head) walked as the runtime steps
    (`walk_acceptance`), so the steps a run takes, not every position. One
    target forward per sequence serves every drafter."""
    steps = [[] for _ in drafters]
    lean = drafters[0].lean
    for sequence, prompt_length in zip(sequences, prompt_lengths):
        cache = lean.new_cache(sequence.shape[0])
        features = lean(sequence, cache, hidden_layers=(-1,), logits="none").hidden[lean.config.num_layers]  # (T, D)
        for drafter, walked in zip(drafters, steps):
            roots = torch.arange(prompt_length, sequence.shape[0] - drafter.num_used)  # truth covers the deepest draft
            if roots.numel() == 0:
                continue
            ranked = drafter.head_logits(features[roots - 1]).topk(drafter.top, dim=-1).indices  # (K, R, top)
            tokens = ranked[drafter.head_index, :, drafter.rank_index].t()  # (R, N)
            if drafter.vocab is not None:
                tokens = drafter.vocab[tokens]
            accepted = [greedy_accepted(Candidates(row, drafter.parents), sequence[root + 1:].tolist())
                        for row, root in zip(tokens, roots.tolist())]
            walked += walk_acceptance(accepted)
    return steps
