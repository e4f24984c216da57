"""Imports point one way: heads <- data <- train; heads <- eval; heads <- export; inside eval, the
measurement (eval/*.py) reads the runtime (eval/runtime/) and never the other way. No import
circle anywhere in the packages. Hydra and OmegaConf appear only in __main__.py entry points."""
from __future__ import annotations

import ast
import sys
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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for _, path in _modules()}


def _module_imports(path: Path) -> set[str]:
    """The project modules `path` imports, by full name: `from a.b import c` names a.b.c where c is
    a module, else a.b. Imports inside functions count too: a deferred import still runs, and a
    circle through one is a circle the moment both functions are called (as eval.run and
    eval.batch_eval once were). Relative imports are resolved against the module's package."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                module = alias.name
                while module and module not in MODULES:  # `import a.b.c` where c is a name, not a module
                    module = module.rpartition(".")[0]
                if module:
                    found.add(module)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    found.add(f"{base}.{alias.name}")
                elif base in MODULES:
                    found.add(base)
    found.discard(name)
    return found


RUNTIME = sorted((ROOT / "eval" / "runtime").rglob("*.py"))


@pytest.mark.parametrize("path", RUNTIME, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_runtime_imports_no_measurement(path):
    """eval/runtime/ is what a serving engine would hold: the measurement that times and reports it
    (eval/*.py) may import it, never the reverse."""
    measurement = sorted(m for m in _module_imports(path)
                         if m.split(".")[0] == "eval" and m != "eval" and not m.startswith("eval.runtime"))
    assert not measurement, f"{path.relative_to(ROOT)} imports eval's measurement modules {measurement}"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * len(graph) + 100))
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return circles


def test_no_import_circle_among_the_packages():
    """Every import of heads, data, train, eval and export, at module level or inside a function,
    forms one acyclic graph: a piece two modules share lives where both import it one way. The
    orchestration from train/__main__.py and train/pipeline.py into the eval and export stages
    points one way and needs no exception."""
    graph = {name: _module_imports(path) for name, path in MODULES.items()}
    circles = _circles(graph)
    assert not circles, "import circles: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) + ")" for c in circles)


def test_the_circle_check_finds_a_deferred_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
