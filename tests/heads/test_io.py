import json

import pytest
import torch

from heads.eagle import EagleConfig, EagleHead
from heads.io import HeadMismatchError, build_head, load_head, save_head
from heads.medusa import MedusaConfig
from tests.tiny import tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_round_trip(tmp_path, target, kind):
    config = EagleConfig.from_target(target) if kind == "eagle" else MedusaConfig.from_target(target, num_layers=2)
    head = build_head(config)
    save_head(tmp_path, head, config, extra={"step": 7})
    meta = json.loads((tmp_path / "head_config.json").read_text())
    assert meta["type"] == kind and meta["step"] == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head_config.json", "model.safetensors"]
    loaded, loaded_config, loaded_meta = load_head(tmp_path, target)
    assert loaded_config == config and loaded_meta["step"] == 7
    for key, value in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)
    if kind == "eagle":
        x = torch.randn(1, 4, 64)
        pos = torch.arange(4)[None]
        torch.testing.assert_close(loaded(x, x, pos)[0], head(x, x, pos)[0])


def test_mismatched_target_is_refused(tmp_path, target):
    config = EagleConfig.from_target(target)
    save_head(tmp_path, EagleHead(config), config)
    other = tiny_target(seed=1)  # same shapes, different weights
    with pytest.raises(HeadMismatchError, match="lm_head_digest"):
        load_head(tmp_path, other)
    load_head(tmp_path, other, strict_fingerprint=False)  # shapes agree: allowed when not strict
    wider = tiny_target(hidden_size=32, intermediate_size=64)
    with pytest.raises(HeadMismatchError, match="hidden_size: head 64 vs target 32"):
        load_head(tmp_path, wider, strict_fingerprint=False)


def test_missing_config_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="head_config.json"):
        load_head(tmp_path)


def _saved(tmp_path, target):
    config = EagleConfig.from_target(target)
    save_head(tmp_path, EagleHead(config), config)
    return tmp_path


def test_non_finite_weights_are_refused_on_save_and_load(tmp_path, target):
    from safetensors.torch import load_file, save_file

    from heads.io import HeadFileError

    config = EagleConfig.from_target(target)
    head = EagleHead(config)
    with torch.no_grad():
        head.fc.weight[0, 0] = float("nan")
    with pytest.raises(HeadFileError, match=r"not written, the head holds NaN or infinite weights in \['fc.weight'\]"):
        save_head(tmp_path / "nan", head, config)
    assert not (tmp_path / "nan").exists()
    folder = _saved(tmp_path / "ok", target)
    state = load_file(str(folder / "model.safetensors"))
    state["fc.weight"][1, 2] = float("inf")
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(HeadFileError, match=r"ok/model.safetensors: NaN or infinite values in \['fc.weight'\]"):
        load_head(folder, target)


def test_damaged_files_are_named(tmp_path, target):
    from heads.io import HeadFileError

    folder = _saved(tmp_path, target)
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(HeadFileError, match=r"model.safetensors: not a readable safetensors file"):
        load_head(folder, target)
    weights.write_bytes(good)
    (folder / "head_config.json").write_text('{"type": "eagle", "config": {')
    with pytest.raises(HeadFileError, match=r"head_config.json: not valid JSON"):
        load_head(folder, target)
    (folder / "head_config.json").write_text("[1, 2]")
    with pytest.raises(HeadFileError, match=r"head_config.json: a JSON list, expected an object"):
        load_head(folder, target)
    (folder / "head_config.json").write_text('{"type": "eagle", "config": {"no_such_field": 1}}')
    with pytest.raises(HeadFileError, match=r"head_config.json: .*no_such_field"):
        load_head(folder, target)
