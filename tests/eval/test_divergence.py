"""A greedy output that leaves plain decoding: a near-tie of the target's own logits (rounding) is
told apart from a real mismatch (a broken drafter or verification), in the report and its log."""
import dataclasses
import logging

import pytest
import torch

import eval.run
from eval.config import RuntimeConfig
from eval.divergence import classify, divergence, tie_tolerance, ulp
from eval.report import markdown_table
from eval.run import evaluate
from eval.runtime.generate import plain_generate
from eval.runtime.model import LeanLlama
from tests.helpers import report, report_row
from tests.tiny import tiny_model, tiny_target

PROMPT = torch.tensor([5, 17, 33, 9, 60, 4])


def test_ulp_and_tolerance_follow_the_dtype():
    assert ulp(17.0, torch.bfloat16) == 0.125 and ulp(-17.0, torch.bfloat16) == 0.125
    assert ulp(1.0, torch.float32) == 2.0 ** -23
    assert tie_tolerance(17.0, torch.bfloat16) == 2.0  # above the 1.17 measured between row counts
    assert tie_tolerance(17.0, torch.float32) < 1e-3


@pytest.fixture(scope="module")
def tied():
    """A tiny target whose lm_head rows for its first greedy token and one other are equal: the two
    tokens' logits tie exactly at that position."""
    model = tiny_model()
    first = plain_generate(LeanLlama.from_hf(model, max_seq_len=64), PROMPT, 1).tokens[0]
    other = (first + 7) % model.config.vocab_size
    with torch.no_grad():
        model.lm_head.weight[other] = model.lm_head.weight[first]
    lean = LeanLlama.from_hf(model, max_seq_len=64)
    return lean, plain_generate(lean, PROMPT, 8).tokens, first, other


def test_an_exact_tie_is_a_near_tie(tied):
    lean, plain, first, other = tied
    swapped = [other if plain[0] == first else first] + plain[1:]
    found = divergence(lean, PROMPT, plain, swapped)
    assert found["position"] == 0 and found["logit_gap"] == 0.0 and found["near_tie"] is True
    assert classify(lean, [PROMPT], [plain], [swapped])["greedy_identical_up_to_ties"] is True


def test_a_wrong_token_is_a_real_mismatch(tied):
    lean, plain, _, _ = tied
    logits = lean(torch.cat([PROMPT, torch.tensor(plain[:3])]), lean.new_cache(16), logits="last").logits[-1]
    wrong = plain[:3] + [int(logits.argmin())] + plain[4:]
    found = divergence(lean, PROMPT, plain, wrong)
    assert found["position"] == 3 and found["logit_gap"] > 1.0 and found["near_tie"] is False
    assert divergence(lean, PROMPT, plain, plain) is None
    assert divergence(lean, PROMPT, plain, plain[:5])["near_tie"] is False  # stopped early: never rounding
    result = classify(lean, [PROMPT, PROMPT[:4]], [plain, plain], [plain, wrong])
    assert result["greedy_identical_up_to_ties"] is False
    assert [d["prompt"] for d in result["greedy_divergences"]] == [1]


def test_evaluate_reports_a_broken_runtime_as_a_mismatch(monkeypatch, tmp_path, caplog):
    """A speculative loop that commits a wrong token at one position (what a broken acceptance rule
    does) is reported as a GREEDY MISMATCH, not excused as a tie."""
    honest = eval.run.speculative_generate

    def broken(lean, drafter, prompt, *args, **kwargs):
        result = honest(lean, drafter, prompt, *args, **kwargs)
        tokens = list(result.tokens)
        logits = lean(torch.cat([prompt, torch.tensor(tokens[:2])]), lean.new_cache(64), logits="last").logits[-1]
        tokens[2] = int(logits.argmin())
        return dataclasses.replace(result, tokens=tokens)

    monkeypatch.setattr(eval.run, "speculative_generate", broken)
    runtime = RuntimeConfig(max_new_tokens=6, compare_transformers=False, fallback=False, threads=1)
    with caplog.at_level(logging.WARNING, logger="eval.run"):
        result = evaluate(tiny_target(), [PROMPT.tolist()], ["prompt_lookup"], runtime, out_dir=tmp_path,
                          progress=False)
    (row,) = result["drafters"]
    assert row["greedy_identical"] is False and row["greedy_identical_up_to_ties"] is False
    assert row["greedy_divergences"][0]["position"] == 2
    assert "GREEDY MISMATCH" in caplog.text
    assert "**GREEDY MISMATCH against plain decoding: prompt_lookup**" in (tmp_path / "report.md").read_text()


def test_a_report_with_near_ties_only_notes_them():
    tie = {"prompt": 3, "position": 39, "near_tie": True, "why": "bfloat16 logits +0.125 apart (within 2)"}
    row = {**report_row("eagle_chain", identical=False), "greedy_identical_up_to_ties": True,
           "greedy_divergences": [tie]}
    text = markdown_table(report(drafters=[row], dtype={"chosen": "bfloat16", "reason": "measured"}))
    assert "MISMATCH" not in text and "| near-ties |" in text
    assert "- eagle_chain, prompt 3, token 39: bfloat16 logits +0.125 apart (within 2)" in text


def test_the_batch_sweep_classifies_its_mismatches(monkeypatch, tmp_path):
    """A batch decoder that commits a wrong token is a real mismatch at every batch size."""
    import eval.sweep

    honest = eval.sweep.batch_generate

    def broken(lean, group, *args, decoder=None, **kwargs):
        results = honest(lean, group, *args, decoder=decoder, **kwargs)
        if decoder is None or decoder.drafter_factory is None:
            return results
        for result in results:
            result.tokens[1] = (result.tokens[1] + 1) % 128
        return results

    monkeypatch.setattr(eval.sweep, "batch_generate", broken)
    runtime = RuntimeConfig(max_new_tokens=6, compare_transformers=False, threads=1, batch_sizes=[1, 2])
    result = evaluate(tiny_target(), [PROMPT.tolist(), PROMPT[:4].tolist()], ["prompt_lookup"], runtime,
                      out_dir=tmp_path, progress=False)
    for row in result["batch_sweep"]["rows"]:
        figures = row["methods"]["prompt_lookup"]
        assert figures["greedy_identical"] is False and figures["greedy_identical_up_to_ties"] is False
        assert {d["position"] for d in figures["greedy_divergences"]} == {1}
        assert row["methods"]["plain"]["greedy_identical"] is True
    assert "| prompt_lookup |" in (tmp_path / "report.md").read_text()
