"""The engine comparison's own arithmetic, without the engine: our steps become the engine's
counters under one definition, training's estimate is the product of its top-1 rates, the
comparison flags a difference beyond its tolerance, the folder handed to the engine is the layout it
loads, and a failing engine is one error naming its log."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eval.config import RuntimeConfig
from eval.engine import (TOLERANCE, EngineError, agreement, opening_walk, rates, run_ours, run_vllm,
                         sampled_tolerance, step_counters, training_estimate)
from eval.stage import engine_heads
from export import export_head
from tests.export.conftest import make_eagle, make_medusa
from tests.tiny import tiny_eagle_setup, tiny_target


def test_steps_become_the_engines_counters():
    # steps accepted 0, 3, 1, 2 of 3 drafted; one plain step (nothing drafted) is not a draft
    counters = step_counters([0, 3, 1, 0, 2], [3, 3, 3, 0, 3], k=3)
    assert counters == {"drafts": 4, "draft_tokens": 12, "accepted_tokens": 6,
                        "accepted_per_position_counts": [3, 2, 1]}
    row = rates([counters, step_counters([1], [3], k=3)], k=3)
    assert row["drafts"] == 5 and row["accepted_per_position_counts"] == [4, 2, 1]
    assert row["accepted_per_position"] == [0.8, 0.4, 0.2]
    assert row["mean_acceptance_length"] == pytest.approx(1 + 7 / 5) == pytest.approx(1 + sum(row["accepted_per_position"]))
    assert rates([], k=2)["mean_acceptance_length"] is None


def test_training_estimate_multiplies_the_top1_rates():
    manifest = {"training": {"held_out": {"eval/top1_step0": 0.5, "eval/top1_step1": 0.4, "eval/top1_step2": 0.5}}}
    estimate = training_estimate(manifest, k=3)
    assert estimate["accepted_per_position"] == pytest.approx([0.5, 0.2, 0.1])
    assert estimate["mean_acceptance_length"] == pytest.approx(1.8)
    assert training_estimate(manifest, k=5)["steps_known"] == 3
    assert training_estimate({}, k=3) is None


def test_the_opening_walk_is_read_only_at_the_engines_depth():
    walked = {"eval/opening_chain_accept_step0": 0.5, "eval/opening_chain_accept_step1": 0.25,
              "eval/opening_chain_accept_step2": 0.125, "eval/opening_tokens": 64.0}
    walk = opening_walk({"training": {"held_out": walked}}, k=3)
    assert walk["accepted_per_position"] == [0.5, 0.25, 0.125] and walk["mean_acceptance_length"] == 1.875
    assert walk["reply_tokens"] == 64.0
    assert opening_walk({"training": {"held_out": walked}}, k=2) is None  # a depth-3 walk is not a K=2 run's
    assert opening_walk({"training": {"held_out": walked}}, k=4) is None
    assert opening_walk({}, k=3) is None


def test_agreement_flags_a_difference_beyond_the_tolerance():
    ours = {"accepted_per_position": [0.30, 0.10, 0.02]}
    assert agreement(ours, {"accepted_per_position": [0.30, 0.11, 0.02]})["within_tolerance"]
    off = agreement(ours, {"accepted_per_position": [0.30 - 2 * TOLERANCE, 0.10, 0.02]})
    assert not off["within_tolerance"] and off["max_abs_difference"] == pytest.approx(2 * TOLERANCE)
    assert not agreement(ours, {"accepted_per_position": [0.30, 0.10]})["within_tolerance"]  # K differs
    assert sampled_tolerance(400) == pytest.approx(4 * (0.5 / 400) ** 0.5)


def test_the_engine_gets_the_layout_it_loads(tmp_path):
    target = tiny_target()
    head, config = make_eagle(target)
    native = export_head(head, config, "native", tmp_path / "native", target, dtype="float32")
    (exported,) = engine_heads(target, [native], tmp_path / "work")
    assert exported.folder == tmp_path / "work" / "engine_export_0" / "eagle_vllm" and exported.method == "eagle"
    assert json.loads((exported.folder / "specheads.json").read_text())["format"] == "eagle_vllm"
    assert exported.source == native and exported.manifest["format"] == "native"
    (again,) = engine_heads(target, [exported.folder], tmp_path / "other")
    assert again.folder == exported.folder  # an engine layout is used as written
    release = tmp_path / "release"
    export_head(head, config, "native", release, target, dtype="float32")
    export_head(head, config, "eagle_vllm", release / "eagle_vllm", target, dtype="float32")
    (found,) = engine_heads(target, [(release, [("broken", tmp_path / "b", 2)])], tmp_path / "w2")
    assert found.folder == release / "eagle_vllm" and found.broken == [("broken", tmp_path / "b", 2)]
    medusa, medusa_config = make_medusa(target)
    medusa_native = export_head(medusa, medusa_config, "native", tmp_path / "m", target, dtype="float32")
    (medusa_head,) = engine_heads(target, [medusa_native], tmp_path / "w3")
    assert medusa_head.folder.name == "medusa_vllm" and medusa_head.method == "medusa"


def test_a_failing_engine_is_one_error_naming_its_log(tmp_path, monkeypatch):
    monkeypatch.setattr("eval.engine.base_folder", lambda target: tmp_path)
    with pytest.raises(EngineError, match=r"vLLM failed \(exit 1; log .*vllm.log\)"):
        run_vllm(None, [[1, 2]], [], 4, 0.0, 0, tmp_path / "work", python=Path("/bin/false"))


def test_our_chain_is_lossless_and_counts_what_it_drafted():
    target, _, head = tiny_eagle_setup()
    prompts = [torch.randint(0, 100, (12,)).tolist() for _ in range(3)]
    runtime = RuntimeConfig(max_new_tokens=16, temperature=0.0)
    ours = run_ours(target, [head], prompts, 3, runtime, transformers=False)
    chain = ours["chains"][0]
    assert chain["tokens"] == ours["plain"]["tokens"]
    row = rates(chain["per_prompt"], 3)
    assert row["drafts"] > 0 and row["draft_tokens"] == 3 * row["drafts"]
    counts = row["accepted_per_position_counts"]
    assert counts == sorted(counts, reverse=True) and counts[0] <= row["drafts"]


def test_the_report_puts_the_engine_beside_our_chain_per_category(tmp_path, monkeypatch):
    """measure_engine with a stand-in engine that accepts what our chain accepted on the first
    prompt and nothing after: the rows, the agreement verdict and a row per category follow."""
    from eval.engine_eval import EngineHead, measure_engine

    target, _, head = tiny_eagle_setup()
    prompts = [{"prompt_ids": torch.randint(0, 100, (10,)).tolist(), "category": c} for c in ("code", "chat", "code")]
    seen = {}

    def engine(target, ids, cases, max_tokens, temperature, seed, work, dtype, threads=None, python=None):
        seen["cases"] = [case.job() for case in cases]
        ours = seen["ours"]
        runs = [{"name": "plain", "tokens": ours["plain"]["tokens"], "seconds": 1.0,
                 "per_prompt_seconds": [1 / 3] * 3, "new_tokens": ours["plain"]["new_tokens"]}]
        per_prompt = [ours["chains"][0]["per_prompt"][0]] + [
            {"drafts": c["drafts"], "draft_tokens": c["draft_tokens"], "accepted_tokens": 0,
             "accepted_per_position_counts": [0, 0, 0]} for c in ours["chains"][0]["per_prompt"][1:]]
        for name, counters in (("head0", per_prompt), ("head1", ours["chains"][1]["per_prompt"])):
            runs.append({"name": name, "tokens": ours["plain"]["tokens"], "seconds": 1.0,
                         "per_prompt_seconds": [1 / 3] * 3, "new_tokens": ours["plain"]["new_tokens"],
                         "per_prompt": counters})
        return {"version": "stand-in", "runs": runs}

    import eval.engine_eval as engine_eval

    real_ours = engine_eval.run_ours
    monkeypatch.setattr(engine_eval, "run_ours", lambda *a, **k: seen.setdefault("ours", real_ours(*a, **k)))
    monkeypatch.setattr(engine_eval, "run_vllm", engine)
    manifest = {"training": {"held_out": {"eval/top1_step0": 0.5}}}
    walked = {"training": {"held_out": {"eval/top1_step0": 0.5, "eval/opening_tokens": 64.0,
                                        **{f"eval/opening_chain_accept_step{j}": 0.25 for j in range(3)}}}}
    heads = [EngineHead(tmp_path / "head", head, manifest, tmp_path / "engine", "eagle"),
             EngineHead(tmp_path / "other", head, walked, tmp_path / "engine", "eagle")]
    report = measure_engine(target, heads, prompts, RuntimeConfig(max_new_tokens=12), tmp_path / "out", k=3,
                            transformers=False)
    assert seen["cases"] == [{"name": f"head{i}", "method": "eagle", "model": str((tmp_path / "engine").resolve()),
                              "k": 3, "prompts": None} for i in range(2)]
    row, other = report["heads"]
    (comparison,) = report["comparisons"]  # head0 (what our chain accepted on one prompt) minus head1 (on all)
    assert comparison["against"] == str(tmp_path / "other")
    lengths = [r["rows"]["engine"]["mean_acceptance_length"] for r in (row, other)]
    assert comparison["mean_acceptance_length"]["difference"] == pytest.approx(lengths[0] - lengths[1])
    ours, theirs = row["rows"]["ours_chain"], row["rows"]["engine"]
    assert ours["drafts"] == theirs["drafts"] and row["tokens"]["engine_speculative_vs_engine_plain"]["identical"] == 3
    difference = max(abs(a - b) for a, b in zip(ours["accepted_per_position"], theirs["accepted_per_position"]))
    assert row["agreement"]["max_abs_difference"] == difference
    assert row["agreement"]["within_tolerance"] == (difference <= TOLERANCE)
    assert row["rows"]["training_estimate"]["accepted_per_position"] == [0.5]
    assert set(row["categories"]) == {"code", "chat"} and row["categories"]["code"]["prompts"] == 2
    chat = row["categories"]["chat"]
    assert chat["engine"]["accepted_per_position"] == [0.0, 0.0, 0.0]
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "| code | 2 |" in markdown and "specheads chain" in markdown and f"| {tmp_path / 'other'} | " in markdown
    # the head scored at the engine's K shows its opening walk; the other has none
    assert row["rows"]["opening_walk"] is None and other["rows"]["opening_walk"]["mean_acceptance_length"] == 1.75
    assert markdown.count("| held-out walk, first 64 reply tokens | – | 1.750 | 0.250 / 0.250 / 0.250 | – | – |") == 1
    assert json.loads((tmp_path / "out" / "report.json").read_text())["k"] == 3


def test_paired_difference_is_the_spread_over_prompts():
    """Equal drafts on every prompt: the difference is the mean of the per-prompt differences over
    the drafts and its bootstrap standard error that mean's (population) standard error; a head
    against itself differs by nothing, with no spread."""
    from eval.engine import paired_difference

    generator = torch.Generator().manual_seed(3)
    n, drafts = 60, 20

    def head(high):
        accepted = torch.randint(0, high, (n,), generator=generator)
        return [{"drafts": drafts, "draft_tokens": 3 * drafts, "accepted_tokens": int(a),
                 "accepted_per_position_counts": [int(min(a, drafts)), 0, 0]} for a in accepted]

    a, b = head(40), head(25)
    out = paired_difference(a, b)
    per_prompt = torch.tensor([(x["accepted_tokens"] - y["accepted_tokens"]) / drafts for x, y in zip(a, b)],
                              dtype=torch.float64)
    assert out["prompts"] == n
    assert out["mean_acceptance_length"]["difference"] == pytest.approx(float(per_prompt.mean()))
    expected = float(per_prompt.std(unbiased=False)) / n ** 0.5
    assert out["mean_acceptance_length"]["standard_error"] == pytest.approx(expected, rel=0.1)
    assert out["first_position"]["standard_error"] > 0
    same = paired_difference(a, a)
    assert same["mean_acceptance_length"] == {"difference": 0.0, "standard_error": 0.0}
    with pytest.raises(ValueError, match="prompts"):
        paired_difference(a, b[:-1])


def test_every_head_kind_has_a_layout_vllm_loads_and_a_method():
    from eval.engine import VLLM_LAYOUTS, VLLM_METHODS
    from export.formats import FORMATS
    from train.kinds import KINDS

    assert set(VLLM_LAYOUTS) == set(KINDS)
    for kind, layout in VLLM_LAYOUTS.items():
        assert layout in FORMATS and FORMATS[layout].head_type == kind and layout in VLLM_METHODS, (kind, layout)
    assert VLLM_METHODS["speculators_peagle"] == "peagle"  # vllm_check turns it into eagle3 + parallel_drafting
    check = (Path(__file__).resolve().parents[2] / "scripts" / "vllm_check.py").read_text()
    assert 'parallel_drafting=True' in check
