"""Imports point one way: heads <- data <- train; heads <- eval; heads <- export.
Hydra and OmegaConf appear only in __main__.py entry points."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("heads", "data", "train", "eval", "export")
ALLOWED = {
    "heads": set(),
    "data": {"heads"},
    "train": {"heads", "data"},
    "eval": {"heads"},
    "export": {"heads"},
}
# Entry points orchestrate stages: they may reach further.
ENTRY_ALLOWED = {
    "train": {"heads", "data", "eval", "export"},
    "eval": {"heads", "data", "export"},
    "export": {"heads"},
}
# The job schema composes every group's config dataclass, and the pipeline runs every stage.
ORCHESTRATORS = {"train/job.py": {"eval", "export"}, "train/pipeline.py": {"eval", "export"}}
# The one eval door reads prompts (data) and heads; every head folder is read by the one head
# loader, export.load_export (eval's door and trainer.init_from alike).
ONE_DOOR = {"eval/stage.py": {"data", "export"}, "train/loop.py": {"export"}}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield package, path


@pytest.mark.parametrize("package, path", list(_modules()), ids=lambda v: str(v.relative_to(ROOT)) if isinstance(v, Path) else v)
def test_import_direction(package, path):
    rel = path.relative_to(ROOT).as_posix()
    allowed = set(ALLOWED[package]) | {package}
    if path.name == "__main__.py":
        allowed |= ENTRY_ALLOWED.get(package, set())
    allowed |= ORCHESTRATORS.get(rel, set()) | ONE_DOOR.get(rel, set())
    internal = _imports(path) & set(PACKAGES)
    assert internal <= allowed, f"{rel} imports {sorted(internal - allowed)}"


@pytest.mark.parametrize("package, path", list(_modules()), ids=lambda v: str(v.relative_to(ROOT)) if isinstance(v, Path) else v)
def test_hydra_only_in_entry_points(package, path):
    if path.name == "__main__.py":
        return
    assert not _imports(path) & {"hydra", "omegaconf"}, f"{path.relative_to(ROOT)} imports Hydra/OmegaConf"
