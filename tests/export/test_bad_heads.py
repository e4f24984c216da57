"""Non-finite weights are never exported nor validated, and an export names one base model: its
head_config.target_fingerprint (what eval checks) and base_model.fingerprint (what `validate base=`
checks) must agree, and both are checked against a base."""
from __future__ import annotations

import json

import pytest
import torch

from export import ExportError, ExportValidationError, export_head, load_export, validate_export
from heads.io import HeadMismatchError
from tests.export.conftest import make_eagle, make_target
from tests.helpers import reseal, tamper_weights, validation_problems


def test_a_head_with_nan_is_not_exported(tmp_path, target):
    head, config = make_eagle(target)
    with torch.no_grad():
        head.fc.weight[3, 1] = float("nan")
    with pytest.raises(ExportError, match=r"NaN or infinite weights in \['fc.weight'\]"):
        export_head(head, config, "eagle", tmp_path / "out", target)
    assert list(tmp_path.iterdir()) == []


def test_weights_beyond_float16_are_refused_before_writing(tmp_path, target):
    head, config = make_eagle(target)
    with torch.no_grad():
        head.fc.weight[0, 0] = 1e6  # finite in float32 and bfloat16, infinite in float16
    with pytest.raises(ExportError, match=r"\['fc.weight'\] do not fit in float16"):
        export_head(head, config, "eagle", tmp_path / "out", target, dtype="float16")
    export_head(head, config, "eagle", tmp_path / "out", target, dtype="bfloat16")


def test_validate_names_non_finite_tensors(tmp_path, target):
    head, config = make_eagle(target)
    folder = export_head(head, config, "eagle", tmp_path / "out", target)

    def poison(tensors):
        tensors["fc.weight"][0, 0] = float("inf")
    tamper_weights(folder, "model.safetensors", poison)
    assert "model.safetensors: 'fc.weight' holds NaN or infinite values" in validation_problems(folder)
    with pytest.raises(ExportValidationError):
        load_export(folder, target)


def test_a_damaged_weights_file_is_named(tmp_path, target):
    head, config = make_eagle(target)
    folder = export_head(head, config, "eagle", tmp_path / "out", target)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    reseal(folder, "model.safetensors")  # the hash cannot help: the manifest was written for it
    assert "model.safetensors: not a readable safetensors file" in validation_problems(folder)


def _edit_manifest(folder, change):
    manifest = json.loads((folder / "specheads.json").read_text())
    change(manifest)
    (folder / "specheads.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("side", ["head_config", "base_model"])
def test_the_two_fingerprints_must_agree(tmp_path, target, side):
    head, config = make_eagle(target)
    folder = export_head(head, config, "eagle", tmp_path / "out", target)

    def edit(manifest):
        record = manifest["head_config"]["target_fingerprint"] if side == "head_config" else \
            manifest["base_model"]["fingerprint"]
        record["lm_head_digest"] = "0123456789abcdef"
    _edit_manifest(folder, edit)
    problems = validation_problems(folder)  # without a base: the manifest contradicts itself
    assert "head_config.target_fingerprint.lm_head_digest" in problems and "differs from base_model" in problems
    with pytest.raises(ExportValidationError, match="lm_head_digest"):
        load_export(folder, target)  # eval's route
    assert "lm_head_digest: export '0123456789abcdef' vs base" in validation_problems(folder, target)  # validate base=


def test_export_for_another_base_names_that_base_in_both_places(tmp_path, target):
    head, config = make_eagle(target)
    other = make_target(seed=1)
    with pytest.raises(HeadMismatchError):
        export_head(head, config, "eagle", tmp_path / "strict", other)
    folder = export_head(head, config, "eagle", tmp_path / "out", other, strict_fingerprint=False)
    manifest = json.loads((folder / "specheads.json").read_text())
    assert manifest["head_config"]["target_fingerprint"] == manifest["base_model"]["fingerprint"] == \
        other.fingerprint()
    assert any(f"fingerprint {target.fingerprint()['id']}" in note for note in manifest["notes"])
    validate_export(folder, other)
    load_export(folder, other)
