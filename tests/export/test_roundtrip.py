"""Export -> load back gives the checkpoint's outputs: exact in float32, within the dtype's
tolerance otherwise; the manifest and model card carry what serving teams need."""
from __future__ import annotations

import json

import pytest
import torch

from export import ExportError, export_all, export_head, load_export, resolve_formats
from heads.io import HeadMismatchError
from heads.recommended import RecommendedRuntime
from tests.export.conftest import make_eagle, make_medusa, make_target

TOLERANCE = {"float32": 0.0, "bfloat16": 5e-2, "float16": 5e-3}  # relative to the output's scale


def _eagle_out(head, target):
    torch.manual_seed(3)
    ids = torch.randint(0, target.vocab_size, (2, 6))
    features = target.features(ids).hidden[target.num_layers]
    embeds = target.embed_tokens(ids.roll(-1, dims=1))
    positions = torch.arange(6)[None].expand(2, 6)
    with torch.no_grad():
        return head(embeds, features, positions)[0]


def _medusa_out(head, target):
    torch.manual_seed(3)
    features = target.features(torch.randint(0, target.vocab_size, (2, 6))).hidden[target.num_layers]
    with torch.no_grad():
        return head.logits(features, target.lm_head.weight)


def _assert_close(got, want, dtype):
    if dtype == "float32":
        assert torch.equal(got, want)
    else:
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() <= TOLERANCE[dtype] * scale
        assert not torch.equal(got, want)  # the cast happened


@pytest.mark.parametrize("fmt", ["native", "eagle", "eagle_vllm"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_eagle_round_trip(tmp_path, target, fmt, dtype):
    head, config = make_eagle(target)
    folder = export_head(head, config, fmt, tmp_path / fmt, target, dtype=dtype)
    loaded, loaded_config, manifest = load_export(folder, target)
    assert loaded_config == config and manifest["format"] == fmt
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    _assert_close(_eagle_out(loaded, target), _eagle_out(head, target), dtype)


def test_eagle_round_trip_with_fc_bias(tmp_path, target):
    head, config = make_eagle(target, fc_bias=True, qkv_bias=True)
    loaded, _, _ = load_export(export_head(head, config, "eagle", tmp_path / "e", target, dtype="float32"), target)
    assert torch.equal(_eagle_out(loaded, target), _eagle_out(head, target))


@pytest.mark.parametrize("fmt", ["native", "medusa", "medusa_vllm"])
@pytest.mark.parametrize("share_lm_head", [False, True])
def test_medusa_round_trip(tmp_path, target, fmt, share_lm_head):
    head, config = make_medusa(target, share_lm_head=share_lm_head)
    folder = export_head(head, config, fmt, tmp_path / fmt, target, dtype="float32")
    loaded, loaded_config, _ = load_export(folder, target)
    assert loaded_config == config  # share_lm_head survives: the lm_head copies are dropped again
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in head.parameters())
    assert torch.equal(_medusa_out(loaded, target), _medusa_out(head, target))


def test_medusa_round_trip_bfloat16(tmp_path, target):
    head, config = make_medusa(target)
    loaded, _, _ = load_export(export_head(head, config, "medusa", tmp_path / "m", target), target)
    _assert_close(_medusa_out(loaded, target), _medusa_out(head, target), "bfloat16")


def test_load_export_refuses_another_target(tmp_path, target):
    head, config = make_eagle(target)
    folder = export_head(head, config, "eagle", tmp_path / "e", target)
    with pytest.raises(HeadMismatchError, match="embed_digest"):
        load_export(folder, make_target(seed=1))


def test_export_refuses_a_head_of_another_target(tmp_path, target):
    head, config = make_eagle(target)
    with pytest.raises(HeadMismatchError, match="target_fingerprint"):
        export_head(head, config, "eagle", tmp_path / "e", make_target(seed=1))
    assert not (tmp_path / "e").exists()


def test_manifest_and_model_card(tmp_path, target):
    head, config = make_eagle(target)
    extra = {"runtime": RecommendedRuntime(top_k=4, depth=3, total_tokens=12, chain_depth=3),
             "training": {"steps": 200, "tokens": 123456, "eval_top1": [0.61, 0.42]},
             "eval": {"tau": 2.4, "speedup": 1.7, "hardware": "2-core CPU"}, "base_model_id": "org/tiny-base"}
    folder = export_head(head, config, "eagle", tmp_path / "e", target, manifest_extra=extra)
    manifest = json.loads((folder / "specheads.json").read_text())
    assert (manifest["format"], manifest["format_version"], manifest["head_type"]) == ("eagle", 1, "eagle")
    assert manifest["base_model"]["fingerprint"] == target.fingerprint()
    assert manifest["base_model"]["hub_id"] == "org/tiny-base"
    assert manifest["head_config"] == config.to_dict()
    assert manifest["feature_layer"]["hidden_states_index"] == target.num_layers
    assert manifest["runtime"]["source"] == "measured"
    assert manifest["runtime"]["sglang"] == {"speculative_num_steps": 3, "speculative_eagle_topk": 4,
                                             "speculative_num_draft_tokens": 12}
    assert manifest["runtime"]["vllm"] == {"num_speculative_tokens": 3}
    assert manifest["training"] == extra["training"] and manifest["eval"] == extra["eval"]
    assert set(manifest["files"]) == {"model.safetensors", "config.json"}
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nbase_model: org/tiny-base\n")
    assert "--speculative-algorithm EAGLE" in card and "--speculative-num-draft-tokens 12" in card
    assert "| tau | 2.4 |" in card


def test_a_native_exports_model_card_names_each_tag_once(tmp_path, target):
    head, config = make_eagle(target)
    card = (export_head(head, config, "native", tmp_path / "n", target) / "README.md").read_text()
    tags = card.split("tags: [", 1)[1].split("]", 1)[0].split(", ")
    assert "specheads" in tags and len(tags) == len(set(tags))


def test_medusa_manifest_defaults_to_a_valid_tree(tmp_path, target):
    head, config = make_medusa(target)
    folder = export_head(head, config, "medusa", tmp_path / "m", target)
    manifest = json.loads((folder / "specheads.json").read_text())
    choices = manifest["runtime"]["medusa_choices"]
    assert manifest["runtime"]["source"] == "default (not measured)"
    assert max(len(path) for path in choices) == config.num_heads
    assert all(path[:-1] in choices for path in choices if len(path) > 1)
    assert json.loads((folder / "config.json").read_text())["medusa_choices"] == choices


def test_export_all_resolves_engine_and_keeps_native_full_precision(tmp_path, target):
    head, config = make_eagle(target)
    paths = export_all(head, config, ["native", "engine"], tmp_path / "export", target)
    assert set(paths) == {"native", "eagle", "eagle_vllm"}
    assert json.loads((paths["native"] / "specheads.json").read_text())["dtype"] == "float32"
    assert json.loads((paths["eagle"] / "specheads.json").read_text())["dtype"] == "bfloat16"


def test_resolve_formats_checks_the_head_type():
    assert resolve_formats(["engine", "native"], "medusa") == ["medusa", "medusa_vllm", "native"]
    with pytest.raises(ExportError, match="'medusa' exports medusa heads"):
        resolve_formats(["medusa"], "eagle")
    with pytest.raises(ExportError, match="'onnx'"):
        resolve_formats(["onnx"], "eagle")


def test_bad_dtype_is_refused(tmp_path, target):
    head, config = make_eagle(target)
    with pytest.raises(ExportError, match="dtype='int8'"):
        export_head(head, config, "eagle", tmp_path / "e", target, dtype="int8")
