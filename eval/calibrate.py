"""Start-of-run calibration on the machine that runs: the target's verification-cost curve (one
forward over n tokens), and from it plus the head's measured acceptance on a few calibration
prompts (which are also measured prompts) the Medusa tree (`medusa_choices: auto`) and the EAGLE-2
tree size (`tree_total_tokens: auto`)."""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from eval.acceptance import measure_rank_accuracies, measure_tree_acceptance, walk_tree_acceptance
from eval.config import RuntimeConfig
from eval.runtime.clock import device_clock, module_device
from eval.runtime.drafters.eagle import EagleDrafter
from eval.runtime.drafters.medusa import MedusaDrafter
from eval.runtime.generate import plain_generate
from eval.runtime.medusa_trees import build_tree_from_accuracies, expected_acceptance, parse_choices
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import SamplingConfig
from heads.medusa import MedusaHeads

log = logging.getLogger(__name__)

MEDUSA_AUTO_SIZES = (4, 8, 16, 32, 64)  # candidate node budgets for the tree built from measured accuracies
CALIBRATION_PROMPTS = 4


@torch.no_grad()
def verify_costs(lean: LeanLlama, prompt: torch.Tensor, sizes: Sequence[int], repeats: int = 5) -> dict[int, float]:
    """Seconds of one target forward over n new tokens after `prompt`, for each n in sizes: the
    median of `repeats` rounds that time every size in turn (load drift hits all sizes alike),
    made non-decreasing in n (`monotone_costs`)."""
    cache = lean.new_cache(prompt.shape[0] + max(sizes) + 1)
    lean(prompt, cache, logits="none")
    cache.commit()
    times: dict[int, list[float]] = {n: [] for n in sizes}
    clock = device_clock(module_device(lean))  # CUDA: the forward's kernels, not their launches
    for _ in range(repeats):
        for n in sizes:
            start = clock()
            lean(prompt[:1].repeat(n), cache)
            times[n].append(clock() - start)
            cache.truncate(cache.length)
    return monotone_costs({n: sorted(t)[len(t) // 2] for n, t in times.items()})


def monotone_costs(costs: dict[int, float]) -> dict[int, float]:
    """A forward over more tokens never costs less: each size gets the largest cost measured at or
    below it, so a noisy cheap reading at a large size cannot pick that size."""
    out, running = {}, 0.0
    for n in sorted(costs):
        running = max(running, costs[n])
        out[n] = running
    return out


def _bar(items, description: str, progress: bool):
    """A progress bar over calibration prompts: each costs up to max_new_tokens target forwards."""
    from tqdm.auto import tqdm

    return tqdm(items, desc=f"calibration: {description}", unit="prompt", disable=not progress, leave=False)


def _greedy_sequences(lean: LeanLlama, prompts, max_new_tokens: int, eos,
                      progress: bool = False) -> tuple[list[torch.Tensor], list[int]]:
    """Calibration data: (prompt + plain greedy continuation) for the first CALIBRATION_PROMPTS prompts."""
    sequences, lengths = [], []
    for prompt in _bar(prompts[:CALIBRATION_PROMPTS], "greedy continuations", progress):
        tokens = plain_generate(lean, prompt, max_new_tokens, SamplingConfig(), eos).tokens
        sequences.append(torch.cat([prompt, torch.tensor(tokens)]))
        lengths.append(prompt.shape[0])
    return sequences, lengths


def choose_tree_budget(verify_seconds: dict[int, float], accepted: dict[int, float],
                       draft_seconds: dict[int, float]) -> tuple[int, dict[int, float]]:
    """The total_tokens budget n with the most expected tokens per plain-decode-step time,
    (1 + accepted[n]) * verify_seconds[1] / (verify_seconds[n] + draft_seconds[n]) (accepted: mean
    accepted drafts; verify_seconds[n]: one target forward over n tokens). Returns (n, values)."""
    values = {n: (1.0 + accepted[n]) * verify_seconds[1] / (verify_seconds[n] + draft_seconds[n]) for n in accepted}
    return max(values, key=lambda n: (values[n], -n)), values


def eagle_tree_budget(head, lean: LeanLlama, runtime: RuntimeConfig, prompts, eos, draft_vocab,
                      progress: bool = False) -> tuple[int, dict]:
    """runtime.tree_total_tokens "auto": the budget from the measured verification-cost curve of
    this machine and the head's teacher-forced acceptance per budget on calibration prompts, taken
    over the steps a greedy run with that budget would take (`measure_tree_acceptance`;
    `progress`: bars over the calibration prompts)."""
    budgets = sorted(set(runtime.tree_auto_sizes))
    if not budgets or budgets[0] < 2:
        raise ValueError(f"runtime.tree_auto_sizes must be total_tokens budgets >= 2, got {runtime.tree_auto_sizes}")
    top_k = runtime.tree_top_k
    largest = 1 + top_k + (runtime.tree_depth - 1) * top_k * top_k  # root + every node the expansion drafts
    budgets = [n for n in budgets if n <= largest] or [largest]
    sequences, lengths = _greedy_sequences(lean, prompts, runtime.max_new_tokens, eos, progress)
    drafter = EagleDrafter(head, lean, mode="tree", depth=runtime.tree_depth, top_k=top_k, total_tokens=budgets[-1],
                           draft_vocab=draft_vocab)
    measured = measure_tree_acceptance(drafter, _bar(sequences, "tree acceptance per size", progress), lengths,
                                       budgets)
    costs = verify_costs(lean, prompts[0], (1, *budgets))
    per_level = measured["expand_seconds"] / measured["levels"]
    draft = {n: measured["catch_up_seconds"] + per_level * min(runtime.tree_depth, n - 1) for n in budgets}
    best, values = choose_tree_budget(costs, measured["accepted"], draft)
    log.info("eagle_tree total_tokens auto: %d (expected tau %.2f, %.2f tokens per plain-step time; verify cost in "
             "plain steps %s)", best, 1 + measured["accepted"][best], values[best],
             {n: round(costs[n] / costs[1], 2) for n in budgets})
    return best, {
        "chosen": best, "calibration_prompts": len(sequences), "positions": measured["positions"],
        "verify_seconds_by_tokens": costs,
        "verify_cost_in_plain_steps": {n: costs[n] / costs[1] for n in costs},
        "draft_cost_in_plain_steps": {n: draft[n] / costs[1] for n in budgets},
        "expected_tau_by_size": {n: 1.0 + a for n, a in measured["accepted"].items()},
        "steps_by_size": measured["steps"],
        "tau_over_every_position_by_size": {n: 1.0 + a for n, a in measured["accepted_per_position"].items()},
        "tokens_per_plain_step_by_size": values,
    }


def medusa_choices(heads: MedusaHeads, lean: LeanLlama, runtime: RuntimeConfig, prompts, eos, draft_vocab,
                   progress: bool = False):
    """runtime.medusa_choices "auto": the static tree (of MEDUSA_AUTO_SIZES nodes) with the most expected
    tokens per plain-step time from measured rank accuracies and verification costs; else the named
    or JSON tree. Returns (choices, report fields)."""
    if runtime.medusa_choices != "auto":
        return parse_choices(runtime.medusa_choices), {}
    chain = [(0,) * (k + 1) for k in range(heads.config.num_heads)]
    probe = MedusaDrafter(heads, lean, chain, draft_vocab)
    sequences, lengths = _greedy_sequences(lean, prompts, runtime.max_new_tokens, eos, progress)
    accuracies = measure_rank_accuracies(probe, sequences, lengths, top=10)
    costs = verify_costs(lean, prompts[0], (1, *(n + 1 for n in MEDUSA_AUTO_SIZES)))  # root + n nodes
    trees = {n: build_tree_from_accuracies(accuracies, n) for n in MEDUSA_AUTO_SIZES}
    # Each tree's acceptance over the steps a greedy run with it takes: the accuracies' product
    # (an average over every position) overstates it, as for EAGLE trees.
    walked = walk_tree_acceptance([MedusaDrafter(heads, lean, tree, draft_vocab) for tree in trees.values()],
                                  sequences, lengths)
    accepted = {n: sum(steps) / max(len(steps), 1) for n, steps in zip(trees, walked)}
    value = {n: (1.0 + accepted[n]) * costs[1] / costs[n + 1] for n in trees}
    best = max(value, key=lambda n: (value[n], -n))
    choices = trees[best]
    log.info("medusa tree from measured rank accuracies (calibration on %d prompts that are also measured) and "
             "verification costs: %d nodes, expected accepted drafts per step %.2f (per position %.2f), expected "
             "tokens per plain step %.2f (sizes tried: %s)", len(sequences), len(choices), accepted[best],
             expected_acceptance(choices, accuracies), value[best], {n: round(v, 2) for n, v in value.items()})
    return choices, {"rank_accuracies": accuracies, "tokens_per_plain_step_by_size": value,
                     "expected_tau_by_size": {n: 1.0 + a for n, a in accepted.items()},
                     "tau_over_every_position_by_size": {n: 1.0 + expected_acceptance(tree, accuracies)
                                                         for n, tree in trees.items()},
                     "verify_seconds_by_tokens": costs}
