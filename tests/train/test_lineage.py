"""W&B lineage of a job: dataset -> checkpoint -> export artifacts, offline (inputs listed in the
run's config) and online (declared with use_artifact)."""
from __future__ import annotations

import json
import types

from train.config import LoggerConfig
from train.metrics import artifact_name, declare_inputs, log_lineage_artifact, read_lineage, stage_run


def test_offline_stage_run_logs_artifacts_and_lists_its_inputs(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    (tmp_path / "data.jsonl").write_text('{"id": 1}\n')
    (tmp_path / "data_stats.json").write_text("{}")
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "model.safetensors").write_bytes(b"weights")
    with stage_run(LoggerConfig(kind="wandb", mode="offline"), tmp_path, "data") as run:
        assert run.job_type == "data" and run.group == (tmp_path / "wandb_run_id.txt").read_text()
        dataset = log_lineage_artifact(run, tmp_path, "dataset", "recipe/x data", "dataset",
                                       folders={"data.jsonl": tmp_path / "data.jsonl"},
                                       files=[tmp_path / "data_stats.json"])
        checkpoint = log_lineage_artifact(run, tmp_path, "checkpoint", "recipe-checkpoint", "model",
                                          folders={"checkpoint": tmp_path / "head"}, inputs=("dataset", "absent"))
        assert run.config["lineage_inputs"] == [dataset]  # offline: no use_artifact (it would raise)
    assert dataset["name"] == "recipe-x-data" and len(dataset["digest"]) == 32 and "version" not in dataset
    assert read_lineage(tmp_path) == {"dataset": dataset, "checkpoint": checkpoint}
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_online_runs_declare_inputs_with_use_artifact(tmp_path):
    (tmp_path / "wandb_artifacts.json").write_text(json.dumps({
        "dataset": {"name": "r-data", "type": "dataset", "digest": "d" * 32, "version": "v3"},
        "checkpoint": {"name": "r-checkpoint", "type": "model", "digest": "c" * 32}}))  # logged offline: no version
    used, config = [], {}
    run = types.SimpleNamespace(settings=types.SimpleNamespace(_offline=False),
                                config=types.SimpleNamespace(update=lambda values, **_: config.update(values)),
                                use_artifact=lambda name, type: used.append((name, type)))
    records = declare_inputs(run, tmp_path, ("dataset", "checkpoint"))
    assert used == [("r-data:v3", "dataset")] and config["lineage_inputs"] == records and len(records) == 2
    assert declare_inputs(None, tmp_path, ("dataset",)) == records[:1]  # no run: nothing declared


def test_no_run_when_wandb_is_off(tmp_path):
    for config in (LoggerConfig(kind="none"), LoggerConfig(kind="wandb", mode="disabled")):
        with stage_run(config, tmp_path, "eval") as run:
            assert run is None
            assert log_lineage_artifact(run, tmp_path, "dataset", "x", "dataset") is None
    assert not (tmp_path / "wandb_artifacts.json").exists()
    assert artifact_name("a b/c:d") == "a-b-c-d"
