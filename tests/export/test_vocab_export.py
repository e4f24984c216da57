"""The draft vocabulary travels with every head: native checkpoints and every export layout hold
it, load_export gives it back, and a damaged list is refused naming the file."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from export import ExportValidationError, export_head, load_export, validate_export
from heads.io import HeadFileError, load_head, save_head
from heads.vocab import draft_ids, set_draft_vocab
from tests.export.conftest import make_eagle, make_eagle3, make_medusa, make_target3
from tests.helpers import reseal

IDS = torch.tensor([0, 3, 4, 9, 17, 40, 41, 77, 100, 111])


def _with_vocab(head):
    set_draft_vocab(head, IDS)
    return head, head.config


@pytest.mark.parametrize("make, formats", [(make_eagle, ["native", "eagle", "eagle_vllm"]),
                                           (make_medusa, ["native", "medusa", "medusa_vllm"])])
def test_every_layout_carries_the_id_list(tmp_path, target, make, formats):
    head, config = _with_vocab(make(target)[0])
    assert config.draft_vocab_size == len(IDS) and torch.equal(draft_ids(head), IDS)
    save_head(tmp_path / "checkpoint", head, config)
    loaded, loaded_config, _ = load_head(tmp_path / "checkpoint", target)
    assert loaded_config.draft_vocab_size == len(IDS) and torch.equal(draft_ids(loaded), IDS)
    for fmt in formats:
        folder = export_head(head, config, fmt, tmp_path / fmt, target, dtype="bfloat16")
        manifest = json.loads((folder / "specheads.json").read_text())
        assert manifest["draft_vocab"]["size"] == len(IDS)
        if fmt != "native":  # the engine's weight file keeps FORMATS.md's keys; the ids sit beside it
            assert "draft_vocab" not in load_file(str(folder / manifest["weights_file"]))
            assert manifest["draft_vocab"]["file"] == "draft_vocab.json"
            assert "draft_vocab.json" in manifest["files"]
            # vLLM loads every *.safetensors file of a draft folder as weights: only one may exist.
            assert [p.name for p in folder.glob("*.safetensors")] == [manifest["weights_file"]], fmt
        loaded, loaded_config, _ = load_export(folder, target)
        assert loaded_config == config, fmt
        assert torch.equal(draft_ids(loaded), IDS), fmt


def test_heads_without_a_list_have_none_and_write_no_sidecar(tmp_path, target):
    head, config = make_eagle(target)
    assert config.draft_vocab_size == 0 and draft_ids(head) is None
    folder = export_head(head, config, "eagle", tmp_path / "e", target, dtype="float32")
    assert not (folder / "draft_vocab.json").exists()
    assert "draft_vocab" not in json.loads((folder / "specheads.json").read_text())
    assert draft_ids(load_export(folder, target)[0]) is None


def test_an_older_checkpoint_without_the_field_loads_with_no_vocabulary(tmp_path, target):
    head, config = make_medusa(target)
    save_head(tmp_path / "old", head, config)
    meta_path = tmp_path / "old" / "head_config.json"
    meta = json.loads(meta_path.read_text())
    del meta["config"]["draft_vocab_size"]  # as written before heads stored a vocabulary
    meta_path.write_text(json.dumps(meta))
    loaded, loaded_config, _ = load_head(tmp_path / "old", target)
    assert loaded_config.draft_vocab_size == 0 and draft_ids(loaded) is None


def test_eagle3_reads_its_vocabulary_from_d2t(tmp_path):
    target = make_target3()
    head, config = make_eagle3(target, draft_vocab_size=40)
    ids = draft_ids(head)
    assert ids.shape == (40,) and bool((ids[1:] > ids[:-1]).all())
    assert torch.equal(draft_ids(load_export(export_head(head, config, "native", tmp_path / "n", target), target)[0]),
                       ids)
    full, _ = make_eagle3(target, draft_vocab_size=None)
    assert draft_ids(full) is None


def test_a_damaged_list_is_refused_naming_the_file(tmp_path, target):
    head, config = _with_vocab(make_eagle(target)[0])
    folder = export_head(head, config, "eagle", tmp_path / "e", target, dtype="float32")
    (folder / "draft_vocab.json").write_text(json.dumps({"draft_vocab": IDS.flip(0).tolist()}))
    reseal(folder, "draft_vocab.json")
    with pytest.raises(ExportValidationError, match=r"draft_vocab.json: draft_vocab: token ids must be strictly"):
        validate_export(folder)
    (folder / "draft_vocab.json").write_text(json.dumps({"draft_vocab": [1.5, 2]}))
    reseal(folder, "draft_vocab.json")
    with pytest.raises(ExportValidationError, match=r"draft_vocab.json: 'draft_vocab' must be a list of integer"):
        validate_export(folder)
    (folder / "draft_vocab.json").write_text("[1, 2")
    reseal(folder, "draft_vocab.json")
    with pytest.raises(ExportValidationError, match=r"draft_vocab.json: not valid JSON"):
        validate_export(folder)
    (folder / "draft_vocab.json").unlink()
    with pytest.raises(ExportValidationError, match=r"draft_vocab.json: missing"):
        load_export(folder, target)
    save_head(tmp_path / "native", head, config)
    weights = tmp_path / "native" / "model.safetensors"
    state = load_file(str(weights))
    state["draft_vocab"] = state["draft_vocab"] + 500
    save_file(state, str(weights))
    with pytest.raises(HeadFileError, match=r"model.safetensors: draft_vocab: token ids must .*\[0, 112\)"):
        load_head(tmp_path / "native", target)


def test_an_export_with_the_earlier_safetensors_sidecar_still_loads(tmp_path, target):
    head, config = _with_vocab(make_eagle(target)[0])
    folder = export_head(head, config, "eagle_vllm", tmp_path / "e", target, dtype="float32")
    (folder / "draft_vocab.json").unlink()
    save_file({"draft_vocab": IDS}, str(folder / "draft_vocab.safetensors"))
    manifest = json.loads((folder / "specheads.json").read_text())
    manifest["files"]["draft_vocab.safetensors"] = manifest["files"].pop("draft_vocab.json")
    manifest["draft_vocab"]["file"] = "draft_vocab.safetensors"
    (folder / "specheads.json").write_text(json.dumps(manifest))
    reseal(folder, "draft_vocab.safetensors")
    assert torch.equal(draft_ids(load_export(folder, target)[0]), IDS)


def test_set_draft_vocab_checks_the_ids(target):
    head, _ = make_eagle(target)
    with pytest.raises(ValueError, match="strictly ascending"):
        set_draft_vocab(head, torch.tensor([3, 2]))
    with pytest.raises(ValueError, match=r"\[0, 112\)"):
        set_draft_vocab(head, torch.tensor([3, 112]))
    head3, _ = make_eagle3(make_target3(), draft_vocab_size=40)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        set_draft_vocab(head3, IDS)  # an EAGLE-3 head's lm_head has exactly Vd rows
