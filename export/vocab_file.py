"""The draft vocabulary of EAGLE-1/2 and Medusa heads in an export folder.

Engine weight files keep the key tables FORMATS.md fixes, so an engine layout carries the head's
`draft_vocab` (sorted target ids) beside them in `draft_vocab.safetensors` (one int64 tensor,
hashed in the manifest like the other files); `load_export` puts it back into the head. The
native layout holds it in model.safetensors (the head's own state dict), and EAGLE-3 layouts in
their `d2t`/`t2d` tensors. Engines do not read it: they draft over the full vocabulary, or over
`d2t` for EAGLE-3.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from heads.io import HeadFileError, read_weights
from heads.vocab import VOCAB_KEY, check_ids, stores_id_list

VOCAB_FILE = "draft_vocab.safetensors"


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
    save_file({VOCAB_KEY: ids.clone()}, str(folder / VOCAB_FILE), metadata={"format": "pt"})


def manifest_entry(layout, config) -> dict | None:
    """The manifest's `draft_vocab` record: where the ids are and how many (None: no id list)."""
    if not stores_id_list(config):
        return None
    where = VOCAB_FILE if has_sidecar(layout, config) else layout.weights_file
    return {"size": config.draft_vocab_size, "file": where, "key": VOCAB_KEY,
            "ids": "sorted target token ids the head drafts over, counted over the training split's loss "
                   "positions; specheads' runtime reads them, engines draft over the full vocabulary"}


def vocab_problems(folder: Path, layout, config, tensors: dict) -> list[str]:
    """Problems of the head's id list: in `tensors` (native) or in VOCAB_FILE (engine layouts)."""
    if not stores_id_list(config):
        return []
    if has_sidecar(layout, config):
        try:
            tensors = read_weights(folder / VOCAB_FILE)
        except HeadFileError as error:
            return [str(error)]
        unexpected = sorted(set(tensors) - {VOCAB_KEY})
        if unexpected:
            return [f"{VOCAB_FILE}: unexpected keys {unexpected}"]
    file = VOCAB_FILE if has_sidecar(layout, config) else layout.weights_file
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


def read_sidecar(folder: Path) -> torch.Tensor:
    return read_weights(folder / VOCAB_FILE)[VOCAB_KEY].to(torch.long)
