"""Export formats: pure mappings between our head state and an engine's files, and back.

A format turns (head state, head config, base-model tensors) into the tensors of one safetensors
file plus one JSON config, says which keys and shapes a folder of that format must hold, checks
the JSON against the head config, and maps the tensors back to our head state. No I/O here: the
writer (`export.writer`) and the validator (`export.validate`) do the files.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from heads.io import CONFIG_NAME as NATIVE_CONFIG_NAME
from heads.io import FORMAT_VERSION as NATIVE_FORMAT_VERSION
from heads.io import WEIGHTS_NAME as NATIVE_WEIGHTS_NAME
from heads.io import head_type

Tensors = dict[str, torch.Tensor]

# A format's files change only with this number; validate() refuses versions it does not know.
EXPORT_FORMAT_VERSION = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    """A head cannot be exported in the asked format, or an export cannot be read back."""


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ExportError(f"dtype={name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass
class BaseModel:
    """What an export needs from the frozen target: its identity and the tensors the head shares."""

    name: str  # how the target was loaded (hub id, path, `embedded:...`)
    hub_id: str  # the id a serving engine loads the base model by
    architecture: str  # e.g. LlamaForCausalLM
    model_type: str  # e.g. llama
    embed_tokens: torch.Tensor  # (V, D)
    lm_head: torch.Tensor  # (V, D)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None


class Format(Protocol):
    """One export layout. `config_file` is the JSON the folder carries beside `weights_file`."""

    name: str
    head_type: str
    weights_file: str
    config_file: str
    engines: tuple[str, ...]

    def to_files(self, state: Tensors, config, base: BaseModel, dtype: str) -> tuple[Tensors, dict]:
        """Head state dict -> (tensors to write, config JSON)."""

    def expected_shapes(self, config) -> dict[str, tuple[int, ...]]:
        """Every key the weights file must hold, with its shape, for a head config."""

    def check_config(self, config_json: dict, config, dtype: str) -> list[str]:
        """Problems between the config JSON and the head config, each naming the field."""

    def to_state(self, tensors: Tensors, config) -> Tensors:
        """Tensors read from the folder -> the head's state dict (inverse of `to_files`)."""

    def base_copies(self, config) -> dict[str, str]:
        """Keys holding a copy of a base-model tensor -> "embedding" | "lm_head" (validated
        against the base model). Optional on a format: `notes(config, base)` (model-card notes),
        `add_runtime(config_json, runtime)` (measured runtime settings into the config JSON),
        `file_layer_ids(config)` (the JSON field, values and convention of EAGLE-3 aux layers)."""


class NativeFormat:
    """Our own layout: the head checkpoint of `heads.io` (`head_config.json` + `model.safetensors`),
    so `export.load_export`, `python -m eval` and `trainer.init_from` read it as they are."""

    name = "native"
    head_type = "any"
    weights_file = NATIVE_WEIGHTS_NAME
    config_file = NATIVE_CONFIG_NAME
    engines = ("specheads",)

    def to_files(self, state, config, base, dtype):
        meta = {"type": head_type(config), "config": config.to_dict(), "format_version": NATIVE_FORMAT_VERSION,
                "dtype": dtype}
        return dict(state), meta

    def expected_shapes(self, config):
        from heads.io import build_head

        with torch.device("meta"):
            head = build_head(config)
        return {key: tuple(value.shape) for key, value in head.state_dict().items()}

    def check_config(self, config_json, config, dtype):
        problems = []
        if config_json.get("type") != head_type(config):
            problems.append(f"{self.config_file}.type: {config_json.get('type')!r}, expected {head_type(config)!r}")
        if config_json.get("config") != config.to_dict():
            ours, theirs = config.to_dict(), config_json.get("config") or {}
            defaults = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}
            for key in sorted(set(ours) | set(theirs)):  # a field added later may be missing at its default
                if ours.get(key) != theirs.get(key, defaults.get(key)):
                    problems.append(f"{self.config_file}.config.{key}: {theirs.get(key)!r}, manifest says {ours.get(key)!r}")
        if config_json.get("format_version") != NATIVE_FORMAT_VERSION:
            problems.append(f"{self.config_file}.format_version: {config_json.get('format_version')!r}, "
                            f"expected {NATIVE_FORMAT_VERSION}")
        return problems

    def to_state(self, tensors, config):
        return dict(tensors)

    def base_copies(self, config):
        return {}


def get_format(name: str) -> Format:
    """The format object for one of FORMAT_NAMES."""
    from export.eagle import EagleFormat
    from export.eagle3 import Eagle3Format
    from export.medusa import MedusaFormat, MedusaVllmFormat
    from export.speculators import SpeculatorsFormat

    formats = {"native": NativeFormat(), "eagle": EagleFormat("sglang"), "eagle_vllm": EagleFormat("vllm"),
               "eagle3": Eagle3Format("sglang"), "eagle3_vllm": Eagle3Format("vllm"),
               "speculators": SpeculatorsFormat(), "medusa": MedusaFormat(), "medusa_vllm": MedusaVllmFormat()}
    if name not in formats:
        raise ExportError(f"format={name!r} is not one of {sorted(formats)} (or 'engine')")
    return formats[name]


FORMAT_NAMES = ("native", "eagle", "eagle_vllm", "eagle3", "eagle3_vllm", "speculators", "medusa", "medusa_vllm")
ENGINE_FORMATS = {"eagle": ("eagle", "eagle_vllm"), "eagle3": ("eagle3", "eagle3_vllm", "speculators"),
                  "medusa": ("medusa", "medusa_vllm")}


def resolve_formats(formats: list[str] | tuple[str, ...], kind: str) -> list[str]:
    """Expand `engine` (every engine layout of the head type) and check each format fits the head."""
    resolved: list[str] = []
    for name in formats:
        for fmt in ENGINE_FORMATS[kind] if name == "engine" else (name,):
            if fmt not in FORMAT_NAMES:
                raise ExportError(f"export.formats: {fmt!r} is not one of {list(FORMAT_NAMES)} or 'engine'")
            if fmt != "native" and get_format(fmt).head_type != kind:
                raise ExportError(f"export.formats: {fmt!r} exports {get_format(fmt).head_type} heads, "
                                  f"but this head is {kind!r}")
            if fmt not in resolved:
                resolved.append(fmt)
    return resolved


def shape_problems(tensors: Tensors, expected: dict[str, tuple[int, ...]], file: str) -> list[str]:
    """Missing keys, unexpected keys and wrong shapes, each naming the key."""
    problems = [f"{file}: missing key {key!r} (expected shape {list(shape)})"
                for key, shape in expected.items() if key not in tensors]
    problems += [f"{file}: unexpected key {key!r}" for key in tensors if key not in expected]
    problems += [f"{file}: {key!r} has shape {list(tensors[key].shape)}, expected {list(shape)}"
                 for key, shape in expected.items() if key in tensors and tuple(tensors[key].shape) != shape]
    return problems
