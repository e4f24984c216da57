"""What eval may write into its output folder (`python -m eval out=DIR`, a job's `<run_dir>/eval`).

Every writer of that folder (eval.report, eval.batch_eval, eval.engine_eval) names what it is about
to write with `claim`, which records the names in RECORD_NAME there before the files are written;
a name the folder already holds but the record does not is refused, so a user's report.md kept in
that folder is never replaced. `check_out_folder` applies the stricter rule of the entry points
before any model loads: the folder may hold only what an earlier eval recorded, unless the user
passed `overwrite`.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Iterable

RECORD_NAME = ".specheads_eval.json"  # {"written": [names eval wrote at the top of the folder]}


class OutFolderError(ValueError):
    """The output folder holds files eval did not write; the message names them."""


def _recorded(out: Path) -> set[str]:
    path = out / RECORD_NAME
    if not path.is_file():
        return set()
    try:
        written = json.loads(path.read_text()).get("written", [])
    except (json.JSONDecodeError, AttributeError):
        raise OutFolderError(f"{path} is damaged (not the JSON object eval writes); eval cannot tell which files "
                             "there are its own: move the folder away or choose another out=") from None
    return {name for name in written if isinstance(name, str)}


def _record(out: Path, names: set[str]) -> None:
    tmp = out / f"{RECORD_NAME}.tmp"
    tmp.write_text(json.dumps({"written": sorted(names)}, indent=2) + "\n")
    os.replace(tmp, out / RECORD_NAME)  # a crash leaves the old record or the new one, never half of one


def _not_a_file(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise OutFolderError(f"{out} is a file, not a folder; eval writes its reports into a folder")


def _check_writable(out: Path) -> None:
    """Create `out` and write a probe file there: a folder eval cannot write (read-only, no
    permission, a full disk) fails now, not after minutes of measuring."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise OutFolderError(f"{out} cannot be written ({error.strerror or error}); eval writes its reports there: "
                             "choose another out=") from None


def check_out_folder(out: str | os.PathLike, overwrite: bool = False, written: Iterable[str] = (),
                     advice: str = "choose another out=, or pass overwrite=true to let eval replace what is there"
                     ) -> None:
    """Refuse `out` when it holds anything an earlier eval did not record (a user's files), saying
    `advice`. `written`: names another record says an eval wrote there (a job's job_summary.json,
    from before eval kept its own). With `overwrite`, what `out` holds becomes eval's to replace.
    What is accepted is recorded now, so the writers' `claim` accepts it too."""
    out = Path(out)
    _not_a_file(out)
    _check_writable(out)
    recorded = _recorded(out)
    present = {entry.name for entry in out.iterdir()} - {RECORD_NAME}
    known = recorded | (present & set(written))
    foreign = sorted(present - known)
    if foreign and not overwrite:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutFolderError(f"{out} holds files eval did not write ({shown}); eval writes report.json, "
                             f"report.md and plots there: {advice}")
    if known | set(foreign) != recorded:
        _record(out, known | set(foreign))


def claim(out: str | os.PathLike, names: Iterable[str]) -> None:
    """Record `names` (entries at the top of `out`) as eval's before writing them; refuse one the
    folder holds that no eval recorded. Creates `out`."""
    out = Path(out)
    _not_a_file(out)
    out.mkdir(parents=True, exist_ok=True)
    names = set(names)
    recorded = _recorded(out)
    theirs = sorted(name for name in names - recorded if os.path.lexists(out / name))
    if theirs:
        raise OutFolderError(f"{out} holds {', '.join(theirs)}, which eval did not write; it is not replaced: "
                             "choose another folder, or pass overwrite=true (python -m eval) to let eval replace it")
    if not names <= recorded:
        _record(out, recorded | names)
