"""The docs name files that exist and show commands that compose.

A repository path is a backquoted token or a markdown link whose first segment is a top-level
entry of the repository (`train/...`, `docs/serving.md`, `README.md`); paths under `runs/` are
what a job writes and are allowed; tokens with a placeholder (`<...>`, `DIR`, `NNN`, `*`) are
not paths. Every `python -m train ...` command in a code block composes (`compose_job`, the
`--cfg job` route, no heavy work), and so does every `python -m eval ...` one (`compose_eval`).
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
TOP_LEVEL = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")} | {"docs"}
JOB_OUTPUTS = ("runs/",)  # written by jobs, never in the repository
PLACEHOLDER = re.compile(r"<|>|\*|\{|\}|\bNNN|\b[A-Z][A-Z_]{2,}\b|\.\.\.")


def _paths(text: str) -> set[str]:
    tokens = set(re.findall(r"`([^`\s]+)`", text)) | set(re.findall(r"\]\(([^)\s#]+)\)", text))
    paths = set()
    for token in tokens:
        token = token.rstrip(".,:;")
        if "://" in token or "=" in token or PLACEHOLDER.search(token) or token.startswith(JOB_OUTPUTS):
            continue
        first = token.split("/")[0]
        if first in TOP_LEVEL or (token.endswith(".md") and "/" not in token):
            paths.add(token)
    return paths


def _commands(text: str, module: str) -> list[list[str]]:
    """Arguments of each `python -m <module>` line in the code blocks (continuations joined)."""
    commands = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].split("&&")[-1]
            words = shlex.split(line) if f"-m {module}" in line else []
            if words:
                start = words.index(module) + 1
                commands.append([w for w in words[start:] if not w.startswith("-") and w not in ("job",)])
    return commands


@pytest.mark.parametrize("doc", [*DOCS, ROOT / "README.md"], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_paths_exist(doc):
    missing = sorted(p for p in _paths(doc.read_text()) if not (ROOT / p).exists() and not (doc.parent / p).exists())
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"


@pytest.mark.parametrize("doc", [*DOCS, ROOT / "README.md"], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_shown_commands_compose(doc):
    from eval.__main__ import compose_eval
    from train.__main__ import compose_job

    text = doc.read_text()
    for module, compose in (("train", compose_job), ("eval", compose_eval)):
        for overrides in _commands(text, module):
            if any(PLACEHOLDER.search(o) for o in overrides):
                continue  # e.g. trainer.init_from=DIR: the shape is shown, not a value
            compose(overrides)  # raises on an unknown key, group or value


def test_the_checks_catch_what_they_look_for():
    text = "see `train/no_such_file.py`, `runs/x/y.json`, `conf/<group>.yaml` and [formats](formats.md)\n"
    assert _paths(text) == {"train/no_such_file.py", "formats.md"}
    block = "```bash\npython -m train +recipe=eagle_smollm2_135m \\\n  trainer.max_steps=3 --cfg job  # note\n```\n"
    assert _commands(block, "train") == [["+recipe=eagle_smollm2_135m", "trainer.max_steps=3"]]
