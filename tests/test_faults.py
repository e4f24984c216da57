"""Faults at random points: training killed mid-step or mid-checkpoint, the feature cache killed
mid-shard, an export killed mid-write. A resumed run reproduces the uninterrupted losses, and
nothing half-written passes for a finished artifact.

A kill is simulated in-process by a BaseException (nothing catches it, like SIGKILL no `except
Exception` runs); tests/train/test_loop.py kills a real process with SIGKILL once."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

import export.writer as writer
import train.checkpoint as checkpoint
from data.feature_cache import FeatureCache, shard_name, write_feature_cache, write_index
from export import ExportValidationError, export_head, validate_export
from tests.export.conftest import make_eagle, make_target
from tests.tiny import tiny_target
from tests.train.loop_fixtures import tiny_data, tiny_job, tiny_rows
from train.loop import train_heads
from train.objectives import OnlineFeatures


class Killed(BaseException):
    """The process died here."""


def _losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["train/loss"] for line in lines if "train/loss" in line}


def _job(run_dir):
    return tiny_job(run_dir, save_every=2, keep_last=3)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    target, data = tiny_target(), tiny_data()
    run_dir = tmp_path_factory.mktemp("reference")
    online, calls = OnlineFeatures(target), []

    def counting(batch):
        calls.append(1)
        return online(batch)

    train_heads(_job(run_dir), target, data, source=counting)
    return target, data, _losses(run_dir), len(calls)


def _assert_same(run_dir, losses):
    resumed = _losses(run_dir)
    assert sorted(resumed) == list(range(1, 9))
    for step in range(1, 9):
        assert resumed[step] == pytest.approx(losses[step], rel=1e-6, abs=1e-7), step


def test_training_killed_at_random_forward_passes_resumes_to_the_same_losses(tmp_path, reference):
    target, data, losses, passes = reference
    online = OnlineFeatures(target)
    for kill_at in sorted(random.Random(14).sample(range(1, passes + 1), 3)):  # steps and evaluations alike
        calls = 0

        def dying(batch, kill_at=kill_at):
            nonlocal calls
            calls += 1
            if calls == kill_at:
                raise Killed(f"forward pass {kill_at}")
            return online(batch)

        run_dir = tmp_path / f"killed-{kill_at}"
        with pytest.raises(Killed):
            train_heads(_job(run_dir), target, data, source=dying)
        train_heads(_job(run_dir), target, data)
        _assert_same(run_dir, losses)


def test_training_killed_while_writing_a_checkpoint_resumes_to_the_same_losses(tmp_path, reference, monkeypatch):
    target, data, losses, _ = reference
    real_save = torch.save
    for kill_at in (2, 11):  # the scheduler file of the 1st checkpoint, then of the 4th
        writes = 0

        def dying_save(obj, path, *args, kill_at=kill_at, **kwargs):
            nonlocal writes
            writes += 1
            if writes == kill_at:
                Path(path).write_bytes(b"half a file")
                raise Killed(f"torch.save {kill_at}")
            return real_save(obj, path, *args, **kwargs)

        run_dir = tmp_path / f"killed-{kill_at}"
        monkeypatch.setattr(checkpoint.torch, "save", dying_save)
        with pytest.raises(Killed):
            train_heads(_job(run_dir), target, data)
        monkeypatch.setattr(checkpoint.torch, "save", real_save)
        leftovers = list((run_dir / "checkpoints").glob(".tmp-step-*"))
        assert leftovers and all(checkpoint.read_state(path) is None for path in leftovers)
        train_heads(_job(run_dir), target, data)
        _assert_same(run_dir, losses)
        assert not list((run_dir / "checkpoints").glob(".tmp-step-*"))


def test_feature_cache_killed_mid_shard_resumes_to_the_same_cache(tmp_path, monkeypatch):
    target, rows = tiny_target(), list(tiny_rows(9, 0))
    kwargs = dict(dtype="float32", shard_records=2, progress=False)
    write_feature_cache(tmp_path / "whole", target, rows, **kwargs)
    whole = FeatureCache(write_index(tmp_path / "whole"))
    from safetensors.torch import save_file

    for kill_at in sorted(random.Random(7).sample(range(1, 6), 2)):
        written = 0

        def dying_save(tensors, path, metadata=None, kill_at=kill_at):
            nonlocal written
            written += 1
            save_file(tensors, path, metadata=metadata)
            if written == kill_at:
                raw = Path(path).read_bytes()
                Path(path).write_bytes(raw[: len(raw) // 2])  # the process died mid-write
                raise Killed(f"shard {kill_at}")

        folder = tmp_path / f"killed-{kill_at}"
        monkeypatch.setattr("safetensors.torch.save_file", dying_save)
        with pytest.raises(Killed):
            write_feature_cache(folder, target, rows, **kwargs)
        monkeypatch.setattr("safetensors.torch.save_file", save_file)
        with pytest.raises((FileNotFoundError, ValueError)):
            write_index(folder)  # an unfinished cache never gets an index
        with pytest.raises(FileNotFoundError):
            FeatureCache(folder)
        again = write_feature_cache(folder, target, rows, **kwargs)
        assert again["written"][0] == kill_at - 1  # resumes at the shard that died
        cache = FeatureCache(write_index(folder))
        for n in range(len(whole)):
            assert torch.equal(cache[n]["hidden"][-1], whole[n]["hidden"][-1])
        # a shard cut after the fact (a bad copy) is not counted as done either
        shard = folder / shard_name(1)
        shard.write_bytes(shard.read_bytes()[:-7])
        assert write_feature_cache(folder, target, rows, **kwargs)["written"] == [1]


@pytest.mark.parametrize("step", ["weights", "config", "card", "manifest", "place"])
def test_export_killed_mid_write_leaves_the_old_export_or_nothing_valid(tmp_path, monkeypatch, step):
    target = make_target()
    head, config = make_eagle(target)
    old = export_head(head, config, "eagle", tmp_path / "out", target, dtype="float32")
    before = (old / "specheads.json").read_text()

    def die(*args, **kwargs):
        raise Killed(step)

    def half_then_die(write):
        def dying(path, *args, **kwargs):
            write(path, *args, **kwargs)
            Path(path).write_bytes(Path(path).read_bytes()[:40])
            raise Killed(step)
        return dying

    if step == "weights":
        monkeypatch.setattr(writer, "_write_weights", half_then_die(writer._write_weights))
    elif step == "config":
        real = writer._write_json
        monkeypatch.setattr(writer, "_write_json", lambda path, values: half_then_die(real)(path, values)
                            if path.name != "specheads.json" else real(path, values))
    elif step == "card":
        monkeypatch.setattr(writer, "model_card", die)
    elif step == "manifest":
        real = writer._write_json
        monkeypatch.setattr(writer, "_write_json", lambda path, values: half_then_die(real)(path, values)
                            if path.name == "specheads.json" else real(path, values))
    else:
        monkeypatch.setattr(writer, "_place", die)
    monkeypatch.setattr(writer.shutil, "rmtree", lambda *args, **kwargs: None)  # a kill cleans nothing up
    with pytest.raises(Killed):
        export_head(head, config, "eagle", tmp_path / "out", target, dtype="bfloat16")
    monkeypatch.undo()
    assert (old / "specheads.json").read_text() == before
    assert validate_export(old, target)["dtype"] == "float32"
    (leftover,) = [p for p in tmp_path.iterdir() if p.name != "out"]
    assert leftover.name.startswith(".out.tmp-")  # hidden, beside the destination
    if step == "place":  # killed after the new export was finished and validated, before its rename
        assert validate_export(leftover, target)["dtype"] == "bfloat16"
    else:
        with pytest.raises(ExportValidationError):
            validate_export(leftover, target)


def test_export_killed_between_its_two_renames_keeps_both_copies_whole(tmp_path, monkeypatch):
    """Replacing an export is two renames (old aside, new in). A kill between them leaves no
    `out`, but the old export and the new one are each whole under a hidden name beside it."""
    target = make_target()
    head, config = make_eagle(target)
    out = export_head(head, config, "eagle", tmp_path / "out", target, dtype="float32")
    real, renames = writer.os.replace, []

    def dying_replace(source, destination):
        renames.append(source)
        if len(renames) >= 2:  # dead: no rename after the first happens, not even the undo
            raise Killed("between the renames")
        real(source, destination)

    monkeypatch.setattr(writer.os, "replace", dying_replace)
    monkeypatch.setattr(writer.shutil, "rmtree", lambda *args, **kwargs: None)
    with pytest.raises(Killed):
        export_head(head, config, "eagle", out, target, dtype="bfloat16")
    monkeypatch.undo()
    assert not out.exists()
    (old,) = tmp_path.glob(".out.old-*/out")
    (new,) = tmp_path.glob(".out.tmp-*")
    assert validate_export(old, target)["dtype"] == "float32" and validate_export(new, target)["dtype"] == "bfloat16"
