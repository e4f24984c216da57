"""The `speculators` layout of a P-EAGLE head (`speculators_peagle`; FORMATS.md "P-EAGLE"): what
`SpeculatorModel.from_pretrained(DIR)` loads as a `PEagleDraftModel` and vLLM serves as EAGLE-3
with parallel drafting.

It is the EAGLE-3 `speculators` layout (export/speculators.py) with the P-EAGLE identity
(`PEagleSpeculator`, `speculators_model_type` and `speculators_config.algorithm` "peagle"),
`mask_token_id` (vLLM raises a KeyError without it), the head's K as the greedy proposal's
`speculative_tokens`, and one more weight, `mask_hidden` [1, 1, n·Ht], which vLLM requires.
`embed_requires_grad` is written false because our embedding is the target's, frozen
(heads/peagle.py says why); the file still holds a copy of it, as the eagle3 layout does.
vLLM copies neither `fc_norm` nor `norm_output` into its P-EAGLE drafter, so a head with either is
refused.
"""
from __future__ import annotations

from export.eagle3 import field_problems
from export.layout import BaseModel, ExportError, Tensors
from export.speculators import SpeculatorsFormat
from heads.peagle import PeagleConfig

ARCHITECTURE = "PEagleSpeculator"
ALGORITHM = "peagle"
# What the eagle3 layout writes where P-EAGLE writes its own identity: its checks see these.
_EAGLE3_IDENTITY = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "algorithm": "eagle3"}


class PeagleSpeculatorsFormat(SpeculatorsFormat):
    name = "speculators_peagle"
    head_type = "peagle"

    def to_files(self, state: Tensors, config: PeagleConfig, base: BaseModel, dtype: str) -> tuple[Tensors, dict]:
        unread = [flag for flag in ("fc_norm", "norm_output") if getattr(config, flag, False)]
        if unread:
            raise ExportError(f"format={self.name}: vLLM's P-EAGLE drafter does not read "
                              f"{' or '.join(unread)}; this head sets {', '.join(f'{f}=true' for f in unread)}")
        tensors, _ = super().to_files(state, config, base, dtype)  # mask_hidden travels under its own name
        return tensors, self.config_json(config, base, dtype)

    def config_json(self, config: PeagleConfig, base: BaseModel, dtype: str, speculative_tokens: int | None = None) -> dict:
        values = super().config_json(config, base, dtype, speculative_tokens or config.speculative_tokens)
        values["architectures"] = [ARCHITECTURE]
        values["speculators_model_type"] = ALGORITHM
        values["speculators_config"]["algorithm"] = ALGORITHM
        values["mask_token_id"] = config.mask_token_id
        values["embed_requires_grad"] = False
        return values

    def add_runtime(self, config_json: dict, runtime: dict) -> None:
        """Nothing: one draft pass proposes the head's K tokens, whatever chain eval measured."""

    def expected_shapes(self, config: PeagleConfig) -> dict[str, tuple[int, ...]]:
        return {**super().expected_shapes(config),
                "mask_hidden": (1, 1, len(config.aux_layer_ids) * config.target_hidden_size)}

    def check_config(self, config_json: dict, config: PeagleConfig, dtype: str) -> list[str]:
        """The eagle3 layout's checks on every shared field, then P-EAGLE's own."""
        method = config_json.get("speculators_config")
        shared = {**config_json, "architectures": _EAGLE3_IDENTITY["architectures"],
                  "speculators_model_type": _EAGLE3_IDENTITY["speculators_model_type"]}
        if isinstance(method, dict):
            shared["speculators_config"] = {**method, "algorithm": _EAGLE3_IDENTITY["algorithm"]}
        problems = super().check_config(shared, config, dtype)
        expected = {"architectures": [ARCHITECTURE], "speculators_model_type": ALGORITHM,
                    "speculators_config.algorithm": ALGORITHM, "mask_token_id": config.mask_token_id}
        problems += field_problems(config_json, expected, self.config_file)
        methods = (method or {}).get("proposal_methods") if isinstance(method, dict) else None
        tokens = [m.get("speculative_tokens") for m in methods or [] if isinstance(m, dict)]
        if config.speculative_tokens not in tokens:
            problems.append(f"{self.config_file}.speculators_config.proposal_methods: speculative_tokens {tokens}, "
                            f"expected the head's K = {config.speculative_tokens}")
        return problems

    def notes(self, config: PeagleConfig, base: BaseModel) -> list[str]:
        return super().notes(config, base) + [
            f"P-EAGLE: one draft pass proposes K = {config.speculative_tokens} tokens (the bonus token, then "
            f"{config.speculative_tokens - 1} slots of mask token {config.mask_token_id}); vLLM runs it as "
            '`"method": "eagle3", "parallel_drafting": true` (V1 only).',
            "embed_requires_grad is false: the head was trained on the target's frozen embedding, a copy of "
            "which is embed_tokens.weight.",
        ]
