"""Resuming never mixes runs: checkpoints carry the run's identity, a resume refuses another run's,
a fresh run refuses a folder of checkpoints, pruning keeps to its own run, and a damaged newest
checkpoint falls back to the previous one with a WARNING naming the file."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from train.checkpoint import CheckpointError, list_checkpoints, prune_checkpoints, read_state, run_id
from train.loop import train_heads
from train.run_identity import data_fingerprint
from tests.tiny import tiny_target
from tests.train.loop_fixtures import tiny_data, tiny_job, tiny_rows


def _metrics(run_dir, key="train/loss"):
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line[key] for line in lines if key in line}


def _quick(run_dir, **trainer):
    return tiny_job(run_dir, **{"max_steps": 2, "eval_every": 100, "save_every": 2, "eval_at_start": False,
                                **trainer})


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_data_fingerprint_follows_content_and_order():
    rows = tiny_rows(6, 0)
    assert data_fingerprint(rows) == data_fingerprint(tiny_rows(6, 0))
    assert data_fingerprint(rows) != data_fingerprint(tiny_rows(6, 2))
    assert data_fingerprint(rows) != data_fingerprint(rows.select([1, 0, 2, 3, 4, 5]))
    assert data_fingerprint(rows.select([0, 1])) == data_fingerprint(tiny_rows(2, 0))  # a selection is read as such
    masked = rows.map(lambda row: {"loss_mask": [1] * len(row["loss_mask"])})
    assert data_fingerprint(rows) != data_fingerprint(masked)


def test_resume_refuses_a_checkpoint_of_other_data_naming_the_field(tmp_path, target):
    first = train_heads(_quick(tmp_path), target, tiny_data())
    assert read_state(first.last_checkpoint)["run"]["fields"]["model.fingerprint"] == target.fingerprint()["id"]
    other = tiny_data()
    other.train = tiny_rows(32, 5)  # data.source changed: same run folder, resume=auto
    with pytest.raises(CheckpointError, match=r"belongs to another run.*data\.train_rows: checkpoint '\w+' vs"):
        train_heads(_quick(tmp_path), target, other)


def test_resume_refuses_other_head_options_and_target(tmp_path, target):
    train_heads(_quick(tmp_path), target, tiny_data())
    job = _quick(tmp_path)
    job.heads.eagle.feature_loss_weight = 0.5
    with pytest.raises(CheckpointError, match=r"heads\.eagle\.feature_loss_weight: checkpoint 1\.0 vs this run 0\.5"):
        train_heads(job, target, tiny_data())
    with pytest.raises(CheckpointError, match=r"model\.fingerprint"):
        train_heads(_quick(tmp_path), tiny_target(seed=3), tiny_data())
    # what does not change the weights may change: a longer budget continues the run
    result = train_heads(_quick(tmp_path, max_steps=3, eval_every=7), target, tiny_data())
    assert result.steps == 3


def test_a_fresh_run_refuses_a_folder_with_checkpoints(tmp_path, target):
    train_heads(_quick(tmp_path), target, tiny_data())
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(CheckpointError, match=r"resume=never, but .* holds checkpoints \(step-00000002\)"):
        train_heads(_quick(tmp_path, resume="never"), target, tiny_data())
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


def test_pruning_never_touches_another_runs_checkpoints(tmp_path, target):
    """Two runs' checkpoints in one folder (as an older specheads left them after resume=never):
    pruning by step across both would delete the new run's newest; by run id it keeps each run's."""
    old = train_heads(_quick(tmp_path / "old", max_steps=8, save_every=2, keep_last=4), target, tiny_data())
    new = train_heads(_quick(tmp_path / "new", max_steps=4, save_every=1, keep_last=4), target, tiny_data(train=24))
    root = tmp_path / "new" / "checkpoints"
    for step in (6, 8):
        (old.run_dir / "checkpoints" / f"step-{step:08d}").rename(root / f"step-{step:08d}")
    prune_checkpoints(root, keep_last=1, run=run_id(read_state(new.last_checkpoint)))
    assert [p.name for _, p in list_checkpoints(root)] == ["step-00000004", "step-00000006", "step-00000008"]
    assert new.last_checkpoint.is_dir()


def test_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path, target, caplog):
    data = tiny_data()
    train_heads(tiny_job(tmp_path / "reference", keep_last=3), target, data)
    reference = _metrics(tmp_path / "reference")
    run = tmp_path / "run"
    train_heads(tiny_job(run, keep_last=3), target, data)
    newest = run / "checkpoints" / "step-00000008" / "model.safetensors"
    raw = bytearray(newest.read_bytes())
    raw[-64:] = bytes(64)  # same size, other bytes: the size check cannot see it
    newest.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        result = train_heads(tiny_job(run, keep_last=3), target, data)
    assert f"{newest}: sha256 differs" in caplog.text
    assert result.steps == 8 and (run / "checkpoints" / "step-00000008.damaged").is_dir()
    resumed = _metrics(run)
    for step in range(5, 9):  # retrained from step 4, exactly as the first time
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7)


def test_non_finite_weights_stop_training_before_they_are_saved(tmp_path, target, monkeypatch):
    """A finite loss and gradient can still leave infinite weights (an optimizer overflow): the
    checkpoint is not written, and the error names the last good one."""
    from train.checkpoint import TrainingDiverged

    real_step = torch.optim.AdamW.step

    def overflowing_step(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        if self._step_count_for_test == 3:
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("inf"))
        self._step_count_for_test += 1
        return result

    monkeypatch.setattr(torch.optim.AdamW, "_step_count_for_test", 0, raising=False)
    monkeypatch.setattr(torch.optim.AdamW, "step", overflowing_step)
    with pytest.raises(TrainingDiverged, match=r"non-finite weights at step 4.*step-00000002"):
        train_heads(_quick(tmp_path, max_steps=6), target, tiny_data())
    assert [p.name for _, p in list_checkpoints(tmp_path / "checkpoints")] == ["step-00000002"]
