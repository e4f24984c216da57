"""P-EAGLE's `speculators_peagle` export against FORMATS.md "P-EAGLE" and the minimal SmolLM2
config.json there; round trip back to a PeagleHead through export.load_export."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from export import (ENGINE_FORMATS, ExportError, export_all, export_head, get_format, load_export, resolve_formats,
                    validate_export)
from export.manifest import serve_command
from heads.peagle import PeagleConfig, PeagleHead
from heads.vocab import set_draft_vocab
from tests.export.conftest import SIZES, make_target3, randomize

H, V = SIZES["hidden_size"], SIZES["vocab_size"]


@pytest.fixture
def target3():
    return make_target3()


def _head(target, draft_vocab_size=40, **options):
    config = PeagleConfig.from_target(target, draft_vocab_size=draft_vocab_size, mask_token_id=3,
                                      speculative_tokens=5, norm_before_residual=True, **options)
    head = randomize(PeagleHead(config), 4)
    if draft_vocab_size < V:
        set_draft_vocab(head, torch.randperm(V, generator=torch.Generator().manual_seed(4))[:draft_vocab_size].sort().values)
    return head, config


def _read(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    return tensors, json.loads((folder / "config.json").read_text())


def test_config_is_the_formats_minimal_peagle_config(tmp_path, target3):
    head, config = _head(target3)
    _, cfg = _read(export_head(head, config, "speculators_peagle", tmp_path / "p", target3, dtype="float32"))
    # FORMATS.md's minimal SmolLM2 peagle config, with our choices: the frozen embedding, K = 5.
    assert cfg["architectures"] == ["PEagleSpeculator"] and cfg["speculators_model_type"] == "peagle"
    assert cfg["mask_token_id"] == 3 and cfg["embed_requires_grad"] is False
    assert {key: cfg[key] for key in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")} == \
        {"norm_before_fc": False, "fc_norm": False, "norm_before_residual": True, "norm_output": False}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4] and cfg["draft_vocab_size"] == 40
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "peagle" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1,
                                         "accept_tolerance": 0.0}]
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["head_dim"] == 16


def test_weights_are_the_eagle3_set_plus_mask_hidden(tmp_path, target3):
    head, config = _head(target3)
    eagle3, _ = _read(export_head(*_eagle3(target3), "speculators", tmp_path / "e", target3, dtype="float32"))
    tensors, _ = _read(export_head(head, config, "speculators_peagle", tmp_path / "p", target3, dtype="float32"))
    assert set(tensors) == set(eagle3) | {"mask_hidden"}
    assert tuple(tensors["mask_hidden"].shape) == (1, 1, 3 * H)
    torch.testing.assert_close(tensors["mask_hidden"], head.mask_hidden.detach())
    torch.testing.assert_close(tensors["embed_tokens.weight"], target3.embed_tokens.weight)
    torch.testing.assert_close(tensors["layers.0.self_attn.q_proj.weight"], head.midlayer.self_attn.q_proj.weight)


def _eagle3(target):
    from heads.eagle3 import Eagle3Config, Eagle3Head

    config = Eagle3Config.from_target(target, draft_vocab_size=40)
    return randomize(Eagle3Head(config), 4), config


@pytest.mark.parametrize("draft_vocab_size", [40, V])
def test_round_trip(tmp_path, target3, draft_vocab_size):
    head, config = _head(target3, draft_vocab_size)
    folder = export_head(head, config, "speculators_peagle", tmp_path / "p", target3, dtype="float32")
    validate_export(folder, target3)
    loaded, loaded_config, manifest = load_export(folder, target3)
    assert isinstance(loaded, PeagleHead) and loaded_config == config and manifest["format"] == "speculators_peagle"
    for key, value in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, msg=key)
    assert manifest["runtime"]["vllm"]["num_speculative_tokens"] == 5
    command = serve_command(manifest)
    assert '"parallel_drafting": true' in command and '"method": "eagle3"' in command


def test_engine_formats_and_refusals(tmp_path, target3):
    assert ENGINE_FORMATS["peagle"] == ("speculators_peagle",)
    assert resolve_formats(["engine"], "peagle") == ["speculators_peagle"]
    with pytest.raises(ExportError, match="exports peagle heads"):
        resolve_formats(["speculators_peagle"], "eagle3")
    with pytest.raises(ExportError, match="exports eagle3 heads"):
        resolve_formats(["speculators"], "peagle")
    head, config = _head(target3, norm_output=True)
    with pytest.raises(ExportError, match="does not read norm_output"):
        export_head(head, config, "speculators_peagle", tmp_path / "p", target3)
    head, config = _head(target3)
    written = export_all(head, config, ["native", "engine"], tmp_path / "all", target3)
    assert sorted(written) == ["native", "speculators_peagle"]


def test_config_check_names_a_wrong_mask_token_and_k(tmp_path, target3):
    head, config = _head(target3)
    folder = export_head(head, config, "speculators_peagle", tmp_path / "p", target3, dtype="float32")
    values = json.loads((folder / "config.json").read_text())
    assert get_format("speculators_peagle").check_config(values, config, "float32") == []
    values["mask_token_id"] = 7
    values["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 2
    values["speculators_config"]["algorithm"] = "eagle3"
    problems = get_format("speculators_peagle").check_config(values, config, "float32")
    assert len(problems) == 3, problems
    assert any("mask_token_id: 7, expected 3" in p for p in problems)
    assert any("speculative_tokens [2]" in p for p in problems)
    assert any("algorithm: 'eagle3', expected 'peagle'" in p for p in problems)
