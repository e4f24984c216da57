"""Command-line conventions shared by the `python -m train|eval|export` entry points.

Hydra parses its flags and the overrides with one argparse parser, which accepts the overrides
only as one unbroken run and reads a token after `--info` as the topic to show. So
`+recipe=X --cfg job trainer.max_steps=3` or `--info +recipe=X` fail in a plain Hydra app.
`hydra_argv` puts the overrides first and the flags (with their values) after them, which Hydra
parses whatever order the user typed. No Hydra import here: the entry points hand the result on.
"""
from __future__ import annotations

import sys

# Hydra's own run folder is not used: every job writes where its config says and keeps the cwd.
HYDRA_SETTINGS = ("hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none",
                  "hydra/hydra_logging=none")
# Hydra 1.3's flags that take a value (tests/test_cli.py checks them against Hydra's parser).
VALUE_FLAGS = frozenset({"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                         "--config-dir", "-cd", "--experimental-rerun"})
# `--info` takes an optional topic: the next token is its value only when it names one.
INFO_FLAGS = frozenset({"--info", "-i"})
INFO_TOPICS = frozenset({"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"})


def hydra_argv(argv: list[str]) -> list[str]:
    """User arguments -> [HYDRA_SETTINGS..., overrides..., flags...] for Hydra's parser."""
    overrides, flags = [], []
    index = 0
    while index < len(argv):
        token = argv[index]
        index += 1
        if not token.startswith("-"):
            overrides.append(token)
            continue
        flags.append(token)
        if "=" in token or index >= len(argv):  # --cfg=job carries its value
            continue
        following = argv[index]
        if (token in VALUE_FLAGS and not following.startswith("-")) or (token in INFO_FLAGS and following in INFO_TOPICS):
            flags.append(following)
            index += 1
    return [*HYDRA_SETTINGS, *overrides, *flags]


def sweep_output(path: str, task_overrides: list[str], key: str) -> str:
    """Where one job of a Hydra multirun (`-m`) writes: `path/<its overrides, the output folder
    `key` left out>`, so the jobs of a sweep neither share nor resume each other's folder."""
    named = sorted(o for o in task_overrides if o.lstrip("+~").split("=", 1)[0] != key)
    return f"{path.rstrip('/')}/{','.join(named).replace('/', '-') or 'default'}"


class TaskFlag:
    """Whether an entry point's task function (the one `hydra.main` wraps) has started."""

    def __init__(self) -> None:
        self.started = False


def exit_status(exit_: SystemExit, task: TaskFlag) -> int:
    """A SystemExit caught by an entry point's `cli` -> its exit status (a message goes to stderr).
    Hydra ends with status 1 on its own errors, reported before the task starts (an override it
    cannot parse or apply, a config option that does not exist): usage errors, so status 2 like
    every other one. A 1 from inside the task is a crash whose traceback Hydra printed: kept."""
    if exit_.code is None or isinstance(exit_.code, int):
        code = exit_.code or 0
        return 2 if code == 1 and not task.started else code
    print(exit_.code, file=sys.stderr)
    return 1


def interrupted(kept: str) -> int:
    """Ctrl-C in an entry point: one line saying what was kept and how to go on, instead of a
    KeyboardInterrupt traceback; status 130, the shell's for an interrupt."""
    print(f"interrupted: {kept}", file=sys.stderr)
    return 130
