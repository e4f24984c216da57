"""The draft vocabulary of EAGLE-1/2 and Medusa heads in an export folder.

Engine weight files keep the key tables FORMATS.md fixes, so an engine layout carries the head's
`draft_vocab` (sorted target ids) beside them in `draft_vocab.json` (`{"draft_vocab": [ids]}`,
hashed in the manifest like the other files); `load_export` puts it back into the head. The
native layout holds it in model.safetensors (the head's own state dict), and EAGLE-3 layouts in
their `d2t`/`t2d` tensors. Engines draft over the full vocabulary (or over `d2t` for EAGLE-3) and
must not see it: vLLM loads every `*.safetensors` file of a draft folder as weights and refuses a
key its model lacks, so the ids are JSON. Folders exported with the earlier
`draft_vocab.safetensors` still load (their manifest names that file).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from heads.io import HeadFileError, read_json, read_weights
from heads.vocab import VOCAB_KEY, check_ids, stores_id_list

VOCAB_FILE = "draft_vocab.json"
LEGACY_VOCAB_FILE = "draft_vocab.safetensors"


def has_sidecar(layout, config) -> bool:
    """True when an export of `layout` keeps the head's vocabulary in VOCAB_FILE."""
    return layout.name != "native" and stores_id_list(config)


def split_state(state: dict, layout, config) -> tuple[dict, torch.Tensor | None]:
    """(the state an engine layout maps, the id list it leaves for VOCAB_FILE or None)."""
    if not has_sidecar(layout, config):
        return state, None
    state = dict(state)
    return state, state.pop(VOCAB_KEY).detach().to("cpu", torch.long).contiguous()


def write_sidecar(folder: Path, ids: torch.Tensor) -> None:
    (folder / VOCAB_FILE).write_text(json.dumps({VOCAB_KEY: [int(i) for i in ids.tolist()]}) + "\n")


def sidecar_name(manifest: dict) -> str:
    """The file holding the ids: the manifest's record (an older export's safetensors file) or VOCAB_FILE."""
    named = (manifest.get("draft_vocab") or {}).get("file") if isinstance(manifest.get("draft_vocab"), dict) else None
    return LEGACY_VOCAB_FILE if named == LEGACY_VOCAB_FILE else VOCAB_FILE


def _read_ids(path: Path) -> dict:
    """{VOCAB_KEY: ids} from the JSON sidecar (or an older safetensors one); HeadFileError naming it."""
    if path.name == LEGACY_VOCAB_FILE:
        return read_weights(path)
    values = read_json(path)
    ids = values.get(VOCAB_KEY)
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise HeadFileError(f"{path}: {VOCAB_KEY!r} must be a list of integer token ids")
        values = {**values, VOCAB_KEY: torch.tensor(ids, dtype=torch.long)}
    return values


def manifest_entry(layout, config) -> dict | None:
    """The manifest's `draft_vocab` record: where the ids are and how many (None: no id list)."""
    if not stores_id_list(config):
        return None
    where = VOCAB_FILE if has_sidecar(layout, config) else layout.weights_file
    return {"size": config.draft_vocab_size, "file": where, "key": VOCAB_KEY,
            "ids": "sorted target token ids the head drafts over, counted over the training split's loss "
                   "positions; specheads' runtime reads them, engines draft over the full vocabulary"}


def vocab_problems(folder: Path, layout, config, tensors: dict, sidecar: str = VOCAB_FILE) -> list[str]:
    """Problems of the head's id list: in `tensors` (native) or in the sidecar (engine layouts)."""
    if not stores_id_list(config):
        return []
    if has_sidecar(layout, config):
        try:
            tensors = _read_ids(folder / sidecar)
        except HeadFileError as error:
            return [str(error)]
        unexpected = sorted(set(tensors) - {VOCAB_KEY})
        if unexpected:
            return [f"{sidecar}: unexpected keys {unexpected}"]
    file = sidecar if has_sidecar(layout, config) else layout.weights_file
    ids = tensors.get(VOCAB_KEY)
    if ids is None:
        return [f"{file}: missing key {VOCAB_KEY!r} (the head's draft vocabulary, draft_vocab_size="
                f"{config.draft_vocab_size})"]
    if tuple(ids.shape) != (config.draft_vocab_size,):
        return [f"{file}: {VOCAB_KEY!r} has shape {list(ids.shape)}, expected [{config.draft_vocab_size}]"]
    try:
        check_ids(ids, config.vocab_size, f"{file}: {VOCAB_KEY}")
    except ValueError as error:
        return [str(error)]
    return []


def read_sidecar(folder: Path, sidecar: str = VOCAB_FILE) -> torch.Tensor:
    return _read_ids(folder / sidecar)[VOCAB_KEY].to(torch.long)
