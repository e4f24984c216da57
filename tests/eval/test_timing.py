"""Timed regions wait for the device's work on CUDA (a fake CUDA device: the synchronise call is
recorded, the work stays on the CPU) and read a bare clock on the CPU."""
import time

import pytest
import torch

import eval.acceptance
import eval.calibrate
import eval.run
import eval.runtime.clock
import eval.runtime.drafters.eagle
import eval.runtime.generate
from eval.config import RuntimeConfig
from eval.runtime.clock import device_clock, timed
from eval.runtime.drafters.prompt_lookup import PromptLookupDrafter
from eval.runtime.generate import plain_generate, speculative_generate
from eval.runtime.model import LeanLlama
from tests.tiny import tiny_model

CUDA = torch.device("cuda:0")


@pytest.fixture
def syncs(monkeypatch):
    calls = []
    monkeypatch.setattr(eval.runtime.clock, "_cuda_synchronize", lambda device: calls.append(("sync", str(device))))
    return calls


@pytest.fixture(scope="module")
def lean():
    torch.manual_seed(0)
    return LeanLlama.from_hf(tiny_model(num_hidden_layers=2), max_seq_len=64)


def test_the_timer_synchronises_around_the_region_on_cuda_only(syncs):
    with timed(CUDA) as region:
        syncs.append("work")
    assert syncs == [("sync", "cuda:0"), "work", ("sync", "cuda:0")] and region.seconds >= 0
    syncs.clear()
    with timed("cpu") as region:
        syncs.append("work")
    assert syncs == ["work"]
    assert device_clock("cpu") is time.perf_counter and device_clock(None) is time.perf_counter


def test_generation_and_calibration_read_a_synchronised_clock_on_cuda(syncs, lean, monkeypatch):
    prompt = torch.arange(3, 9)
    plain = plain_generate(lean, prompt, 5).tokens
    assert syncs == []  # CPU work: no synchronisation
    for module in (eval.runtime.generate, eval.calibrate, eval.run):  # the lean model's work "runs on CUDA"
        monkeypatch.setattr(module, "module_device", lambda model: CUDA)
    plain_generate(lean, prompt, 5)
    assert len(syncs) == 3  # start, end of prefill, end
    syncs.clear()
    result = speculative_generate(lean, PromptLookupDrafter(2), prompt, 5)
    assert result.tokens == plain and len(syncs) == 3 + 4 * len(result.accepted)  # start, prefill, end + 4 a step
    syncs.clear()
    eval.calibrate.verify_costs(lean, prompt, (1, 2), repeats=3)
    assert len(syncs) == 2 * 2 * 3  # around each timed forward
    syncs.clear()
    gated = eval.run._gated(lambda: PromptLookupDrafter(2), RuntimeConfig(fallback=True), 1e-3, lean)()
    speculative_generate(lean, gated, prompt, 5)
    assert syncs and all(call == ("sync", "cuda:0") for call in syncs)


def test_size_calibration_times_runs_on_a_synchronised_clock(syncs, monkeypatch):
    from tests.tiny import tiny_eagle_setup

    _, lean, head = tiny_eagle_setup(max_seq_len=32)
    build = {2: lambda: eval.runtime.drafters.eagle.EagleDrafter(head, lean, mode="tree", depth=2, top_k=2,
                                                                   total_tokens=2)}
    eval.calibrate.measure_sizes(lean, build, [torch.arange(3, 9)], 4, [])
    assert syncs == []
    monkeypatch.setattr(eval.runtime.generate, "module_device", lambda model: CUDA)
    measured = eval.calibrate.measure_sizes(lean, build, [torch.arange(3, 9)], 4, [])
    assert measured["steps"][2] >= 1 and syncs and all(call == ("sync", "cuda:0") for call in syncs)


def test_dynamic_gamma_gets_the_curve_measured_here(lean):
    runtime = RuntimeConfig(drafters=["self_speculation"], draft_layers=1)
    methods, extra = eval.run.build_methods(["self_speculation"], runtime, lean, prompts=[torch.arange(3, 9)])
    curve = extra["verify_cost"]
    assert len(curve) == 9 and curve[0] == 1.0 and curve == sorted(curve)
    drafter = methods[1].build()
    assert list(drafter.controller.verify_cost) == curve
    assert methods[1].settings["verify_cost"] == [round(c, 3) for c in curve]
