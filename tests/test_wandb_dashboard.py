"""scripts/wandb_dashboard.py: every panel reads a key the code logs (found by running the logging
code: a tiny training loop's metrics and the eval report's W&B call), and the optional dependency
is named when missing."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _dashboard():
    if "wandb_dashboard" not in sys.modules:  # a script, not a package: load it by path (once)
        spec = importlib.util.spec_from_file_location("wandb_dashboard", ROOT / "scripts" / "wandb_dashboard.py")
        module = sys.modules["wandb_dashboard"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["wandb_dashboard"]


@pytest.fixture(scope="module")
def logged_keys(tmp_path_factory) -> set[str]:
    """Keys the train runs log (metrics.jsonl holds what MetricsLogger hands W&B) and the eval runs
    log (eval.report.log_to_wandb with a stub W&B module that records its call)."""
    from eval.report import write_report
    from tests.helpers import report
    from tests.tiny import tiny_target
    from tests.train.loop_fixtures import tiny_data, tiny_job
    from train.loop import train_heads

    folder = tmp_path_factory.mktemp("dashboard")
    train_heads(tiny_job(folder / "train", max_steps=1, eval_at_start=False), tiny_target(), tiny_data())
    keys = {key for line in (folder / "train" / "metrics.jsonl").read_text().splitlines()
            for key in json.loads(line) if key not in ("step", "time")}
    logged = []
    stub = types.SimpleNamespace(run=object(), log=logged.append, Image=lambda path: path,
                                 Table=lambda columns: types.SimpleNamespace(add_data=lambda *row: None))
    saved = sys.modules.get("wandb")
    sys.modules["wandb"] = stub
    try:
        write_report(report(), folder / "eval")
    finally:
        sys.modules.pop("wandb")
        if saved is not None:
            sys.modules["wandb"] = saved
    (eval_metrics,) = logged
    return keys | set(eval_metrics)


def test_every_panel_reads_a_logged_key(logged_keys):
    panels = _dashboard().panel_keys()
    assert panels["keys"] and panels["regexes"]
    missing = [key for key in panels["keys"] if key not in logged_keys]
    assert not missing, f"panels read keys no code logs: {missing}"
    for pattern in panels["regexes"]:
        assert any(re.search(pattern, key) for key in logged_keys), pattern
    assert {"train/loss", "eval/acceptance_length", "eval/table"} <= set(panels["keys"])


def test_missing_optional_dependency_is_named(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb_workspaces", None)  # import fails as if not installed
    assert _dashboard().main(["--entity", "someone"]) == 2
    assert "pip install wandb-workspaces" in capsys.readouterr().err


def test_workspace_builds_offline():
    pytest.importorskip("wandb_workspaces")
    workspace = _dashboard().build_workspace("someone", "specheads", "specheads standard")
    workspace._to_model()  # the full view spec, without a server
    assert [section.name for section in workspace.sections] == ["Training", "Held-out", "Speculative decoding"]
