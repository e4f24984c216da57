"""Start-of-run calibration on the machine that runs: the head drafters' size (the EAGLE-2 tree's
`tree_total_tokens: auto`, P-EAGLE's `peagle_tree_tokens: auto`, the Medusa tree of
`medusa_choices: auto`) chosen by running each candidate as the runtime runs it on a few
calibration prompts (which are also measured prompts), and the target's verification-cost curve
(one forward over n tokens) that the gate and the draft-model chains read.

A candidate is timed whole: drafting, the target's forward over the tree, verification, cache
compaction and the drafter's accept, at the cache lengths of a running sequence. An estimate built
from a causal forward over n repeated tokens plus the drafting cost left out the rest of the step
and the longer cache, and understated a 24-token step by a fifth: it then chose trees larger than
the fastest one."""
from __future__ import annotations

import logging
from typing import Callable, Mapping, Sequence

import torch

from eval.acceptance import measure_rank_accuracies
from eval.config import RuntimeConfig
from eval.runtime.clock import device_clock, module_device
from eval.runtime.drafters import Drafter
from eval.runtime.drafters.eagle import EagleDrafter
from eval.runtime.drafters.medusa import MedusaDrafter
from eval.runtime.drafters.peagle import peagle_tree
from eval.runtime.generate import plain_generate, speculative_generate
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
    """A forward (or a step) over more tokens never costs less: each size gets the largest cost
    measured at or below it, so a noisy cheap reading at a large size cannot pick that size."""
    out, running = {}, 0.0
    for n in sorted(costs):
        running = max(running, costs[n])
        out[n] = running
    return out


def _bar(items, description: str, progress: bool):
    """A progress bar over calibration prompts: each costs up to max_new_tokens target forwards per candidate."""
    from tqdm.auto import tqdm

    return tqdm(items, desc=f"calibration: {description}", unit="prompt", disable=not progress, leave=False)


@torch.no_grad()
def measure_sizes(lean: LeanLlama, candidates: Mapping[int, Callable[[], Drafter]], prompts, max_new_tokens: int,
                  eos, description: str = "sizes", progress: bool = False, plain_runs=None) -> dict:
    """Greedy generation on the first CALIBRATION_PROMPTS prompts: plain decoding, then each
    candidate drafter in turn on the same prompt (load drift hits all alike), each run as the
    runtime runs it (`speculative_generate`, no gate). plain_runs: the plain decoding of those
    prompts when the caller has just run it (`plain_generate`'s results, in order), timed there
    instead of again.

    Returns {"plain_step_seconds": decode seconds per plain step, "step_seconds": {size: seconds
    per speculative step, made non-decreasing in size (`monotone_costs`)}, "tau": {size: tokens
    committed per step}, "steps": {size: steps}, "calibration_prompts", "speedup": {size: tau x
    plain step / step}}: the ratio of tokens per second a run with that size would reach on these
    prompts. Seconds are totals over the prompts divided by steps, as throughput is; a run's first
    step, which includes the drafter's own prefill over the prompt, is left out of the time and
    the count of its steps, and kept in tau."""
    plain_time = plain_steps = 0.0
    times = {size: 0.0 for size in candidates}
    timed = {size: 0 for size in candidates}
    committed = {size: 0 for size in candidates}
    steps = {size: 0 for size in candidates}
    chosen = list(prompts[:CALIBRATION_PROMPTS])
    if plain_runs is not None and len(plain_runs) != len(chosen):
        raise ValueError(f"plain_runs holds {len(plain_runs)} runs for {len(chosen)} calibration prompts")
    for i, prompt in enumerate(_bar(chosen, description, progress)):
        plain = plain_runs[i] if plain_runs is not None else plain_generate(lean, prompt, max_new_tokens,
                                                                             SamplingConfig(), eos)
        plain_time += plain.decode_time
        plain_steps += max(len(plain.tokens) - 1, 0)
        for size, build in candidates.items():
            run = speculative_generate(lean, build(), prompt, max_new_tokens, SamplingConfig(), eos)
            committed[size] += sum(a + 1 for a in run.accepted)
            steps[size] += len(run.accepted)
            if len(run.accepted) > 1:
                times[size] += sum(run.draft_times[1:]) + sum(run.verify_times[1:])
                timed[size] += len(run.accepted) - 1
    plain_seconds = plain_time / plain_steps if plain_steps else float("nan")
    step_seconds = monotone_costs({size: times[size] / timed[size] if timed[size] else float("inf")
                                   for size in candidates})
    tau = {size: committed[size] / steps[size] if steps[size] else 1.0 for size in candidates}
    speedup = {size: tau[size] * plain_seconds / step_seconds[size] for size in candidates}
    return {"calibration_prompts": len(chosen), "plain_step_seconds": plain_seconds, "step_seconds": step_seconds,
            "tau": tau, "steps": steps, "speedup": speedup}


def choose_size(speedup: Mapping[int, float]) -> int:
    """The size with the highest measured speedup; the smaller on a tie (less work, same speed)."""
    return max(speedup, key=lambda n: (speedup[n], -n))


def _choose(lean: LeanLlama, candidates: Mapping[int, Callable[[], Drafter]], prompts, runtime: RuntimeConfig, eos,
            what: str, progress: bool, plain_runs=None) -> tuple[int, dict]:
    """`measure_sizes` over the candidates, the fastest size (`choose_size`), logged; returns (size,
    report fields, which eval.report renders)."""
    measured = measure_sizes(lean, candidates, prompts, runtime.max_new_tokens, eos, what, progress, plain_runs)
    best = choose_size(measured["speedup"])
    plain = measured["plain_step_seconds"]
    report = {"chosen": best, "calibration_prompts": measured["calibration_prompts"],
              "plain_step_seconds": plain, "step_seconds_by_size": measured["step_seconds"],
              "step_cost_in_plain_steps": {n: s / plain for n, s in measured["step_seconds"].items()},
              "expected_tau_by_size": measured["tau"], "steps_by_size": measured["steps"],
              "expected_speedup_by_size": measured["speedup"]}
    log.info("%s auto: %d (expected tau %.2f, %.2fx plain on %d calibration prompts; step cost in plain steps %s)",
             what, best, measured["tau"][best], measured["speedup"][best], measured["calibration_prompts"],
             {n: round(c, 2) for n, c in report["step_cost_in_plain_steps"].items()})
    return best, report


def _candidate_sizes(runtime: RuntimeConfig, largest: int | None = None) -> list[int]:
    sizes = sorted(set(runtime.tree_auto_sizes))
    if not sizes or sizes[0] < 2:
        raise ValueError(f"runtime.tree_auto_sizes must be total_tokens budgets >= 2, got {runtime.tree_auto_sizes}")
    if largest is None:
        return sizes
    return [n for n in sizes if n <= largest] or [largest]


def eagle_tree_budget(head, lean: LeanLlama, runtime: RuntimeConfig, prompts, eos, draft_vocab,
                      progress: bool = False) -> tuple[int, dict]:
    """runtime.tree_total_tokens "auto": the budget of `runtime.tree_auto_sizes` (up to the most
    nodes the expansion drafts) whose greedy runs on the calibration prompts go fastest
    (`measure_sizes`; `progress`: a bar over the prompts)."""
    top_k = runtime.tree_top_k
    largest = 1 + top_k + (runtime.tree_depth - 1) * top_k * top_k  # root + every node the expansion drafts
    budgets = _candidate_sizes(runtime, largest)
    candidates = {n: (lambda n=n: EagleDrafter(head, lean, mode="tree", depth=runtime.tree_depth, top_k=top_k,
                                               total_tokens=n, draft_vocab=draft_vocab)) for n in budgets}
    return _choose(lean, candidates, prompts, runtime, eos, "eagle tree sizes", progress)


def peagle_tree_budget(head, lean: LeanLlama, runtime: RuntimeConfig, depth: int, prompts, eos,
                       progress: bool = False) -> tuple[int, dict]:
    """runtime.peagle_tree_tokens "auto": as `eagle_tree_budget`, over P-EAGLE trees of
    `runtime.tree_auto_sizes` tokens on `depth` slots."""
    budgets = _candidate_sizes(runtime)
    candidates = {n: (lambda n=n: peagle_tree(head, lean, depth, n)) for n in budgets}
    return _choose(lean, candidates, prompts, runtime, eos, "peagle tree sizes", progress)


def medusa_choices(heads: MedusaHeads, lean: LeanLlama, runtime: RuntimeConfig, prompts, eos, draft_vocab,
                   progress: bool = False):
    """runtime.medusa_choices "auto": among the static trees of MEDUSA_AUTO_SIZES nodes built from
    the heads' rank accuracies measured on the calibration prompts' greedy continuations, the one
    whose greedy runs go fastest (`measure_sizes`); else the named or JSON tree. Returns (choices,
    report fields)."""
    if runtime.medusa_choices != "auto":
        return parse_choices(runtime.medusa_choices), {}
    chain = [(0,) * (k + 1) for k in range(heads.config.num_heads)]
    probe = MedusaDrafter(heads, lean, chain, draft_vocab)
    sequences, lengths, plain_runs = [], [], []
    for prompt in _bar(prompts[:CALIBRATION_PROMPTS], "greedy continuations", progress):
        plain_runs.append(plain_generate(lean, prompt, runtime.max_new_tokens, SamplingConfig(), eos))
        sequences.append(torch.cat([prompt, torch.tensor(plain_runs[-1].tokens, dtype=torch.long)]))
        lengths.append(prompt.shape[0])
    accuracies = measure_rank_accuracies(probe, sequences, lengths, top=10)
    trees = {n: build_tree_from_accuracies(accuracies, n) for n in MEDUSA_AUTO_SIZES}
    candidates = {n: (lambda tree=tree: MedusaDrafter(heads, lean, tree, draft_vocab)) for n, tree in trees.items()}
    # the continuations' plain runs are also the timed baseline: plain decoding runs once
    best, report = _choose(lean, candidates, prompts, runtime, eos, "medusa trees", progress, plain_runs)
    return trees[best], {"rank_accuracies": accuracies, **report,
                         "tau_over_every_position_by_size": {n: 1.0 + expected_acceptance(tree, accuracies)
                                                             for n, tree in trees.items()}}
