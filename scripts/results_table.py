"""The recipe results table, built from each recipe's last run, so no figure is typed by hand.

    python scripts/results_table.py                         # print the table (runs under runs/)
    python scripts/results_table.py --runs runs other/runs  # run folders under several roots
    python scripts/results_table.py --write README.md       # rewrite the marked block in place
    python scripts/results_table.py --releases none         # run folders only

A shipped release head (heads/release/*/specheads.json) stands for its recipe when no run folder
of that recipe is newer: its manifest carries the training run's steps and held-out figures and
the eval measured on it, so the long recipes keep a row on a checkout without their run folders.

A run folder is one a job wrote (`trainer.output_dir`): `job_summary.json` (recipe, hardware,
wall time, training and eval figures), else `result.json` (the training loop's) and
`eval/report.json` (the eval stage's). A recipe's last run is its folder whose summary was
written last. `--write FILE` replaces what lies between the lines `<!-- results:begin -->` and
`<!-- results:end -->` of FILE (each exactly once, in that order) and leaves the rest as it is.
"""
from __future__ import annotations

import argparse
import calendar
import json
import os
import re
import time
from pathlib import Path

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
# drafters that run the trained head (the others: prompt lookup, draft models)
HEAD_DRAFTERS = ("eagle", "peagle", "dflash", "medusa")
COLUMNS = ["recipe", "training steps", "held-out top-1 (first step / head)", "held-out τ est.",
           "best speculative method: τ, vs plain", "job minutes", "hardware (date)", "run folder"]


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError as error:
        raise SystemExit(f"{path}: not valid JSON ({error})") from None


def run_figures(run_dir: Path) -> dict | None:
    """One run folder's figures, or None when it holds no finished stage."""
    summary = _read(run_dir / "job_summary.json") or {}
    result = _read(run_dir / "result.json") or {}
    report = summary.get("eval") or _read(run_dir / "eval" / "report.json") or {}
    train = summary.get("train") or result
    if not train and not report:
        return None
    sources = [p for p in (run_dir / "job_summary.json", run_dir / "result.json", run_dir / "eval" / "report.json")
               if p.is_file()]
    held_out = train.get("final_eval") or {}
    return {
        "recipe": summary.get("recipe") or train.get("recipe") or run_dir.name,
        "run": str(run_dir), "written": max(p.stat().st_mtime for p in sources),
        "steps": train.get("steps"), "stopped": train.get("stopped"),
        "top1": _first_top1(held_out), "tau_estimate": held_out.get("eval/acceptance_length"),
        **_methods([row for row in report.get("drafters", []) if not row.get("sweep")]),
        "minutes": _job_minutes(summary),
        "hardware": train.get("hardware") or summary.get("hardware"),
    }


def _job_minutes(summary: dict) -> float | None:
    """The end-to-end minutes of the job that trained the head (`job_seconds`). A later run of some
    stages only (e.g. stages=[eval]) keeps that figure and writes its own wall_seconds beside it, so
    wall_seconds is the job's time only in a summary written before `stages` was recorded."""
    if summary.get("job_seconds") is not None:
        return summary["job_seconds"] / 60
    if "stages" not in summary and "wall_seconds" in summary and "train" in summary:
        return summary["wall_seconds"] / 60
    return None


def release_figures(manifest_path: Path) -> dict | None:
    """The figures a release head's manifest (specheads.json) records, as run_figures gives them."""
    manifest = _read(manifest_path) or {}
    training = manifest.get("training") or {}
    if not training.get("recipe"):
        return None
    held_out = training.get("held_out") or {}
    measured = manifest.get("eval") or {}
    created = manifest.get("created_utc")
    written = (calendar.timegm(time.strptime(created, "%Y-%m-%dT%H:%M:%SZ")) if created
               else manifest_path.stat().st_mtime)
    return {
        "recipe": training["recipe"], "run": f"{manifest_path.parent} (release head)", "written": written,
        "steps": training.get("steps"), "stopped": "release head", "top1": _first_top1(held_out),
        "tau_estimate": held_out.get("eval/acceptance_length"),
        **_methods([{"name": name, **row} for name, row in measured.items() if isinstance(row, dict) and "tau" in row]),
        "minutes": None, "hardware": measured.get("hardware") or training.get("hardware"),
    }


def _first_top1(held_out: dict) -> float | None:
    """Held-out top-1 of the first draft step (EAGLE: eval/top1_step0) or head (Medusa: eval/top1_head0)."""
    keys = sorted((k for k in held_out if k.startswith("eval/top1_")), key=lambda k: int(re.search(r"(\d+)$", k).group(1)))
    return held_out[keys[0]] if keys else None


def _methods(rows: list[dict]) -> dict:
    """The fastest speculative method of eval `rows`, and the fastest that runs the trained head."""
    own = [row for row in rows if row["name"].startswith(HEAD_DRAFTERS)]
    return {"method": _method(_fastest(rows)), "head_method": _method(_fastest(own))}


def _fastest(rows: list[dict]) -> dict | None:
    return max(rows, key=lambda row: row.get("speedup_vs_plain") or 0.0, default=None)


def _method(row: dict | None) -> dict | None:
    return row and {"name": row["name"], "tau": row.get("tau"), "vs_plain": row.get("speedup_vs_plain")}


def last_runs(roots: list[Path], releases: Path | None = None) -> list[dict]:
    """Each recipe's last run under `roots` (folders holding a job's files, any depth), by recipe
    name; a release head under `releases` counts as a run written when its manifest was."""
    latest: dict[str, dict] = {}
    for manifest in sorted(releases.glob("*/specheads.json")) if releases else []:
        figures = release_figures(manifest)
        if figures and (figures["recipe"] not in latest or figures["written"] > latest[figures["recipe"]]["written"]):
            latest[figures["recipe"]] = figures
    for root in roots:
        folders = {p.parent for name in ("job_summary.json", "result.json") for p in root.rglob(name)}
        for folder in sorted(folders):
            figures = run_figures(folder)
            if figures and (figures["recipe"] not in latest or figures["written"] > latest[figures["recipe"]]["written"]):
                latest[figures["recipe"]] = figures
    return [latest[name] for name in sorted(latest)]


def _number(value, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _shown(method: dict | None) -> str:
    return "–" if method is None else f"{method['name']}: {_number(method['tau'], 2)}, {_number(method['vs_plain'], 2)}x"


def render(rows: list[dict], recipes: list[str] = ()) -> str:
    """The markdown table of `rows` (run_figures dicts), plus a row for each of `recipes` that
    has no run yet."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for row in rows:
        shown = _shown(row["method"])
        if row["head_method"] is not None and row["head_method"] != row["method"]:
            shown += f" ({_shown(row['head_method'])})"  # the head's own drafter, when another was faster
        steps = "–" if row["steps"] is None else f"{row['steps']} ({row['stopped']})"
        day = time.strftime("%Y-%m-%d", time.gmtime(row["written"]))
        lines.append("| " + " | ".join([
            row["recipe"], steps, _number(row["top1"]), _number(row["tau_estimate"]), shown,
            _number(row["minutes"], 1), f"{row['hardware'] or '–'} ({day})", f"`{row['run']}`"]) + " |")
    seen = {row["recipe"] for row in rows}
    for recipe in recipes:
        if recipe not in seen:
            lines.append(f"| {recipe} | not yet measured |" + " – |" * (len(COLUMNS) - 2))
    return "\n".join(lines)


def cpu_recipes(conf: Path) -> list[str]:
    """The recipes on the embedded target (conf/recipe/*smollm2_135m*.yaml), sorted."""
    return sorted(path.stem for path in conf.glob("*smollm2_135m*.yaml"))


def replace_block(text: str, block: str, name: str = "the file", begin: str = BEGIN, end: str = END) -> str:
    """`text` with the lines between the `begin` and `end` marker lines replaced by `block`."""
    lines = text.splitlines(keepends=True)
    begins = [i for i, line in enumerate(lines) if line.strip() == begin]
    ends = [i for i, line in enumerate(lines) if line.strip() == end]
    if len(begins) != 1 or len(ends) != 1 or begins[0] > ends[0]:
        raise SystemExit(f"{name}: needs one line '{begin}' followed by one line '{end}' "
                         f"(found {len(begins)} begin line(s) at {[i + 1 for i in begins]}, "
                         f"{len(ends)} end line(s) at {[i + 1 for i in ends]})")
    return "".join(lines[: begins[0] + 1]) + block.rstrip("\n") + "\n" + "".join(lines[ends[0]:])


def write_block(path: Path, block: str, begin: str = BEGIN, end: str = END) -> None:
    """Rewrite the marked block of `path` in place (atomically: a temporary file, then a rename)."""
    new = replace_block(path.read_text(encoding="utf-8"), block, str(path), begin, end)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(new, encoding="utf-8")
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", type=Path, default=[Path("runs")], help="roots holding run folders")
    parser.add_argument("--releases", default="heads/release",
                        help="folder of release heads whose manifests stand for their recipe's run ('none': skip)")
    parser.add_argument("--write", type=Path, help="markdown file whose marked block is rewritten")
    parser.add_argument("--recipes", type=Path, default=Path(__file__).resolve().parent.parent / "conf" / "recipe",
                        help="folder whose *smollm2_135m* recipes get a row even without a run")
    args = parser.parse_args()
    rows = last_runs(args.runs, None if args.releases == "none" else Path(args.releases))
    if not rows:
        raise SystemExit(f"no run folders (job_summary.json or result.json) under {', '.join(map(str, args.runs))}")
    table = (f"<!-- generated by `python scripts/results_table.py --write FILE` from each recipe's last run; "
             f"edits here are overwritten -->\n{render(rows, cpu_recipes(args.recipes))}")
    if args.write:
        write_block(args.write, table)
        print(f"{args.write}: results block rewritten ({len(rows)} recipes)")
    else:
        print(table)


if __name__ == "__main__":
    main()
