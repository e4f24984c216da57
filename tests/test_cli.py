"""Hydra's standard flags work anywhere among the overrides, for every entry point."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from heads.cli import INFO_FLAGS, VALUE_FLAGS, hydra_argv, sweep_output

ROOT = Path(__file__).resolve().parents[1]


def test_the_command_line_as_typed_composes():
    """The entry point itself, as a user runs it: flags after, and between, the overrides."""
    done = subprocess.run([sys.executable, "-m", "train", "+recipe=eagle_smollm2_135m", "--cfg", "job",
                           "trainer.max_steps=3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "recipe: eagle_smollm2_135m" in done.stdout and "max_steps: 3" in done.stdout


def test_overrides_go_first_and_flags_keep_their_values():
    assert hydra_argv(["a=1", "--cfg", "job", "b=2", "-m"])[-5:] == ["a=1", "b=2", "--cfg", "job", "-m"]
    assert hydra_argv(["--info", "a=1"])[-2:] == ["a=1", "--info"]  # not a topic: the override stays one
    assert hydra_argv(["--info", "defaults", "a=1"])[-3:] == ["a=1", "--info", "defaults"]
    assert hydra_argv(["--cfg=job", "a=1"])[-2:] == ["a=1", "--cfg=job"]
    assert hydra_argv(["~trainer.seed", "-cn", "eval"])[-3:] == ["~trainer.seed", "-cn", "eval"]


def test_value_flags_match_hydras_parser():
    from hydra._internal.utils import get_args_parser

    actions = [a for a in get_args_parser()._actions if isinstance(a, argparse._StoreAction) and a.option_strings]
    takes_value = {option for a in actions if a.nargs is None for option in a.option_strings}
    optional = {option for a in actions if a.nargs == "?" for option in a.option_strings}
    assert takes_value == set(VALUE_FLAGS) and optional == set(INFO_FLAGS)


def test_sweep_jobs_get_their_own_folders():
    assert sweep_output("runs/x", ["trainer.learning_rate=0.001", "+recipe=r"], "trainer.output_dir") == \
        "runs/x/+recipe=r,trainer.learning_rate=0.001"
    assert sweep_output("runs/a", ["trainer.output_dir=runs/a", "x=1"], "trainer.output_dir") == "runs/a/x=1"
    assert sweep_output("out/", ["data.source=/data/x.json"], "out") == "out/data.source=-data-x.json"
    assert sweep_output("out", [], "out") == "out/default"


@pytest.fixture(params=["train", "eval", "export"])
def entry(request, monkeypatch):
    """(cli, a valid override, the name of the function that would do the work) per entry point."""
    if request.param == "train":
        from train.__main__ import cli

        return cli, "trainer.max_steps=3", ("train.pipeline", "run_job")
    if request.param == "eval":
        from eval.__main__ import cli

        return cli, "runtime.max_new_tokens=3", ("eval.__main__", "run")
    from export.__main__ import cli

    return cli, "dtype=float32", ("export.__main__", "run_export")


def test_flags_anywhere(entry, capsys):
    cli, override, _ = entry
    key, value = override.split("=")
    for argv in ([override, "--cfg", "job"], ["--cfg", "job", override]):
        assert cli(argv) == 0, argv
        assert f"{key.split('.')[-1]}: {value}" in capsys.readouterr().out, argv
    assert cli(["--info", override]) == 0
    assert "Config search path" in capsys.readouterr().out


def test_help_anywhere(capsys):
    """(Only the export's: Hydra lists every config group in --help, which costs a second for the others.)"""
    from export.__main__ import cli

    assert cli(["--help", "dtype=float32"]) == 0
    assert "dtype: float32" in capsys.readouterr().out


def test_multirun_jobs_run_once_each_in_their_own_folder(entry, tmp_path, monkeypatch):
    import importlib

    cli, override, (module, function) = entry
    seen = []
    monkeypatch.setattr(importlib.import_module(module), function, lambda config, *a: seen.append(config) or {})
    key = override.split("=")[0]
    output_key = "trainer.output_dir" if key.startswith("trainer.") else "out"
    assert cli([f"{key}=3,4", "-m", f"hydra.sweep.dir={tmp_path}", f"{output_key}=runs/o"]) == 0
    folders = [config.trainer.output_dir if output_key != "out" else config.out for config in seen]
    assert folders == [f"runs/o/{key}=3", f"runs/o/{key}=4"], folders


def test_hydras_own_errors_exit_2_and_a_crash_in_the_task_keeps_1(entry, capsys, monkeypatch):
    import importlib

    cli, override, (module, function) = entry
    for argv in (["no_such_key=1"], [override.split("=")[0] + "=["]):  # an unknown key; an override Hydra cannot parse
        assert cli(argv) == 2, argv
        assert "HYDRA_FULL_ERROR" in capsys.readouterr().err, argv

    def crash(*args):
        raise RuntimeError("a bug, not a bad input")

    monkeypatch.setattr(importlib.import_module(module), function, crash)
    assert cli([override]) == 1
    assert "a bug, not a bad input" in capsys.readouterr().err


def test_ctrl_c_is_one_line_saying_what_was_kept(entry, capsys, monkeypatch):
    import importlib

    cli, override, (module, function) = entry

    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(module), function, interrupt)
    assert cli([override]) == 130
    err = capsys.readouterr().err
    assert err.startswith("interrupted: ") and err.count("\n") == 1 and "Traceback" not in err
