"""EAGLE-3 layouts (FORMATS.md "EAGLE-3"): `config.json` + `model.safetensors`, weights under the
SafeAILab / SGLang names (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`).

Two variants of one weights file, because the engines read the config differently:

- `eagle3` (SGLang, TensorRT-LLM, the EAGLE repo): architecture `LlamaForCausalLMEagle3`, aux
  layers under `eagle_config.eagle_aux_hidden_state_layer_ids` in the *output-of-layer*
  convention (id i = output of decoder layer i; SGLang adds one before capturing), and
  `tie_word_embeddings: false` (true would make SGLang score with the embedding).
- `eagle3_vllm` (vLLM): architecture `Eagle3LlamaForCausalLM`, top-level
  `eagle_aux_hidden_state_layer_ids` in vLLM's *entering-layer* convention (= transformers'
  `hidden_states` index, our `aux_layer_ids`), and `norm_before_residual` always written: vLLM
  reads a missing one as true, the speculators library as false. The EAGLE-3.1 flags
  (`norm_before_fc`, `fc_norm`, `norm_output`) are written too: vLLM's drafter reads them from the
  top level, with the weights `input_norm.weight` / `fc_norm.{i}.weight` under the names the
  head has. SGLang's layout has no place for them, so `eagle3` refuses a head that sets one.

The draft vocabulary maps (`d2t` int64 [Vd], `t2d` bool [V]) are written when Vd < V and left out
when Vd = V (the loaders then use the identity). `embed_tokens.weight` is a copy of the target's
embedding: vLLM and SGLang would share the target's anyway, but the speculators library (0.9.0 on
transformers 5) leaves a draft embedding that is not in the checkpoint at zeros instead of
reading the verifier's, and its converter keeps only what the file holds.
"""
from __future__ import annotations

import torch

from export.layout import BaseModel, ExportError, LayoutCannotHold, Tensors
from heads.eagle3 import Eagle3Config

ENTERING = "entering"  # id i = residual stream entering decoder layer i = transformers hidden_states[i]
OUTPUT = "output"  # id i = output of decoder layer i = transformers hidden_states[i + 1]
CONVENTIONS = {
    ENTERING: "id i = the residual stream entering decoder layer i (0-based) = transformers "
              "output_hidden_states[i]; vLLM and speculators number aux layers this way",
    OUTPUT: "id i = the output of decoder layer i (0-based) = transformers output_hidden_states[i + 1]; "
            "SGLang, TensorRT-LLM and ModelOpt number aux layers this way (SGLang adds one before capturing)",
}
_LAYER = "midlayer"
_SGLANG_AUX_LAYERS = 3  # vLLM and SGLang build fc for exactly three target layers
EAGLE31_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")  # config.json keys = Eagle3Config fields


def to_output_ids(entering_ids: list[int]) -> list[int]:
    """vLLM / transformers ids (stream entering layer i) -> SGLang ids (output of layer i - 1)."""
    if any(i < 1 for i in entering_ids):
        raise ExportError(f"aux_layer_ids={list(entering_ids)}: id 0 (the embedding output) has no "
                          "output-of-layer id, so SGLang / TensorRT-LLM cannot capture it")
    return [i - 1 for i in entering_ids]


def to_entering_ids(output_ids: list[int]) -> list[int]:
    """SGLang ids (output of layer i) -> vLLM / transformers ids (stream entering layer i + 1)."""
    if any(i < 0 for i in output_ids):
        raise ExportError(f"output-of-layer ids {list(output_ids)} must be >= 0")
    return [i + 1 for i in output_ids]


def rope_parameters(config: Eagle3Config) -> dict:
    """transformers-5 `rope_parameters` of the draft's attention (its real base, not 10000)."""
    return {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}


def field_problems(values: dict, expected: dict, file: str) -> list[str]:
    """Compare dotted paths of a JSON object (`a.b.c`) with expected values, naming each miss."""
    problems = []
    for path, want in expected.items():
        node = values
        for part in path.split("."):
            node = node.get(part, "<missing>") if isinstance(node, dict) else "<missing>"
        same_type = type(node) is type(want) or (type(want) is float and type(node) is int)  # bool is not int here
        if node != want or not same_type:
            problems.append(f"{file}.{path}: {node!r}, expected {want!r}")
    return problems


def has_vocab_maps(config: Eagle3Config) -> bool:
    return config.draft_vocab_size < config.vocab_size


def vocab_map_problems(d2t: torch.Tensor, t2d: torch.Tensor, config: Eagle3Config) -> list[str]:
    """d2t must send draft id i to target id i + d2t[i], ascending, inside V; t2d must mark exactly
    those target ids."""
    Vd, V = config.draft_vocab_size, config.vocab_size
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        return [f"d2t/t2d dtypes {d2t.dtype}/{t2d.dtype}, expected int64/bool"]
    if tuple(d2t.shape) != (Vd,) or tuple(t2d.shape) != (V,):
        return [f"d2t/t2d shapes {list(d2t.shape)}/{list(t2d.shape)}, expected [{Vd}]/[{V}]"]
    ids = torch.arange(Vd) + d2t
    problems = []
    if Vd and not (0 <= int(ids.min()) and int(ids.max()) < V):
        problems.append(f"d2t maps draft ids outside the target vocabulary [0, {V})")
    elif Vd > 1 and not bool((ids[1:] > ids[:-1]).all()):
        problems.append("d2t: the target ids i + d2t[i] are not strictly ascending")
    elif int(t2d.sum()) != Vd or not bool(t2d[ids].all()):
        problems.append(f"t2d marks {int(t2d.sum())} target ids, not the {Vd} ids that d2t maps to")
    return problems


def eagle3_shapes(config: Eagle3Config, layer: str) -> dict[str, tuple[int, ...]]:
    """Weights of the one-layer EAGLE-3 draft under `layer` (`midlayer` or `layers.0`)."""
    H, I, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes = {
        "embed_tokens.weight": (config.vocab_size, H),
        "fc.weight": (H, len(config.aux_layer_ids) * config.target_hidden_size),
        f"{layer}.self_attn.q_proj.weight": (q_out, 2 * H),
        f"{layer}.self_attn.k_proj.weight": (kv_out, 2 * H),
        f"{layer}.self_attn.v_proj.weight": (kv_out, 2 * H),
        f"{layer}.self_attn.o_proj.weight": (H, q_out),
        f"{layer}.mlp.gate_proj.weight": (I, H),
        f"{layer}.mlp.up_proj.weight": (I, H),
        f"{layer}.mlp.down_proj.weight": (H, I),
        f"{layer}.input_layernorm.weight": (H,),
        f"{layer}.hidden_norm.weight": (H,),
        f"{layer}.post_attention_layernorm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (config.draft_vocab_size, H),
    }
    n, Ht = len(config.aux_layer_ids), config.target_hidden_size
    if config.norm_before_fc:
        shapes["input_norm.weight"] = (n * Ht,)
    if config.fc_norm:
        shapes.update({f"fc_norm.{i}.weight": (Ht,) for i in range(n)})
    if has_vocab_maps(config):
        shapes.update({"d2t": (config.draft_vocab_size,), "t2d": (config.vocab_size,)})
    return shapes


def to_layer(state: Tensors, config: Eagle3Config, base: BaseModel, layer: str) -> Tensors:
    """Native head state (+ the target's embedding) -> file tensors, decoder layer under `layer`."""
    if tuple(base.embed_tokens.shape) != (config.vocab_size, config.hidden_size):
        raise ExportError(f"base model embedding has shape {list(base.embed_tokens.shape)}, the head expects "
                          f"[{config.vocab_size}, {config.hidden_size}] (vocab_size, hidden_size)")
    tensors = {"embed_tokens.weight": base.embed_tokens}
    tensors.update({(layer + key[len(_LAYER):] if key.startswith(_LAYER + ".") else key): value
                    for key, value in state.items()})
    if not has_vocab_maps(config):
        del tensors["d2t"], tensors["t2d"]
    return tensors


def from_layer(tensors: Tensors, config: Eagle3Config, layer: str) -> Tensors:
    """File tensors -> native head state (inverse of `to_layer`); checks the vocabulary maps."""
    state = {(_LAYER + key[len(layer):] if key.startswith(layer + ".") else key): value
             for key, value in tensors.items() if key != "embed_tokens.weight"}
    if has_vocab_maps(config):
        problems = vocab_map_problems(state["d2t"], state["t2d"], config)
        if problems:
            raise ExportError("; ".join(problems))
    else:
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    return state


def refuse_unloadable(config: Eagle3Config, fmt: str, *, three_layers: bool, residual_norm: bool,
                      eagle31: bool) -> None:
    """Heads the engines behind `fmt` would load silently wrong (`eagle31`: whether its config
    carries the EAGLE-3.1 flags)."""
    for field, on in (("qkv_bias", config.qkv_bias), ("qk_norm", config.qk_norm)):
        if on:
            raise LayoutCannotHold(f"format={fmt}: the engines' EAGLE-3 Llama draft has no {field}; this head has "
                              f"{field}=true (train the draft with {field}=false to serve it)")
    if three_layers and len(config.aux_layer_ids) != _SGLANG_AUX_LAYERS:
        raise LayoutCannotHold(f"format={fmt}: vLLM and SGLang build fc for exactly {_SGLANG_AUX_LAYERS} target "
                          f"layers; this head reads {len(config.aux_layer_ids)} ({config.aux_layer_ids}); "
                          "export format=speculators instead")
    if not residual_norm and config.norm_before_residual:
        raise LayoutCannotHold(f"format={fmt}: SGLang's EAGLE-3 layer keeps the un-normed residual; this head has "
                          "norm_before_residual=true (export eagle3_vllm or speculators instead)")
    on = [flag for flag in EAGLE31_FLAGS if getattr(config, flag)]
    if not eagle31 and on:
        # SGLang skips weight keys it does not know: input_norm / fc_norm would be dropped silently.
        raise LayoutCannotHold(f"format={fmt}: this layout has no EAGLE-3.1 options; this head has "
                          f"{', '.join(f'{flag}=true' for flag in on)} (export eagle3_vllm or speculators instead)")


class Eagle3Format:
    head_type = "eagle3"
    weights_file = "model.safetensors"
    config_file = "config.json"

    def __init__(self, engine: str):
        if engine not in ("sglang", "vllm"):
            raise ValueError(f"engine={engine!r} is not one of ['sglang', 'vllm']")
        self.engine = engine
        self.name = "eagle3" if engine == "sglang" else "eagle3_vllm"
        self.engines = ("sglang", "tensorrt-llm", "eagle-reference") if engine == "sglang" else ("vllm",)
        self.architecture = "LlamaForCausalLMEagle3" if engine == "sglang" else "Eagle3LlamaForCausalLM"

    def file_layer_ids(self, config: Eagle3Config) -> tuple[str, list[int], str]:
        """(config.json field, its values, convention) of the aux layers in this file."""
        if self.engine == "sglang":
            return "eagle_config.eagle_aux_hidden_state_layer_ids", to_output_ids(config.aux_layer_ids), OUTPUT
        return "eagle_aux_hidden_state_layer_ids", list(config.aux_layer_ids), ENTERING

    def to_files(self, state: Tensors, config: Eagle3Config, base: BaseModel, dtype: str) -> tuple[Tensors, dict]:
        refuse_unloadable(config, self.name, three_layers=True, residual_norm=self.engine == "vllm",
                          eagle31=self.engine == "vllm")
        return to_layer(state, config, base, _LAYER), self.config_json(config, base, dtype)

    def config_json(self, config: Eagle3Config, base: BaseModel, dtype: str) -> dict:
        """A Llama config of the one-layer draft plus the EAGLE-3 fields its engine reads."""
        values = {
            "architectures": [self.architecture],
            "model_type": "llama",
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "num_hidden_layers": 1,
            "vocab_size": config.vocab_size,
            "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": config.target_hidden_size,
            "rms_norm_eps": config.rms_norm_eps,
            "rope_theta": config.rope_theta,
            "rope_scaling": config.rope_scaling,
            "max_position_embeddings": config.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "bias": False,  # SGLang's fc bias
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            "bos_token_id": base.bos_token_id,
            "eos_token_id": base.eos_token_id,
        }
        field, ids, _ = self.file_layer_ids(config)
        if self.engine == "sglang":
            values["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
        else:
            values[field] = ids
            values["norm_before_residual"] = config.norm_before_residual
            values.update({flag: getattr(config, flag) for flag in EAGLE31_FLAGS})
        return values

    def expected_shapes(self, config: Eagle3Config) -> dict[str, tuple[int, ...]]:
        return eagle3_shapes(config, _LAYER)

    def check_config(self, config_json: dict, config: Eagle3Config, dtype: str) -> list[str]:
        expected = {
            "architectures": [self.architecture], "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size, "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
            "num_hidden_layers": 1, "vocab_size": config.vocab_size, "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": config.target_hidden_size, "rms_norm_eps": config.rms_norm_eps,
            "rope_theta": config.rope_theta, "max_position_embeddings": config.max_position_embeddings,
            "tie_word_embeddings": False, "torch_dtype": dtype,
        }
        field, ids, _ = self.file_layer_ids(config)
        expected[field] = ids
        if self.engine == "vllm":
            expected["norm_before_residual"] = config.norm_before_residual
            # Folders written before the EAGLE-3.1 flags lack them; vLLM reads a missing one as false.
            expected.update({flag: getattr(config, flag) for flag in EAGLE31_FLAGS
                             if getattr(config, flag) or flag in config_json})
        problems = field_problems(config_json, expected, self.config_file)
        if config_json.get("rope_scaling") != config.rope_scaling:
            problems.append(f"{self.config_file}.rope_scaling: {config_json.get('rope_scaling')!r}, "
                            f"expected {config.rope_scaling!r}")
        return problems

    def to_state(self, tensors: Tensors, config: Eagle3Config) -> Tensors:
        return from_layer(tensors, config, _LAYER)

    def base_copies(self, config: Eagle3Config) -> dict[str, str]:
        return {"embed_tokens.weight": "embedding"}  # the lm_head is the draft's own

    def notes(self, config: Eagle3Config, base: BaseModel) -> list[str]:
        field, ids, convention = self.file_layer_ids(config)
        notes = [f"aux layers: config.json `{field}` = {ids} ({convention} convention: {CONVENTIONS[convention]}); "
                 f"transformers hidden_states indices {list(config.aux_layer_ids)}."]
        if self.engine == "sglang":
            notes.append("`speculators convert --algorithm eagle3` does not read `eagle_config`: pass "
                         f"--algorithm-kwargs '{{\"eagle_aux_hidden_state_layer_ids\": {list(config.aux_layer_ids)}}}' "
                         "(entering-layer ids), or load the `speculators` export instead.")
        if not has_vocab_maps(config):
            notes.append("draft vocabulary = the full target vocabulary: no d2t / t2d in the file.")
        return notes
