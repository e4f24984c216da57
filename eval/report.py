"""Evaluation report: report.json, a markdown table (report.md) and PNG plots (acceptance per
depth; speedup vs tree size), plus W&B logging when a run is active. Pure over the report dict
that `eval.run.evaluate` assembles."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _identical(row: dict) -> str:
    """yes, NO, or "near-ties" where every difference from plain decoding was a rounding near-tie."""
    if row.get("greedy_identical") is False and row.get("greedy_identical_up_to_ties"):
        return "near-ties"
    return _fmt(row.get("greedy_identical"))


def _settings(settings: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items() if k != "choices" or v != "auto") or "–"


def markdown_table(report: dict) -> str:
    """The report as markdown: baselines, one row per drafter, and the notes."""
    baselines = report["baselines"]
    plain = baselines["plain"]
    lines = [
        f"# Speculative decoding report: {report['target']}",
        "",
        f"{report['num_prompts']} prompts, max_new_tokens={report['runtime']['max_new_tokens']}, "
        f"sampling={report['sampling']}, {report['threads']} threads.",
        "",
        "| method | verification | settings | τ (bonus incl.) | speculated | mean tree | draft ms/step | verify ms/step "
        "| verify ÷ plain step | break-even τ | tokens/s | vs plain | vs transformers | greedy identical |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    hf = baselines.get("transformers")
    if hf is not None:
        lines.append(f"| transformers generate | – | – | 1.00 | – | – | – | – | – | – | {_fmt(hf['tokens_per_second'])} "
                     f"| {_fmt(hf['tokens_per_second'] / plain['tokens_per_second'] if plain['tokens_per_second'] else None)} "
                     f"| 1.00 | {_identical(hf)} |")
    lines.append(f"| plain (lean forward) | – | – | 1.00 | – | – | – | – | 1.00 | 1.00 | {_fmt(plain['tokens_per_second'])} "
                 f"| 1.00 | {_fmt(plain.get('speedup_vs_transformers'))} | – |")
    for row in report["drafters"]:
        verification = "typical (LOSSY)" if row["lossy"] else row["verification"]
        lines.append(
            f"| {row['name']} | {verification} | {_settings(row['settings'])} | {_fmt(row.get('tau'))} "
            f"| {_fmt(row.get('speculated_fraction'))} | {_fmt(row.get('mean_tree_size'), 1)} | {_fmt(row.get('draft_ms_per_step'), 1)} "
            f"| {_fmt(row.get('verify_ms_per_step'), 1)} | {_fmt(row.get('verify_cost_in_plain_steps'))} "
            f"| {_fmt(row.get('break_even_tau'))} "
            f"| {_fmt(row['tokens_per_second'])} "
            f"| {_fmt(row['speedup_vs_plain'])} | {_fmt(row['speedup_vs_transformers'])} "
            f"| {_identical(row)} |")
    depth_rows = _depth_rows(report)
    if depth_rows:
        width = max(len(r["acceptance_per_depth"]) for r in depth_rows)
        lines += ["", "Acceptance per depth (fraction of speculative steps accepting at least d drafted tokens; "
                  "speculated = fraction of steps that speculated):", "",
                  "| method | speculated | " + " | ".join(f"d={d}" for d in range(1, width + 1)) + " |",
                  "| --- | --- |" + " --- |" * width]
        for row in depth_rows:
            values = row["acceptance_per_depth"] + [None] * (width - len(row["acceptance_per_depth"]))
            lines.append(f"| {row['name']} | {_fmt(row.get('speculated_fraction'))} | "
                         + " | ".join(_fmt(v) for v in values) + " |")
    lines += _budget_lines(report.get("eagle_tree_budget"))
    lines += _budget_lines(report.get("peagle_tree_budget"), "P-EAGLE tree")
    lines += _budget_lines(report.get("medusa"), "Medusa tree", "nodes")
    lines += _runtime_lines(report.get("dtype"), report.get("linear_paths"))
    lines += _placement_lines(report.get("placement"), report.get("weights"))
    lines += ["", "Notes:", ""] + [f"- {note}" for note in report.get("notes", [])]
    lines += _mismatch_lines(report)
    return "\n".join(lines) + "\n"


def _mismatch_lines(report: dict) -> list[str]:
    """Greedy outputs that left plain decoding: loud where the target's logits were not a near-tie
    (a bug), a note naming the positions where they were (reduced-precision rounding)."""
    rows = [r for r in report["drafters"] if r.get("greedy_identical") is False]
    hf = report["baselines"].get("transformers")
    real = [r["name"] for r in rows if not r.get("greedy_identical_up_to_ties", False)]
    lines = ["", f"**GREEDY MISMATCH against plain decoding: {', '.join(real)}**"] if real else []
    ties = [(r["name"], d) for r in rows + ([{"name": "transformers", **hf}] if hf else [])
            for d in r.get("greedy_divergences", []) if d["near_tie"]]
    if ties:
        dtype = (report.get("dtype") or {}).get("chosen", "reduced precision")
        lines += ["", f"Greedy output left plain decoding at {dtype} near-ties (the target's top logits within "
                  "rounding of each other: a one-row decode step and a multi-row verification round differently; "
                  "`runtime.dtype=float32` is token-identical):", ""]
        lines += [f"- {name}, prompt {d['prompt']}, token {d['position']}: {d['why']}" for name, d in ties]
    return lines


def _budget_lines(budget: dict | None, what: str = "EAGLE tree", knob: str = "total_tokens") -> list[str]:
    """A size calibration ("auto"): each size's step cost, τ and speedup in greedy runs on the calibration prompts."""
    if not budget or "chosen" not in budget:  # a configured size (or a named Medusa tree): nothing measured
        return []
    lines = ["", f"{what} size chosen by timing greedy runs of each size on this machine: {knob}={budget['chosen']} "
             f"({budget['calibration_prompts']} calibration prompts, which are also measured above; a whole "
             f"speculative step in plain decode steps of {1000 * budget['plain_step_seconds']:.1f} ms):", "",
             f"| {knob} | step cost | τ | speedup over plain |", "| --- | --- | --- | --- |"]
    for size, value in budget["expected_speedup_by_size"].items():
        mark = " (chosen)" if size == budget["chosen"] else ""
        lines.append(f"| {size}{mark} | {_fmt(budget['step_cost_in_plain_steps'][size])} "
                     f"| {_fmt(budget['expected_tau_by_size'][size])} | {_fmt(value)}x |")
    return lines


def _depth_rows(report: dict) -> list[dict]:
    return [r for r in report["drafters"] if r.get("acceptance_per_depth") and not r["sweep"]]


def _placement_lines(placement: dict | None, weights: str | None) -> list[str]:
    """A split target's devices, one run of layers each (nothing for a target in one piece)."""
    if not placement or not placement["split"]:
        return []
    def layers(run) -> str:
        if run == "head":
            return "the head"
        return f"layer {run[0]}" if run[1] == run[0] + 1 else f"layers {run[0]}-{run[1] - 1}"

    runs = ", ".join(f"{layers(s['layers'])} on {s['key']} ({s['device']})" for s in placement["stages"])
    return ["", f"Target split across devices ({placement['boundaries']} boundaries): {runs}; {weights or ''}."]


def _runtime_lines(dtype: dict | None, paths: dict | None) -> list[str]:
    """The target's compute dtype, the linear path per layer role and row count, and the cost curve
    (forward over N tokens) with the default rule and with the chosen paths."""
    lines = []
    if dtype:
        lines += ["", f"Target compute dtype: **{dtype['chosen']}** ({dtype['reason']})."]
        if dtype.get("decode_plus_verify_ms"):
            lines[-1] += (f" Decode step + verification of {dtype['verify_size']} tokens: " + ", ".join(
                f"{k} {_fmt(v, 1)} ms" for k, v in dtype["decode_plus_verify_ms"].items()) + ".")
    if not paths:
        return lines
    chosen = (paths.get("by_dtype") or {}).get(paths["dtype"])
    if chosen:
        sizes = chosen["sizes"]
        lines += ["", f"Linear paths chosen on this machine ({paths['dtype']}, per layer role and row count N):", "",
                  "| layer | " + " | ".join(f"N={n}" for n in sizes) + " |", "| --- |" + " --- |" * len(sizes)]
        for site, plan in chosen["chosen"].items():
            lines.append(f"| {site} | " + " | ".join(plan[n] for n in sizes) + " |")
        memory = chosen["memory_mb"]
        lines.append(f"\nWeight layouts held: {_fmt(memory['held_after'], 1)} MB ({_fmt(memory['one_copy'], 1)} MB is one "
                     f"copy; budget {_fmt(memory['budget'], 1)} MB; memory shared with the loaded model not counted).")
    curves = paths["verify_curve_ms"]
    sizes = sorted(next(iter(curves.values())))
    lines += ["", f"Forward over N new tokens, ms ({paths.get('clock', 'wall')}, {paths.get('threads', '?')} threads, minimum "
              "of interleaved rounds; ÷ N=1 in brackets):", "",
              "| variant | " + " | ".join(f"N={n}" for n in sizes) + " |", "| --- |" + " --- |" * len(sizes)]
    for name, row in curves.items():
        lines.append(f"| {name} | " + " | ".join(f"{_fmt(row[n], 1)} ({_fmt(row[n] / row[1])})" for n in sizes) + " |")
    return lines


def _tree_points(report: dict) -> list[tuple[int, dict]]:
    rows = [r for r in report["drafters"] if r["name"].startswith("eagle_tree")]
    return sorted((r["settings"]["total_tokens"], r) for r in rows)


def plot_acceptance(report: dict, path: Path) -> Path:
    """Acceptance per depth over speculative steps (left) beside the fraction of steps that
    speculated (right): together they say how good the drafts are and how often they were used."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _depth_rows(report)
    figure, (axis, share) = plt.subplots(1, 2, figsize=(8, 4), gridspec_kw={"width_ratios": [3, 1]})
    colors = []
    for row in rows:
        values = row["acceptance_per_depth"]
        tau = row.get("tau_when_speculating") or row.get("tau")
        line, = axis.plot(range(1, len(values) + 1), values, marker="o",
                          label=f"{row['name']} (τ={tau:.2f} when speculating)")
        colors.append(line.get_color())
    axis.xaxis.get_major_locator().set_params(integer=True)
    axis.set_xlabel("depth d")
    axis.set_ylabel("fraction of speculative steps accepting ≥ d drafts")
    axis.set_ylim(0, 1)
    axis.set_title("Acceptance per depth")
    axis.grid(alpha=0.3)
    if axis.lines:
        axis.legend(fontsize=8)
    shown = [(row["name"], row["speculated_fraction"], color) for row, color in zip(rows, colors)
             if row.get("speculated_fraction") is not None]
    bars = share.barh([name for name, _, _ in shown], [value for _, value, _ in shown],
                      color=[color for _, _, color in shown])
    share.bar_label(bars, labels=[f"{value:.0%}" for _, value, _ in shown], fontsize=8, padding=2)
    share.set_xlim(0, 1.25)
    share.set_xticks([0, 0.5, 1])
    share.invert_yaxis()  # same order as the legend
    share.set_xlabel("fraction of steps")
    share.set_title("Speculated")
    share.tick_params(axis="y", labelsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_speedup_vs_tree_size(report: dict, path: Path) -> Path | None:
    """Speedup and τ against the EAGLE tree size; None (no plot) with fewer than two sizes measured,
    where a curve would be a single dot (the table has that one figure)."""
    points = _tree_points(report)
    if len(points) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    sizes = [size for size, _ in points]
    axis.plot(sizes, [r["speedup_vs_plain"] or 0.0 for _, r in points], marker="o", label="speedup vs plain")
    axis.plot(sizes, [r.get("tau", 1.0) for _, r in points], marker="s", linestyle="--", label="τ (bonus incl.)")
    axis.set_xscale("log", base=2)
    axis.set_xticks(sizes, [str(s) for s in sizes])
    axis.legend(fontsize=8)
    axis.axhline(1.0, color="gray", linewidth=0.8)
    axis.set_xlabel("tree size (total_tokens, root included)")
    axis.set_title("EAGLE-2 tree: speedup vs tree size")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def write_report(report: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write report.json, report.md, acceptance_per_depth.png and, with two or more EAGLE tree
    sizes measured, speedup_vs_tree_size.png; log to W&B when a run is active. Returns the paths
    by kind."""
    from eval.out_folder import claim

    out_dir = Path(out_dir)
    paths = {"json": out_dir / "report.json", "markdown": out_dir / "report.md",
             "acceptance_plot": out_dir / "acceptance_per_depth.png"}
    speedup = out_dir / "speedup_vs_tree_size.png"
    claim(out_dir, [path.name for path in (*paths.values(), speedup)])  # a user's report.md there is refused
    paths["json"].write_text(json.dumps(report, indent=2, default=str))
    paths["markdown"].write_text(markdown_table(report))
    plot_acceptance(report, paths["acceptance_plot"])
    if plot_speedup_vs_tree_size(report, speedup) is not None:
        paths["speedup_plot"] = speedup
    else:
        speedup.unlink(missing_ok=True)  # an earlier report's plot in this folder would describe another run
    log_to_wandb(report, paths)
    return paths


def log_to_wandb(report: dict, paths: dict[str, Path]) -> bool:
    """Log summary figures, the table and the plots to the active W&B run; False when none."""
    wandb = sys.modules.get("wandb")  # never imported: no run can be active (and the import costs seconds)
    if wandb is None or getattr(wandb, "run", None) is None:
        return False
    metrics = {"eval/plain_tokens_per_second": report["baselines"]["plain"]["tokens_per_second"]}
    if "transformers" in report["baselines"]:
        metrics["eval/transformers_tokens_per_second"] = report["baselines"]["transformers"]["tokens_per_second"]
    columns = ["name", "verification", "tau", "speculated_fraction", "tokens_per_second", "speedup_vs_plain",
               "speedup_vs_transformers", "draft_ms_per_step", "verify_ms_per_step", "greedy_identical"]
    table = wandb.Table(columns=columns)
    for row in report["drafters"]:
        table.add_data(*[row.get(c) for c in columns])
        for key in ("tau", "speculated_fraction", "tokens_per_second", "speedup_vs_plain", "speedup_vs_transformers"):
            if row.get(key) is not None:
                metrics[f"eval/{row['name']}/{key}"] = row[key]
    if report.get("eagle_tree_budget"):
        metrics["eval/eagle_tree_total_tokens"] = report["eagle_tree_budget"]["chosen"]
    metrics["eval/table"] = table
    metrics["eval/acceptance_per_depth"] = wandb.Image(str(paths["acceptance_plot"]))
    if "speedup_plot" in paths:
        metrics["eval/speedup_vs_tree_size"] = wandb.Image(str(paths["speedup_plot"]))
    wandb.log(metrics)
    return True
