"""The whole job end to end on a tiny random target that uses SmolLM2's tokenizer and chat
template: data -> train -> eval -> export, then the exported folder validates."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import pipeline_job
from train.pipeline import run_job


@pytest.mark.integration
def test_job_runs_every_stage(tiny_chat_model, tmp_path):
    job = pipeline_job(tiny_chat_model, tmp_path, "run", 2, "runtime.drafters=[eagle_chain,prompt_lookup]",
                   "runtime.tree_sweep=[]", "runtime.num_prompts=1", "runtime.max_new_tokens=6",
                   "runtime.compare_transformers=false")
    summary = run_job(job)
    assert summary["train"]["steps"] == 2
    assert {row["name"] for row in summary["eval"]["drafters"]} == {"eagle_chain", "prompt_lookup"}
    assert set(summary["export"]) == {"native", "eagle", "eagle_vllm"}
    run = tmp_path / "run"
    assert (run / "metrics.jsonl").is_file() and (run / "eval" / "report.json").is_file()

    from export.validate import validate_export

    for folder in summary["export"].values():
        validate_export(folder)
    # Re-running only the later stages picks up the trained head from the run folder.
    again = run_job(pipeline_job(tiny_chat_model, tmp_path, "run", 2, "stages=[export]", f"export.out={tmp_path / 'x'}"))
    assert set(again["export"]) == {"native", "eagle", "eagle_vllm"}
    manifest = json.loads((tmp_path / "x" / "native" / "specheads.json").read_text())
    assert manifest["training"]["steps"] == 2  # figures of the run that trained the head
    assert manifest["training"]["held_out"] == summary["train"]["final_eval"]
    assert manifest["training"]["hardware"] == summary["train"]["hardware"] and manifest["training"]["data_source"]
    kept = json.loads((run / "job_summary.json").read_text())
    assert kept["train"] == summary["train"] and kept["export"] == again["export"]
    # the export-only run's time is its own; the job's end-to-end time stays the training run's
    assert kept["stages"] == ["export"] and kept["wall_seconds"] == again["wall_seconds"]
    assert kept["job_seconds"] == summary["job_seconds"] == summary["wall_seconds"] and "job_seconds" not in again
    # Training can start from an engine-layout export (bf16 weights read back into a head).
    resumed = run_job(pipeline_job(tiny_chat_model, tmp_path, "again", 1,
                               f"trainer.init_from={summary['export']['eagle']}", "stages=[data,train]"))
    assert resumed["train"]["steps"] == 1
    # and the head it started from is on record: the export's manifest and its steps
    listing = json.loads((Path(summary["export"]["eagle"]) / "specheads.json").read_text())
    assert resumed["train"]["started_from"] == {"path": summary["export"]["eagle"], "recipe": summary["recipe"],
                                                "steps": 2, "weights_sha256": listing["files"][listing["weights_file"]]["sha256"]}
    assert summary["train"]["started_from"] is None
    # Its later stages, run with the same overrides, export the head it trained, not the one it started from.
    out = tmp_path / "y"
    run_job(pipeline_job(tiny_chat_model, tmp_path, "again", 1, f"trainer.init_from={summary['export']['eagle']}",
                         "stages=[export]", f"export.out={out}"))
    from export.validate import load_export

    exported, trained = (load_export(folder)[0].state_dict() for folder in (out / "native", resumed["train"]["best_checkpoint"]))
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    assert json.loads((out / "native" / "specheads.json").read_text())["training"]["steps"] == 1


def test_a_failed_eval_keeps_the_training_figures_for_a_later_export(tiny_chat_model, tmp_path, monkeypatch):
    def broken_eval(*args, **kwargs):
        raise RuntimeError("eval broke")

    monkeypatch.setattr("eval.stage.run_eval_stage", broken_eval)
    job = pipeline_job(tiny_chat_model, tmp_path, "run", 2, "runtime.num_prompts=1", "runtime.max_new_tokens=4")
    with pytest.raises(RuntimeError, match="eval broke"):
        run_job(job)
    monkeypatch.undo()
    again = run_job(pipeline_job(tiny_chat_model, tmp_path, "run", 2, "stages=[export]", f"export.out={tmp_path / 'x'}"))
    manifest = json.loads((tmp_path / "x" / "native" / "specheads.json").read_text())
    assert manifest["training"]["steps"] == 2 and manifest["training"]["held_out"], manifest["training"]
    assert set(again["export"]) >= {"native"}


def test_a_job_whose_eval_would_have_no_prompt_is_refused_before_training(tiny_chat_model, tmp_path):
    # 24 conversations, 2% held out: the split holds none of them back
    job = pipeline_job(tiny_chat_model, tmp_path, "run", 2, "data.eval_fraction=0.02")
    with pytest.raises(ValueError, match=r"eval stage would have no prompt: the held-out side of .*data.jsonl"):
        run_job(job)
    assert not list((tmp_path / "run").glob("checkpoint*")), "it trained before refusing"
    # without the eval stage, or with prompts of its own, the same split is a job
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Count from 3."}\n')
    with_prompts = pipeline_job(tiny_chat_model, tmp_path, "run", 1, "data.eval_fraction=0.02", "stages=[data,eval]",
                                f"runtime.prompts_file={prompts}")
    from train.pipeline import _check_eval_prompts, load_job_target

    _check_eval_prompts(with_prompts, load_job_target(with_prompts))
    assert "train" in run_job(pipeline_job(tiny_chat_model, tmp_path, "run", 1, "data.eval_fraction=0.02",
                                           "stages=[data,train]"))


def test_an_export_credits_the_data_the_head_trained_on(tiny_chat_model, tmp_path):
    from train.checkpoint import CheckpointError

    trained = run_job(pipeline_job(tiny_chat_model, tmp_path, "run", 1, "stages=[data,train]"))["data"]["train"]
    stats = tmp_path / "run" / "data_stats.json"
    before = stats.read_text()
    # Other data into the same folder: the resume is refused before the data stage's record is replaced.
    with pytest.raises(CheckpointError, match="data.train_rows"):
        run_job(pipeline_job(tiny_chat_model, tmp_path, "run", 1, "stages=[data,train]", records="6"))
    assert stats.read_text() == before
    # The data stage alone may prepare other data there; an export still names what the head saw.
    run_job(pipeline_job(tiny_chat_model, tmp_path, "run", 1, "stages=[data]", records="6"))
    assert json.loads(stats.read_text())["train"]["records"] == 6 != trained["records"]
    run_job(pipeline_job(tiny_chat_model, tmp_path, "run", 1, "stages=[export]", "export.formats=[native]",
                         f"export.out={tmp_path / 'x'}"))
    training = json.loads((tmp_path / "x" / "native" / "specheads.json").read_text())["training"]
    assert (training["train_records"], training["train_tokens"]) == (trained["records"], trained["tokens"])
    # the frozen target's dtype for the features, so a re-evaluation computes them as training did
    summary = json.loads((tmp_path / "run" / "job_summary.json").read_text())
    assert training["target_dtype"]["dtype"] in ("float32", "bfloat16")
    assert training["target_dtype"] == summary["train"]["target_dtype"]


@pytest.mark.integration
@pytest.mark.parametrize("batch_size", [1, 4])  # 1: the lean runtime; 4: transformers' batched generate
def test_self_distilled_offline_job(tiny_chat_model, tmp_path, batch_size):
    """regenerate -> data on the regenerated set -> offline feature cache -> train."""
    job = pipeline_job(tiny_chat_model, tmp_path, "run", 2, "data.regenerate.enabled=true",
                   f"data.regenerate.batch_size={batch_size}",
                   "data.regenerate.max_new_tokens=5", "data.regenerate.shard_size=4", "data.mode=offline",
                   "data.feature_cache_dtype=float32", "stages=[data,train]", records="8")
    summary = run_job(job)
    regenerated = (tmp_path / "run" / "regenerated" / "regenerated.jsonl").read_text().splitlines()
    assert len(regenerated) == 8
    assert summary["train"]["steps"] == 2
    assert "the first assistant turn of the first 8 conversations regenerated by the target itself (greedy" \
        in summary["train"]["data_source"]  # what the manifest says the head learned from
    assert re.search(r"new tokens each; computed in (float32|bfloat16); self-distillation", summary["train"]["data_source"])
    assert any((tmp_path / "run").rglob("*.safetensors"))


@pytest.mark.integration
def test_eagle3_job_runs_every_stage(tiny_chat_model, tmp_path):
    """heads=eagle3: the loop trains it on its aux streams, the eval drafts with it, the engine
    layouts of EAGLE-3 are written and validate."""
    from export.validate import validate_export

    job = pipeline_job(tiny_chat_model, tmp_path, "run", 2, "heads=eagle3", "heads.eagle3.aux_layer_ids=[1,1,1]",
                       "heads.draft_vocab_size=512", "runtime.drafters=[eagle_chain]", "runtime.tree_sweep=[]",
                       "runtime.num_prompts=1", "runtime.max_new_tokens=6", "runtime.compare_transformers=false")
    summary = run_job(job)
    assert summary["train"]["steps"] == 2 and "eval/top1_step2" in summary["train"]["final_eval"]
    assert [row["name"] for row in summary["eval"]["drafters"]] == ["eagle_chain"]
    assert "native" in summary["export"] and len(summary["export"]) > 1
    for folder in summary["export"].values():
        validate_export(folder)
    config = json.loads((tmp_path / "run" / "export" / "native" / "head_config.json").read_text())
    assert config["type"] == "eagle3" and config["config"]["draft_vocab_size"] == 512


@pytest.mark.integration
def test_a_job_with_a_batch_sweep_exports_its_policy(tiny_chat_model, tmp_path, capsys):
    """runtime.batch_sizes in a job: the eval stage sweeps batch sizes, the job summary keeps its
    figures and the export's manifest carries the speculation policy per batch size."""
    job = pipeline_job(tiny_chat_model, tmp_path, "run", 2, "runtime.drafters=[eagle_tree]", "runtime.tree_sweep=[]",
                       "runtime.tree_total_tokens=4", "runtime.num_prompts=2", "runtime.max_new_tokens=4", "runtime.compare_transformers=false",
                       "runtime.batch_sizes=[1,2]", "export.formats=[native,eagle]")
    summary = run_job(job)
    sweep = summary["eval"]["batch_sweep"]
    assert sweep and summary["eval"]["speculation_policy"]["family"]
    policy = summary["eval"]["recommended_runtime"]["batch_policy"]
    manifest = json.loads((tmp_path / "run" / "export" / "eagle" / "specheads.json").read_text())
    exported = dict(manifest["runtime"]["batch_policy"])
    assert "NOT GPU serving advice" in exported.pop("advice")  # timed on this CPU, and labelled so
    assert exported == policy
    assert exported["measured_on"]["hardware"].startswith("CPU ")
    figures = manifest["eval"]["batch_sweep"]
    assert sorted(figures) == ["1", "2"] and figures["2"]["eagle_tree"]["tau"] == sweep["rows"][1]["methods"]["eagle_tree"]["tau"]
    out = capsys.readouterr().out
    assert "eval batch 1: eagle_tree tau" in out and "eval batch 2: eagle_tree tau" in out
    kept = json.loads((tmp_path / "run" / "job_summary.json").read_text())
    assert kept["eval"]["batch_sweep"] == sweep


@pytest.mark.integration
def test_eagle3_options_job_runs_every_stage(tiny_chat_model, tmp_path):
    """heads.eagle3.norm_before_fc=true heads.eagle3.norm_output=true as overrides of the job: the
    head trains and drafts with them, `engine` writes the layouts that carry them (SGLang's does not)
    and they validate with the flags and input_norm written."""
    from export.validate import validate_export

    job = pipeline_job(tiny_chat_model, tmp_path, "run", 2, "heads=eagle3", "heads.eagle3.aux_layer_ids=[1,1,1]",
                       "heads.eagle3.norm_before_fc=true", "heads.eagle3.norm_output=true", "heads.eagle3.init_fc=ridge",
                       "heads.eagle3.ridge_tokens=100", "heads.draft_vocab_size=512", "runtime.drafters=[eagle_chain]",
                       "runtime.tree_sweep=[]", "runtime.num_prompts=1", "runtime.max_new_tokens=6",
                       "runtime.compare_transformers=false")
    summary = run_job(job)
    assert summary["train"]["steps"] == 2 and [row["name"] for row in summary["eval"]["drafters"]] == ["eagle_chain"]
    assert set(summary["export"]) == {"native", "eagle3_vllm", "speculators"}
    for folder in summary["export"].values():
        validate_export(folder)
    native = json.loads((tmp_path / "run" / "export" / "native" / "head_config.json").read_text())["config"]
    assert (native["norm_before_fc"], native["fc_norm"], native["norm_output"]) == (True, False, True)
    for fmt in ("eagle3_vllm", "speculators"):
        config = json.loads((tmp_path / "run" / "export" / fmt / "config.json").read_text())
        assert (config["norm_before_fc"], config["fc_norm"], config["norm_output"]) == (True, False, True)


def test_the_manifest_credits_eval_figures_to_the_machine_the_eval_ran_on():
    """An export-only job (other threads, another machine) writes the eval figures a run measured
    earlier: their hardware is the eval report's, not the exporting job's."""
    from train.pipeline import _eval_figures

    summary = {"hardware": "CPU Y, 1 threads", "eval": {
        "threads": 2, "measured_on": {"device_type": "cpu", "hardware": "CPU X, 2 threads"},
        "drafters": [{"name": "eagle_tree", "tau": 2.0, "speedup_vs_plain": 1.5}]}}
    figures = _eval_figures(summary)
    assert figures["hardware"] == "CPU X, 2 threads" and figures["eagle_tree"]["tau"] == 2.0
    del summary["eval"]["measured_on"]  # a report from before it recorded the machine
    assert _eval_figures(summary)["hardware"] == "CPU Y, 1 threads"


def test_the_recorded_start_is_the_head_read_before_training(tiny_chat_model, tmp_path, monkeypatch):
    """A newer head written to the init_from path while the run trains (a release head replaced
    by its successor) is not the one this run started from."""
    start = tmp_path / "release"
    start.mkdir()
    manifest = {"weights_file": "model.safetensors", "training": {"recipe": "r", "steps": 7},
                "files": {"model.safetensors": {"sha256": "a" * 64}}}
    (start / "specheads.json").write_text(json.dumps(manifest))

    def training_while_the_start_is_replaced(job, target, prepared, source=None):
        manifest["files"]["model.safetensors"]["sha256"] = "b" * 64
        manifest["training"]["steps"] = 8
        (start / "specheads.json").write_text(json.dumps(manifest))
        from types import SimpleNamespace

        return SimpleNamespace(steps=1, stopped="max_steps", best_eval=None, final_eval=None, mixed_precision="no",
                               best_checkpoint=None, last_checkpoint=tmp_path / "ckpt")

    monkeypatch.setattr("train.loop.train_heads", training_while_the_start_is_replaced)
    summary = run_job(pipeline_job(tiny_chat_model, tmp_path, "run", 1, f"trainer.init_from={start}",
                                   "stages=[data,train]"))
    assert summary["train"]["started_from"] == {"path": str(start), "recipe": "r", "steps": 7,
                                                "weights_sha256": "a" * 64}
