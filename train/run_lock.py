"""One job at a time in a run folder: two jobs writing one `trainer.output_dir` would write each
checkpoint name twice and double every metrics.jsonl line. The job's main process holds an
exclusive `flock` on LOCK_NAME in the folder while it runs; the file holds its pid, so a second job
is refused naming it. The kernel drops the lock when the process ends, however it ends (a SIGKILL
leaves no stale lock), so the file is never deleted: deleting it would let a third job lock a new
file while the second still holds the old one.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

LOCK_NAME = ".specheads.lock"


class RunFolderBusy(ValueError):
    """Another job holds the run folder's lock."""


@contextlib.contextmanager
def run_folder_lock(folder: str | os.PathLike) -> Iterator[Path]:
    """Hold the lock of run folder `folder` (created if missing) for the body; RunFolderBusy
    naming the holder's pid when another process holds it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise RunFolderBusy(f"{folder} is in use by another job (pid {holder}): wait for it to end, or choose "
                                "another trainer.output_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)  # released: no pid names a job that has ended
    finally:
        os.close(fd)  # closing drops the lock
