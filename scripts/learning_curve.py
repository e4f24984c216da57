"""Learning curve of a training run from its metrics.jsonl: held-out top-1 per EAGLE step (or per
Medusa head) and the acceptance-length estimate against wall minutes and tokens seen, with the
chain walk's first-position acceptance and mean length where the run logs them (train/heldout.py).

    python scripts/learning_curve.py runs/eagle_smollm2_135m [runs/eagle_smollm2_135m_long ...]
    python scripts/learning_curve.py RUN --markdown      # a table for the README

Minutes count from the start of the training loop (`eval/wall_minutes`, which includes the ridge
fit and evaluations), or for older runs from the first evaluation. CPU-minutes = wall minutes x
the run's threads.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def curve(run_dir: Path) -> list[dict]:
    """One row per evaluation: step, minutes, tokens seen, top-1 per step/head, acceptance estimate."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no such file (not a run folder, or the run has not logged yet)")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise SystemExit(f"{path} is empty")
    tokens, start, rows = 0, None, []
    for line in lines:
        tokens = line.get("train/tokens_seen", tokens)
        if "eval/acceptance_length" not in line:
            continue
        start = line["time"] if start is None else start
        minutes = line.get("eval/wall_minutes", (line["time"] - start) / 60)
        top1 = [line[k] for k in sorted(line) if k.startswith("eval/top1_")]
        walk = [line.get(k) for k in ("eval/chain_accept_step0", "eval/chain_accept_head0",
                                       "eval/chain_acceptance_length")]
        rows.append({"step": line["step"], "minutes": minutes, "tokens": tokens, "top1": top1,
                     "tau": line["eval/acceptance_length"],
                     "walk": (walk[0] if walk[0] is not None else walk[1], walk[2]) if walk[2] is not None else None})
    return rows


def render(name: str, rows: list[dict], markdown: bool) -> str:
    width = max(len(r["top1"]) for r in rows)
    walked = any(r["walk"] for r in rows)
    head = ["step", "minutes", "tokens seen", *(f"top-1 [{i}]" for i in range(width)), "tau est."]
    head += ["chain: first accepted", "chain: mean length"] if walked else []
    body = [[str(r["step"]), f"{r['minutes']:.1f}", f"{r['tokens']:,}", *(f"{a:.3f}" for a in r["top1"]),
             f"{r['tau']:.3f}"] + ([f"{r['walk'][0]:.3f}", f"{r['walk'][1]:.3f}"] if r["walk"] else ["–", "–"] if walked else [])
            for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
    else:
        widths = [max(len(x) for x in column) for column in zip(head, *body)]
        lines = ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in [head, *body]]
    return f"{name}\n" + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    for run in args.runs:
        print(render(str(run), curve(run), args.markdown) + "\n")


if __name__ == "__main__":
    main()
