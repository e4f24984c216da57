"""validate_export on EAGLE-3 and vLLM-Medusa folders: good ones pass with their base model, each
broken field is named (weights re-sealed in the manifest, so the schema check must catch it)."""
from __future__ import annotations

import pytest
import torch

from export import export_head, load_export, validate_export
from tests.export.conftest import make_eagle3, make_medusa, make_target3
from tests.helpers import tamper_json, tamper_weights, validation_problems


@pytest.fixture
def target3():
    return make_target3()


@pytest.fixture(params=["eagle3", "eagle3_vllm", "speculators"])
def export3(request, tmp_path, target3):
    head, config = make_eagle3(target3)
    return export_head(head, config, request.param, tmp_path / request.param, target3), request.param


def test_good_exports_pass_with_their_base(export3, target3):
    folder, fmt = export3
    summary = validate_export(folder, target3)
    assert summary["format"] == fmt and summary["base_checked"] and summary["head_type"] == "eagle3"


def test_other_base_is_refused(export3):
    assert "base_model.fingerprint" in validation_problems(export3[0], make_target3(seed=1))


def test_non_ascending_d2t_is_named(export3):
    folder, _ = export3

    def change(t):
        t["d2t"][[3, 4]] = t["d2t"][[4, 3]] + torch.tensor([1, -1])  # swaps target ids 3 and 4
    tamper_weights(folder, "model.safetensors", change)
    assert "not strictly ascending" in validation_problems(folder)


def test_t2d_that_disagrees_with_d2t_is_named(export3):
    folder, _ = export3

    def change(t):
        first = int(t["t2d"].nonzero()[0])
        t["t2d"][first] = False
    tamper_weights(folder, "model.safetensors", change)
    assert "t2d marks 39 target ids, not the 40 ids that d2t maps to" in validation_problems(folder)


def test_d2t_outside_the_vocabulary_is_named(export3):
    folder, _ = export3
    tamper_weights(folder, "model.safetensors", lambda t: t["d2t"].__setitem__(-1, 10_000))
    assert "outside the target vocabulary" in validation_problems(folder)


def test_d2t_of_the_wrong_dtype_is_named(export3):
    folder, _ = export3
    tamper_weights(folder, "model.safetensors", lambda t: t.__setitem__("d2t", t["d2t"].int()))
    assert "int64/bool" in validation_problems(folder)


def test_layer_named_for_another_loader_is_missing_and_unexpected(export3):
    folder, fmt = export3
    ours, theirs = ("layers.0.", "midlayer.") if fmt == "speculators" else ("midlayer.", "layers.0.")

    def change(t):
        t[theirs + "hidden_norm.weight"] = t.pop(ours + "hidden_norm.weight")
    tamper_weights(folder, "model.safetensors", change)
    problems = validation_problems(folder)
    assert f"missing key '{ours}hidden_norm.weight'" in problems
    assert f"unexpected key '{theirs}hidden_norm.weight'" in problems


@pytest.mark.parametrize("fmt, change, named", [
    # a file written in the other convention: ids off by one
    ("eagle3", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 3, 4]),
     "config.json.eagle_config.eagle_aux_hidden_state_layer_ids: [2, 3, 4], expected [1, 2, 3]"),
    ("eagle3", lambda c: c.update(tie_word_embeddings=True), "config.json.tie_word_embeddings: True, expected False"),
    ("eagle3", lambda c: c.update(architectures=["Eagle3LlamaForCausalLM"]), "config.json.architectures"),
    ("eagle3_vllm", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 3]),
     "config.json.eagle_aux_hidden_state_layer_ids: [1, 2, 3], expected [2, 3, 4]"),
    ("eagle3_vllm", lambda c: c.pop("norm_before_residual"),
     "config.json.norm_before_residual: '<missing>', expected False"),
    ("eagle3_vllm", lambda c: c.update(draft_vocab_size=112), "config.json.draft_vocab_size: 112, expected 40"),
    ("speculators", lambda c: c["transformer_layer_config"].pop("head_dim"),
     "config.json.transformer_layer_config.head_dim: '<missing>', expected 16"),
    ("speculators", lambda c: c.update(speculators_model_type="eagle"), "config.json.speculators_model_type"),
    ("speculators", lambda c: c["speculators_config"]["verifier"].update(name_or_path=None),
     "config.json.speculators_config.verifier.name_or_path"),
    ("speculators", lambda c: c["speculators_config"].update(proposal_methods=[]),
     "config.json.speculators_config.proposal_methods"),
    ("speculators", lambda c: c.update(norm_before_residual=1), "config.json.norm_before_residual: 1, expected False"),
    ("speculators", lambda c: c.update(norm_output=True), "config.json.norm_output: True, expected False"),
    ("speculators", lambda c: c.pop("fc_norm"), "config.json.fc_norm: '<missing>', expected False"),
    ("eagle3_vllm", lambda c: c.update(norm_before_fc=True), "config.json.norm_before_fc: True, expected False"),
])
def test_config_field_mismatch_is_named(tmp_path, target3, fmt, change, named):
    head, config = make_eagle3(target3)
    folder = export_head(head, config, fmt, tmp_path / fmt, target3)
    tamper_json(folder, "config.json", change)
    assert named in validation_problems(folder)


def test_medusa_vllm_good_and_broken(tmp_path):
    target = make_target3()
    head, config = make_medusa(target, share_lm_head=True)
    folder = export_head(head, config, "medusa_vllm", tmp_path / "m", target)
    assert validate_export(folder, target)["format"] == "medusa_vllm"

    def change(t):
        t["lm_heads.1.weight"] = torch.zeros_like(t["lm_heads.1.weight"])
    tamper_weights(folder, "model.safetensors", change)
    assert "'lm_heads.1.weight' differs from the base model's lm_head" in validation_problems(folder, target)
    tamper_json(folder, "config.json", lambda c: c.update(num_attention_heads=8, medusa_num_heads=3))
    problems = validation_problems(folder)
    assert "keys ['medusa_num_heads', 'num_attention_heads'] would overwrite num_heads" in problems


def test_load_export_refuses_a_broken_eagle3_folder(export3):
    folder, _ = export3
    tamper_weights(folder, "model.safetensors", lambda t: t["t2d"].fill_(True))
    with pytest.raises(ValueError, match="t2d marks"):
        load_export(folder)


@pytest.mark.parametrize("fmt", ["eagle3_vllm", "speculators"])
def test_eagle31_flag_off_in_the_file_is_named(tmp_path, target3, fmt):
    """A head with norm_before_fc and norm_output whose config.json says otherwise: the engines would
    skip its input norm and feed back the pre-norm state."""
    head, config = make_eagle3(target3, norm_before_fc=True, norm_output=True)
    folder = export_head(head, config, fmt, tmp_path / fmt, target3)
    tamper_json(folder, "config.json", lambda c: c.update(norm_before_fc=False, norm_output=False))
    problems = validation_problems(folder)
    assert "config.json.norm_before_fc: False, expected True" in problems
    assert "config.json.norm_output: False, expected True" in problems


def test_eagle3_vllm_folder_without_the_eagle31_flags_still_validates(tmp_path, target3):
    """Folders written before the flags existed: vLLM reads a missing one as false."""
    head, config = make_eagle3(target3)
    folder = export_head(head, config, "eagle3_vllm", tmp_path / "v", target3)
    tamper_json(folder, "config.json", lambda c: [c.pop(flag) for flag in ("norm_before_fc", "fc_norm", "norm_output")])
    assert validate_export(folder, target3)["format"] == "eagle3_vllm"
