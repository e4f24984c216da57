"""The project's standard W&B workspace, as code, and the lineage of runs that trained offline.

Jobs log to W&B offline (conf/logger/wandb_offline.yaml: nothing waits on a network). This script
is the one online step, run where the network is:

    pip install wandb-workspaces          # optional dependency, this script only
    wandb login
    python scripts/wandb_dashboard.py --entity ENTITY [--project specheads] [--sync runs/JOB ...]

1. `--sync DIR`: uploads the offline runs under DIR/wandb (`wandb sync`, one call per run folder).
2. Declares each run's inputs: offline runs cannot call `use_artifact`, so every stage run lists
   the artifacts it read in its config (`lineage_inputs`, train/metrics.py); here each is looked
   up by name and digest and declared used, which completes the lineage
   dataset -> train run -> checkpoint -> export run -> export (and checkpoint -> eval run).
   `--no-lineage` skips it.
3. Saves the workspace below (a new view named `--name`) and prints its URL.

Panels, and the run that logs each key:
- Training (train runs, every trainer.log_every steps): train/loss; train/tokens_per_s.
- Held-out (train runs, every trainer.eval_every steps): eval/top1_step<j> (EAGLE, EAGLE-3) or
  eval/top1_head<k> (Medusa) per draft step; the acceptance-length estimate eval/acceptance_length;
  the chain walk's eval/chain_accept_<step|head><j> and eval/chain_acceptance_length, and its
  mean over reply openings eval/opening_chain_acceptance_length, against steps and against
  eval/wall_minutes.
- Speculative decoding (eval runs: the job's eval stage and `python -m eval` with a W&B logger):
  the table eval/table (τ, speedup vs plain and vs transformers' generate, per drafter) and the
  plots eval/acceptance_per_depth and eval/speedup_vs_tree_size.
The batch-size sweep gets its panel when the eval logs one. tests/test_wandb_dashboard.py checks
that every key here is one the code logs.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Panel:
    """One panel: kind "line" (y keys or a y regex against x), "table" or "media" (logged keys)."""

    kind: str
    title: str
    keys: tuple[str, ...] = ()
    x: str = "Step"
    regex: str | None = None


@dataclass(frozen=True)
class Section:
    name: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


SECTIONS = (
    Section("Training", (
        Panel("line", "training loss", ("train/loss",)),
        Panel("line", "training tokens/s", ("train/tokens_per_s",)),
    )),
    Section("Held-out", (
        Panel("line", "held-out top-1 per draft step", regex=r"^eval/top1_(step|head)\d+$"),
        Panel("line", "acceptance length estimate (τ) by step", ("eval/acceptance_length",)),
        Panel("line", "acceptance length estimate (τ) by wall minutes", ("eval/acceptance_length",),
              x="eval/wall_minutes"),
        Panel("line", "chain walk: accepted per drafted position", regex=r"^eval/chain_accept_(step|head)\d+$"),
        Panel("line", "chain walk: mean acceptance length", ("eval/chain_acceptance_length",)),
        Panel("line", "chain walk over reply openings (an engine run's stretch): mean acceptance length",
              ("eval/opening_chain_acceptance_length",)),
    )),
    Section("Speculative decoding", (
        Panel("table", "eval: τ and speedup per drafter", ("eval/table",)),
        Panel("media", "acceptance per depth (per speculative step) and speculated fraction",
              ("eval/acceptance_per_depth",)),
        Panel("media", "speedup vs EAGLE tree size", ("eval/speedup_vs_tree_size",)),
    )),
)


def panel_keys() -> dict[str, list[str]]:
    """{"keys": every logged key a panel reads (x axes included), "regexes": y patterns}."""
    keys, regexes = [], []
    for section in SECTIONS:
        for panel in section.panels:
            keys += [*panel.keys, *([panel.x] if panel.x != "Step" else [])]
            regexes += [panel.regex] if panel.regex else []
    return {"keys": sorted(set(keys)), "regexes": regexes}


def build_workspace(entity: str, project: str, name: str):
    """SECTIONS as a `wandb_workspaces` Workspace (not saved)."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    def make(panel: Panel):
        if panel.kind == "line":
            if panel.regex:
                return wr.LinePlot(title=panel.title, x=panel.x, metric_regex=panel.regex)
            return wr.LinePlot(title=panel.title, x=panel.x, y=list(panel.keys))
        if panel.kind == "table":
            return wr.WeavePanelSummaryTable(table_name=panel.keys[0], layout=wr.Layout(w=24, h=10))
        if panel.kind == "media":
            return wr.MediaBrowser(title=panel.title, media_keys=list(panel.keys))
        raise ValueError(f"unknown panel kind {panel.kind!r}")

    return ws.Workspace(entity=entity, project=project, name=name, sections=[
        ws.Section(name=section.name, panels=[make(p) for p in section.panels], is_open=True)
        for section in SECTIONS])


def sync(folders: list[str]) -> None:
    for folder in folders:
        runs = sorted(Path(folder).glob("wandb/offline-run-*")) or sorted(Path(folder).glob("offline-run-*"))
        if not runs:
            sys.exit(f"--sync {folder}: no offline W&B runs under {folder}/wandb")
        for run in runs:
            subprocess.run([sys.executable, "-m", "wandb", "sync", str(run)], check=True)


def link_lineage(entity: str, project: str) -> int:
    """Declare the inputs that offline runs listed in their config; returns how many were new."""
    import wandb

    api, added = wandb.Api(), 0
    for run in api.runs(f"{entity}/{project}", filters={"config.lineage_inputs": {"$exists": True}}):
        used = {(artifact.name.split(":")[0], artifact.digest) for artifact in run.used_artifacts()}
        for record in run.config.get("lineage_inputs") or []:
            if (record["name"], record["digest"]) in used:
                continue
            versions = api.artifacts(record["type"], f"{entity}/{project}/{record['name']}")
            match = next((a for a in versions if a.digest == record["digest"]), None)
            if match is None:
                print(f"lineage: {run.name}: input {record['name']} ({record['digest'][:8]}) is not uploaded yet "
                      "(sync the run that logged it)", file=sys.stderr)
                continue
            run.use_artifact(match)
            added += 1
    return added


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entity", required=True)
    parser.add_argument("--project", default="specheads")
    parser.add_argument("--name", default="specheads standard")
    parser.add_argument("--sync", nargs="*", default=[], metavar="RUN_DIR", help="job folders whose offline runs to upload")
    parser.add_argument("--no-lineage", action="store_true")
    args = parser.parse_args(argv)
    try:
        import wandb_workspaces  # noqa: F401
    except ImportError:
        print("scripts/wandb_dashboard.py needs the optional package wandb-workspaces: "
              "pip install wandb-workspaces", file=sys.stderr)
        return 2
    sync(args.sync)
    if not args.no_lineage:
        print(f"lineage: {link_lineage(args.entity, args.project)} input(s) declared")
    workspace = build_workspace(args.entity, args.project, args.name)
    workspace.save()
    print(workspace.url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
