"""Export formats: pure mappings between our head state and an engine's files, and back.

A format turns (head state, head config, base-model tensors) into the tensors of one safetensors
file plus one JSON config, says which keys and shapes a folder of that format must hold, checks
the JSON against the head config, and maps the tensors back to our head state. No I/O here: the
writer (`export.writer`) and the validator (`export.validate`) do the files.
"""
from __future__ import annotations

import dataclasses

import torch

from export.dflash import DflashFormat
from export.eagle import EagleFormat
from export.eagle3 import Eagle3Format
from export.layout import (  # noqa: F401  (the shared types, for modules that read them here)
    DTYPES, EXPORT_FORMAT_VERSION, BaseModel, ExportError, Format, Tensors, shape_problems, torch_dtype,
)
from export.medusa import MedusaFormat, MedusaVllmFormat
from export.peagle import PeagleSpeculatorsFormat
from export.speculators import SpeculatorsFormat
from heads.io import CONFIG_NAME as NATIVE_CONFIG_NAME
from heads.io import FORMAT_VERSION as NATIVE_FORMAT_VERSION
from heads.io import WEIGHTS_NAME as NATIVE_WEIGHTS_NAME
from heads.io import head_type

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


# Every layout, one line each: the names, and each head kind's engine layouts (its `head_type`, in
# this order), derive from it. A new kind's layout is its file in export/ plus one line here.
FORMATS: dict[str, Format] = {layout.name: layout for layout in (
    NativeFormat(),
    EagleFormat("sglang"), EagleFormat("vllm"),
    Eagle3Format("sglang"), Eagle3Format("vllm"), SpeculatorsFormat(),
    MedusaFormat(), MedusaVllmFormat(),
    PeagleSpeculatorsFormat(),
    DflashFormat(),
)}
FORMAT_NAMES = tuple(FORMATS)
ENGINE_FORMATS = {kind: tuple(name for name, layout in FORMATS.items() if layout.head_type == kind)
                  for kind in dict.fromkeys(layout.head_type for layout in FORMATS.values()) if kind != "any"}


def get_format(name: str) -> Format:
    """The format object for one of FORMAT_NAMES."""
    if name not in FORMATS:
        raise ExportError(f"format={name!r} is not one of {sorted(FORMATS)} (or 'engine')")
    return FORMATS[name]


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
