"""The `speculators` DFlash layout (FORMATS.md "DFlash (`dflash`)"): what speculators 0.9.0's
`SpeculatorModel.from_pretrained(DIR)` and vLLM's DFlash proposer load as they are.

config.json is a `DFlashSpeculatorConfig`: the draft layers as a nested Qwen3
`transformer_layer_config` (q_norm/k_norm are part of every layer; explicit `head_dim`,
`layer_types` all `full_attention`), aux layers under `aux_hidden_state_layer_ids` in the
entering-layer convention (vLLM copies them to the ids its target captures), `block_size`,
`mask_token_id`, `sample_from_anchor: false` (slot 0 is the anchor; K = B-1 drafted tokens) and
`sliding_window_non_causal: true`: vLLM sets one causality flag for all layers from that key, and
an all-full draft is bidirectional within the block in speculators, so true keeps both the same.
Weights are ours under the same names (`fc`, `hidden_norm`, `layers.{l}.*`, `norm`). A head over
the target's vocabulary saves neither `embed_tokens` nor `lm_head` (both loaders take the
verifier's); one with its own draft vocabulary of Vd ids adds `lm_head.weight` [Vd, H], `d2t` [Vd]
and `t2d` [V] with `draft_vocab_size` = Vd, which vLLM maps back to target ids (`d2t`; it skips
`t2d`). `embed_tokens` is never saved.
"""
from __future__ import annotations

from export.eagle3 import CONVENTIONS, ENTERING, field_problems, rope_parameters
from export.layout import BaseModel, ExportError, Tensors
from export.speculators import SPECULATORS_VERSION
from heads.dflash import DflashConfig


def dflash_shapes(config: DflashConfig) -> dict[str, tuple[int, ...]]:
    H, I, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes = {"fc.weight": (H, len(config.aux_layer_ids) * config.target_hidden_size), "hidden_norm.weight": (H,),
              "norm.weight": (H,)}
    for layer in range(config.num_layers):
        prefix = f"layers.{layer}"
        shapes.update({
            f"{prefix}.self_attn.q_proj.weight": (q_out, H), f"{prefix}.self_attn.k_proj.weight": (kv_out, H),
            f"{prefix}.self_attn.v_proj.weight": (kv_out, H), f"{prefix}.self_attn.o_proj.weight": (H, q_out),
            f"{prefix}.self_attn.q_norm.weight": (hd,), f"{prefix}.self_attn.k_norm.weight": (hd,),
            f"{prefix}.mlp.gate_proj.weight": (I, H), f"{prefix}.mlp.up_proj.weight": (I, H),
            f"{prefix}.mlp.down_proj.weight": (H, I), f"{prefix}.input_layernorm.weight": (H,),
            f"{prefix}.post_attention_layernorm.weight": (H,),
        })
    if config.own_vocab:
        Vd = config.draft_vocab_size
        shapes.update({"lm_head.weight": (Vd, H), "d2t": (Vd,), "t2d": (config.vocab_size,)})
    return shapes


def _draft_vocab_size(config: DflashConfig) -> int:
    return config.draft_vocab_size if config.own_vocab else config.vocab_size


class DflashFormat:
    name = "speculators_dflash"
    head_type = "dflash"
    weights_file = "model.safetensors"
    config_file = "config.json"
    engines = ("vllm", "speculators")

    def to_files(self, state: Tensors, config: DflashConfig, base: BaseModel, dtype: str) -> tuple[Tensors, dict]:
        if config.target_hidden_size != config.hidden_size:
            raise ExportError(f"format=speculators_dflash: speculators builds fc over n x hidden_size={config.hidden_size} "
                              f"columns, but this head's target_hidden_size is {config.target_hidden_size}")
        return dict(state), self.config_json(config, base, dtype)

    def layer_config(self, config: DflashConfig, base: BaseModel, dtype: str) -> dict:
        """`transformer_layer_config`: a Qwen3Config of the L_d draft layers over the target vocabulary."""
        return {
            "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "num_hidden_layers": config.num_layers, "vocab_size": config.vocab_size,
            "hidden_act": "silu", "rms_norm_eps": config.rms_norm_eps,
            "max_position_embeddings": config.max_position_embeddings, "rope_parameters": rope_parameters(config),
            "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * config.num_layers, "max_window_layers": config.num_layers,
            "sliding_window": None, "use_sliding_window": False,
            "pad_token_id": base.pad_token_id, "bos_token_id": base.bos_token_id, "eos_token_id": base.eos_token_id,
            "dtype": dtype,
        }

    def config_json(self, config: DflashConfig, base: BaseModel, dtype: str) -> dict:
        return {
            "architectures": ["DFlashSpeculator"],
            "speculators_model_type": "dflash",
            "speculators_version": SPECULATORS_VERSION,
            "draft_vocab_size": _draft_vocab_size(config),
            "target_hidden_size": None,
            "aux_hidden_state_layer_ids": list(config.aux_layer_ids),
            "block_size": config.block_size,
            "mask_token_id": config.mask_token_id,
            "sample_from_anchor": False,
            "sliding_window_non_causal": True,
            "tie_word_embeddings": False,
            "dtype": dtype,
            "transformer_layer_config": self.layer_config(config, base, dtype),
            "speculators_config": {
                "algorithm": "dflash",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size - 1,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": base.hub_id, "architectures": [base.architecture]},
            },
        }

    def file_layer_ids(self, config: DflashConfig) -> tuple[str, list[int], str]:
        return "aux_hidden_state_layer_ids", list(config.aux_layer_ids), ENTERING

    def expected_shapes(self, config: DflashConfig) -> dict[str, tuple[int, ...]]:
        return dflash_shapes(config)

    def check_config(self, config_json: dict, config: DflashConfig, dtype: str) -> list[str]:
        layer = "transformer_layer_config"
        expected = {
            "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
            "draft_vocab_size": _draft_vocab_size(config), "aux_hidden_state_layer_ids": list(config.aux_layer_ids),
            "block_size": config.block_size, "mask_token_id": config.mask_token_id, "sample_from_anchor": False,
            "sliding_window_non_causal": True, "dtype": dtype,
            f"{layer}.model_type": "qwen3", f"{layer}.hidden_size": config.hidden_size,
            f"{layer}.intermediate_size": config.intermediate_size,
            f"{layer}.num_attention_heads": config.num_attention_heads,
            f"{layer}.num_key_value_heads": config.num_key_value_heads, f"{layer}.head_dim": config.head_dim,
            f"{layer}.num_hidden_layers": config.num_layers, f"{layer}.vocab_size": config.vocab_size,
            f"{layer}.rms_norm_eps": config.rms_norm_eps, f"{layer}.rope_parameters": rope_parameters(config),
            f"{layer}.layer_types": ["full_attention"] * config.num_layers, f"{layer}.attention_bias": False,
            "speculators_config.algorithm": "dflash", "speculators_config.default_proposal_method": "greedy",
        }
        problems = field_problems(config_json, expected, self.config_file)
        methods = (config_json.get("speculators_config") or {}).get("proposal_methods") or [{}]
        if not isinstance(methods[0], dict) or methods[0].get("speculative_tokens") != config.block_size - 1:
            problems.append(f"{self.config_file}.speculators_config.proposal_methods[0].speculative_tokens: "
                            f"{methods[0].get('speculative_tokens') if isinstance(methods[0], dict) else methods[0]!r}"
                            f", expected block_size - 1 = {config.block_size - 1}")
        verifier = (config_json.get("speculators_config") or {}).get("verifier") or {}
        if not isinstance(verifier.get("name_or_path"), str) or not verifier["name_or_path"]:
            problems.append(f"{self.config_file}.speculators_config.verifier.name_or_path: "
                            f"{verifier.get('name_or_path')!r}, expected the base model's hub id")
        return problems

    def to_state(self, tensors: Tensors, config: DflashConfig) -> Tensors:
        return dict(tensors)

    def base_copies(self, config: DflashConfig) -> dict[str, str]:
        return {}

    def notes(self, config: DflashConfig, base: BaseModel) -> list[str]:
        return [f"aux layers: config.json `aux_hidden_state_layer_ids` = {list(config.aux_layer_ids)} "
                f"({ENTERING} convention: {CONVENTIONS[ENTERING]}).",
                f"one forward drafts block_size - 1 = {config.block_size - 1} tokens, verified as a chain; "
                + (f"drafts over {config.draft_vocab_size} of the verifier's {config.vocab_size} ids (lm_head.weight "
                   "holds their rows, d2t maps them to target ids); no embed_tokens: it is the verifier's."
                   if config.own_vocab else "no embed_tokens or lm_head in the file: both are the verifier's.")]
