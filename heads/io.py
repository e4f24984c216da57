"""Native head checkpoint: `head_config.json` + `model.safetensors`, each written atomically.

head_config.json = {"type": "eagle" | "eagle3" | "medusa" | "dflash" | "peagle", "config": {<its config dataclass's fields>},
                    "format_version": 1, **extra}
The head's draft vocabulary is part of its weights: `draft_vocab` (sorted target ids, EAGLE-1/2
and Medusa with config draft_vocab_size > 0) or `d2t`/`t2d` (EAGLE-3, P-EAGLE); heads/vocab.py.
A training checkpoint (train/checkpoint.py) is such a folder plus `trainer_state.json`, which
records each file's bytes and sha256; `load_head` checks the head's files against it.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from heads.dflash import DflashConfig, DflashHead
from heads.eagle import EagleConfig, EagleHead
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.medusa import MedusaConfig, MedusaHeads
from heads.peagle import PeagleConfig, PeagleHead
from heads.vocab import VOCAB_KEY, check_ids, stores_id_list

CONFIG_NAME = "head_config.json"
WEIGHTS_NAME = "model.safetensors"
STATE_NAME = "trainer_state.json"  # a training checkpoint's record of its files (train/checkpoint.py)
FORMAT_VERSION = 1
_TYPES = {"eagle": (EagleConfig, EagleHead), "eagle3": (Eagle3Config, Eagle3Head), "medusa": (MedusaConfig, MedusaHeads),
          "dflash": (DflashConfig, DflashHead), "peagle": (PeagleConfig, PeagleHead)}


class HeadMismatchError(ValueError):
    """A head does not belong to the target it is paired with; the message names the fields."""


class HeadFileError(ValueError):
    """A head or checkpoint file that cannot be used: not readable, not JSON, damaged, or holding
    non-finite weights. The message names the file."""


class DiskFullError(OSError):
    """A write ran out of disk space; the message names the folder and the bytes it needed."""

    def __init__(self, message: str):
        super().__init__(message)  # one argument: str() is the message alone, without "[Errno 28]"
        self.errno = errno.ENOSPC


def tensor_bytes(value) -> int:
    """Bytes of the tensors in a (nested) state dict: about what writing it takes on disk."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item) for item in value)
    return 0


def raise_if_disk_full(error: BaseException, folder: str | os.PathLike, needed_bytes: int, what: str,
                       advice: str) -> None:
    """Call in an `except` block after the write's temporaries are removed: raise DiskFullError
    when `error` is the disk running out of space. The writers do not say so in one way: an
    OSError says ENOSPC, but torch.save raises a RuntimeError ("enforce fail at inline_container.cc")
    and safetensors a SafetensorError, so any other failed write counts as full when the folder's
    disk has less free than the write needed."""
    folder = Path(folder).resolve()
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    free = shutil.disk_usage(existing).free
    if isinstance(error, OSError):
        full = error.errno in (errno.ENOSPC, errno.EDQUOT)
    else:
        full = isinstance(error, Exception) and free < needed_bytes
    if full:
        raise DiskFullError(f"{folder}: no space left on its disk: {what} needs about {needed_bytes:,} bytes "
                            f"and {free:,} are free; {advice}") from None


def non_finite_keys(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Keys of floating tensors holding a NaN or an infinity."""
    return [key for key, value in tensors.items()
            if value.is_floating_point() and not bool(torch.isfinite(value).all())]


def read_weights(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A safetensors file -> tensors; a damaged or truncated file is a HeadFileError naming it."""
    from safetensors import SafetensorError

    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError) as error:
        raise HeadFileError(f"{path}: not a readable safetensors file ({error}); it is damaged, truncated or "
                            "was not written by specheads") from None


def read_json(path: str | os.PathLike) -> dict:
    """A JSON object file; text that is not a JSON object is a HeadFileError naming the path."""
    try:
        values = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HeadFileError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(values, dict):
        raise HeadFileError(f"{path}: a JSON {type(values).__name__}, expected an object")
    return values


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def recorded_file_problems(directory: str | os.PathLike, files: dict, checksums: bool = True) -> list[str]:
    """Problems naming each file of `directory` that is missing or differs from its record in
    `files` ({name: {"bytes", "sha256"}}, or {name: bytes} in checkpoints saved before checksums):
    its size always, its sha256 with `checksums`."""
    problems = []
    for name, entry in files.items():
        file = Path(directory) / name
        size, digest = (entry["bytes"], entry.get("sha256")) if isinstance(entry, dict) else (int(entry), None)
        if not file.is_file():
            problems.append(f"{file}: missing")
        elif file.stat().st_size != size:
            problems.append(f"{file}: {file.stat().st_size} bytes, {STATE_NAME} recorded {size} (truncated)")
        elif checksums and digest is not None and sha256_file(file) != digest:
            problems.append(f"{file}: sha256 differs from the one recorded when it was saved (damaged)")
    return problems


def _check_recorded_files(directory: Path) -> None:
    """A file damaged at the same size passes every other check; a checkpoint's own record of its
    files catches it wherever the head is read (export, eval, init_from), not only on resume."""
    path = directory / STATE_NAME
    if not path.is_file():
        return  # a head folder that is not a training checkpoint records no checksums
    files = read_json(path).get("files")
    if not isinstance(files, dict):
        raise HeadFileError(f"{path}: no 'files' record; the checkpoint is incomplete")
    head_files = {name: entry for name, entry in files.items() if name in (CONFIG_NAME, WEIGHTS_NAME)}
    problems = recorded_file_problems(directory, head_files)
    if problems:
        raise HeadFileError(f"{directory} is a damaged checkpoint: " + "; ".join(problems))


def head_type(config) -> str:
    for name, (config_class, _) in _TYPES.items():
        if type(config) is config_class:  # exact: a PeagleConfig is also an Eagle3Config
            return name
    raise TypeError(f"unknown head config {type(config).__name__}")


def build_head(config) -> nn.Module:
    """A freshly initialised head for an EagleConfig, Eagle3Config or MedusaConfig (and the other _TYPES)."""
    return _TYPES[head_type(config)][1](config)


def config_from_dict(kind: str, values: dict):
    if kind not in _TYPES:
        raise ValueError(f"head type {kind!r} is not one of {sorted(_TYPES)}")
    config = _TYPES[kind][0](**values)
    heads = getattr(config, "num_attention_heads", None)
    # Building the head would fail deep inside transformers' LlamaConfig (RoPE) with a traceback.
    if heads is not None and (not isinstance(heads, int) or heads < 1 or config.hidden_size % heads):
        raise ValueError(f"config.hidden_size={config.hidden_size} is not a multiple of "
                         f"config.num_attention_heads={heads!r}")
    return config


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
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
    bad = non_finite_keys(tensors)
    if bad:
        raise HeadFileError(f"{directory}: not written, the head holds NaN or infinite weights in {bad[:8]}")
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"type": head_type(config), "config": config.to_dict(), "format_version": FORMAT_VERSION, **(extra or {})}
    _atomic_write(directory / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    _atomic_write(directory / CONFIG_NAME, lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2)))
    return directory


def fingerprint_differences(ours: dict | None, theirs: dict | None) -> list[tuple[str, object, object]]:
    """(key, ours, theirs) for each fingerprint field that differs; the `id` only when every named
    field agrees (it is their digest, so it differs whenever one of them does)."""
    ours, theirs = ours or {}, theirs or {}
    found = [(key, ours.get(key), theirs.get(key)) for key in sorted(set(ours) | set(theirs))
             if key != "id" and ours.get(key) != theirs.get(key)]
    if not found and ours.get("id") != theirs.get("id"):
        found.append(("id", ours.get("id"), theirs.get("id")))
    return found


def check_against_target(config, target, strict_fingerprint: bool = True) -> None:
    """Raise HeadMismatchError naming every field where `config` disagrees with the target."""
    problems = []
    if config.hidden_size != target.hidden_size:
        problems.append(f"hidden_size: head {config.hidden_size} vs target {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocab_size: head {config.vocab_size} vs target {target.vocab_size}")
    if strict_fingerprint:
        problems += [f"target_fingerprint.{key}: head {ours!r} vs target {theirs!r}"
                     for key, ours, theirs in fingerprint_differences(config.target_fingerprint, target.fingerprint())]
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
    meta = read_json(path)
    if not isinstance(meta.get("config"), dict) or "type" not in meta:
        raise HeadFileError(f"{path}: needs 'type' and a 'config' object")
    return meta


def load_head(directory: str | os.PathLike, target=None, strict_fingerprint: bool = True,
              device: str | torch.device = "cpu"):
    """Load a native head checkpoint -> (head, config, meta). With a target, refuse a head that
    does not belong to it (HeadMismatchError); a damaged file, or weights with NaN or infinities,
    is a HeadFileError naming the file; so is a checkpoint file whose sha256 differs from the one
    its trainer_state.json recorded."""
    meta = read_head_meta(directory)
    _check_recorded_files(Path(directory))
    try:
        config = config_from_dict(meta["type"], meta["config"])
    except (TypeError, ValueError) as error:
        raise HeadFileError(f"{Path(directory) / CONFIG_NAME}: {error}") from None
    if target is not None:
        check_against_target(config, target, strict_fingerprint)
    with torch.device("meta"):
        head = build_head(config)
    weights = Path(directory) / WEIGHTS_NAME
    state = read_weights(weights, device)
    bad = non_finite_keys(state)
    if bad:
        raise HeadFileError(f"{weights}: NaN or infinite values in {bad[:8]}; the head cannot be used")
    try:
        head.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as error:  # missing, unexpected or misshapen keys
        raise HeadFileError(f"{weights} does not match {CONFIG_NAME}: {error}") from None
    if stores_id_list(config):
        try:
            check_ids(head.draft_vocab, config.vocab_size, f"{weights}: {VOCAB_KEY}")
        except ValueError as error:
            raise HeadFileError(str(error)) from None
    # Non-persistent buffers (RoPE frequencies) are rebuilt on the real device.
    for name, buffer in list(head.named_buffers()):
        if buffer.is_meta:
            fresh = build_buffers(config)[name]
            module_name, _, leaf = name.rpartition(".")
            head.get_submodule(module_name).register_buffer(leaf, fresh.to(device), persistent=False)
    return head, config, meta


def build_buffers(config) -> dict[str, torch.Tensor]:
    if isinstance(config, (EagleConfig, Eagle3Config, DflashConfig)):
        from heads.eagle import rope_inv_freq

        return {"inv_freq": rope_inv_freq(config)[0]}
    return {}
