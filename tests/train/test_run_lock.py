"""One job at a time in a run folder: a second job into a folder that a running job holds is
refused with the first one's pid, before it writes anything; the lock goes with the process that
held it, however it ends."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import pipeline_job
from train.run_lock import LOCK_NAME, RunFolderBusy, run_folder_lock

ROOT = Path(__file__).resolve().parents[2]
_HOLDER = """
import sys
from train.run_lock import run_folder_lock
with run_folder_lock(sys.argv[1]):
    print("locked", flush=True)
    sys.stdin.read()  # hold it until the test closes stdin or kills this process
"""


def _holder(folder: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder)], cwd=ROOT, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "locked"
    return process


def test_a_second_job_into_a_held_folder_is_refused_naming_the_first(tiny_chat_model, tmp_path, monkeypatch, capsys):
    from train.__main__ import cli
    from train.pipeline import run_job

    folder = tmp_path / "run"
    first = _holder(folder)
    try:
        with pytest.raises(RunFolderBusy, match=rf"run is in use by another job \(pid {first.pid}\)"):
            run_job(pipeline_job(tiny_chat_model, tmp_path, "run", 1, "stages=[data,train]"))
        assert sorted(p.name for p in folder.iterdir()) == [LOCK_NAME]  # nothing written by the refused job

        def no_target(job):
            raise AssertionError("the target must not load when the run folder is refused")

        monkeypatch.setattr("train.pipeline.load_job_target", no_target)
        assert cli([f"trainer.output_dir={folder}", "logger=none"]) == 2
        assert f"(pid {first.pid})" in capsys.readouterr().err
    finally:
        first.kill()
        first.wait()
    with run_folder_lock(folder):  # a SIGKILL leaves no stale lock
        assert (folder / LOCK_NAME).read_text().strip() == str(os.getpid())


def test_the_lock_is_released_when_the_job_ends(tmp_path):
    with run_folder_lock(tmp_path / "run"):
        with pytest.raises(RunFolderBusy):  # another open of the file, as a second process would
            with run_folder_lock(tmp_path / "run"):
                pass
    with run_folder_lock(tmp_path / "run"):
        pass
    assert (tmp_path / "run" / LOCK_NAME).read_text() == ""  # no pid names a job that has ended
