"""Check an export folder against its format's schema and a base model, and load it back."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from export.formats import get_format
from export.layout import DTYPES as _DTYPES
from export.layout import EXPORT_FORMAT_VERSION, ExportError, Format, shape_problems
from export.manifest import MANIFEST_NAME
from export.vocab_file import has_sidecar, read_sidecar, sidecar_name, vocab_problems
from heads.io import CONFIG_NAME as NATIVE_CONFIG_NAME
from heads.vocab import VOCAB_KEY
from heads.io import (HeadFileError, build_buffers, build_head, check_against_target, config_from_dict,
                      fingerprint_differences, load_head, non_finite_keys, read_weights, sha256_file)

_REQUIRED = ("format", "format_version", "head_type", "dtype", "head_config", "base_model", "files", "runtime",
             "feature_layer")
_OBJECTS = ("head_config", "base_model", "files", "runtime", "feature_layer")


class ExportValidationError(ExportError):
    """An export folder does not match its schema or the base model; `problems` names each field."""

    def __init__(self, folder, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"{folder} is not a valid export:\n  - " + "\n  - ".join(self.problems))


def existing_folder(folder: str | os.PathLike) -> Path:
    """`folder` as a Path; a path that does not exist, or a file, is an OSError saying so (not
    "not a valid export", which sends a user looking for what is wrong inside it)."""
    folder = Path(folder)
    if not folder.exists():
        raise FileNotFoundError(f"{folder} does not exist (expected a head checkpoint or an export folder)")
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is a file, not a head checkpoint or an export folder")
    return folder


def read_manifest(folder: str | os.PathLike) -> dict:
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        raise ExportValidationError(folder, [f"{MANIFEST_NAME}: missing (not a complete specheads export)"])
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ExportValidationError(folder, [f"{MANIFEST_NAME}: not valid JSON ({error})"]) from None
    missing = [f"{MANIFEST_NAME}.{key}: missing" for key in _REQUIRED if key not in manifest]
    missing += [f"{MANIFEST_NAME}.{key}: {type(manifest[key]).__name__}, expected an object"
                for key in _OBJECTS if key in manifest and not isinstance(manifest[key], dict)]
    if missing:
        raise ExportValidationError(folder, missing)
    if manifest["format_version"] != EXPORT_FORMAT_VERSION:
        raise ExportValidationError(folder, [f"{MANIFEST_NAME}.format_version: {manifest['format_version']!r}, "
                                             f"this specheads reads {EXPORT_FORMAT_VERSION}"])
    if manifest["dtype"] not in _DTYPES:
        raise ExportValidationError(folder, [f"{MANIFEST_NAME}.dtype: {manifest['dtype']!r} is not one of "
                                             f"{sorted(_DTYPES)}"])
    return manifest


def _layout_and_config(folder, manifest: dict) -> tuple[Format, object]:
    try:
        layout = get_format(manifest["format"])
        config = config_from_dict(manifest["head_type"], manifest["head_config"])
    except (ExportError, ValueError, TypeError) as error:
        raise ExportValidationError(folder, [f"{MANIFEST_NAME}.format/head_type/head_config: {error}"]) from None
    if layout.head_type not in ("any", manifest["head_type"]):
        raise ExportValidationError(folder, [f"{MANIFEST_NAME}.head_type: {manifest['head_type']!r}, but format "
                                             f"{layout.name!r} holds {layout.head_type} heads"])
    return layout, config


def _file_problems(folder: Path, layout: Format, manifest: dict, config) -> list[str]:
    problems = []
    for name in (layout.weights_file, layout.config_file,
                 *([sidecar_name(manifest)] if has_sidecar(layout, config) else [])):
        info = manifest["files"].get(name)
        if not (folder / name).is_file():
            problems.append(f"{name}: missing")
        elif not isinstance(info, dict) or "sha256" not in info:
            problems.append(f"{MANIFEST_NAME}.files.{name}.sha256: missing")
        elif sha256_file(folder / name) != info["sha256"]:
            problems.append(f"{name}: sha256 differs from {MANIFEST_NAME}.files.{name}.sha256 "
                            "(the file changed after export)")
    return problems


def _identity_problems(manifest: dict, config) -> list[str]:
    """The two records of the target, head_config.target_fingerprint (what eval checks) and
    base_model.fingerprint (what `validate base=` checks), must name one model."""
    head_side = getattr(config, "target_fingerprint", None)
    if not head_side:
        return []
    return [f"{MANIFEST_NAME}: head_config.target_fingerprint.{key} {ours!r} differs from "
            f"base_model.fingerprint.{key} {theirs!r}" for key, ours, theirs in
            fingerprint_differences(head_side, manifest["base_model"].get("fingerprint"))]


def _read_tensors(folder: Path, layout: Format) -> dict:
    try:
        return read_weights(folder / layout.weights_file)
    except HeadFileError as error:
        raise ExportValidationError(folder, [str(error)]) from None


def _base_problems(manifest: dict, layout: Format, config, tensors: dict, target) -> list[str]:
    problems = [f"base_model.fingerprint.{key}: export {ours!r} vs base {theirs!r}" for key, ours, theirs in
                fingerprint_differences(manifest["base_model"].get("fingerprint"), target.fingerprint())]
    problems += [f"head_config.target_fingerprint.{key}: export {ours!r} vs base {theirs!r}" for key, ours, theirs in
                 fingerprint_differences(getattr(config, "target_fingerprint", None), target.fingerprint())]
    tokenizer_hash = manifest["base_model"].get("tokenizer_hash")
    if tokenizer_hash and getattr(target, "tokenizer", None) is not None and target.tokenizer_hash() != tokenizer_hash:
        problems.append(f"base_model.tokenizer_hash: export {tokenizer_hash!r} vs base {target.tokenizer_hash()!r}")
    dtype = _DTYPES[manifest["dtype"]]
    weights = {"embedding": target.embed_tokens.weight, "lm_head": target.lm_head.weight}
    for key, what in layout.base_copies(config).items():
        weight = weights[what]
        if key in tensors and tensors[key].shape == weight.shape:
            if not torch.equal(tensors[key], weight.detach().to("cpu", dtype)):
                problems.append(f"{layout.weights_file}: {key!r} differs from the base model's {what}")
    return problems


def validate_export(folder: str | os.PathLike, target=None) -> dict:
    """Check every key, shape, dtype and config field of an export folder against its format (and,
    with `target`, against that base model's fingerprint and tensors). Raises
    ExportValidationError naming each bad field; returns a summary dict."""
    folder = existing_folder(folder)
    manifest = read_manifest(folder)
    layout, config = _layout_and_config(folder, manifest)
    problems = _file_problems(folder, layout, manifest, config)
    if problems:
        raise ExportValidationError(folder, problems)
    try:
        config_json = json.loads((folder / layout.config_file).read_text())
    except json.JSONDecodeError as error:
        raise ExportValidationError(folder, [f"{layout.config_file}: not valid JSON ({error})"]) from None
    problems += layout.check_config(config_json, config, manifest["dtype"])
    problems += _identity_problems(manifest, config)
    tensors = _read_tensors(folder, layout)
    problems += shape_problems(tensors, layout.expected_shapes(config), layout.weights_file)
    problems += vocab_problems(folder, layout, config, tensors, sidecar_name(manifest))
    problems += [f"{layout.weights_file}: {key!r} holds NaN or infinite values" for key in non_finite_keys(tensors)]
    dtype = _DTYPES[manifest["dtype"]]
    problems += [f"{layout.weights_file}: {key!r} has dtype {str(value.dtype).removeprefix('torch.')}, "
                 f"expected {manifest['dtype']}"
                 for key, value in tensors.items() if value.is_floating_point() and value.dtype != dtype]
    if not problems:
        try:
            layout.to_state(tensors, config)
        except ExportError as error:
            problems.append(f"{layout.weights_file}: {error}")
    if target is not None:
        problems += _base_problems(manifest, layout, config, tensors, target)
    if problems:
        raise ExportValidationError(folder, problems)
    return {"folder": str(folder), "format": layout.name, "head_type": manifest["head_type"],
            "dtype": manifest["dtype"], "keys": len(tensors),
            "parameters": sum(value.numel() for value in tensors.values()), "base_checked": target is not None,
            "base_fingerprint_id": manifest["base_model"]["fingerprint"].get("id")}


def load_export(folder: str | os.PathLike, target=None, strict_fingerprint: bool = True,
                dtype: str | None = "float32"):
    """Load any export (one of FORMAT_NAMES) or a plain head checkpoint back into
    a head -> (head, config, manifest). With `target`, refuse a head that does not belong to it.
    `dtype`: cast the head's weights (None keeps the file's dtype)."""
    folder = existing_folder(folder)
    if not (folder / MANIFEST_NAME).is_file() and (folder / NATIVE_CONFIG_NAME).is_file():
        head, config, meta = load_head(folder, target, strict_fingerprint)
        manifest = {"format": "checkpoint", **meta}
    else:
        validate_export(folder, None)
        manifest = read_manifest(folder)
        layout, config = _layout_and_config(folder, manifest)
        if target is not None:
            check_against_target(config, target, strict_fingerprint)
        state = layout.to_state(_read_tensors(folder, layout), config)
        if has_sidecar(layout, config):  # validated above
            state[VOCAB_KEY] = read_sidecar(folder, sidecar_name(manifest))
        with torch.device("meta"):
            head = build_head(config)
        head.load_state_dict(state, strict=True, assign=True)
        for name, fresh in build_buffers(config).items():  # non-persistent buffers (RoPE) on the CPU
            module_name, _, leaf = name.rpartition(".")
            module = head.get_submodule(module_name) if module_name else head
            module.register_buffer(leaf, fresh, persistent=False)
    if dtype is not None:
        head = head.to(_DTYPES[dtype])
    return head, config, manifest
