"""Medusa-1 in FasterDecoding's layout (FORMATS.md), which TensorRT-LLM's converter reads:
`medusa_lm_head.safetensors` (`{h}.{l}.linear.weight|bias`, `{h}.{L}.weight`) + `config.json`.

TensorRT-LLM builds one lm_head per Medusa head and loads `{h}.{L}.weight` for every head, so a
head trained with `share_lm_head` (the target's frozen lm_head) is exported with a copy of the
target's lm_head under each `{h}.{L}.weight`; importing it back drops those copies again.
config.json also carries `medusa_choices`, the tree the head was evaluated with (engines take the
tree as a launch flag, not from this file).
"""
from __future__ import annotations

from export.layout import BaseModel, ExportError, Tensors
from heads.medusa import MedusaConfig


def choices_problems(choices, num_heads: int, field: str) -> list[str]:
    """A Medusa tree is a list of paths of non-negative choice indices, at most `num_heads` deep,
    each path's prefixes also present, no duplicates."""
    if not isinstance(choices, list) or not choices:
        return [f"{field}: {choices!r} is not a non-empty list of paths"]
    paths = []
    for path in choices:
        if not (isinstance(path, list) and path and all(isinstance(i, int) and i >= 0 for i in path)):
            return [f"{field}: {path!r} is not a non-empty list of non-negative ints"]
        paths.append(tuple(path))
    problems = []
    if len(set(paths)) != len(paths):
        problems.append(f"{field}: duplicate paths")
    deepest = max(len(path) for path in paths)
    if deepest > num_heads:
        problems.append(f"{field}: a path is {deepest} deep but the head has {num_heads} Medusa heads")
    present = set(paths)
    orphans = [list(path) for path in paths if len(path) > 1 and path[:-1] not in present]
    if orphans:
        problems.append(f"{field}: paths whose prefix is missing: {orphans[:3]}")
    return problems


def default_choices(num_heads: int, budget: int = 2) -> list[list[int]]:
    """An untuned tree for when none was measured: every path whose choice indices sum to at most
    `budget` (top-1 chains plus near-misses), shallow paths first."""
    paths: list[list[int]] = [[]]
    out: list[list[int]] = []
    for _ in range(num_heads):
        paths = [path + [i] for path in paths for i in range(budget + 1) if sum(path) + i <= budget]
        out += paths
    return out


class MedusaFormat:
    name = "medusa"
    head_type = "medusa"
    weights_file = "medusa_lm_head.safetensors"
    config_file = "config.json"
    engines = ("tensorrt-llm", "medusa-reference")

    def to_files(self, state: Tensors, config: MedusaConfig, base: BaseModel, dtype: str) -> tuple[Tensors, dict]:
        tensors = dict(state)
        if config.share_lm_head:
            if tuple(base.lm_head.shape) != (config.vocab_size, config.hidden_size):
                raise ExportError(f"base model lm_head has shape {list(base.lm_head.shape)}, the head expects "
                                  f"[{config.vocab_size}, {config.hidden_size}] (vocab_size, hidden_size)")
            for h in range(config.num_heads):
                tensors[f"{h}.{config.num_layers}.weight"] = base.lm_head  # the writer clones each copy
        return tensors, self.config_json(config, base, dtype)

    def config_json(self, config: MedusaConfig, base: BaseModel, dtype: str) -> dict:
        return {
            "medusa_num_heads": config.num_heads,
            "medusa_num_layers": config.num_layers,
            "base_model_name_or_path": base.hub_id,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "torch_dtype": dtype,
        }

    def expected_shapes(self, config: MedusaConfig) -> dict[str, tuple[int, ...]]:
        H, L = config.hidden_size, config.num_layers
        shapes: dict[str, tuple[int, ...]] = {}
        for h in range(config.num_heads):
            for layer in range(L):
                shapes[f"{h}.{layer}.linear.weight"] = (H, H)
                shapes[f"{h}.{layer}.linear.bias"] = (H,)
            shapes[f"{h}.{L}.weight"] = (config.vocab_size, H)
        return shapes

    def check_config(self, config_json: dict, config: MedusaConfig, dtype: str) -> list[str]:
        expected = {"medusa_num_heads": config.num_heads, "medusa_num_layers": config.num_layers,
                    "hidden_size": config.hidden_size, "vocab_size": config.vocab_size, "torch_dtype": dtype}
        problems = [f"config.json.{key}: {config_json.get(key, '<missing>')!r}, expected {value!r}"
                    for key, value in expected.items() if config_json.get(key, "<missing>") != value]
        if not isinstance(config_json.get("base_model_name_or_path"), str) or not config_json["base_model_name_or_path"]:
            problems.append(f"config.json.base_model_name_or_path: {config_json.get('base_model_name_or_path')!r}, "
                            "expected the base model's id")
        if "medusa_choices" in config_json:
            problems += choices_problems(config_json["medusa_choices"], config.num_heads, "config.json.medusa_choices")
        else:
            problems.append("config.json.medusa_choices: missing (the tree the head was evaluated with)")
        return problems

    def to_state(self, tensors: Tensors, config: MedusaConfig) -> Tensors:
        if not config.share_lm_head:
            return dict(tensors)
        lm_heads = {f"{h}.{config.num_layers}.weight" for h in range(config.num_heads)}
        return {key: value for key, value in tensors.items() if key not in lm_heads}

    def add_runtime(self, config_json: dict, runtime: dict) -> None:
        """The tree the head was evaluated with travels in config.json too."""
        config_json["medusa_choices"] = runtime["medusa_choices"]

    def base_copies(self, config: MedusaConfig) -> dict[str, str]:
        """Keys that hold a copy of a base-model tensor (validated against the base model)."""
        if not config.share_lm_head:
            return {}
        return {f"{h}.{config.num_layers}.weight": "lm_head" for h in range(config.num_heads)}


class MedusaVllmFormat:
    """vLLM's Medusa drafter (FORMATS.md "vLLM layout"): `model.safetensors` with
    `blocks.{h}.layers.{l}.weight|bias` and `lm_heads.{h}.weight`, and a MedusaConfig config.json.

    vLLM proposes top-1 tokens only (no tree), so no `medusa_choices` travel with this folder.
    vLLM's MedusaConfig renames any config key holding "num" and "heads"/"layers" to
    `num_heads`/`num_hidden_layers`, so the file carries no other such key. A head trained with the
    target's lm_head gets a copy under every `lm_heads.{h}.weight`, as in the `medusa` layout.
    """

    name = "medusa_vllm"
    head_type = "medusa"
    weights_file = "model.safetensors"
    config_file = "config.json"
    engines = ("vllm",)

    def to_files(self, state: Tensors, config: MedusaConfig, base: BaseModel, dtype: str) -> tuple[Tensors, dict]:
        faster, config_json = MedusaFormat().to_files(state, config, base, dtype)
        L = config.num_layers
        tensors = {}
        for h in range(config.num_heads):
            for layer in range(L):
                for leaf in ("weight", "bias"):
                    tensors[f"blocks.{h}.layers.{layer}.{leaf}"] = faster[f"{h}.{layer}.linear.{leaf}"]
            tensors[f"lm_heads.{h}.weight"] = faster[f"{h}.{L}.weight"]
        return tensors, self.config_json(config, base, dtype)

    def config_json(self, config: MedusaConfig, base: BaseModel, dtype: str) -> dict:
        return {
            "architectures": ["MedusaModel"],
            "model_type": "medusa",
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "num_heads": config.num_heads,
            "num_hidden_layers": config.num_layers,
            "medusa_fc_bias": True,  # our ResBlocks have a bias; vLLM's default is none
            "truncated_vocab_size": config.vocab_size,
            "base_model_name_or_path": base.hub_id,
            "torch_dtype": dtype,
        }

    def expected_shapes(self, config: MedusaConfig) -> dict[str, tuple[int, ...]]:
        H = config.hidden_size
        shapes: dict[str, tuple[int, ...]] = {}
        for h in range(config.num_heads):
            for layer in range(config.num_layers):
                shapes[f"blocks.{h}.layers.{layer}.weight"] = (H, H)
                shapes[f"blocks.{h}.layers.{layer}.bias"] = (H,)
            shapes[f"lm_heads.{h}.weight"] = (config.vocab_size, H)
        return shapes

    def check_config(self, config_json: dict, config: MedusaConfig, dtype: str) -> list[str]:
        expected = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": config.hidden_size,
                    "vocab_size": config.vocab_size, "num_heads": config.num_heads,
                    "num_hidden_layers": config.num_layers, "medusa_fc_bias": True,
                    "truncated_vocab_size": config.vocab_size, "torch_dtype": dtype}
        problems = [f"config.json.{key}: {config_json.get(key, '<missing>')!r}, expected {value!r}"
                    for key, value in expected.items() if config_json.get(key, "<missing>") != value]
        renamed = sorted(key for key in config_json if "num" in key and ("heads" in key or "layers" in key)
                         and key not in ("num_heads", "num_hidden_layers"))
        if renamed:
            problems.append(f"config.json: keys {renamed} would overwrite num_heads / num_hidden_layers in vLLM")
        return problems

    def to_state(self, tensors: Tensors, config: MedusaConfig) -> Tensors:
        L = config.num_layers
        faster = {}
        for h in range(config.num_heads):
            for layer in range(L):
                for leaf in ("weight", "bias"):
                    faster[f"{h}.{layer}.linear.{leaf}"] = tensors[f"blocks.{h}.layers.{layer}.{leaf}"]
            faster[f"{h}.{L}.weight"] = tensors[f"lm_heads.{h}.weight"]
        return MedusaFormat().to_state(faster, config)

    def base_copies(self, config: MedusaConfig) -> dict[str, str]:
        return {f"lm_heads.{h}.weight": "lm_head" for h in range(config.num_heads)} if config.share_lm_head else {}
