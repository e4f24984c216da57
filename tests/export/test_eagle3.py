"""EAGLE-3 exports (eagle3, eagle3_vllm, speculators) against the key/shape tables, config fields
and layer-id conventions of ../shared/FORMATS.md; round trips back to an Eagle3Head.

The tables are copied from FORMATS.md as data (symbols), then evaluated for the tiny target's sizes."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from export import ExportError, export_all, export_head, load_export, resolve_formats
from export.eagle3 import to_entering_ids, to_output_ids
from heads.recommended import RecommendedRuntime
from tests.export.conftest import SIZES, make_eagle3, make_target3

# FORMATS.md "EAGLE-3", SafeAILab / SGLang / TensorRT-LLM layout. `L.` is `midlayer.` there and
# `layers.0.` in the speculators layout.
EAGLE3_TABLE = {
    "embed_tokens.weight": ("V", "H"),  # optional in FORMATS.md; the speculators library needs it
    "L.self_attn.q_proj.weight": ("nH*hd", "2H"),
    "L.self_attn.k_proj.weight": ("nKV*hd", "2H"),
    "L.self_attn.v_proj.weight": ("nKV*hd", "2H"),
    "L.self_attn.o_proj.weight": ("H", "nH*hd"),
    "L.mlp.gate_proj.weight": ("I", "H"),
    "L.mlp.up_proj.weight": ("I", "H"),
    "L.mlp.down_proj.weight": ("H", "I"),
    "L.input_layernorm.weight": ("H",),
    "L.hidden_norm.weight": ("H",),
    "L.post_attention_layernorm.weight": ("H",),
    "fc.weight": ("H", "n*Ht"),
    "norm.weight": ("H",),
    "lm_head.weight": ("Vd", "H"),
    "d2t": ("Vd",),
    "t2d": ("V",),
}
LAYER_PREFIX = {"eagle3": "midlayer.", "eagle3_vllm": "midlayer.", "speculators": "layers.0."}
FORMATS = tuple(LAYER_PREFIX)
VD = 40
H, I, V, nH, nKV, hd = (SIZES[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
                                           "num_key_value_heads", "head_dim"))
SYMBOLS = {"H": H, "2H": 2 * H, "I": I, "V": V, "Vd": VD, "n*Ht": 3 * H, "nH*hd": nH * hd, "nKV*hd": nKV * hd}


def _expected(fmt: str, maps: bool = True) -> dict:
    shapes = {key.replace("L.", LAYER_PREFIX[fmt], 1): tuple(SYMBOLS[s] for s in shape)
              for key, shape in EAGLE3_TABLE.items()}
    if not maps:
        del shapes["d2t"], shapes["t2d"]
    return shapes


def _read(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    return tensors, json.loads((folder / "config.json").read_text())


def _aux(target, ids, layers):
    hidden = target.features(ids, layers=layers).hidden
    return torch.cat([hidden[i] for i in layers], dim=-1)  # (B, T, n·Ht)


@torch.no_grad()
def _eagle3_logits(head, target, steps: int = 2):
    """Logits of `steps` draft steps (step k > 0 reads the previous step's output, normed under
    norm_output), causal."""
    torch.manual_seed(3)
    ids = torch.randint(0, target.vocab_size, (2, 6))
    hidden = head.project(_aux(target, ids, head.config.aux_layer_ids))
    embeds = target.embed_tokens(ids.roll(-1, dims=1))
    positions = torch.arange(6)[None].expand(2, 6)
    logits = []
    for k in range(steps):
        out = head(embeds, hidden, positions + k)[0]
        logits.append(head.logits(out))
        hidden = head.feedback(out)
    return torch.stack(logits)


def test_symbols_are_distinct():
    assert len(set(SYMBOLS.values())) == len(SYMBOLS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_keys_shapes_and_tensors(tmp_path, target3, fmt):
    head, config = make_eagle3(target3)
    folder = export_head(head, config, fmt, tmp_path / fmt, target3)
    tensors, _ = _read(folder)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == _expected(fmt)
    assert torch.equal(tensors.pop("embed_tokens.weight"), target3.embed_tokens.weight.to(torch.bfloat16))
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.bfloat16 for k, v in tensors.items() if k not in ("d2t", "t2d"))
    state = head.state_dict()
    for key, value in tensors.items():
        native = "midlayer." + key.removeprefix(LAYER_PREFIX[fmt]) if key.startswith(LAYER_PREFIX[fmt]) else key
        assert torch.equal(value, state[native].to(value.dtype)), key
    # d2t / t2d describe one ascending vocabulary: target id = i + d2t[i], t2d marks exactly those.
    ids = torch.arange(VD) + tensors["d2t"]
    assert bool((ids[1:] > ids[:-1]).all()) and torch.equal(tensors["t2d"].nonzero().flatten(), ids)


@pytest.mark.parametrize("fmt", FORMATS)
def test_full_vocabulary_leaves_the_maps_out(tmp_path, target3, fmt):
    head, config = make_eagle3(target3, draft_vocab_size=None)
    assert config.draft_vocab_size == V
    folder = export_head(head, config, fmt, tmp_path / fmt, target3, dtype="float32")
    tensors, cfg = _read(folder)
    expected = _expected(fmt, maps=False)
    expected["lm_head.weight"] = (V, H)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert cfg["draft_vocab_size"] == V
    loaded, _, _ = load_export(folder, target3)
    assert torch.equal(loaded.d2t, torch.zeros(V, dtype=torch.long)) and bool(loaded.t2d.all())
    assert torch.equal(_eagle3_logits(loaded, target3), _eagle3_logits(head, target3))


def test_sglang_config_fields(tmp_path, target3):
    head, config = make_eagle3(target3)
    _, cfg = _read(export_head(head, config, "eagle3", tmp_path / "e", target3))
    assert config.aux_layer_ids == [2, 3, 4]
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}
    assert "eagle_aux_hidden_state_layer_ids" not in cfg  # one convention per file
    assert cfg["tie_word_embeddings"] is False
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"], cfg["vocab_size"]) == (VD, H, V)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]) == (1, H, I, hd)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (nH, nKV)
    assert cfg["rope_theta"] == target3.config.rope_parameters["rope_theta"]
    assert cfg["rms_norm_eps"] == target3.config.rms_norm_eps and cfg["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_vllm_config_fields(tmp_path, target3, norm_before_residual):
    head, config = make_eagle3(target3, norm_before_residual=norm_before_residual)
    _, cfg = _read(export_head(head, config, "eagle3_vllm", tmp_path / "v", target3))
    assert cfg["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]  # entering-layer convention
    assert "eagle_config" not in cfg  # vLLM does not read the nested one
    assert cfg["norm_before_residual"] is norm_before_residual  # written even when false
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"], cfg["tie_word_embeddings"]) == (VD, H, False)


def test_speculators_config_fields(tmp_path, target3):
    head, config = make_eagle3(target3)
    folder = export_head(head, config, "speculators", tmp_path / "s", target3,
                         manifest_extra={"runtime": RecommendedRuntime(chain_depth=5), "base_model_id": "org/tiny-base"})
    _, cfg = _read(folder)
    # FORMATS.md "speculators format" field list.
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3DraftModel"]
    assert cfg["speculators_version"] == "0.9.0"
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (VD, H)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert cfg["norm_before_residual"] is False and cfg["tie_word_embeddings"] is False
    assert cfg["dtype"] == cfg["transformer_layer_config"]["dtype"] == "bfloat16"
    assert (cfg["norm_before_fc"], cfg["fc_norm"], cfg["norm_output"]) == (False, False, False)
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["head_dim"] == hd and layer["num_hidden_layers"] == 1
    assert (layer["vocab_size"], layer["hidden_size"], layer["intermediate_size"]) == (V, H, I)
    assert layer["rope_parameters"] == {"rope_type": "default",
                                        "rope_theta": target3.config.rope_parameters["rope_theta"]}
    assert (layer["attention_bias"], layer["mlp_bias"], layer["pad_token_id"]) == (False, False, 0)
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1,
                                         "accept_tolerance": 0.0}]
    assert spec["verifier"] == {"name_or_path": "org/tiny-base", "architectures": ["LlamaForCausalLM"]}


def test_layer_id_conversion_both_ways():
    assert to_output_ids([2, 15, 27]) == [1, 14, 26]  # SmolLM2-135M (L = 30), FORMATS.md
    assert to_entering_ids([1, 14, 26]) == [2, 15, 27]
    for ids in ([1], [3, 1, 2], [5, 9, 29, 30]):
        assert to_entering_ids(to_output_ids(ids)) == ids
        assert to_output_ids(to_entering_ids(ids)) == [i for i in ids]
    with pytest.raises(ExportError, match="embedding output"):
        to_output_ids([0, 4, 5])
    with pytest.raises(ExportError, match=">= 0"):
        to_entering_ids([-1, 3])


@pytest.mark.parametrize("fmt, field, values, convention", [
    ("eagle3", "config.json:eagle_config.eagle_aux_hidden_state_layer_ids", [1, 2, 3], "output"),
    ("eagle3_vllm", "config.json:eagle_aux_hidden_state_layer_ids", [2, 3, 4], "entering"),
    ("speculators", "config.json:eagle_aux_hidden_state_layer_ids", [2, 3, 4], "entering"),
    ("native", "head_config.json:config.aux_layer_ids", [2, 3, 4], "entering"),
])
def test_manifest_names_each_files_layer_id_convention(tmp_path, target3, fmt, field, values, convention):
    head, config = make_eagle3(target3)
    folder = export_head(head, config, fmt, tmp_path / fmt, target3)
    manifest = json.loads((folder / "specheads.json").read_text())
    feature = manifest["feature_layer"]
    assert feature["hidden_states_indices"] == [2, 3, 4]
    assert feature["layer_ids"] == {"specheads.json:head_config.aux_layer_ids": {"values": [2, 3, 4],
                                                                                 "convention": "entering"},
                                    field: {"values": values, "convention": convention}}
    assert set(feature["conventions"]) == {"entering", "output"}
    card = (folder / "README.md").read_text()
    if fmt != "native":
        assert f"{values}" in card and convention in card


@pytest.mark.parametrize("fmt", ("native", *FORMATS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_gives_the_same_logits(tmp_path, target3, fmt, dtype):
    head, config = make_eagle3(target3, norm_before_residual=fmt in ("eagle3_vllm", "speculators"))
    folder = export_head(head, config, fmt, tmp_path / fmt, target3, dtype=dtype)
    loaded, loaded_config, manifest = load_export(folder, target3)
    assert loaded_config == config and manifest["format"] == fmt
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    got, want = _eagle3_logits(loaded, target3), _eagle3_logits(head, target3)
    if dtype == "float32":
        assert torch.equal(got, want)
    else:
        assert not torch.equal(got, want)  # the cast happened
        assert (got - want).abs().max() <= 5e-2 * want.abs().max()


def test_engine_resolves_to_the_three_eagle3_layouts(tmp_path, target3):
    assert resolve_formats(["native", "engine"], "eagle3") == ["native", "eagle3", "eagle3_vllm", "speculators"]
    with pytest.raises(ExportError, match="'eagle3' exports eagle3 heads"):
        resolve_formats(["eagle3"], "eagle")
    head, config = make_eagle3(target3)
    paths = export_all(head, config, ["engine"], tmp_path / "export", target3)
    assert set(paths) == {"eagle3", "eagle3_vllm", "speculators"}
    cards = {fmt: (path / "README.md").read_text() for fmt, path in paths.items()}
    assert "--speculative-algorithm EAGLE3" in cards["eagle3"] and "eagle3_layers_to_capture: [1, 2, 3]" in cards["eagle3"]
    assert '"method": "eagle3"' in cards["eagle3_vllm"] and "vllm serve ./THIS_FOLDER" in cards["speculators"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("option", ["qkv_bias", "qk_norm"])
def test_refuses_attention_the_engines_lack(tmp_path, target3, fmt, option):
    head, config = make_eagle3(target3, **{option: True})
    with pytest.raises(ExportError, match=option):
        export_head(head, config, fmt, tmp_path / "out", target3)
    assert not (tmp_path / "out").exists()


def test_sglang_layout_refuses_norm_before_residual(tmp_path, target3):
    head, config = make_eagle3(target3, norm_before_residual=True)
    with pytest.raises(ExportError, match="norm_before_residual"):
        export_head(head, config, "eagle3", tmp_path / "e", target3)
    for fmt in ("eagle3_vllm", "speculators"):
        export_head(head, config, fmt, tmp_path / fmt, target3)


def test_two_aux_layers_only_in_the_speculators_layout(tmp_path, target3):
    head, config = make_eagle3(target3, aux_layer_ids=[3, 5])
    for fmt in ("eagle3", "eagle3_vllm"):
        with pytest.raises(ExportError, match="exactly 3 target layers"):
            export_head(head, config, fmt, tmp_path / fmt, target3)
    folder = export_head(head, config, "speculators", tmp_path / "s", target3, dtype="float32")
    assert _read(folder)[0]["fc.weight"].shape == (H, 2 * H)
    assert torch.equal(_eagle3_logits(load_export(folder, target3)[0], target3), _eagle3_logits(head, target3))


def test_sglang_layout_refuses_the_embedding_stream(tmp_path, target3):
    head, config = make_eagle3(target3, aux_layer_ids=[0, 3, 5])
    with pytest.raises(ExportError, match="embedding output"):
        export_head(head, config, "eagle3", tmp_path / "e", target3)
    export_head(head, config, "eagle3_vllm", tmp_path / "v", target3)  # vLLM numbers it 0


def test_speculators_refuses_a_wider_target(tmp_path):
    target = make_target3()
    head, config = make_eagle3(target, target_hidden_size=2 * H)
    with pytest.raises(ExportError, match="target_hidden_size"):
        export_head(head, config, "speculators", tmp_path / "s", target)
    export_head(head, config, "eagle3", tmp_path / "e", target)  # SGLang / vLLM read target_hidden_size


# FORMATS.md "EAGLE-3.1 options": the flags and the weights they add, by speculators' / vLLM's names.
EAGLE31_FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")
EAGLE31 = [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_output": True},
           {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True},
           {"fc_norm": True, "norm_output": True}]


def _eagle31_keys(options: dict) -> dict:
    keys = {"input_norm.weight": (3 * H,)} if options.get("norm_before_fc") else {}
    if options.get("fc_norm"):
        keys.update({f"fc_norm.{i}.weight": (H,) for i in range(3)})
    return keys


@pytest.mark.parametrize("fmt", ("native", "eagle3_vllm", "speculators"))
@pytest.mark.parametrize("options", EAGLE31, ids=lambda o: "+".join(o))
def test_eagle31_options_round_trip(tmp_path, target3, fmt, options):
    """All four flags written, the norms' weights under their engine names, read back by load_export
    into the same head (same logits over three steps, where norm_output shows)."""
    from export import validate_export

    head, config = make_eagle3(target3, **options)
    folder = export_head(head, config, fmt, tmp_path / fmt, target3, dtype="float32")
    tensors, cfg = _read(folder) if fmt != "native" else (None, None)
    if fmt != "native":
        assert {k: tuple(v.shape) for k, v in tensors.items()} == {**_expected(fmt), **_eagle31_keys(options)}
        for key in _eagle31_keys(options):
            assert torch.equal(tensors[key], head.state_dict()[key]), key
        assert {flag: cfg[flag] for flag in EAGLE31_FLAGS} == {flag: options.get(flag, False) for flag in EAGLE31_FLAGS}
    validate_export(folder, target3)
    loaded, loaded_config, _ = load_export(folder, target3)
    assert loaded_config == config
    assert torch.equal(_eagle3_logits(loaded, target3, steps=3), _eagle3_logits(head, target3, steps=3))


@pytest.mark.parametrize("option", ["norm_before_fc", "fc_norm", "norm_output"])
def test_sglang_layout_refuses_the_eagle31_options(tmp_path, target3, option):
    """SGLang's layout has no flag for them (and skips unknown weights): named alone it refuses;
    `engine` writes the layouts that can hold the head."""
    head, config = make_eagle3(target3, **{option: True})
    with pytest.raises(ExportError, match=f"format=eagle3: this layout has no EAGLE-3.1 options; this head has "
                                          f"{option}=true"):
        export_head(head, config, "eagle3", tmp_path / "e", target3)
    assert not (tmp_path / "e").exists()
    with pytest.raises(ExportError, match="no EAGLE-3.1 options"):
        export_all(head, config, ["native", "eagle3"], tmp_path / "named", target3)
    paths = export_all(head, config, ["native", "engine"], tmp_path / "all", target3)
    assert set(paths) == {"native", "eagle3_vllm", "speculators"} and not (tmp_path / "all" / "eagle3").exists()


def test_eagle31_flags_are_exclusive_in_every_config(tmp_path, target3):
    with pytest.raises(ValueError, match="norm_before_fc and fc_norm are exclusive"):
        make_eagle3(target3, norm_before_fc=True, fc_norm=True)
