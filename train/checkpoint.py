"""Training checkpoints: atomic folders, newest-valid lookup, keep-last-N plus the best.

Layout of `<run_dir>/checkpoints/step-00000123/` (a native head folder plus trainer state):
    head_config.json, model.safetensors   (heads.io: loadable by `load_head`)
    optimizer.pt, scheduler.pt            (torch.save of state dicts; loaded with weights_only=True)
    rng.pt                                ({"ranks": [per-process RNG states]})
    trainer_state.json                    (step, data position, best, eval, run identity, per file
                                           bytes + sha256; written last)
The folder is built as `.tmp-step-...` and renamed into place, so a crash leaves either the old
set of checkpoints or the new one, never a half-written folder under a valid name. Sizes are
checked whenever checkpoints are listed; checksums when one is loaded, and a resume falls back to
the previous checkpoint (with a WARNING naming the file) when the newest fails them. Each
checkpoint records its run (train/run_identity.py): a resume refuses another run's, a fresh run
refuses a folder that holds checkpoints, and pruning deletes only its own run's.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import torch

from heads.io import (STATE_NAME, HeadFileError, non_finite_keys, raise_if_disk_full, read_weights,
                      recorded_file_problems, save_head, sha256_file, tensor_bytes)
from train.run_identity import RUN_KEY, identity_differences

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class TrainingDiverged(RuntimeError):
    """A non-finite loss, gradient norm or weight; the last good checkpoint is kept."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: damaged files, another run's, or none loadable."""


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
    """Write one checkpoint folder atomically; call on the main process only. Weights holding NaN
    or infinities are not written: TrainingDiverged names the last good checkpoint instead."""
    root = Path(root)
    bad = non_finite_keys(head.state_dict())
    if bad:
        run = (trainer_state.get(RUN_KEY) or {}).get("id")
        raise TrainingDiverged(
            f"non-finite weights after step {step} ({bad[:4]}); not saved. The last good checkpoint is "
            f"{latest_valid_checkpoint(root, run) or 'none'}: lower trainer.learning_rate or trainer.max_grad_norm, "
            "check the data, then resume from it.")
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    theirs, ours = run_id(read_state(final)), (trainer_state.get(RUN_KEY) or {}).get("id")
    if final.exists() and theirs is not None and ours is not None and theirs != ours:
        raise CheckpointError(f"{final} holds another run's checkpoint ({theirs}); not replaced. Use a new "
                              "trainer.output_dir for this run")
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_head(tmp, head, head_config, extra={"step": step})
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(scheduler_state, tmp / "scheduler.pt")
        torch.save({"ranks": rng_states}, tmp / "rng.pt")
        files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(tmp.iterdir())}
        state = {**trainer_state, "step": step, "files": files, "complete": True}
        (tmp / STATE_NAME).write_text(json.dumps(state, indent=1))
        _fsync_dir(tmp)
    except Exception as error:  # a failed write (a full disk) removes its half-written folder; a kill
        # cannot, and the next run's save clears such leftovers
        shutil.rmtree(tmp, ignore_errors=True)
        needed = tensor_bytes([head.state_dict(), optimizer_state, scheduler_state, rng_states])
        last = latest_valid_checkpoint(root, ours)
        raise_if_disk_full(error, root, needed, f"checkpoint {final.name}",
                           f"training stopped, the last checkpoint is {last or 'none'}: free some space and run "
                           "the job again (it resumes), or choose another trainer.output_dir")
        raise
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


def state_problems(path: str | os.PathLike, checksums: bool = False) -> tuple[dict | None, list[str]]:
    """(trainer state, problems naming each bad file) of a checkpoint folder; with `checksums`
    every file is also read and hashed against its recorded sha256."""
    path = Path(path)
    try:
        state = json.loads((path / STATE_NAME).read_text())
    except OSError:
        return None, [f"{path / STATE_NAME}: missing"]
    except ValueError as error:
        return None, [f"{path / STATE_NAME}: not valid JSON ({error})"]
    if not isinstance(state, dict) or not state.get("complete"):
        return None, [f"{path / STATE_NAME}: not marked complete"]
    return state, recorded_file_problems(path, state.get("files", {}), checksums)


def read_state(path: str | os.PathLike) -> dict | None:
    """The trainer state of a checkpoint folder, or None when the folder is not a complete one
    (sizes checked, not checksums)."""
    state, problems = state_problems(path)
    return None if problems else state


def run_id(state: dict | None) -> str | None:
    return ((state or {}).get(RUN_KEY) or {}).get("id")


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of every step-named folder under root, oldest first (valid or not)."""
    root = Path(root)
    found = []
    for path in root.iterdir() if root.is_dir() else []:
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_valid_checkpoint(root: str | os.PathLike, run: str | None = None) -> Path | None:
    """The newest complete checkpoint (of run id `run` when given)."""
    for _, path in reversed(list_checkpoints(root)):
        state = read_state(path)
        if state is not None and (run is None or run_id(state) == run):
            return path
    return None


def prune_checkpoints(root: str | os.PathLike, keep_last: int, keep_steps: set[int] = frozenset(),
                      run: str | None = None) -> None:
    """Delete all but the newest `keep_last` valid checkpoints and those in keep_steps (the best),
    plus invalid folders and leftovers of interrupted writes. With `run`, only checkpoints whose
    state names that run id are considered: another run's are never touched."""
    root = Path(root)
    ours = []
    for step, path in list_checkpoints(root):
        state, problems = state_problems(path)
        if run is None or run_id(state) == run:
            ours.append((step, path, not problems))
    keep = {step for step, _, valid in ours if valid}
    keep = set(sorted(keep)[-keep_last:]) | set(keep_steps)
    for step, path, valid in ours:
        if step not in keep or not valid:
            shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(".tmp-step-*"):
        shutil.rmtree(path, ignore_errors=True)


def _torch_file(path: Path, device="cpu"):
    """torch.load(weights_only=True) whose failures name the file. Torch's own message advises
    weights_only=False, which would unpickle arbitrary code from a damaged or foreign file: not
    passed on."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as error:  # noqa: BLE001 - pickle, zip and legacy-format errors alike
        raise CheckpointError(f"{path}: not a readable checkpoint file ({type(error).__name__}); it is damaged "
                              "or was not written by specheads") from None


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict:
    """{state, model (head state dict), optimizer, scheduler, rng: [per-rank]} of a valid checkpoint;
    every file is checked against its recorded size and sha256 first (CheckpointError naming it)."""
    path = Path(path)
    state, problems = state_problems(path, checksums=True)
    if problems:
        raise CheckpointError(f"{path} is not a usable checkpoint: " + "; ".join(problems))
    try:
        model = read_weights(path / "model.safetensors", device)
    except HeadFileError as error:
        raise CheckpointError(str(error)) from None
    return {
        "state": state,
        "model": model,
        "optimizer": _torch_file(path / "optimizer.pt", device),
        "scheduler": _torch_file(path / "scheduler.pt"),
        "rng": _torch_file(path / "rng.pt")["ranks"],
    }


def _check_identity(path: Path, state: dict, identity: dict | None) -> None:
    if identity is None:
        return
    saved = state.get(RUN_KEY)
    if saved is None:
        log.warning("%s records no run identity (saved by an older specheads): resuming it unchecked", path)
        return
    differences = identity_differences(saved, identity)
    if differences:
        raise CheckpointError(
            f"{path} belongs to another run; resuming it would credit this run's settings to its weights. "
            "Differences: " + "; ".join(differences) + ". Use a new trainer.output_dir (trainer.init_from=<that "
            "checkpoint> starts a new run from its weights), or restore the settings to continue it.")


def _set_aside(path: Path) -> None:
    """Rename a damaged checkpoint so no later resume or pruning counts it (kept for inspection)."""
    for n in range(100):
        aside = path.with_name(f"{path.name}.damaged" + (f"-{n}" if n else ""))
        if not aside.exists():
            try:
                os.replace(path, aside)
                log.warning("moved the damaged checkpoint %s aside to %s", path, aside)
            except OSError:  # another process moved it first
                pass
            return


def trained_data(path: str | os.PathLike) -> dict | None:
    """{"records", "tokens"} of the rows the checkpoint's run trained on (its run identity), or
    None for a folder that is not a checkpoint or one saved before the identity held them."""
    return ((read_state(path) or {}).get(RUN_KEY) or {}).get("data")


def _single_checkpoint(resume: str) -> Path | None:
    """The checkpoint folder `trainer.resume` names, or None when it names a run or checkpoints folder."""
    path = Path(resume)
    return path if path.name != "checkpoints" and not (path / "checkpoints").is_dir() else None


def _checkpoints_root(resume: str, root: Path) -> Path:
    if resume == "auto":
        return root
    path = Path(resume)
    return path if path.name == "checkpoints" else path / "checkpoints"


def check_resume(resume: str, root: str | os.PathLike, identity: dict) -> None:
    """find_resume's refusals (resume=never into a folder of checkpoints, a damaged checkpoint
    named by path, another run's checkpoint) from the trainer states alone, nothing loaded: the
    job runs it before it replaces the data stage's record in the run folder."""
    root = Path(root)
    if resume == "never":
        find_resume(resume, root)
        return
    single = _single_checkpoint(resume) if resume != "auto" else None
    if single is not None:
        state, problems = state_problems(single)
        if problems:
            raise CheckpointError(f"trainer.resume={resume}: " + "; ".join(problems))
        candidates = [single]
    else:
        candidates = [path for _, path in reversed(list_checkpoints(_checkpoints_root(resume, root)))]
    for path in candidates:
        state, problems = state_problems(path)
        if not problems:  # the one find_resume tries first
            if state.get(RUN_KEY) is not None:  # an older checkpoint without one: find_resume warns
                _check_identity(path, state, identity)
            return


def find_resume(resume: str, root: str | os.PathLike, identity: dict | None = None,
                main_process: bool = True) -> tuple[Path | None, dict | None]:
    """Where training starts -> (checkpoint folder, loaded checkpoint) or (None, None) for a fresh run.

    resume: `never` (a fresh run; refused when `root` already holds checkpoints), `auto` (the
    newest checkpoint under `root`) or a path (a checkpoint, or a run or checkpoints folder: its
    newest). A newest checkpoint that fails its checks is reported with a WARNING naming the file
    (and, on the main process, renamed `*.damaged`) and the previous one is tried. A checkpoint of
    another run (`identity` differs) is refused naming the fields; so is a folder of checkpoints
    none of which loads."""
    root = Path(root)
    if resume == "never":
        found = list_checkpoints(root)
        if found:
            raise CheckpointError(
                f"trainer.resume=never, but {root} holds checkpoints ({', '.join(p.name for _, p in found[-3:])}) "
                "of an earlier run; a fresh run there would mix with them. Use a new trainer.output_dir, move "
                f"{root} away, or resume=auto to continue that run.")
        return None, None
    path = _single_checkpoint(resume) if resume != "auto" else None
    if path is not None:
        state, problems = state_problems(path)
        if problems:
            raise CheckpointError(f"trainer.resume={resume}: " + "; ".join(problems))
        _check_identity(path, state, identity)
        return path, load_checkpoint(path)
    root = _checkpoints_root(resume, root)
    failures = []
    for _, path in reversed(list_checkpoints(root)):
        state, problems = state_problems(path)
        if not problems:
            _check_identity(path, state, identity)
            try:
                return path, load_checkpoint(path)
            except CheckpointError as error:
                problems = [str(error)]
        log.warning("cannot resume from %s (%s); trying the previous checkpoint", path, "; ".join(problems))
        failures.append(f"{path.name}: {'; '.join(problems)}")
        if main_process and state is not None:
            _set_aside(path)
    if failures:
        raise CheckpointError(f"no checkpoint under {root} can be resumed: " + " | ".join(failures)
                              + f". Move {root} away to start afresh.")
    return None, None
