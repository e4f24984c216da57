"""EAGLE-1/2 layout (FORMATS.md; `yuhuili/EAGLE-LLaMA3-Instruct-8B`): `config.json` + `model.safetensors`.

Two variants of one layout, because the engines read the same config differently:

- `eagle` (SGLang, and the EAGLE reference loader): architecture `{Target}Eagle`, e.g.
  `LlamaForCausalLMEagle`. SGLang's draft `fc` always has a bias and leaves it at its random
  initial value when the file has none, and it reads a config `bias: true` as *attention* bias.
  So this variant always writes `fc.bias` (zeros for a bias-free head, which changes no output)
  and leaves `bias` out of config.json — the EAGLE reference loader reads a missing `bias` as
  true, which matches the `fc.bias` in the file.
- `eagle_vllm` (vLLM): architecture of the target (`LlamaForCausalLM`); vLLM prefixes `Eagle`
  itself. vLLM's draft `fc` has no bias and its attention takes `bias` as attention bias, so
  this variant writes `bias: false`, no `fc.bias`, and refuses heads with an fc or q/k/v bias.
"""
from __future__ import annotations

import torch

from export.layout import BaseModel, ExportError, Tensors
from heads.eagle import EagleConfig

_VLLM_ARCHITECTURES = {"LlamaForCausalLM"}  # vLLM registers Eagle{arch} for EAGLE-1 drafts of these


class EagleFormat:
    head_type = "eagle"
    weights_file = "model.safetensors"
    config_file = "config.json"

    def __init__(self, engine: str):
        if engine not in ("sglang", "vllm"):
            raise ValueError(f"engine={engine!r} is not one of ['sglang', 'vllm']")
        self.engine = engine
        self.name = "eagle" if engine == "sglang" else "eagle_vllm"
        self.engines = ("sglang", "eagle-reference") if engine == "sglang" else ("vllm",)

    def architecture(self, base_architecture: str) -> str:
        return f"{base_architecture}Eagle" if self.engine == "sglang" else base_architecture

    def _refuse(self, config: EagleConfig, base_architecture: str) -> None:
        if self.engine != "vllm":
            return
        for field, on in (("fc_bias", config.fc_bias), ("qkv_bias", config.qkv_bias), ("qk_norm", config.qk_norm)):
            if on:
                raise ExportError(f"format=eagle_vllm: vLLM's EAGLE draft has no {field}; this head has "
                                  f"{field}=true (export format=eagle for SGLang instead)")
        if base_architecture not in _VLLM_ARCHITECTURES:
            raise ExportError(f"format=eagle_vllm: vLLM has no EAGLE-1 draft class for {base_architecture} "
                              f"(supported: {sorted(_VLLM_ARCHITECTURES)})")

    def to_files(self, state: Tensors, config: EagleConfig, base: BaseModel, dtype: str) -> tuple[Tensors, dict]:
        self._refuse(config, base.architecture)
        if tuple(base.embed_tokens.shape) != (config.vocab_size, config.hidden_size):
            raise ExportError(f"base model embedding has shape {list(base.embed_tokens.shape)}, the head expects "
                              f"[{config.vocab_size}, {config.hidden_size}] (vocab_size, hidden_size)")
        tensors = {"embed_tokens.weight": base.embed_tokens, **state}
        if self.engine == "sglang" and "fc.bias" not in tensors:
            tensors["fc.bias"] = torch.zeros(config.hidden_size, dtype=state["fc.weight"].dtype)
        return tensors, self.config_json(config, base, dtype)

    def config_json(self, config: EagleConfig, base: BaseModel, dtype: str) -> dict:
        """A Llama config of the one-layer draft (FORMATS.md field list)."""
        values = {
            "architectures": [self.architecture(base.architecture)],
            "model_type": base.model_type,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "num_hidden_layers": 1,
            "vocab_size": config.vocab_size,
            "rms_norm_eps": config.rms_norm_eps,
            "rope_theta": config.rope_theta,
            "rope_scaling": config.rope_scaling,
            "max_position_embeddings": config.max_position_embeddings,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            "bos_token_id": base.bos_token_id,
            "eos_token_id": base.eos_token_id,
        }
        if self.engine == "vllm":
            values["bias"] = False
        return values

    def expected_shapes(self, config: EagleConfig) -> dict[str, tuple[int, ...]]:
        H, I, hd = config.hidden_size, config.intermediate_size, config.head_dim
        q_out, kv_out = config.num_attention_heads * hd, config.num_key_value_heads * hd
        attn = "layers.0.self_attn"
        shapes = {
            "embed_tokens.weight": (config.vocab_size, H),
            "fc.weight": (H, 2 * H),
            f"{attn}.q_proj.weight": (q_out, H),
            f"{attn}.k_proj.weight": (kv_out, H),
            f"{attn}.v_proj.weight": (kv_out, H),
            f"{attn}.o_proj.weight": (H, q_out),
            "layers.0.mlp.gate_proj.weight": (I, H),
            "layers.0.mlp.up_proj.weight": (I, H),
            "layers.0.mlp.down_proj.weight": (H, I),
            "layers.0.post_attention_layernorm.weight": (H,),
        }
        if self.engine == "sglang":
            shapes["fc.bias"] = (H,)
        if config.qkv_bias:
            shapes.update({f"{attn}.q_proj.bias": (q_out,), f"{attn}.k_proj.bias": (kv_out,),
                           f"{attn}.v_proj.bias": (kv_out,)})
        if config.qk_norm:
            shapes.update({f"{attn}.q_norm.weight": (hd,), f"{attn}.k_norm.weight": (hd,)})
        return shapes

    def check_config(self, config_json: dict, config: EagleConfig, dtype: str) -> list[str]:
        expected = {
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "num_hidden_layers": 1, "vocab_size": config.vocab_size,
            "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
            "rope_scaling": config.rope_scaling, "max_position_embeddings": config.max_position_embeddings,
            "torch_dtype": dtype,
        }
        problems = [f"config.json.{key}: {config_json.get(key, '<missing>')!r}, expected {value!r}"
                    for key, value in expected.items() if config_json.get(key, "<missing>") != value]
        architectures = config_json.get("architectures")
        suffix_ok = bool(architectures) and len(architectures) == 1 and (
            architectures[0].endswith("Eagle") if self.engine == "sglang" else not architectures[0].endswith("Eagle"))
        if not suffix_ok:
            want = "[<Target>Eagle], e.g. ['LlamaForCausalLMEagle']" if self.engine == "sglang" else "['LlamaForCausalLM']"
            problems.append(f"config.json.architectures: {architectures!r}, expected {want} for {self.name}")
        if self.engine == "sglang" and "bias" in config_json:
            problems.append(f"config.json.bias: present ({config_json['bias']!r}); SGLang reads it as attention "
                            "bias — leave it out (fc.bias is in the weights, which the EAGLE loader reads as bias)")
        if self.engine == "vllm" and config_json.get("bias", "<missing>") is not False:
            problems.append(f"config.json.bias: {config_json.get('bias', '<missing>')!r}, expected false "
                            "(vLLM's EAGLE fc has no bias; a missing bias means true to the EAGLE loader)")
        return problems

    def base_copies(self, config: EagleConfig) -> dict[str, str]:
        return {"embed_tokens.weight": "embedding"}

    def to_state(self, tensors: Tensors, config: EagleConfig) -> Tensors:
        state = {key: value for key, value in tensors.items() if key != "embed_tokens.weight"}
        if not config.fc_bias and "fc.bias" in state:
            if torch.count_nonzero(state["fc.bias"]):
                raise ExportError("fc.bias: non-zero values, but head_config.fc_bias is false")
            del state["fc.bias"]
        return state
