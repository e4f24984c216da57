"""The speculators DFlash layout: keys and config.json as FORMATS.md lists them, and a round trip
through export.load_export that gives the head's outputs back."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from export import export_all, export_head, load_export, resolve_formats
from heads.dflash import DflashConfig, DflashHead, set_draft_vocab
from tests.export.conftest import make_target3, randomize


def make_dflash(target, **options):
    config = DflashConfig.from_target(target, **{"num_layers": 2, "block_size": 4, **options})
    head = randomize(DflashHead(config), 4)
    if config.own_vocab:  # every other id, from 1
        set_draft_vocab(head, torch.arange(1, 2 * config.draft_vocab_size, 2))
    return head, config


def _out(head, target):
    torch.manual_seed(3)
    ids = torch.randint(0, target.vocab_size, (1, 9))
    hidden = target.features(ids, layers=head.config.aux_layer_ids).hidden
    aux = torch.cat([hidden[i] for i in head.config.aux_layer_ids], -1)[:, :5]
    with torch.no_grad():
        kv = head.context_kv(head.project(aux), torch.arange(5)[None])
        block = target.embed_tokens(torch.tensor([[int(ids[0, 5]), 0, 0, 0]]))
        return head.logits(head(block, torch.arange(5, 9)[None], kv), target.lm_head.weight)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip(tmp_path, target3, dtype):
    head, config = make_dflash(target3)
    folder = export_head(head, config, "speculators_dflash", tmp_path / "out", target3, dtype=dtype)
    loaded, loaded_config, manifest = load_export(folder, target3)
    assert loaded_config == config and manifest["format"] == "speculators_dflash"
    want, got = _out(head, target3), _out(loaded, target3)
    if dtype == "float32":
        assert torch.equal(got, want)
    else:
        assert (got - want).abs().max() <= 5e-2 * want.abs().max()


def test_keys_and_config_follow_the_speculators_layout(tmp_path, target3):
    head, config = make_dflash(target3)
    folder = export_head(head, config, "speculators_dflash", tmp_path / "out", target3, dtype="float32")
    tensors = load_file(folder / "model.safetensors")
    assert "embed_tokens.weight" not in tensors and "lm_head.weight" not in tensors and "d2t" not in tensors
    H, hd = config.hidden_size, config.head_dim
    assert tensors["fc.weight"].shape == (H, 3 * H)
    assert tensors["layers.1.self_attn.q_norm.weight"].shape == (hd,)
    assert tensors["layers.1.self_attn.k_proj.weight"].shape == (config.num_key_value_heads * hd, H)
    assert {"hidden_norm.weight", "norm.weight", "layers.0.input_layernorm.weight"} <= set(tensors)
    values = json.loads((folder / "config.json").read_text())
    assert values["architectures"] == ["DFlashSpeculator"] and values["speculators_model_type"] == "dflash"
    assert values["aux_hidden_state_layer_ids"] == [2, 3, 4]  # [2, L//2, L-3] for 7 layers, entering-layer ids
    assert (values["block_size"], values["mask_token_id"]) == (4, 0)
    assert values["sample_from_anchor"] is False and values["sliding_window_non_causal"] is True
    assert values["draft_vocab_size"] == config.vocab_size
    layer = values["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["head_dim"] == hd
    assert layer["layer_types"] == ["full_attention", "full_attention"]
    method = values["speculators_config"]["proposal_methods"][0]
    assert values["speculators_config"]["algorithm"] == "dflash" and method["speculative_tokens"] == 3
    manifest = json.loads((folder / "specheads.json").read_text())
    assert manifest["runtime"]["vllm"]["num_speculative_tokens"] == 3
    assert manifest["feature_layer"]["layer_ids"]["config.json:aux_hidden_state_layer_ids"]["values"] == [2, 3, 4]


def test_engine_formats_of_a_dflash_head_and_a_native_export(tmp_path, target3):
    assert resolve_formats(["engine"], "dflash") == ["speculators_dflash"]
    head, config = make_dflash(target3)
    folders = export_all(head, config, ["native", "engine"], tmp_path, target3, dtype="float32")
    assert sorted(folders) == ["native", "speculators_dflash"]
    for folder in folders.values():
        loaded, _, _ = load_export(folder, target3)
        assert torch.equal(_out(loaded, target3), _out(head, target3))


def test_a_draft_vocabulary_travels_as_lm_head_rows_and_d2t(tmp_path, target3):
    head, config = make_dflash(target3, draft_vocab_size=24)
    folder = export_head(head, config, "speculators_dflash", tmp_path / "out", target3, dtype="float32")
    tensors = load_file(folder / "model.safetensors")
    assert tensors["lm_head.weight"].shape == (24, config.hidden_size) and "embed_tokens.weight" not in tensors
    assert torch.equal(torch.arange(24) + tensors["d2t"], torch.arange(1, 48, 2))  # draft id i -> target id
    assert int(tensors["t2d"].sum()) == 24 and bool(tensors["t2d"][1]) and not bool(tensors["t2d"][0])
    assert json.loads((folder / "config.json").read_text())["draft_vocab_size"] == 24
    loaded, loaded_config, _ = load_export(folder, target3)
    assert loaded_config == config and torch.equal(loaded.draft_ids(), head.draft_ids())
    assert _out(head, target3).shape[-1] == 24 and torch.equal(_out(loaded, target3), _out(head, target3))
