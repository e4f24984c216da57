"""The batch-size sweep: plain and speculative decoding on the same prompts at each batch size, in
one run, methods interleaved per batch of prompts (load on a shared machine hits all alike).

Per batch size and method: aggregate tokens/s (every generated token over the batches' wall time,
prefills included: what a server delivers), speculative ÷ plain, τ, drafted tokens verified per
sequence and step, the target step's time and what a verification step costs in plain steps at
that batch size, and per request the time to first token (TTFT), the time per output token after
it (TPOT) and the end-to-end latency at p50 and p99. The crossover is the first batch size at which
the best speculative method no longer beats plain decoding; the speculation policy per batch size
(`eval.policy`) is chosen from the same figures.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from eval.divergence import classify
from eval.policy import PAYS_MARGIN, choose_policy
from eval.runtime.batch_generate import BatchDecoder, batch_generate, time_per_output_token
from eval.runtime.clock import module_device
from eval.runtime.drafters import Drafter
from eval.runtime.drafters.policy import SIZE_ATTRIBUTES, SpeculationPolicy
from eval.runtime.generate import GenerationResult
from eval.runtime.linear_paths import clock_name, timer
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import SamplingConfig


@dataclass
class SweepMethod:
    """One measured configuration. family/size: its drafter family and draft size for the policy
    (None/0: plain decoding, or a drafter the policy does not size); draft_length: tokens drafted
    along one path (an engine's draft length)."""

    name: str
    build: Callable[[], Drafter] | None
    verification: str = "lossless"
    family: str | None = None
    size: int = 0
    draft_length: int = 0


def sweep_method(name: str, build, settings: dict, verification: str = "lossless") -> SweepMethod:
    """A `eval.run.Method`'s fields as a sweep method (family and size read from its settings)."""
    family = name.split("@")[0]
    if build is None or family not in SIZE_ATTRIBUTES:
        return SweepMethod(name, build, verification)
    size = int(settings[SIZE_ATTRIBUTES[family]])
    length = int(settings["depth"]) if family == "eagle_tree" else size
    return SweepMethod(name, build, verification, family, size, length)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (0-100); None for no values."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    rank = (len(values) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return values[low] + (values[high] - values[low]) * (rank - low)


def latency_figures(results: Sequence[GenerationResult]) -> dict:
    """TTFT, TPOT and end-to-end latency per request, in ms, at p50 and p99."""
    series = {"ttft": [r.prefill_time for r in results], "tpot": [time_per_output_token(r) for r in results],
              "e2e": [r.total_time for r in results]}
    return {f"{name}_ms_p{q}": None if (value := percentile(values, q)) is None else 1000 * value
            for name, values in series.items() for q in (50, 99)}


def summarize_batches(results: Sequence[GenerationResult], wall_seconds: float, batch_size: int) -> dict:
    tokens = sum(len(r.tokens) for r in results)
    steps = [(a, s) for r in results for a, s in zip(r.accepted, r.tree_sizes)]
    verify = [t for r in results for t in r.verify_times]
    summary = {"requests": len(results), "new_tokens": tokens, "seconds": wall_seconds,
               "tokens_per_second": tokens / wall_seconds if wall_seconds > 0 else 0.0,
               "step_ms": 1000 * sum(verify) / len(verify) if verify else None, **latency_figures(results)}
    if steps:
        draft = [t for r in results for t in r.draft_times]
        summary.update(tau=sum(a + 1 for a, _ in steps) / len(steps),
                       draft_tokens_per_sequence=sum(s for _, s in steps) / len(steps),
                       draft_ms_per_sequence=1000 * sum(draft) / len(draft))
    return summary


@torch.no_grad()
def batch_sweep(lean: LeanLlama, methods: Sequence[SweepMethod], prompts: Sequence[torch.Tensor],
                batch_sizes: Sequence[int], max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
                eos_token_ids: Sequence[int] = (), seed: int = 0, max_length: int | None = None,
                progress: bool = False) -> dict:
    """Run every method (the first must be plain decoding) at every batch size on the same prompts:
    at batch size B, max(len(prompts), B) requests rounded up to a multiple of B (prompts reused in
    order), in batches of B, each batch run by every method in turn. Returns {"batch_sizes": [...],
    "rows": [{"batch_size", "methods": {name: figures}, "best", "best_speedup"}], "crossover",
    "crossover_by_method", "clock"}. Times are wall time, or with one CPU thread the thread's CPU
    time (`eval.runtime.linear_paths.timer`)."""
    from tqdm import tqdm

    if not methods or methods[0].build is not None:
        raise ValueError("batch sweep: the first method must be plain decoding (build None)")
    clock = timer(module_device(lean))  # one CPU thread: its CPU time, robust to other jobs on the machine
    pools: dict[str, list] = {m.name: [] for m in methods}  # idle drafters, reused across batch sizes
    rows, reference = [], {}
    total = sum(math.ceil(max(len(prompts), b) / b) * len(methods) for b in batch_sizes)
    bar = tqdm(total=total, desc="batch sweep", disable=not progress)
    for batch_size in batch_sizes:
        count = math.ceil(max(len(prompts), batch_size) / batch_size) * batch_size
        results: dict[str, list[GenerationResult]] = {m.name: [] for m in methods}
        seconds = {m.name: 0.0 for m in methods}
        for method in methods:  # drafters are built before timing: a server builds them once
            while method.build is not None and len(pools[method.name]) < batch_size:
                pools[method.name].append(method.build())
        decoders = {m.name: BatchDecoder(lean, batch_size, sampling, eos_token_ids, m.build, m.verification, max_length,
                                         clock, drafter_pool=pools[m.name]) for m in methods}
        for first in range(0, count, batch_size):
            group = [prompts[i % len(prompts)] for i in range(first, first + batch_size)]
            for method in methods:
                bar.set_postfix_str(f"B={batch_size} {method.name}")
                generators = [torch.Generator().manual_seed(seed + i) for i in range(first, first + batch_size)]
                start = clock()
                results[method.name] += batch_generate(lean, group, max_new_tokens, sampling, eos_token_ids,
                                                       generators, decoder=decoders[method.name])
                seconds[method.name] += clock() - start
                bar.update()
        figures = {m.name: summarize_batches(results[m.name], seconds[m.name], batch_size) for m in methods}
        plain = figures[methods[0].name]
        for i, result in enumerate(results[methods[0].name]):  # plain output at the first batch size
            reference.setdefault(i % len(prompts), result.tokens)
        for method in methods:
            row = figures[method.name]
            if sampling.greedy:  # every method at every batch size against plain at the first one
                row["greedy_identical"] = all(r.tokens == reference[i % len(prompts)]
                                              for i, r in enumerate(results[method.name]))
                if not row["greedy_identical"]:  # rounding near-tie or a bug: eval.divergence tells
                    row.update(classify(lean, prompts, [reference[i] for i in range(len(prompts))],
                                        [r.tokens for r in results[method.name]]))
            if method.build is not None:
                row["speedup_vs_plain"] = row["tokens_per_second"] / plain["tokens_per_second"]
                if plain["step_ms"] and row["step_ms"]:
                    row["verify_cost_in_plain_steps"] = row["step_ms"] / plain["step_ms"]
                    row["break_even_tau"] = (row["step_ms"] + batch_size * row["draft_ms_per_sequence"]) / plain["step_ms"]
        speculative = [m.name for m in methods[1:]]
        best = max(speculative, key=lambda n: figures[n]["tokens_per_second"], default=None)
        rows.append({"batch_size": batch_size, "methods": figures, "best": best,
                     "best_speedup": figures[best]["speedup_vs_plain"] if best else None})
    bar.close()
    return {"batch_sizes": list(batch_sizes), "rows": rows, "clock": clock_name(module_device(lean)),
            "crossover": crossover(rows),
            "crossover_by_method": {m.name: crossover(rows, m.name) for m in methods[1:]}}


def crossover(rows: Sequence[dict], method: str | None = None) -> int | None:
    """The first batch size at which speculation (the best method, or `method`) stops paying:
    tokens/s not above plain's. None: it paid at every batch size measured."""
    for row in rows:
        speedup = row["best_speedup"] if method is None else row["methods"][method]["speedup_vs_plain"]
        if speedup is None or speedup <= 1.0:
            return row["batch_size"]
    return None


def sweep_policy(sweep: dict, methods: Sequence[SweepMethod], measured_on: dict | None = None) -> SpeculationPolicy | None:
    """The per-batch-size policy over the drafter family of the best method at the smallest batch
    size (its sizes measured at every batch size); None without a sized family."""
    sized = [m for m in methods if m.family is not None]
    if not sized:
        return None
    first = sweep["rows"][0]["methods"]
    family = max(sized, key=lambda m: first[m.name]["tokens_per_second"]).family
    members = [m for m in sized if m.family == family]
    plain = {row["batch_size"]: row["methods"][methods[0].name]["tokens_per_second"] for row in sweep["rows"]}
    points = {row["batch_size"]: {m.size: row["methods"][m.name]["tokens_per_second"] for m in members}
              for row in sweep["rows"]}
    return choose_policy(family, plain, points, {m.size: m.draft_length for m in members}, measured_on)


def _identical(figures: dict) -> str:
    value = figures.get("greedy_identical")
    if value is False and figures.get("greedy_identical_up_to_ties"):
        return "near-ties"
    return "–" if value is None else str(value)


def markdown(sweep: dict) -> str:
    """The sweep as two tables (throughput, latency) and the crossover."""
    lines = ["## Batch-size sweep", "",
             "| batch | method | tokens/s | vs plain | τ | drafted / seq | step ms | verify cost (plain steps) "
             "| break-even τ | greedy identical |", "| --- " * 10 + "|"]
    for row in sweep["rows"]:
        for name, f in row["methods"].items():
            lines.append(f"| {row['batch_size']} | {name} | {f['tokens_per_second']:.1f} | "
                         f"{_fmt(f.get('speedup_vs_plain'))} | {_fmt(f.get('tau'))} | "
                         f"{_fmt(f.get('draft_tokens_per_sequence'), 1)} | {_fmt(f['step_ms'], 1)} | "
                         f"{_fmt(f.get('verify_cost_in_plain_steps'))} | {_fmt(f.get('break_even_tau'))} | "
                         f"{_identical(f)} |")
    lines += ["", "| batch | method | TTFT p50 / p99 ms | TPOT p50 / p99 ms | end-to-end p50 / p99 ms |",
              "| --- " * 5 + "|"]
    for row in sweep["rows"]:
        for name, f in row["methods"].items():
            lines.append(f"| {row['batch_size']} | {name} | " + " | ".join(
                f"{_fmt(f[f'{k}_ms_p50'], 0)} / {_fmt(f[f'{k}_ms_p99'], 0)}" for k in ("ttft", "tpot", "e2e")) + " |")
    where = sweep["crossover"]
    first = sweep["rows"][0]["batch_size"] if sweep["rows"] else None
    verdict = ("speculation pays at every batch size measured" if where is None else
               "speculation did not pay at any batch size measured" if where == first else
               f"speculation stops paying at batch size {where}")
    per_method = ", ".join(f"{k}: {v}" for k, v in sweep["crossover_by_method"].items())
    lines += ["", f"Crossover: {verdict} (per method: {per_method}; a speculative size must beat plain by "
                  f"{PAYS_MARGIN:.0%} for the policy to keep it). Times: {sweep.get('clock', 'wall')}.", ""]
    return "\n".join(lines)


def _fmt(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


PLOT_NAMES = ("speedup_vs_batch_size.png", "tpot_vs_batch_size.png")  # what plot() writes


def plot(sweep: dict, out_dir) -> dict:
    """speedup_vs_batch_size.png and tpot_vs_batch_size.png in out_dir; returns their paths."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    sizes = sweep["batch_sizes"]
    names = list(sweep["rows"][0]["methods"])
    paths = {}
    for key, label, kinds in (("speedup", "speculative ÷ plain tokens/s", names[1:]), ("tpot", "TPOT p50 (ms)", names)):
        figure, axis = plt.subplots(figsize=(6, 4))
        for name in kinds:
            column = "speedup_vs_plain" if key == "speedup" else "tpot_ms_p50"
            axis.plot(sizes, [row["methods"][name].get(column) or 0.0 for row in sweep["rows"]], marker="o", label=name)
        if key == "speedup":
            axis.axhline(1.0, color="gray", linewidth=0.8)
        axis.set_xscale("log", base=2)
        axis.set_xticks(sizes, [str(s) for s in sizes])
        axis.set_xlabel("batch size")
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
        figure.tight_layout()
        paths[f"{key}_vs_batch_size"] = out_dir / f"{key}_vs_batch_size.png"
        figure.savefig(paths[f"{key}_vs_batch_size"], dpi=110)
        plt.close(figure)
    return paths
