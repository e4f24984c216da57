"""Write an export folder atomically: everything goes into a temp folder beside the destination,
`specheads.json` last, and the folder is renamed into place only when complete and valid."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from export.formats import ExportError, get_format, resolve_formats, torch_dtype
from export.layout import LayoutCannotHold
from export.manifest import (MANIFEST_NAME, README_NAME, base_model_from_target, build_manifest, model_card,
                             recommended_runtime)
from export.vocab_file import VOCAB_FILE, manifest_entry, split_state, write_sidecar
from export.validate import ExportValidationError, read_manifest, validate_export
from heads.io import (check_against_target, fingerprint_differences, head_type, non_finite_keys, raise_if_disk_full,
                      sha256_file, tensor_bytes)

log = logging.getLogger(__name__)

_SGLANG_EAGLE_TARGETS = {"LlamaForCausalLM", "Qwen2ForCausalLM"}  # SGLang's {arch}Eagle classes

def prepare_tensors(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Cast floating tensors to `dtype` on the CPU, each into its own storage: safetensors refuses
    tensors that share memory (tied embeddings, one lm_head copied into K Medusa heads)."""
    out = {}
    for key, value in tensors.items():
        value = value.detach()
        cast = dtype if value.is_floating_point() else value.dtype
        out[key] = value.to(device="cpu", dtype=cast, copy=True).contiguous()
    return out


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_json(path: Path, values: dict) -> None:
    with open(path, "w") as handle:
        json.dump(values, handle, indent=2)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def _write_weights(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o644)  # readable by the serving user, like the JSON files
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _auto_notes(fmt_name: str, config, base) -> list[str]:
    notes = []
    if fmt_name == "eagle" and not config.fc_bias:
        notes.append("fc.bias is all zeros: the head has no fc bias, and SGLang would leave a missing fc.bias "
                     "at its random initial value; config.json has no `bias` key because SGLang reads it as "
                     "attention bias (the EAGLE loader reads a missing `bias` as true, matching fc.bias).")
    if fmt_name == "eagle" and base.architecture not in _SGLANG_EAGLE_TARGETS:
        notes.append(f"SGLang registers EAGLE-1 draft classes for {sorted(_SGLANG_EAGLE_TARGETS)} targets; "
                     f"check that it has {base.architecture}Eagle before serving this folder.")
    if fmt_name == "medusa" and config.share_lm_head:
        notes.append("trained with the target's frozen lm_head (share_lm_head): each `{h}.{L}.weight` is a copy "
                     "of the base model's lm_head, because TensorRT-LLM loads one lm_head per Medusa head.")
    if base.name.startswith("embedded:"):
        notes.append(f"trained on {base.name}, a dequantized Q4_1 GGUF of {base.hub_id}: features of the "
                     "full-precision hub weights differ slightly, so acceptance may differ a little.")
    return notes


def check_destination(out: Path, fmt: str, kind: str, overwrite: bool = False) -> None:
    """Refuse a destination whose contents the user may own. A missing or empty folder is free; an
    earlier export of the same format and head type is replaced (a re-export); any other export only
    with `overwrite`; a folder without a valid specheads.json, a file, or the working folder never.
    Replacing an export replaces only the files it wrote (`_user_files` keeps the rest)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"out={out} is a file, not a folder; choose another out=")
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        raise ExportError(f"out={out} is the working folder or holds it; an export replaces its whole folder, "
                          "so choose a new folder for out=")
    if not any(out.iterdir()):
        return
    try:
        manifest = read_manifest(out)
    except ExportValidationError as error:
        raise ExportError(f"out={out} exists and is not a specheads export ({error.problems[0]}); it is not "
                          "replaced, even with overwrite=true: choose another out= or empty it yourself") from None
    if overwrite or (manifest["format"], manifest["head_type"]) == (fmt, kind):
        return
    raise ExportError(f"out={out} holds a {manifest['format']} export of a {manifest['head_type']} head; writing "
                      f"a {fmt} export of a {kind} head there would replace it: pass overwrite=true "
                      "(export.overwrite=true in a job) or choose another out=")


def _user_files(out: Path, written: set[str]) -> list[str]:
    """Names at the top of an earlier export `out` that it did not write (its manifest's `files`,
    README.md, specheads.json): the user's, carried into the new export. Refuses one that the new
    export would write (`written`), since keeping it and writing ours cannot both happen."""
    if not out.is_dir() or not (out / MANIFEST_NAME).is_file():
        return []
    owned = {*read_manifest(out)["files"], README_NAME, MANIFEST_NAME}
    theirs = sorted(entry.name for entry in out.iterdir() if entry.name not in owned)
    clash = [name for name in theirs if name in written]
    if clash:
        raise ExportError(f"out={out} holds {clash[0]}, which the earlier export did not write and this one "
                          "would: move it out of the folder or choose another out=")
    return theirs


def _carry(names: list[str], out: Path, tmp: Path) -> None:
    """Copy the user's files from the old export into the new one: copies, not moves, so the old
    folder stays whole until the new one is renamed over it."""
    for name in names:
        source = out / name
        if source.is_dir() and not source.is_symlink():
            shutil.copytree(source, tmp / name, symlinks=True)
        else:
            shutil.copy2(source, tmp / name, follow_symlinks=False)
    if names:
        log.info("kept %d file(s) of yours from the earlier export in %s: %s", len(names), out, ", ".join(names))


def _size(path: Path) -> int:
    if path.is_dir() and not path.is_symlink():
        return sum(file.lstat().st_size for file in path.rglob("*"))
    return path.lstat().st_size


def _for_base(config, target):
    """(config, notes): a head exported for another base model than its own (strict_fingerprint
    off) carries the base's fingerprint, so the manifest names one model in both places; a note
    keeps the one it was trained on."""
    own = getattr(config, "target_fingerprint", None)
    if not own or not fingerprint_differences(own, target.fingerprint()):
        return config, []
    note = (f"trained on {config.target_name or 'another target'} (fingerprint {own.get('id')}), exported for "
            f"{target.name} (fingerprint {target.fingerprint().get('id')}) with strict_fingerprint=false")
    return dataclasses.replace(config, target_fingerprint=target.fingerprint(), target_name=target.name), [note]


def _place(tmp: Path, out: Path) -> None:
    """Rename the finished temp folder to `out`, replacing an older export there."""
    if not out.exists():
        os.replace(tmp, out)
        _fsync_dir(out.parent)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    moved = False
    try:
        os.replace(out, old / out.name)
        moved = True
        try:
            os.replace(tmp, out)
        except BaseException:
            os.replace(old / out.name, out)  # put the previous export back
            moved = False
            raise
        _fsync_dir(out.parent)
    finally:
        if not (moved and not out.exists()):  # keep `old` only when it holds the sole copy
            shutil.rmtree(old, ignore_errors=True)


def export_head(head: nn.Module, config, fmt: str, out_dir: str | os.PathLike, target, dtype: str = "bfloat16",
                manifest_extra: dict | None = None, strict_fingerprint: bool = True, overwrite: bool = False) -> Path:
    """Export a trained head in format `fmt` (one of export.formats.FORMAT_NAMES) to `out_dir`.

    target: the FrozenTarget the head was trained on (its embedding / lm_head go into the engine
    files; its fingerprint into the manifest). manifest_extra: optional `runtime` (the
    heads.recommended.RecommendedRuntime eval chose), dicts `training` (steps, tokens, held-out
    accuracies, ...) and `eval` (tau, speedup, hardware, ...), `notes` (list
    of str), `base_model_id` (hub id engines load the base by). An existing `out_dir` is replaced
    only when it is an earlier export of the same format and head type, or with `overwrite` any
    export (`check_destination`); files in it that the earlier export did not write are kept.
    Returns the folder; it is validated before it is renamed into place, and logged as a W&B
    artifact when a run is active.
    """
    layout = get_format(fmt)
    kind = head_type(config)
    resolve_formats([fmt], kind)
    check_against_target(config, target, strict_fingerprint)
    out = Path(out_dir).resolve()
    check_destination(out, layout.name, kind, overwrite)
    bad = non_finite_keys(head.state_dict())
    if bad:
        raise ExportError(f"the head holds NaN or infinite weights in {bad[:8]}; nothing exported to {out}")
    extra = dict(manifest_extra or {})
    config, relabelled = _for_base(config, target)
    extra["notes"] = [*relabelled, *(extra.get("notes") or [])]
    base = base_model_from_target(target, extra.get("base_model_id"))
    cast = torch_dtype(dtype)
    state, vocab = split_state(head.state_dict(), layout, config)  # engine files keep FORMATS.md's keys
    tensors, config_json = layout.to_files(state, config, base, dtype)
    tensors = prepare_tensors(tensors, cast)
    bad = non_finite_keys(tensors)
    if bad:
        raise ExportError(f"weights {bad[:8]} do not fit in {dtype} (values beyond its range become infinite); "
                          f"export in bfloat16 or float32. Nothing exported to {out}")
    written = {layout.weights_file, layout.config_file, README_NAME, MANIFEST_NAME,
               *([VOCAB_FILE] if vocab is not None else [])}
    kept = _user_files(out, written)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)
        own_notes = layout.notes(config, base) if hasattr(layout, "notes") else []
        extra["notes"] = [*_auto_notes(fmt, config, base), *own_notes, *(extra.get("notes") or [])]
        if hasattr(layout, "add_runtime"):  # e.g. the Medusa tree eval used travels in config.json too
            layout.add_runtime(config_json, recommended_runtime(config, extra.get("runtime")))
        _write_weights(tmp / layout.weights_file, tensors)
        _write_json(tmp / layout.config_file, config_json)
        names = [layout.weights_file, layout.config_file]
        if vocab is not None:
            write_sidecar(tmp, vocab)
            names.append(VOCAB_FILE)
        files = {name: {"sha256": sha256_file(tmp / name), "bytes": (tmp / name).stat().st_size} for name in names}
        manifest = build_manifest(layout, config, base, target, dtype, files, extra)
        if manifest_entry(layout, config) is not None:
            manifest["draft_vocab"] = manifest_entry(layout, config)
        _carry(kept, out, tmp)
        (tmp / README_NAME).write_text(model_card(manifest))
        _write_json(tmp / MANIFEST_NAME, manifest)  # last: a folder without it is not an export
        validate_export(tmp, target)  # also checks the embedding / lm_head copies against the target
        _fsync_dir(tmp)
        _place(tmp, out)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        needed = tensor_bytes(tensors) + sum(_size(out / name) for name in kept)
        raise_if_disk_full(error, out, needed, "the export", "free some space or choose another out=")
        raise
    log.info("exported %s head as %s (%s) to %s", kind, fmt, dtype, out)
    try:
        log_artifact(out, manifest)
    except Exception as error:  # the export is in place and valid; W&B trouble must not undo it
        log.warning("export %s not logged to W&B: %s", out, error)
    return out


def export_all(head: nn.Module, config, formats: list[str], out_root: str | os.PathLike, target,
               dtype: str = "bfloat16", native_dtype: str | None = "float32",
               manifest_extra: dict | None = None, strict_fingerprint: bool = True,
               overwrite: bool = False) -> dict[str, Path]:
    """Export every format in `formats` (`engine` = every engine layout of the head type that can
    hold this head) to `out_root/<format>`; native uses `native_dtype` (None: `dtype`) so training
    can resume from it. A format named on its own that cannot hold the head is an error."""
    paths = {}
    for fmt in resolve_formats(formats, head_type(config)):
        fmt_dtype = (native_dtype or dtype) if fmt == "native" else dtype
        try:
            paths[fmt] = export_head(head, config, fmt, Path(out_root) / fmt, target, fmt_dtype, manifest_extra,
                                     strict_fingerprint, overwrite)
        except LayoutCannotHold as error:
            # `engine` asks for what the engines can load: a head option one layout lacks (SGLang's
            # EAGLE-3 and norm_before_fc, say) leaves that layout out, not the job's other exports.
            if fmt in formats:
                raise
            log.warning("export: %s left out of `engine`: %s", fmt, error)
    return paths


def log_artifact(folder: Path, manifest: dict) -> bool:
    """Log the folder as a W&B artifact (manifest as metadata) when a W&B run is active. W&B is not
    imported here: a process with an active run has imported it already."""
    wandb = sys.modules.get("wandb")
    if wandb is None or getattr(wandb, "run", None) is None:
        return False
    fingerprint = manifest["base_model"]["fingerprint"].get("id", "")
    name = f"{manifest['head_type']}-{manifest['format']}-{fingerprint}".replace("_", "-")
    artifact = wandb.Artifact(name=name, type="speculative-head", metadata=manifest,
                              description=f"{manifest['head_type']} head, {manifest['format']} layout")
    artifact.add_dir(str(folder))
    wandb.run.log_artifact(artifact)
    return True
