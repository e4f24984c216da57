"""The head-kinds table: every kind trained on the same data and minutes (scripts/bench_kinds.sh),
measured in our runtime and in vLLM, read from the files the runs wrote, so no figure is typed by hand.

    python scripts/kinds_table.py runs/kinds                      # print the table
    python scripts/kinds_table.py runs/kinds --write README.md    # rewrite the marked block in place
    python scripts/kinds_table.py runs/kinds --norms              # EAGLE-3 with each EAGLE-3.1 option

Reads OUT/<recipe>/job_summary.json (training and the eval stage), OUT/engine_*/report.json (vLLM
beside our chain at the engine's K) and, when present, OUT/draft_cost.json
(scripts/bench_draft_cost.py: every kind's drafters in one run, the draft cost per step in EAGLE head
forwards and the speedup its median steps give). With it the "our runtime" columns are that run's
best drafter for each kind, so every kind is timed on the same prompts in one process; without it
they are each job's own eval stage (each timed in its own run). `--write FILE` replaces what lies between the lines `<!-- kinds:begin -->` and `<!-- kinds:end -->` of FILE.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.bench_draft_cost import unit_key  # noqa: E402
from scripts.results_table import write_block  # noqa: E402

BEGIN, END = "<!-- kinds:begin -->", "<!-- kinds:end -->"
KINDS = {"eagle_smollm2_135m": "EAGLE-1/2", "eagle3_smollm2_135m": "EAGLE-3", "peagle_smollm2_135m": "P-EAGLE",
         "dflash_smollm2_135m": "DFlash", "medusa_smollm2_135m": "Medusa"}
HEAD_DRAFTERS = ("eagle", "peagle", "dflash", "medusa")
COLUMNS = ["kind", "training steps", "held-out top-1 (first position)", "our runtime: drafter, τ",
           "draft ms / step (EAGLE head forwards)", "vs plain (ours)", "vLLM: K, first position, mean length",
           "vs plain (vLLM)"]


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError as error:
        raise SystemExit(f"{path}: not valid JSON ({error})") from None


def _fmt(value, digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _best_head_row(report: dict) -> dict | None:
    """The eval stage's fastest row among the drafters that run the trained head."""
    rows = [r for r in report.get("drafters", []) if not r.get("sweep") and r["name"].startswith(HEAD_DRAFTERS)]
    return max(rows, key=lambda r: r.get("speedup_vs_plain") or 0.0, default=None)


def engine_rows(out: Path) -> dict[str, dict]:
    """recipe -> its head's vLLM figures, from every engine report under `out`."""
    found = {}
    for path in sorted(out.glob("engine_*/report.json")):
        report = _read(path)
        for head in report.get("heads", []):
            recipe = next((name for name in KINDS if f"/{name}/" in f"/{head['head']}/"), None)
            if recipe is not None:
                found[recipe] = {"k": report["k"], "engine": head["rows"]["engine"],
                                 "speed": head["speed"]["engine_speculative"], "version": report.get("engine_version"),
                                 "agreement": head["agreement"]}
    return found


def draft_costs(data: dict | None) -> dict[tuple[str, str], dict]:
    """(recipe, drafter) -> scripts/bench_draft_cost.py's row, with the EAGLE head forwards it costs:
    the one-token EAGLE chain with the heads in the same dtype (a drafter label's "/bfloat16" suffix)."""
    data = data or {}
    units = data.get("eagle_head_forward_ms_by_head_dtype") or {"": data.get("eagle_head_forward_ms")}
    found = {}
    for row in data.get("rows", []):
        recipe = next((name for name in KINDS if f"/{name}/" in f"/{row['head']}/"), None)
        unit = units.get(unit_key(row["drafter"]))
        if recipe is not None:
            found[(recipe, row["drafter"])] = {**row, "forwards": row["draft_ms_per_step"] / unit if unit else None}
    return found


def _best_cost_row(costs: dict, recipe: str) -> dict | None:
    """The draft-cost run's fastest drafter for this kind (the one-token EAGLE chain is the unit, not a contender)."""
    rows = [row for (name, drafter), row in costs.items() if name == recipe and "@1" not in drafter]
    return max(rows, key=lambda r: r.get("speedup_est") or 0.0, default=None)


def table(out: Path, draft_cost: Path | None = None) -> tuple[str, list[str]]:
    """The markdown table and the notes under it (CPU, dtype, what each column measured). draft_cost:
    scripts/bench_draft_cost.py's JSON (default OUT/draft_cost.json)."""
    cost_run = _read(draft_cost or out / "draft_cost.json")
    engines, costs = engine_rows(out), draft_costs(cost_run)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    hardware, dtypes = set(), set()
    for recipe, kind in KINDS.items():
        summary = _read(out / recipe / "job_summary.json")
        if summary is None:
            lines.append(f"| {kind} | not run |" + " – |" * (len(COLUMNS) - 2))
            continue
        train = summary.get("train") or {}
        report = summary.get("eval") or _read(out / recipe / "eval" / "report.json") or {}
        held_out = train.get("final_eval") or {}
        first = held_out.get("eval/top1_step0", held_out.get("eval/top1_head0"))
        hardware.add(train.get("hardware") or summary.get("hardware"))
        best = _best_cost_row(costs, recipe)
        if best is not None:  # every kind in one run, every step drafting (no gate)
            row = {"name": best["drafter"], "tau": best.get("tau"), "speedup_vs_plain": best.get("speedup_est")}
            draft = f"{best['draft_ms_per_step']:.1f} ({_fmt(best['forwards'])})"
        else:
            row = _best_head_row(report)
            dtypes.add(((report.get("dtype") or {}).get("chosen")))
            draft = "–" if row is None else _fmt(row.get("draft_ms_per_step"), 1)
        engine = engines.get(recipe)
        vllm = "–" if engine is None else (
            f"K={engine['k']}: {engine['engine']['accepted_per_position'][0]:.3f}, "
            f"{engine['engine']['mean_acceptance_length']:.2f}")
        lines.append("| " + " | ".join([
            kind, f"{train.get('steps', '–')} ({train.get('stopped', '–')})", _fmt(first, 3),
            "–" if row is None else f"`{row['name']}` {_fmt(row.get('tau'))}", draft,
            "–" if row is None else _fmt(row.get("speedup_vs_plain"), 2, "x"), vllm,
            "–" if engine is None else _fmt(engine["speed"].get("speedup_vs_plain"), 2, "x")]) + " |")
    if cost_run is not None:
        dtypes.add(cost_run.get("dtype"))
        source = ("our runtime: every kind's drafters in one run (scripts/bench_draft_cost.py, linear paths "
                  f"{cost_run.get('linear_paths', 'default')}), the fastest shown; "
                  "vs plain = τ x plain step / (draft + verify), median steps")
    else:
        source = "our runtime: each job's eval stage, its fastest head drafter"
    notes = [f"Hardware: {', '.join(sorted(h for h in hardware if h))}; runtime dtype "
             f"{', '.join(sorted(d for d in dtypes if d))}; {source}; run folder `{out}`."]
    return "\n".join(lines), notes


NORMS = ("norm_before_fc", "fc_norm", "norm_output")


def norms_table(out: Path) -> str:
    """EAGLE-3 as bench_kinds.sh trained it beside the same head with each EAGLE-3.1 option alone
    (OUT/eagle3_<option>, same data and minutes): held-out top-1 per drafted step and the τ estimate
    of each run's final evaluation."""
    lines = ["| EAGLE-3 | training steps | held-out top-1, drafted steps 0 / 1 / 2 / 3 | held-out τ est. |",
             "| --- | --- | --- | --- |"]
    for name, folder in [("as trained above", "eagle3_smollm2_135m")] + [(f"`{o}`", f"eagle3_{o}") for o in NORMS]:
        summary = _read(out / folder / "job_summary.json")
        if summary is None:
            lines.append(f"| {name} | not run | – | – |")
            continue
        train = summary.get("train") or {}
        held_out = train.get("final_eval") or {}
        top1 = " / ".join(_fmt(held_out.get(f"eval/top1_step{i}"), 3) for i in range(4))
        lines.append(f"| {name} | {train.get('steps', '–')} ({train.get('stopped', '–')}) | {top1} | "
                     f"{_fmt(held_out.get('eval/acceptance_length'), 3)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", default=Path("runs/kinds"), help="bench_kinds.sh's OUT folder")
    parser.add_argument("--write", type=Path, help="markdown file whose kinds block is rewritten")
    parser.add_argument("--norms", action="store_true", help="print the EAGLE-3.1 options' table instead")
    parser.add_argument("--draft-cost", type=Path, help="bench_draft_cost.py's JSON (default OUT/draft_cost.json)")
    args = parser.parse_args()
    if not args.out.is_dir():
        raise SystemExit(f"{args.out}: no such folder (run scripts/bench_kinds.sh first)")
    if args.norms:
        print(norms_table(args.out))
        return
    body, notes = table(args.out, args.draft_cost)
    flag = f" --draft-cost {args.draft_cost}" if args.draft_cost else ""
    block = (f"<!-- generated by `python scripts/kinds_table.py {args.out}{flag} --write FILE`; edits here are "
             f"overwritten -->\n{body}\n\n" + "\n".join(notes) + "\n")
    if args.write:
        write_block(args.write, block, BEGIN, END)
        print(f"{args.write}: kinds block rewritten")
    else:
        print(block)


if __name__ == "__main__":
    main()
