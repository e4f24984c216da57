"""The types every export format shares: the tensors a format writes, the base model's identity
and shared tensors, the Format protocol, and the checks a folder's weights must pass. Each format
module (export/eagle.py, eagle3.py, speculators.py, medusa.py) imports these; export/formats.py
collects the formats by name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

Tensors = dict[str, torch.Tensor]

# A format's files change only with this number; validate() refuses versions it does not know.
EXPORT_FORMAT_VERSION = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    """A head cannot be exported in the asked format, or an export cannot be read back."""


class LayoutCannotHold(ExportError):
    """The layout has no place for one of the head's options (its engines would load it wrong)."""


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


def shape_problems(tensors: Tensors, expected: dict[str, tuple[int, ...]], file: str) -> list[str]:
    """Missing keys, unexpected keys and wrong shapes, each naming the key."""
    problems = [f"{file}: missing key {key!r} (expected shape {list(shape)})"
                for key, shape in expected.items() if key not in tensors]
    problems += [f"{file}: unexpected key {key!r}" for key in tensors if key not in expected]
    problems += [f"{file}: {key!r} has shape {list(tensors[key].shape)}, expected {list(shape)}"
                 for key, shape in expected.items() if key in tensors and tuple(tensors[key].shape) != shape]
    return problems
