"""The `speculators` layout (vllm-project/speculators 0.9.0, FORMATS.md): what
`SpeculatorModel.from_pretrained(DIR)` and `vllm serve DIR` load as they are.

config.json is an `Eagle3SpeculatorConfig`: the draft's decoder layer as a nested Llama
`transformer_layer_config` (with an explicit `head_dim`, because speculators doubles
`hidden_size` for its RoPE and would otherwise derive the wrong head size), the EAGLE-3 flags
written out (its defaults differ from vLLM's), aux layers in the entering-layer convention, and a
`speculators_config` whose verifier is the target's hub id. Weights are the `eagle3` ones with the
decoder layer under `layers.0.*`, including the target's embedding: speculators 0.9.0 on
transformers 5 leaves an embedding missing from the checkpoint at zeros (it only reads the
verifier's into a NaN-initialised one, and loading replaces the NaNs).
"""
from __future__ import annotations

from export.eagle3 import (CONVENTIONS, EAGLE31_FLAGS, ENTERING, eagle3_shapes, field_problems, from_layer,
                           has_vocab_maps, refuse_unloadable, rope_parameters, to_layer)
from export.layout import BaseModel, LayoutCannotHold, Tensors
from heads.eagle3 import Eagle3Config

SPECULATORS_VERSION = "0.9.0"  # the schema written here
_LAYER = "layers.0"
_DEFAULT_SPECULATIVE_TOKENS = 3  # speculators' own default chain length, when nothing was measured


class SpeculatorsFormat:
    name = "speculators"
    head_type = "eagle3"
    weights_file = "model.safetensors"
    config_file = "config.json"
    engines = ("vllm", "speculators")

    def to_files(self, state: Tensors, config: Eagle3Config, base: BaseModel, dtype: str) -> tuple[Tensors, dict]:
        refuse_unloadable(config, self.name, three_layers=False, residual_norm=True, eagle31=True)
        if config.target_hidden_size != config.hidden_size:
            raise LayoutCannotHold(f"format=speculators: its fc reads n x hidden_size={config.hidden_size} columns, but "
                              f"this head's target_hidden_size is {config.target_hidden_size}")
        return to_layer(state, config, base, _LAYER), self.config_json(config, base, dtype)

    def layer_config(self, config: Eagle3Config, base: BaseModel, dtype: str) -> dict:
        """`transformer_layer_config`: a LlamaConfig of the draft layer over the target vocabulary."""
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "num_hidden_layers": 1,
            "vocab_size": config.vocab_size,
            "hidden_act": "silu",
            "rms_norm_eps": config.rms_norm_eps,
            "max_position_embeddings": config.max_position_embeddings,
            "rope_parameters": rope_parameters(config),
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "pad_token_id": base.pad_token_id,
            "bos_token_id": base.bos_token_id,
            "eos_token_id": base.eos_token_id,
            "dtype": dtype,
        }

    def config_json(self, config: Eagle3Config, base: BaseModel, dtype: str,
                    speculative_tokens: int = _DEFAULT_SPECULATIVE_TOKENS) -> dict:
        return {
            "architectures": ["Eagle3DraftModel"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": config.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
            "norm_before_residual": config.norm_before_residual,
            **{flag: getattr(config, flag) for flag in EAGLE31_FLAGS},  # input_norm / fc_norm.{i} as named here
            "embed_requires_grad": False,
            "tie_word_embeddings": False,
            "dtype": dtype,  # transformers 5 spelling, as speculators writes it
            "transformer_layer_config": self.layer_config(config, base, dtype),
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": base.hub_id, "architectures": [base.architecture]},
            },
        }

    def add_runtime(self, config_json: dict, runtime: dict) -> None:
        """The chain length eval measured becomes the greedy proposal's `speculative_tokens`."""
        method = config_json["speculators_config"]["proposal_methods"][0]
        method["speculative_tokens"] = int(runtime["chain_depth"])

    def file_layer_ids(self, config: Eagle3Config) -> tuple[str, list[int], str]:
        return "eagle_aux_hidden_state_layer_ids", list(config.aux_layer_ids), ENTERING

    def expected_shapes(self, config: Eagle3Config) -> dict[str, tuple[int, ...]]:
        return eagle3_shapes(config, _LAYER)

    def check_config(self, config_json: dict, config: Eagle3Config, dtype: str) -> list[str]:
        layer = "transformer_layer_config"
        expected = {
            "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
            "draft_vocab_size": config.draft_vocab_size, "target_hidden_size": config.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
            "norm_before_residual": config.norm_before_residual,
            **{flag: getattr(config, flag) for flag in EAGLE31_FLAGS}, "tie_word_embeddings": False, "dtype": dtype, f"{layer}.dtype": dtype,
            f"{layer}.model_type": "llama", f"{layer}.hidden_size": config.hidden_size,
            f"{layer}.intermediate_size": config.intermediate_size,
            f"{layer}.num_attention_heads": config.num_attention_heads,
            f"{layer}.num_key_value_heads": config.num_key_value_heads, f"{layer}.head_dim": config.head_dim,
            f"{layer}.num_hidden_layers": 1, f"{layer}.vocab_size": config.vocab_size,
            f"{layer}.rms_norm_eps": config.rms_norm_eps, f"{layer}.rope_parameters": rope_parameters(config),
            f"{layer}.attention_bias": False, f"{layer}.mlp_bias": False,
            "speculators_config.algorithm": "eagle3", "speculators_config.default_proposal_method": "greedy",
        }
        problems = field_problems(config_json, expected, self.config_file)
        verifier = (config_json.get("speculators_config") or {}).get("verifier") or {}
        if not isinstance(verifier.get("name_or_path"), str) or not verifier["name_or_path"]:
            problems.append(f"{self.config_file}.speculators_config.verifier.name_or_path: "
                            f"{verifier.get('name_or_path')!r}, expected the base model's hub id")
        methods = (config_json.get("speculators_config") or {}).get("proposal_methods")
        if not (isinstance(methods, list) and any(isinstance(m, dict) and m.get("proposal_type") == "greedy"
                                                  and isinstance(m.get("speculative_tokens"), int)
                                                  and m["speculative_tokens"] >= 1 for m in methods)):
            problems.append(f"{self.config_file}.speculators_config.proposal_methods: {methods!r}, expected a "
                            "greedy method with speculative_tokens >= 1")
        return problems

    def to_state(self, tensors: Tensors, config: Eagle3Config) -> Tensors:
        return from_layer(tensors, config, _LAYER)

    def base_copies(self, config: Eagle3Config) -> dict[str, str]:
        return {"embed_tokens.weight": "embedding"}

    def notes(self, config: Eagle3Config, base: BaseModel) -> list[str]:
        notes = [f"aux layers: config.json `eagle_aux_hidden_state_layer_ids` = {list(config.aux_layer_ids)} "
                 f"({ENTERING} convention: {CONVENTIONS[ENTERING]})."]
        if len(config.aux_layer_ids) != 3:
            notes.append(f"this head reads {len(config.aux_layer_ids)} target layers: the speculators library "
                         "loads it, but vLLM's EAGLE-3 drafter builds fc for three.")
        if not has_vocab_maps(config):
            notes.append("draft vocabulary = the full target vocabulary: no d2t / t2d in the file.")
        return notes
