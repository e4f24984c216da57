"""`python -m eval head=DIR engine=vllm`: the engine's acceptance beside our runtime's chain and
training's estimate, on the same prompts, with the same K, max tokens and sampling (eval/engine.py
runs both sides). Writes report.json and report.md into the eval folder; a prompts file whose
lines carry a `category` adds a row per category."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Sequence

from eval.config import RuntimeConfig
from eval.engine import (TOLERANCE, EngineCase, agreement, engine_folder, rates, run_ours, run_vllm,
                         sampled_tolerance, training_estimate)
from eval.timing import cpu_hardware

log = logging.getLogger(__name__)


def _k(manifest: dict, runtime: RuntimeConfig, k: int | None) -> int:
    """K: given, else the head's recommended chain depth (its manifest's runtime), else runtime.chain_depth."""
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"engine_k={k!r} must be an int >= 1")
        return k
    recommended = (manifest.get("runtime") or {}).get("chain_depth")
    return recommended if isinstance(recommended, int) and recommended >= 1 else runtime.chain_depth


def _identical(a: Sequence[list[int]], b: Sequence[list[int]]) -> dict:
    same = [x == y for x, y in zip(a, b)]
    return {"identical": sum(same), "of": len(same), "different_prompts": [i for i, s in enumerate(same) if not s]}


def _speed(run: dict, plain: dict | None = None) -> dict:
    """End-to-end tokens/s (prefill included: the engine times whole requests) and the ratio to `plain`."""
    rate = run["new_tokens"] / run["seconds"] if run["seconds"] > 0 else 0.0
    out = {"tokens_per_second": rate, "seconds": run["seconds"], "new_tokens": run["new_tokens"]}
    if plain is not None and plain["seconds"] > 0:
        out["speedup_vs_plain"] = rate / (plain["new_tokens"] / plain["seconds"])
    return out


def _groups(categories: Sequence[str | None]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for index, category in enumerate(categories):
        if category is not None:
            groups.setdefault(category, []).append(index)
    return groups


def _select(run: dict, indices: list[int]) -> dict:
    seconds = [run["per_prompt_seconds"][i] for i in indices]
    return {"seconds": sum(seconds), "new_tokens": sum(len(run["tokens"][i]) for i in indices)}


def measure_engine(target, head_folder: str | os.PathLike, prompts: Sequence[dict], runtime: RuntimeConfig,
                   out_dir: str | os.PathLike, k: int | None = None, engine: str = "vllm",
                   broken: Sequence[tuple[str, Path]] = (), transformers: bool = True, python: Path | None = None,
                   head=None) -> dict:
    """The engine comparison for one head. `prompts`: dicts with `prompt_ids` (and `category`).
    `broken`: extra (name, folder) cases the engine runs at the same K, each compared with our
    chain (a test's deliberately damaged exports). Returns the report (also written to out_dir)."""
    from export import load_export

    if engine != "vllm":
        raise ValueError(f"engine={engine!r}: the engine this project runs is 'vllm'")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    loaded, config, manifest = load_export(head_folder, target, dtype="float32")
    head = (head if head is not None else loaded).eval()
    k = _k(manifest, runtime, k)
    dtype = "bfloat16" if runtime.dtype in ("bfloat16", "bf16") else "float32"
    folder = engine_folder(head_folder, loaded, config, target, out_dir / "engine_export")
    ids = [list(p["prompt_ids"]) for p in prompts]
    ours = run_ours(target, head, ids, k, runtime, dtype, transformers)
    cases = [EngineCase("engine", folder, k), *[EngineCase(name, Path(path), k) for name, path in broken]]
    answer = run_vllm(target, ids, cases, runtime.max_new_tokens, runtime.temperature, runtime.seed,
                      out_dir / "engine_work", dtype, threads=runtime.threads or None, python=python)
    engine_plain = next(run for run in answer["runs"] if run["name"] == "plain")
    chain = rates(ours["chain"]["per_prompt"], k)
    greedy = runtime.temperature == 0
    tolerance = TOLERANCE if greedy else sampled_tolerance(chain["drafts"])
    runs = {run["name"]: run for run in answer["runs"]}
    main_run = runs["engine"]
    if "error" in main_run:
        raise RuntimeError(f"vLLM refused {folder}: {main_run['error']}")
    engine_rates = rates(main_run["per_prompt"], k)
    report = {
        "engine": "vllm", "engine_version": answer["version"], "hardware": cpu_hardware(), "dtype": dtype, "k": k,
        "temperature": runtime.temperature, "max_new_tokens": runtime.max_new_tokens, "prompts": len(ids),
        "head": str(head_folder), "head_type": manifest.get("head_type"), "engine_folder": str(folder),
        "method": cases[0].job()["method"],
        "rows": {"engine": engine_rates, "ours_chain": chain, "training_estimate": training_estimate(manifest, k)},
        "agreement": agreement(chain, engine_rates, tolerance),
        "tokens": {"engine_speculative_vs_engine_plain": _identical(main_run["tokens"], engine_plain["tokens"]),
                   "ours_chain_vs_ours_plain": _identical(ours["chain"]["tokens"], ours["plain"]["tokens"]),
                   "engine_plain_vs_ours_plain": _identical(engine_plain["tokens"], ours["plain"]["tokens"])},
        "speed": {"ours_plain": _speed(ours["plain"]), "ours_chain": _speed(ours["chain"], ours["plain"]),
                  "engine_plain": _speed(engine_plain), "engine_speculative": _speed(main_run, engine_plain),
                  **({"transformers_generate": _speed(ours["transformers"])} if transformers else {})},
        "notes": [
            "accepted_per_position[i] = drafts whose position i+1 was accepted / drafts (speculative steps); "
            "mean acceptance length = 1 + accepted tokens / drafts.",
            "ours_chain drafts as the engine does: EAGLE-1/2 and Medusa over the full vocabulary, EAGLE-3 over d2t.",
            "training_estimate: position i accepted with the product of held-out top-1 of draft steps before it.",
            "tokens/s are end to end (prefill included), one request at a time; the engine runs in its own process.",
        ],
    }
    if transformers:
        report["speed"]["ours_plain"]["vs_transformers"] = (report["speed"]["ours_plain"]["tokens_per_second"]
                                                           / report["speed"]["transformers_generate"]["tokens_per_second"])
        report["speed"]["engine_plain"]["vs_ours_plain"] = (report["speed"]["engine_plain"]["tokens_per_second"]
                                                           / report["speed"]["ours_plain"]["tokens_per_second"])
    report["broken"] = {}
    for name, _ in broken:
        run = runs[name]
        if "error" in run:
            report["broken"][name] = {"error": run["error"], "agreement": {"within_tolerance": False}}
        else:
            row = rates(run["per_prompt"], k)
            report["broken"][name] = {**row, "agreement": agreement(chain, row, tolerance),
                                      "tokens": _identical(run["tokens"], engine_plain["tokens"])}
    groups = _groups([p.get("category") for p in prompts])
    if groups:
        report["categories"] = {}
        for category, indices in groups.items():
            ours_rates = rates([ours["chain"]["per_prompt"][i] for i in indices], k)
            engine_cat = rates([main_run["per_prompt"][i] for i in indices], k)
            report["categories"][category] = {
                "prompts": len(indices), "ours_chain": ours_rates, "engine": engine_cat,
                "speedup_vs_plain": _speed(_select(ours["chain"], indices),
                                           _select(ours["plain"], indices)).get("speedup_vs_plain"),
                "engine_speedup_vs_plain": _speed(_select(main_run, indices),
                                                  _select(engine_plain, indices)).get("speedup_vs_plain")}
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    (out_dir / "report.md").write_text(markdown(report))
    return report


def _positions(values: Sequence[float]) -> str:
    return " / ".join(f"{v:.3f}" for v in values)


def markdown(report: dict) -> str:
    """The engine report as a markdown table: engine, our chain and training's estimate per row."""
    rows, speed = report["rows"], report["speed"]
    lines = [f"# vLLM {report['engine_version']} vs specheads runtime: {report['head']}", "",
             f"{report['prompts']} prompts x {report['max_new_tokens']} new tokens, K={report['k']} "
             f"(vLLM method `{report['method']}`, folder `{report['engine_folder']}`), temperature "
             f"{report['temperature']}, {report['dtype']}, {report['hardware']}.", "",
             "| row | drafts | mean acceptance length | accepted per position | tokens/s | vs plain |",
             "| --- | --- | --- | --- | --- | --- |"]
    named = [("vLLM", rows["engine"], speed["engine_speculative"]), ("specheads chain", rows["ours_chain"],
                                                                     speed["ours_chain"])]
    for label, row, timing in named:
        lines.append(f"| {label} | {row['drafts']} | {row['mean_acceptance_length']:.3f} | "
                     f"{_positions(row['accepted_per_position'])} | {timing['tokens_per_second']:.1f} | "
                     f"{timing.get('speedup_vs_plain', 0):.2f}x |")
    estimate = rows["training_estimate"]
    if estimate:
        lines.append(f"| training estimate | – | {estimate['mean_acceptance_length']:.3f} | "
                     f"{_positions(estimate['accepted_per_position'])} | – | – |")
    agree = report["agreement"]
    tokens = report["tokens"]
    lines += ["", f"Per-position difference vLLM vs specheads: {agree['max_abs_difference']:.4f} "
                  f"(tolerance {agree['tolerance']:.3f}: {'agree' if agree['within_tolerance'] else 'DISAGREE'}).",
              f"vLLM speculative output equals vLLM plain output on "
              f"{tokens['engine_speculative_vs_engine_plain']['identical']}/{tokens['engine_speculative_vs_engine_plain']['of']} "
              f"prompts; vLLM plain equals specheads plain on {tokens['engine_plain_vs_ours_plain']['identical']}/"
              f"{tokens['engine_plain_vs_ours_plain']['of']}.", "",
              "| plain decoding | tokens/s |", "| --- | --- |",
              f"| specheads lean forward | {speed['ours_plain']['tokens_per_second']:.1f} |",
              f"| vLLM | {speed['engine_plain']['tokens_per_second']:.1f} |"]
    if "transformers_generate" in speed:
        lines.append(f"| transformers `generate` | {speed['transformers_generate']['tokens_per_second']:.1f} |")
    for name, row in report.get("broken", {}).items():
        if "error" in row:
            lines.append(f"\nBroken case `{name}`: vLLM refused it ({row['error'][:200]}).")
        else:
            lines.append(f"\nBroken case `{name}`: vLLM accepted {_positions(row['accepted_per_position'])} "
                         f"(difference {row['agreement']['max_abs_difference']:.3f}).")
    if report.get("categories"):
        lines += ["", "| category | prompts | specheads per position | vLLM per position | speedup (ours) | speedup (vLLM) |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for category, row in report["categories"].items():
            lines.append(f"| {category} | {row['prompts']} | {_positions(row['ours_chain']['accepted_per_position'])} | "
                         f"{_positions(row['engine']['accepted_per_position'])} | {row['speedup_vs_plain'] or 0:.2f}x | "
                         f"{row['engine_speedup_vs_plain'] or 0:.2f}x |")
    lines += ["", *[f"- {note}" for note in report["notes"]], ""]
    return "\n".join(lines)
