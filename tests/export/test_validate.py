"""validate_export: every broken field is reported by name."""
from __future__ import annotations

import pytest
import torch

from export import export_head, validate_export
from tests.export.conftest import make_eagle, make_medusa, make_target
from tests.helpers import tamper_json, tamper_weights, validation_problems


@pytest.fixture
def eagle_export(tmp_path, target):
    head, config = make_eagle(target)
    return export_head(head, config, "eagle", tmp_path / "eagle", target)


def test_valid_export_passes_with_its_base(eagle_export, target):
    summary = validate_export(eagle_export, target)
    assert summary["format"] == "eagle" and summary["base_checked"]


def test_wrong_shape_names_the_key(eagle_export):
    def change(t):
        t["layers.0.mlp.up_proj.weight"] = t["layers.0.mlp.up_proj.weight"][:-1].clone()
    tamper_weights(eagle_export, "model.safetensors", change)
    assert "'layers.0.mlp.up_proj.weight' has shape [79, 48], expected [80, 48]" in validation_problems(eagle_export)


def test_missing_and_unexpected_keys_are_named(eagle_export):
    def change(t):
        t["norm.weight"] = t.pop("layers.0.post_attention_layernorm.weight")
    tamper_weights(eagle_export, "model.safetensors", change)
    problems = validation_problems(eagle_export)
    assert "missing key 'layers.0.post_attention_layernorm.weight'" in problems
    assert "unexpected key 'norm.weight'" in problems


def test_wrong_dtype_is_named(eagle_export):
    def change(t):
        t["fc.weight"] = t["fc.weight"].float()
    tamper_weights(eagle_export, "model.safetensors", change)
    assert "'fc.weight' has dtype float32, expected bfloat16" in validation_problems(eagle_export)


def test_wrong_fingerprint_names_the_field(eagle_export):
    problems = validation_problems(eagle_export, make_target(seed=1))
    assert "base_model.fingerprint.embed_digest" in problems
    assert "embed_tokens.weight' differs from the base model's embedding" in problems


def test_config_field_mismatch_is_named(eagle_export):
    tamper_json(eagle_export, "config.json", lambda c: c.update(hidden_size=64, bias=True))
    problems = validation_problems(eagle_export)
    assert "config.json.hidden_size: 64, expected 48" in problems
    assert "config.json.bias" in problems


def test_vllm_layout_needs_bias_false_and_llama_architecture(tmp_path, target):
    head, config = make_eagle(target)
    folder = export_head(head, config, "eagle_vllm", tmp_path / "v", target)
    tamper_json(folder, "config.json", lambda c: c.update(architectures=["LlamaForCausalLMEagle"], bias=None))
    problems = validation_problems(folder)
    assert "config.json.architectures" in problems and "config.json.bias" in problems


def test_nonzero_fc_bias_on_a_bias_free_head_is_refused(eagle_export):
    tamper_weights(eagle_export, "model.safetensors", lambda t: t["fc.bias"].fill_(0.5))
    assert "fc.bias: non-zero values, but head_config.fc_bias is false" in validation_problems(eagle_export)


def test_changed_file_fails_its_hash(eagle_export):
    (eagle_export / "config.json").write_text("{}")
    assert "config.json: sha256 differs" in validation_problems(eagle_export)


def test_missing_manifest_is_not_an_export(eagle_export):
    (eagle_export / "specheads.json").unlink()
    assert "specheads.json: missing" in validation_problems(eagle_export)


def test_missing_weights_file_is_named(eagle_export):
    (eagle_export / "model.safetensors").unlink()
    assert "model.safetensors: missing" in validation_problems(eagle_export)


def test_bad_medusa_tree_is_named(tmp_path, target):
    head, config = make_medusa(target)
    folder = export_head(head, config, "medusa", tmp_path / "m", target)
    tamper_json(folder, "config.json", lambda c: c.update(medusa_choices=[[0], [1, 0, 0]]))
    problems = validation_problems(folder)
    assert "config.json.medusa_choices: paths whose prefix is missing: [[1, 0, 0]]" in problems


def test_medusa_shared_lm_head_copies_are_checked_against_the_base(tmp_path, target):
    head, config = make_medusa(target, share_lm_head=True)
    folder = export_head(head, config, "medusa", tmp_path / "m", target)

    def change(t):
        t["1.2.weight"] = torch.zeros_like(t["1.2.weight"])
    tamper_weights(folder, "medusa_lm_head.safetensors", change)
    assert "'1.2.weight' differs from the base model's lm_head" in validation_problems(folder, target)


def test_native_config_mismatch_is_named(tmp_path, target):
    head, config = make_eagle(target)
    folder = export_head(head, config, "native", tmp_path / "n", target)
    tamper_json(folder, "head_config.json", lambda c: c["config"].update(rope_theta=1.0))
    assert "head_config.json.config.rope_theta" in validation_problems(folder)
