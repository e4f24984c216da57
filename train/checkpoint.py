"""Training checkpoints: atomic folders, newest-valid lookup, keep-last-N plus the best.

Layout of `<run_dir>/checkpoints/step-00000123/` (a native head folder plus trainer state):
    head_config.json, model.safetensors   (heads.io: loadable by `load_head`)
    optimizer.pt, scheduler.pt            (torch.save of state dicts; loaded with weights_only=True)
    rng.pt                                ({"ranks": [per-process RNG states]})
    trainer_state.json                    (step, data position, best, eval, file sizes; written last)
The folder is built as `.tmp-step-...` and renamed into place, so a crash leaves either the old
set of checkpoints or the new one, never a half-written folder under a valid name.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import torch

from heads.io import save_head

STATE_NAME = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: str | os.PathLike, step: int, head, head_config, optimizer_state: dict,
                    scheduler_state: dict, rng_states: list[dict], trainer_state: dict) -> Path:
    """Write one checkpoint folder atomically; call on the main process only."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_head(tmp, head, head_config, extra={"step": step})
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save(scheduler_state, tmp / "scheduler.pt")
    torch.save({"ranks": rng_states}, tmp / "rng.pt")
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
    state = {**trainer_state, "step": step, "files": files, "complete": True}
    (tmp / STATE_NAME).write_text(json.dumps(state, indent=1))
    _fsync_dir(tmp)
    if final.exists():  # re-saving a step (after a resume): move the old one aside first
        old = root / f".old-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    return final


def _fsync_dir(path: Path) -> None:
    for file in path.iterdir() if path.is_dir() else []:
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_state(path: str | os.PathLike) -> dict | None:
    """The trainer state of a checkpoint folder, or None when the folder is not a complete one."""
    path = Path(path)
    try:
        state = json.loads((path / STATE_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not state.get("complete"):
        return None
    for name, size in state.get("files", {}).items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            return None
    return state


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of every step-named folder under root, oldest first (valid or not)."""
    root = Path(root)
    found = []
    for path in root.iterdir() if root.is_dir() else []:
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_valid_checkpoint(root: str | os.PathLike) -> Path | None:
    for _, path in reversed(list_checkpoints(root)):
        if read_state(path) is not None:
            return path
    return None


def prune_checkpoints(root: str | os.PathLike, keep_last: int, keep_steps: set[int] = frozenset()) -> None:
    """Delete all but the newest `keep_last` valid checkpoints and those in keep_steps (the best),
    plus invalid folders and leftovers of interrupted writes."""
    root = Path(root)
    valid = [(step, path) for step, path in list_checkpoints(root) if read_state(path) is not None]
    keep = {step for step, _ in valid[-keep_last:]} | set(keep_steps)
    for step, path in list_checkpoints(root):
        if step not in keep or read_state(path) is None:
            shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(".tmp-step-*"):
        shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict:
    """{state, model (head state dict), optimizer, scheduler, rng: [per-rank]} of a valid checkpoint."""
    from safetensors.torch import load_file

    path = Path(path)
    state = read_state(path)
    if state is None:
        raise ValueError(f"{path} is not a complete checkpoint ({STATE_NAME} missing, incomplete or files truncated)")
    return {
        "state": state,
        "model": load_file(str(path / "model.safetensors"), device=str(device)),
        "optimizer": torch.load(path / "optimizer.pt", map_location=device, weights_only=True),
        "scheduler": torch.load(path / "scheduler.pt", weights_only=True),
        "rng": torch.load(path / "rng.pt", weights_only=True)["ranks"],
    }
