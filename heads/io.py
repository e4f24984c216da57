"""Native head checkpoint: `head_config.json` + `model.safetensors`, each written atomically.

head_config.json = {"type": "eagle" | "eagle3" | "medusa", "config": {<EagleConfig | Eagle3Config | MedusaConfig fields>},
                    "format_version": 1, **extra}
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from heads.eagle import EagleConfig, EagleHead
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.medusa import MedusaConfig, MedusaHeads

CONFIG_NAME = "head_config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1
_TYPES = {"eagle": (EagleConfig, EagleHead), "eagle3": (Eagle3Config, Eagle3Head), "medusa": (MedusaConfig, MedusaHeads)}


class HeadMismatchError(ValueError):
    """A head does not belong to the target it is paired with; the message names the fields."""


def head_type(config) -> str:
    for name, (config_class, _) in _TYPES.items():
        if isinstance(config, config_class):
            return name
    raise TypeError(f"unknown head config {type(config).__name__}")


def build_head(config) -> nn.Module:
    """A freshly initialised head for an EagleConfig, Eagle3Config or MedusaConfig."""
    return _TYPES[head_type(config)][1](config)


def config_from_dict(kind: str, values: dict):
    if kind not in _TYPES:
        raise ValueError(f"head type {kind!r} is not one of {sorted(_TYPES)}")
    return _TYPES[kind][0](**values)


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".tmp-", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_head(directory: str | os.PathLike, head: nn.Module, config, extra: dict | None = None) -> Path:
    """Write the head's weights and config into `directory` (created if needed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
    meta = {"type": head_type(config), "config": config.to_dict(), "format_version": FORMAT_VERSION, **(extra or {})}
    _atomic_write(directory / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    _atomic_write(directory / CONFIG_NAME, lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2)))
    return directory


def check_against_target(config, target, strict_fingerprint: bool = True) -> None:
    """Raise HeadMismatchError naming every field where `config` disagrees with the target."""
    problems = []
    if config.hidden_size != target.hidden_size:
        problems.append(f"hidden_size: head {config.hidden_size} vs target {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocab_size: head {config.vocab_size} vs target {target.vocab_size}")
    if strict_fingerprint:
        theirs = target.fingerprint()
        ours = config.target_fingerprint or {}
        for key in sorted(set(ours) | set(theirs)):
            if key != "id" and ours.get(key) != theirs.get(key):
                problems.append(f"target_fingerprint.{key}: head {ours.get(key)!r} vs target {theirs.get(key)!r}")
        if not problems and ours.get("id") != theirs.get("id"):
            problems.append(f"target_fingerprint.id: head {ours.get('id')!r} vs target {theirs.get('id')!r}")
    if problems:
        raise HeadMismatchError(
            f"head trained for {config.target_name or '?'} does not match target {target.name}: "
            + "; ".join(problems)
            + (" (strict_fingerprint=False skips the fingerprint check)" if strict_fingerprint else "")
        )


def read_head_meta(directory: str | os.PathLike) -> dict:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a head checkpoint: {CONFIG_NAME} missing")
    return json.loads(path.read_text())


def load_head(directory: str | os.PathLike, target=None, strict_fingerprint: bool = True,
              device: str | torch.device = "cpu"):
    """Load a native head checkpoint -> (head, config, meta). With a target, refuse a head that
    does not belong to it (HeadMismatchError)."""
    meta = read_head_meta(directory)
    config = config_from_dict(meta["type"], meta["config"])
    if target is not None:
        check_against_target(config, target, strict_fingerprint)
    with torch.device("meta"):
        head = build_head(config)
    state = load_file(str(Path(directory) / WEIGHTS_NAME), device=str(device))
    head.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers (RoPE frequencies) are rebuilt on the real device.
    for name, buffer in list(head.named_buffers()):
        if buffer.is_meta:
            fresh = build_buffers(config)[name]
            module_name, _, leaf = name.rpartition(".")
            head.get_submodule(module_name).register_buffer(leaf, fresh.to(device), persistent=False)
    return head, config, meta


def build_buffers(config) -> dict[str, torch.Tensor]:
    if isinstance(config, (EagleConfig, Eagle3Config)):
        from heads.eagle import rope_inv_freq

        return {"inv_freq": rope_inv_freq(config)[0]}
    return {}
