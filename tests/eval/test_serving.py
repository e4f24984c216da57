"""The serving benchmark on a tiny model: Poisson arrivals, static and continuous batching with and
without speculation; every request decodes to its batch-1 output; continuous batching lets a
request join while others run, static batching does not; idle time is skipped, not slept."""
import time

import pytest
import torch

from eval.runtime.drafters.prompt_lookup import PromptLookupDrafter
from eval.runtime.generate import plain_generate
from eval.runtime.model import LeanLlama
from eval.serving import SkipClock, bench_serving, markdown, poisson_arrivals, serve
from tests.tiny import tiny_model


@pytest.fixture(scope="module")
def lean():
    torch.manual_seed(0)
    return LeanLlama.from_hf(tiny_model(), max_seq_len=128)


def prompts(count=5):
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(3, 128, (n,), generator=generator) for n in range(3, 3 + count)]


def test_poisson_arrivals():
    times = poisson_arrivals(2000, 4.0, seed=1)
    assert times == sorted(times) and times == poisson_arrivals(2000, 4.0, seed=1)
    assert 2000 / times[-1] == pytest.approx(4.0, rel=0.1)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, 0.0)


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_every_request_gets_its_batch_one_output(lean, scheduler):
    requests = prompts()
    expected = [plain_generate(lean, p, 10).tokens for p in requests]
    arrivals = [0.0, 0.0, 0.001, 0.002, 0.003]
    for factory in (None, lambda: PromptLookupDrafter(num_draft=3)):
        figures = serve(lean, requests, arrivals, 10, scheduler, 2, factory, max_length=64)
        assert [r.tokens for r in figures["results"]] == expected
        assert 1.0 <= figures["mean_batch_size"] <= 2.0 and figures["tokens_per_second"] > 0
        for result in figures["results"]:
            assert 0 < result.prefill_time <= result.total_time


def test_continuous_batching_admits_a_request_mid_batch_and_static_does_not(lean):
    """Two long requests start together; a third arrives just after. Continuous batching admits
    it when a slot frees (max batch 3: at once); static batching makes it wait for the batch."""
    requests = [prompts(1)[0]] * 3
    arrivals = [0.0, 0.0, 1e-4]
    budgets = 30
    static = serve(lean, requests, arrivals, budgets, "static", 3, max_length=64)["results"]
    continuous = serve(lean, requests, arrivals, budgets, "continuous", 3, max_length=64)["results"]
    assert continuous[2].prefill_time < 0.5 * static[2].prefill_time  # static: waited a whole batch
    assert static[2].prefill_time > static[0].total_time * 0.5


def test_idle_time_is_skipped(lean):
    clock = SkipClock()
    start = time.perf_counter()
    figures = serve(lean, prompts(2), [0.0, 30.0], 4, "continuous", 2, max_length=64, clock=clock)
    assert time.perf_counter() - start < 10  # the 30 s gap was not slept
    assert figures["seconds"] >= 30.0 and clock.offset >= 29.0


def test_bench_serving_rows(lean):
    rows = bench_serving(lean, prompts(3), [50.0, 500.0], 4, 6, 2,
                         {"plain": None, "prompt_lookup": lambda: PromptLookupDrafter(num_draft=3)}, max_length=64)
    assert [(r["rate"], r["scheduler"], r["drafter"]) for r in rows][:4] == [
        (50.0, "static", "plain"), (50.0, "static", "prompt_lookup"), (50.0, "continuous", "plain"),
        (50.0, "continuous", "prompt_lookup")]
    assert len(rows) == 8 and all(r["greedy_identical"] for r in rows)
    assert "TTFT p50 / p99 ms" in markdown(rows)
