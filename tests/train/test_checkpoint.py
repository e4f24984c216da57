import json
import random

import pytest
import torch

from heads.eagle import EagleConfig, EagleHead
from heads.io import load_head
from train.checkpoint import (
    latest_valid_checkpoint, list_checkpoints, load_checkpoint, prune_checkpoints, read_state, rng_state,
    save_checkpoint, set_rng_state,
)
from tests.tiny import tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _save(root, step, target, extra=None):
    config = EagleConfig.from_target(target)
    head = EagleHead(config)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3)
    head(torch.randn(1, 3, 64), torch.randn(1, 3, 64), torch.arange(3)[None])[0].sum().backward()
    optimizer.step()
    return save_checkpoint(root, step, head, config, optimizer.state_dict(), {"last_epoch": step},
                           [rng_state()], {"data_position": {"epoch": 0, "index": step}, **(extra or {})}), head


def test_save_is_complete_and_loadable(tmp_path, target):
    path, head = _save(tmp_path, 3, target)
    assert path.name == "step-00000003" and not list(tmp_path.glob(".tmp-*"))
    state = read_state(path)
    assert state["step"] == 3 and state["complete"] and state["data_position"]["index"] == 3
    loaded = load_checkpoint(path)
    assert loaded["scheduler"] == {"last_epoch": 3} and len(loaded["rng"]) == 1
    assert loaded["optimizer"]["state"][0]["exp_avg"].shape == head.fc.weight.shape
    restored, _, meta = load_head(path, target)  # a checkpoint is a native head folder
    assert meta["step"] == 3
    torch.testing.assert_close(restored.fc.weight, head.fc.weight)


def test_truncated_or_unfinished_checkpoints_are_skipped(tmp_path, target):
    _save(tmp_path, 2, target)
    newer, _ = _save(tmp_path, 4, target)
    weights = newer / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a kill while writing (were it not atomic)
    (tmp_path / ".tmp-step-00000006").mkdir()  # leftover of an interrupted save
    assert read_state(newer) is None
    assert latest_valid_checkpoint(tmp_path).name == "step-00000002"
    with pytest.raises(ValueError, match=r"model.safetensors: 100 bytes, trainer_state.json recorded \d+ \(truncated\)"):
        load_checkpoint(newer)
    state = json.loads((tmp_path / "step-00000002" / "trainer_state.json").read_text())
    state["complete"] = False
    (tmp_path / "step-00000002" / "trainer_state.json").write_text(json.dumps(state))
    assert latest_valid_checkpoint(tmp_path) is None


def test_keep_last_plus_best(tmp_path, target):
    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step, target)
    prune_checkpoints(tmp_path, keep_last=2, keep_steps={2})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4, 5]


def test_resave_same_step_replaces(tmp_path, target):
    _save(tmp_path, 1, target, {"marker": "old"})
    _save(tmp_path, 1, target, {"marker": "new"})
    assert read_state(tmp_path / "step-00000001")["marker"] == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]


def test_rng_round_trip():
    state = rng_state()
    a = (random.random(), torch.rand(3))
    set_rng_state(state)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


def test_checksums_catch_same_size_damage_and_name_the_file(tmp_path, target):
    from train.checkpoint import CheckpointError

    path, _ = _save(tmp_path, 1, target)
    assert read_state(path)["files"]["optimizer.pt"]["sha256"]
    optimizer = path / "optimizer.pt"
    optimizer.write_bytes(bytes(optimizer.stat().st_size))  # zeroed by a failing disk
    assert read_state(path) is not None  # sizes agree: listing stays cheap
    with pytest.raises(CheckpointError, match=r"optimizer.pt: sha256 differs"):
        load_checkpoint(path)


def test_a_zeroed_torch_file_without_checksums_gets_no_unsafe_advice(tmp_path, target):
    from train.checkpoint import CheckpointError

    path, _ = _save(tmp_path, 1, target)
    state = json.loads((path / "trainer_state.json").read_text())
    state["files"] = {name: entry["bytes"] for name, entry in state["files"].items()}  # an older checkpoint
    (path / "trainer_state.json").write_text(json.dumps(state))
    optimizer = path / "optimizer.pt"
    optimizer.write_bytes(bytes(optimizer.stat().st_size))
    with pytest.raises(CheckpointError, match=r"optimizer.pt: not a readable checkpoint file") as error:
        load_checkpoint(path)
    assert "weights_only" not in str(error.value)


def test_non_finite_weights_are_not_checkpointed(tmp_path, target):
    from train.checkpoint import TrainingDiverged

    good, head = _save(tmp_path, 2, target, {"run": {"id": "r1"}})
    with torch.no_grad():
        head.fc.weight.fill_(float("inf"))
    with pytest.raises(TrainingDiverged, match=r"non-finite weights after step 3 \(\['fc.weight'\]\).*step-00000002"):
        save_checkpoint(tmp_path, 3, head, head.config, {}, {}, [], {"run": {"id": "r1"}})
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000002"]


def test_saving_never_replaces_another_runs_checkpoint(tmp_path, target):
    from train.checkpoint import CheckpointError

    _save(tmp_path, 4, target, {"run": {"id": "first"}})
    with pytest.raises(CheckpointError, match="holds another run's checkpoint"):
        _save(tmp_path, 4, target, {"run": {"id": "second"}})
    assert read_state(tmp_path / "step-00000004")["run"]["id"] == "first"
    _save(tmp_path, 4, target, {"run": {"id": "first"}})  # the same run re-saves a step after a resume


def test_a_checkpoint_damaged_at_the_same_size_is_refused_wherever_its_head_is_read(tmp_path, target):
    from export import load_export
    from heads.io import HeadFileError

    path, _ = _save(tmp_path, 2, target)
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    assert read_state(path) is not None  # the sizes agree: listing does not notice
    for load in (lambda: load_head(path, target), lambda: load_export(path, target)):
        with pytest.raises(HeadFileError, match=r"damaged checkpoint: .*model.safetensors: sha256 differs"):
            load()


def test_a_full_disk_stops_with_one_error_and_no_hidden_temporary(tmp_path, target, monkeypatch):
    """torch.save on a full disk raises a RuntimeError without an errno: the folder's free space
    tells it from another failure, and the half-written `.tmp-step-*` folder goes."""
    import shutil

    from heads.io import DiskFullError

    first, _ = _save(tmp_path, 1, target)
    real = torch.save

    def save(value, path):
        with open(path, "wb") as handle:
            handle.write(b"\x00" * 1000)
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 1000 vs 896")
    monkeypatch.setattr(torch, "save", save)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=2000))
    with pytest.raises(DiskFullError, match=rf"{tmp_path}: no space left on its disk: checkpoint step-00000002 needs "
                                            rf"about [\d,]+ bytes and 2,000 are free; .*last checkpoint is {first}"):
        _save(tmp_path, 2, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)  # room enough: another failure stays itself
    with pytest.raises(RuntimeError, match="inline_container"):
        _save(tmp_path, 2, target)
    monkeypatch.setattr(torch, "save", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]
