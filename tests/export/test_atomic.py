"""A crash while exporting leaves nothing that looks like a valid export; W&B gets the artifact."""
from __future__ import annotations

import errno
import json
import shutil
import sys
import types

import pytest

import export.writer as writer
from export import ExportValidationError, export_head, validate_export
from heads.io import DiskFullError
from tests.export.conftest import make_eagle


class Crash(RuntimeError):
    pass


def _crash_on_manifest(monkeypatch):
    real = writer._write_json

    def write_json(path, values):
        if path.name == "specheads.json":
            raise Crash("killed while writing the manifest")
        real(path, values)
    monkeypatch.setattr(writer, "_write_json", write_json)


def test_failed_export_leaves_no_folder(tmp_path, target, monkeypatch):
    head, config = make_eagle(target)
    _crash_on_manifest(monkeypatch)
    with pytest.raises(Crash):
        export_head(head, config, "eagle", tmp_path / "out", target)
    assert list(tmp_path.iterdir()) == []  # no destination, no temp leftovers


def test_hard_crash_leftover_is_hidden_and_invalid(tmp_path, target, monkeypatch):
    """A kill gets no cleanup: simulate it by disabling cleanup. What is left is a hidden temp folder
    with weights and config but no manifest, which validation refuses."""
    head, config = make_eagle(target)
    _crash_on_manifest(monkeypatch)
    monkeypatch.setattr(writer.shutil, "rmtree", lambda *args, **kwargs: None)
    with pytest.raises(Crash):
        export_head(head, config, "eagle", tmp_path / "out", target)
    assert not (tmp_path / "out").exists()
    (leftover,) = tmp_path.iterdir()
    assert leftover.name.startswith(".out.tmp-") and (leftover / "model.safetensors").is_file()
    with pytest.raises(ExportValidationError, match="specheads.json: missing"):
        validate_export(leftover)


def test_failed_reexport_keeps_the_previous_export(tmp_path, target, monkeypatch):
    head, config = make_eagle(target)
    out = export_head(head, config, "eagle", tmp_path / "out", target)
    before = (out / "specheads.json").read_text()
    _crash_on_manifest(monkeypatch)
    with pytest.raises(Crash):
        export_head(head, config, "eagle", out, target, dtype="float32")
    assert (out / "specheads.json").read_text() == before
    validate_export(out, target)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_failed_rename_restores_the_previous_export(tmp_path, target, monkeypatch):
    head, config = make_eagle(target)
    out = export_head(head, config, "eagle", tmp_path / "out", target)
    real = writer.os.replace
    calls = []

    def replace(source, destination):
        calls.append(source)
        if len(calls) == 2:  # the move of the new folder into place
            raise Crash("disk gone")
        real(source, destination)
    monkeypatch.setattr(writer.os, "replace", replace)
    with pytest.raises(Crash):
        export_head(head, config, "eagle", out, target, dtype="float32")
    monkeypatch.setattr(writer.os, "replace", real)
    assert validate_export(out, target)["dtype"] == "bfloat16"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def _half_written(error):
    """A writer that fills part of its file, then fails the way a full disk makes it fail."""
    def save_file(tensors, path, metadata=None):
        with open(path, "wb") as handle:
            handle.write(b"\x00" * 1000)
        raise error
    return save_file


def _free(monkeypatch, free: int):
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=free))


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   "SafetensorError"])  # what safetensors raises for it: says no errno
def test_a_full_disk_is_one_error_naming_the_folder_and_bytes_and_leaves_no_temporary(tmp_path, target,
                                                                                       monkeypatch, error):
    from safetensors import SafetensorError

    head, config = make_eagle(target)
    if error == "SafetensorError":
        error = SafetensorError("Error while serializing: I/O error")
    monkeypatch.setattr(writer, "save_file", _half_written(error))
    _free(monkeypatch, 100)
    needed = sum(p.numel() * 2 for p in head.state_dict().values())  # bf16; plus the target's embedding copies
    with pytest.raises(DiskFullError, match=rf"{tmp_path / 'out'}: no space left on its disk: the export needs "
                                            r"about [\d,]+ bytes and 100 are free; .*choose another out=") as caught:
        export_head(head, config, "eagle", tmp_path / "out", target)
    assert int(str(caught.value).split("about ")[1].split(" ")[0].replace(",", "")) >= needed
    assert "\n" not in str(caught.value) and isinstance(caught.value, OSError)  # the CLIs print one line
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_with_room_to_spare_is_not_called_a_full_disk(tmp_path, target, monkeypatch):
    from safetensors import SafetensorError

    head, config = make_eagle(target)
    monkeypatch.setattr(writer, "save_file", _half_written(SafetensorError("some other trouble")))
    with pytest.raises(SafetensorError, match="some other trouble"):
        export_head(head, config, "eagle", tmp_path / "out", target)
    assert list(tmp_path.iterdir()) == []


def test_reexport_replaces_the_folder(tmp_path, target):
    head, config = make_eagle(target)
    out = export_head(head, config, "eagle", tmp_path / "out", target)
    # A file the earlier export wrote (its manifest lists it) and this one does not write goes with it.
    (out / "stale.txt").write_text("from an older export")
    manifest = json.loads((out / "specheads.json").read_text())
    manifest["files"]["stale.txt"] = {"sha256": "0" * 64, "bytes": 20}
    (out / "specheads.json").write_text(json.dumps(manifest))
    export_head(head, config, "eagle", out, target, dtype="float16")
    assert validate_export(out)["dtype"] == "float16" and not (out / "stale.txt").exists()


class _FakeArtifact:
    def __init__(self, name, type, metadata, description):
        self.name, self.type, self.metadata, self.dirs = name, type, metadata, []

    def add_dir(self, path):
        self.dirs.append(path)


def test_wandb_artifact_when_a_run_is_active(tmp_path, target, monkeypatch):
    logged = []
    run = types.SimpleNamespace(log_artifact=logged.append)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(run=run, Artifact=_FakeArtifact))
    head, config = make_eagle(target)
    out = export_head(head, config, "eagle_vllm", tmp_path / "out", target)
    (artifact,) = logged
    assert artifact.type == "speculative-head" and artifact.dirs == [str(out)]
    assert artifact.metadata["format"] == "eagle_vllm"
    assert artifact.metadata["base_model"]["fingerprint"] == target.fingerprint()
    assert artifact.name == f"eagle-eagle-vllm-{target.fingerprint()['id']}"


def test_no_wandb_artifact_without_a_run(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(run=None, Artifact=_FakeArtifact))
    assert writer.log_artifact(tmp_path, {}) is False
    monkeypatch.delitem(sys.modules, "wandb")
    assert writer.log_artifact(tmp_path, {}) is False
