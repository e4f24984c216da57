"""Each engine layout against the key/shape tables and config fields of ../shared/FORMATS.md.

The tables below are copied from FORMATS.md as data (symbols, not our code's numbers), then
evaluated for the tiny target's sizes."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from export import ExportError, export_head
from heads.recommended import RecommendedRuntime
from tests.export.conftest import SIZES, make_eagle, make_medusa, make_target

# FORMATS.md "EAGLE-1/2": key -> shape in symbols. fc.bias only with `bias: true`.
EAGLE_TABLE = {
    "embed_tokens.weight": ("V", "H"),
    "fc.weight": ("H", "2H"),
    "layers.0.self_attn.q_proj.weight": ("nH*hd", "H"),
    "layers.0.self_attn.k_proj.weight": ("nKV*hd", "H"),
    "layers.0.self_attn.v_proj.weight": ("nKV*hd", "H"),
    "layers.0.self_attn.o_proj.weight": ("H", "nH*hd"),
    "layers.0.mlp.gate_proj.weight": ("I", "H"),
    "layers.0.mlp.up_proj.weight": ("I", "H"),
    "layers.0.mlp.down_proj.weight": ("H", "I"),
    "layers.0.post_attention_layernorm.weight": ("H",),
}
EAGLE_FC_BIAS = {"fc.bias": ("H",)}
EAGLE_ABSENT = ("layers.0.input_layernorm.weight", "norm.weight", "lm_head.weight")
# FORMATS.md config.json field list for EAGLE-1/2 drafts.
EAGLE_CONFIG_FIELDS = ("architectures", "hidden_size", "intermediate_size", "num_attention_heads",
                       "num_key_value_heads", "num_hidden_layers", "vocab_size", "rope_theta", "rms_norm_eps",
                       "max_position_embeddings", "torch_dtype")
# FORMATS.md "Medusa": h in [0, K), l in [0, L).
MEDUSA_TABLE = {"{h}.{l}.linear.weight": ("H", "H"), "{h}.{l}.linear.bias": ("H",), "{h}.{L}.weight": ("V", "H")}
MEDUSA_CONFIG_FIELDS = ("medusa_num_heads", "medusa_num_layers", "base_model_name_or_path", "hidden_size", "vocab_size")
# FORMATS.md "Medusa", vLLM layout and MedusaConfig keys.
MEDUSA_VLLM_TABLE = {"blocks.{h}.layers.{l}.weight": ("H", "H"), "blocks.{h}.layers.{l}.bias": ("H",),
                     "lm_heads.{h}.weight": ("V", "H")}
MEDUSA_VLLM_CONFIG_FIELDS = ("model_type", "hidden_size", "vocab_size", "num_heads", "num_hidden_layers",
                             "medusa_fc_bias", "truncated_vocab_size")

H, I, V, nH, nKV, hd = (SIZES[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
                                           "num_key_value_heads", "head_dim"))
SYMBOLS = {"H": H, "2H": 2 * H, "I": I, "V": V, "nH*hd": nH * hd, "nKV*hd": nKV * hd}


def _shapes(table: dict) -> dict:
    return {key: tuple(SYMBOLS[s] for s in shape) for key, shape in table.items()}


def _read(folder, file):
    with safe_open(str(folder / file), "pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    return tensors, json.loads((folder / "config.json").read_text())


def test_sizes_are_distinct():
    assert len(set(SYMBOLS.values())) == len(SYMBOLS)


@pytest.mark.parametrize("fmt, fc_bias", [("eagle", False), ("eagle", True), ("eagle_vllm", False)])
def test_eagle_keys_shapes_and_config(tmp_path, target, fmt, fc_bias):
    head, config = make_eagle(target, fc_bias=fc_bias)
    folder = export_head(head, config, fmt, tmp_path / "out", target)
    tensors, cfg = _read(folder, "model.safetensors")
    expected = _shapes(EAGLE_TABLE)
    has_bias = fmt == "eagle"  # SGLang's fc always has a bias: the SGLang layout always ships one
    if has_bias:
        expected.update(_shapes(EAGLE_FC_BIAS))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert not set(EAGLE_ABSENT) & set(tensors)
    assert all(v.dtype == torch.bfloat16 for v in tensors.values())  # the default dtype
    for field in EAGLE_CONFIG_FIELDS:
        assert field in cfg, field
    assert cfg["num_hidden_layers"] == 1
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]) == (H, I, V)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (nH, nKV)
    assert cfg["rope_theta"] == target.config.rope_parameters["rope_theta"]
    assert cfg["rms_norm_eps"] == target.config.rms_norm_eps
    assert cfg["max_position_embeddings"] == target.config.max_position_embeddings
    assert cfg["torch_dtype"] == "bfloat16"
    # `bias` consistent with fc (a missing `bias` means true to the EAGLE loader).
    assert cfg.get("bias", True) is ("fc.bias" in tensors)
    if fmt == "eagle":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle"]  # SGLang's class
        if not fc_bias:
            assert not torch.count_nonzero(tensors["fc.bias"])
        else:
            torch.testing.assert_close(tensors["fc.bias"], head.fc.bias.detach().to(torch.bfloat16))
    else:
        assert cfg["architectures"] == ["LlamaForCausalLM"]  # vLLM renames it to EagleLlamaForCausalLM
    # The embedding is the target's, the rest the head's.
    assert torch.equal(tensors["embed_tokens.weight"], target.embed_tokens.weight.to(torch.bfloat16))
    assert torch.equal(tensors["fc.weight"], head.fc.weight.detach().to(torch.bfloat16))


def test_eagle_qkv_bias_and_qk_norm_keys(tmp_path, target):
    head, config = make_eagle(target, qkv_bias=True, qk_norm=True)
    tensors, _ = _read(export_head(head, config, "eagle", tmp_path / "out", target), "model.safetensors")
    attn = "layers.0.self_attn"
    assert tuple(tensors[f"{attn}.q_proj.bias"].shape) == (nH * hd,)
    assert tuple(tensors[f"{attn}.k_proj.bias"].shape) == (nKV * hd,)
    assert tuple(tensors[f"{attn}.v_proj.bias"].shape) == (nKV * hd,)
    assert tuple(tensors[f"{attn}.q_norm.weight"].shape) == (hd,)
    assert f"{attn}.o_proj.bias" not in tensors


@pytest.mark.parametrize("option", ["fc_bias", "qkv_bias", "qk_norm"])
def test_vllm_layout_refuses_what_vllm_cannot_load(tmp_path, target, option):
    head, config = make_eagle(target, **{option: True})
    with pytest.raises(ExportError, match=option):
        export_head(head, config, "eagle_vllm", tmp_path / "out", target)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("share_lm_head", [False, True])
def test_medusa_keys_shapes_and_config(tmp_path, target, share_lm_head):
    head, config = make_medusa(target, share_lm_head=share_lm_head)
    K, L = config.num_heads, config.num_layers
    choices = [[0], [1], [0, 0], [0, 0, 0]]
    folder = export_head(head, config, "medusa", tmp_path / "out", target, dtype="float16",
                         manifest_extra={"runtime": RecommendedRuntime(medusa_choices=choices)})
    assert not (folder / "medusa_lm_head.pt").exists()
    tensors, cfg = _read(folder, "medusa_lm_head.safetensors")
    expected = {}
    for h in range(K):
        for layer in range(L):
            for key, shape in _shapes(MEDUSA_TABLE).items():
                if "{l}" in key:
                    expected[key.format(h=h, l=layer)] = shape
        expected["{h}.{L}.weight".format(h=h, L=L)] = _shapes(MEDUSA_TABLE)["{h}.{L}.weight"]
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert all(v.dtype == torch.float16 for v in tensors.values())
    for field in MEDUSA_CONFIG_FIELDS:
        assert field in cfg, field
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (K, L, H, V)
    assert cfg["base_model_name_or_path"] == target.name
    assert cfg["medusa_choices"] == choices
    # L independent blocks: layer 0 and layer 1 of a head hold different weights.
    assert not torch.equal(tensors["0.0.linear.weight"], tensors["0.1.linear.weight"])
    lm_head = target.lm_head.weight.to(torch.float16)
    for h in range(K):
        own = lm_head if share_lm_head else head.lm_head_weight(h).detach().to(torch.float16)
        assert torch.equal(tensors[f"{h}.{L}.weight"], own)


@pytest.mark.parametrize("share_lm_head", [False, True])
def test_medusa_vllm_keys_shapes_and_config(tmp_path, target, share_lm_head):
    head, config = make_medusa(target, share_lm_head=share_lm_head)
    K, L = config.num_heads, config.num_layers
    folder = export_head(head, config, "medusa_vllm", tmp_path / "out", target, dtype="float16")
    tensors, cfg = _read(folder, "model.safetensors")
    expected = {}
    for h in range(K):
        for key, shape in _shapes(MEDUSA_VLLM_TABLE).items():
            for layer in range(L) if "{l}" in key else (None,):
                expected[key.format(h=h, l=layer)] = shape
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert all(v.dtype == torch.float16 for v in tensors.values())
    for field in MEDUSA_VLLM_CONFIG_FIELDS:
        assert field in cfg, field
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (K, L, H, V)
    assert cfg["truncated_vocab_size"] == V and cfg["medusa_fc_bias"] is True  # our ResBlocks have a bias
    # vLLM renames every key holding "num" and "heads"/"layers": no other such key may be present.
    assert [k for k in cfg if "num" in k and ("heads" in k or "layers" in k)] == ["num_heads", "num_hidden_layers"]
    assert "medusa_choices" not in cfg  # vLLM drafts top-1 chains
    for h in range(K):
        for layer in range(L):
            block = head.head(h)[layer].linear
            assert torch.equal(tensors[f"blocks.{h}.layers.{layer}.weight"], block.weight.detach().half())
            assert torch.equal(tensors[f"blocks.{h}.layers.{layer}.bias"], block.bias.detach().half())
        own = target.lm_head.weight if share_lm_head else head.lm_head_weight(h).detach()
        assert torch.equal(tensors[f"lm_heads.{h}.weight"], own.half())


def test_tied_target_embeddings_export(tmp_path):
    """A target with tied embedding/lm_head (SmolLM2 ties them): every copy is its own tensor."""
    target = make_target(tie_word_embeddings=True)
    assert target.embed_tokens.weight.data_ptr() == target.lm_head.weight.data_ptr()
    head, config = make_medusa(target, share_lm_head=True)
    folder = export_head(head, config, "medusa", tmp_path / "medusa", target, dtype="float32")
    tensors, _ = _read(folder, "medusa_lm_head.safetensors")
    assert torch.equal(tensors["0.2.weight"], target.lm_head.weight)
    eagle, eagle_config = make_eagle(target)
    folder = export_head(eagle, eagle_config, "eagle", tmp_path / "eagle", target, dtype="float32")
    assert torch.equal(_read(folder, "model.safetensors")[0]["embed_tokens.weight"], target.embed_tokens.weight)


def test_native_layout_is_a_head_checkpoint(tmp_path, target):
    from heads.io import load_head

    head, config = make_eagle(target)
    folder = export_head(head, config, "native", tmp_path / "out", target, dtype="float32")
    loaded, loaded_config, meta = load_head(folder, target)
    assert loaded_config == config and meta["type"] == "eagle"
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
