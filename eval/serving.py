"""Request-level measurement within the lean runtime (a measurement tool, not a server): requests
arrive on a Poisson process and a scheduler batches them on one `BatchDecoder`.

  static       when the decoder is idle, the queued requests (up to max_batch) start together and
               the batch runs until its last request finishes; later arrivals wait for the next one
  continuous   at every step boundary queued requests join free slots (first come, first served)
               and finished ones leave

Time runs on a `SkipClock`: wall time while the runtime works (with one CPU thread, that thread's
CPU time, so other jobs on a shared machine do not count), and a jump instead of a sleep while it
waits idle for the next arrival, so the figures are those of real-time serving without the idle
seconds. Per request: TTFT from its arrival (queueing and its prefill included), TPOT, end-to-end
latency; per run: throughput (tokens over the time from the first arrival to the last finish) and
the mean batch size of the decode steps.
"""
from __future__ import annotations

import random
import time
from collections import deque
from typing import Callable, Mapping, Sequence

import torch

from eval.runtime.batch_generate import BatchDecoder
from eval.runtime.clock import module_device
from eval.runtime.drafters import Drafter
from eval.runtime.linear_paths import timer
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import SamplingConfig
from eval.sweep import latency_figures

SCHEDULERS = ("static", "continuous")


class SkipClock:
    """The device clock plus the idle time skipped so far (`skip_to`)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock, self.offset = clock, 0.0

    def __call__(self) -> float:
        return self.clock() + self.offset

    def skip_to(self, moment: float) -> None:
        now = self()
        if moment > now:
            self.offset += moment - now


def poisson_arrivals(count: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (s, from 0) of `count` requests at `rate` per second (exponential gaps)."""
    if rate <= 0:
        raise ValueError(f"serving: arrival rate must be > 0 requests/s, got {rate}")
    rng, moment, times = random.Random(seed), 0.0, []
    for _ in range(count):
        moment += rng.expovariate(rate)
        times.append(moment)
    return times


@torch.no_grad()
def serve(model: LeanLlama, prompts: Sequence[torch.Tensor], arrivals: Sequence[float], max_new_tokens: int,
          scheduler: str, max_batch: int, drafter_factory: Callable[[], Drafter] | None = None,
          sampling: SamplingConfig = SamplingConfig(), eos_token_ids: Sequence[int] = (),
          max_length: int | None = None, seed: int = 0, clock: SkipClock | None = None) -> dict:
    """Serve prompts[i] arriving at arrivals[i] seconds (ascending). Returns the figures and
    "results" (GenerationResult per request, in arrival order)."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"serving: scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
    clock = clock or SkipClock(timer(module_device(model)))
    decoder = BatchDecoder(model, max_batch, sampling, eos_token_ids, drafter_factory, max_length=max_length,
                           clock=clock)
    start = clock()
    waiting = deque(range(len(prompts)))
    queue: deque[int] = deque()
    requests, batch_sizes = {}, []
    while waiting or queue or decoder.active:
        now = clock()
        while waiting and start + arrivals[waiting[0]] <= now:
            queue.append(waiting.popleft())
        if not decoder.active and not queue:
            clock.skip_to(start + arrivals[waiting[0]])  # idle until the next arrival
            continue
        if scheduler == "continuous" or not decoder.active:
            while queue and decoder.free:
                index = queue.popleft()
                generator = torch.Generator().manual_seed(seed + index)
                requests[index] = decoder.join(prompts[index], max_new_tokens, generator, index,
                                               start + arrivals[index])
        if decoder.active:
            batch_sizes.append(len(decoder.active))
            decoder.step()
    results = [requests[i].result for i in range(len(prompts))]
    finish = max(start + arrivals[i] + results[i].total_time for i in range(len(prompts)))
    tokens = sum(len(r.tokens) for r in results)
    steps = [(a, s) for r in results for a, s in zip(r.accepted, r.tree_sizes)]
    return {"scheduler": scheduler, "requests": len(prompts), "new_tokens": tokens,
            "seconds": finish - (start + arrivals[0]), "tokens_per_second": tokens / (finish - (start + arrivals[0])),
            "mean_batch_size": sum(batch_sizes) / len(batch_sizes) if batch_sizes else 0.0,
            "tau": sum(a + 1 for a, _ in steps) / len(steps) if steps else None,
            **latency_figures(results), "results": results}


def bench_serving(model: LeanLlama, prompts: Sequence[torch.Tensor], rates: Sequence[float], requests: int,
                  max_new_tokens: int, max_batch: int, drafters: Mapping[str, Callable[[], Drafter] | None],
                  schedulers: Sequence[str] = SCHEDULERS, sampling: SamplingConfig = SamplingConfig(),
                  eos_token_ids: Sequence[int] = (), max_length: int | None = None, seed: int = 0,
                  progress: Callable[[str], None] | None = None) -> list[dict]:
    """At each rate (requests/s), one Poisson trace of `requests` requests (prompts reused in
    order) served by every scheduler with every drafter (name -> factory; None: plain decoding),
    interleaved per rate. Returns one row per (rate, scheduler, drafter) without per-request results;
    greedy rows carry "greedy_identical" against the first drafter's output on the same trace."""
    rows = []
    trace_prompts = [prompts[i % len(prompts)] for i in range(requests)]
    for rate_index, rate in enumerate(rates):
        arrivals = poisson_arrivals(requests, rate, seed + rate_index)
        reference = None
        for scheduler in schedulers:
            for name, factory in drafters.items():
                if progress:
                    progress(f"rate {rate}/s {scheduler} {name}")
                figures = serve(model, trace_prompts, arrivals, max_new_tokens, scheduler, max_batch, factory,
                                sampling, eos_token_ids, max_length, seed)
                tokens = [r.tokens for r in figures.pop("results")]
                reference = reference or tokens
                row = {"rate": rate, "drafter": name, **figures}
                if sampling.greedy:
                    row["greedy_identical"] = tokens == reference
                rows.append(row)
    return rows


def markdown(rows: Sequence[dict]) -> str:
    lines = ["| rate (req/s) | scheduler | drafter | tokens/s | mean batch | τ | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
             "| end-to-end p50 / p99 ms |", "| --- " * 9 + "|"]
    for r in rows:
        fmt = lambda v, d=0: "–" if v is None else f"{v:.{d}f}"  # noqa: E731
        lines.append(f"| {r['rate']} | {r['scheduler']} | {r['drafter']} | {r['tokens_per_second']:.1f} | "
                     f"{r['mean_batch_size']:.1f} | {fmt(r['tau'], 2)} | "
                     + " | ".join(f"{fmt(r[f'{k}_ms_p50'])} / {fmt(r[f'{k}_ms_p99'])}" for k in ("ttft", "tpot", "e2e"))
                     + " |")
    return "\n".join(lines) + "\n"
