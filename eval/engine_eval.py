"""`python -m eval head=DIR engine=vllm`: the engine's acceptance beside our runtime's chain and
training's estimate, on the same prompts, with the same K, max tokens and sampling (eval/engine.py
runs both sides). Writes report.json and report.md into the eval folder; a prompts file whose
lines carry a `category` adds a row per category."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from eval.config import RuntimeConfig
from eval.engine import (ENGINES, TOLERANCE, EngineCase, EngineError, agreement, paired_difference, rates, run_ours,
                         opening_walk, run_vllm, sampled_tolerance, training_estimate)
from eval.out_folder import claim
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


@dataclass
class EngineHead:
    """A head to measure in the engine (built by eval.stage.engine_heads): where it came from
    (`source`), the head itself and its manifest, the folder of the layout the engine loads and
    the engine's method for it, and extra (name, folder, prompts) cases the engine runs at the same
    K, each compared with our chain for this head on its first `prompts` prompts (None: all): a
    test's deliberately damaged exports."""

    source: Path
    head: object
    manifest: dict
    folder: Path
    method: str
    broken: Sequence[tuple[str, Path, int | None]] = ()


def measure_engine(target, heads: Sequence[EngineHead], prompts: Sequence[dict], runtime: RuntimeConfig,
                   out_dir: str | os.PathLike, k: int | None = None, engine: str = "vllm",
                   transformers: bool = True, python: Path | None = None) -> dict:
    """The engine comparison for each head, one run of each side (plain decoding shared).
    `prompts`: dicts with `prompt_ids` (and `category`). Returns the report (also written to
    out_dir as report.json and report.md)."""
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is not one of {list(ENGINES)}")
    if not heads:
        raise ValueError("engine comparison: no head (give head=DIR)")
    out_dir = Path(out_dir)
    claim(out_dir, ["report.json", "report.md", "engine_work"])
    k = _k(heads[0].manifest, runtime, k)
    dtype = "bfloat16" if runtime.dtype in ("bfloat16", "bf16") else "float32"
    ids = [list(p["prompt_ids"]) for p in prompts]
    ours = run_ours(target, [h.head.eval() for h in heads], ids, k, runtime, dtype, transformers)
    head_cases = [EngineCase(f"head{i}", h.folder, k, h.method) for i, h in enumerate(heads)]
    cases = []
    for case, h in zip(head_cases, heads):
        cases += [case, *(EngineCase(f"{case.name}:{name}", Path(path), k, h.method, count)
                          for name, path, count in h.broken)]
    answer = run_vllm(target, ids, cases, runtime.max_new_tokens, runtime.temperature, runtime.seed,
                      out_dir / "engine_work", dtype, threads=runtime.threads or None, python=python)
    runs = {run["name"]: run for run in answer["runs"]}
    engine_plain = runs["plain"]
    speed = {"ours_plain": _speed(ours["plain"]), "engine_plain": _speed(engine_plain)}
    if transformers:
        speed["transformers_generate"] = _speed(ours["transformers"])
        speed["ours_plain"]["vs_transformers"] = (speed["ours_plain"]["tokens_per_second"]
                                                  / speed["transformers_generate"]["tokens_per_second"])
    speed["engine_plain"]["vs_ours_plain"] = (speed["engine_plain"]["tokens_per_second"]
                                              / speed["ours_plain"]["tokens_per_second"])
    report = {
        "engine": engine, "engine_version": answer["version"], "hardware": cpu_hardware(), "dtype": dtype, "k": k,
        "temperature": runtime.temperature, "max_new_tokens": runtime.max_new_tokens, "prompts": len(ids),
        "speed": speed,
        "tokens": {"engine_plain_vs_ours_plain": _identical(engine_plain["tokens"], ours["plain"]["tokens"])},
        "heads": [_head_report(h, case, runs, ours, chain, engine_plain, prompts, runtime, k)
                  for h, case, chain in zip(heads, head_cases, ours["chains"])],
        "comparisons": _comparisons(heads, head_cases, runs),
        "notes": NOTES,
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    (out_dir / "report.md").write_text(markdown(report))
    return report


NOTES = [
    "accepted_per_position[i] = drafts whose position i+1 was accepted / drafts (speculative steps); "
    "mean acceptance length = 1 + accepted tokens / drafts.",
    "specheads chain drafts as the engine does: EAGLE-1/2 and Medusa over the full vocabulary, EAGLE-3 over d2t.",
    "training estimate: position i accepted with the product of held-out top-1 of the draft steps up to it; "
    "held-out walk, first n reply tokens: training's greedy chain walk over each held-out reply's first n "
    "tokens, where the head was scored at depth K; compare it with a run of n new tokens a prompt.",
    "tokens/s are end to end (prefill included), one request at a time; the engine runs in its own process.",
]


def _comparisons(heads: Sequence[EngineHead], cases: Sequence[EngineCase], runs: dict) -> list[dict]:
    """The first head against each other one in the engine, on the same prompts (paired bootstrap)."""
    first = runs[cases[0].name]
    return [{"head": str(heads[0].source), "against": str(head.source),
             **paired_difference(first["per_prompt"], runs[case.name]["per_prompt"])}
            for head, case in zip(heads[1:], cases[1:]) if "per_prompt" in first and "per_prompt" in runs[case.name]]


def _head_report(head: EngineHead, case: EngineCase, runs: dict, ours: dict, chain_run: dict, engine_plain: dict,
                 prompts: Sequence[dict], runtime: RuntimeConfig, k: int) -> dict:
    folder, manifest = head.folder, head.manifest
    run = runs[case.name]
    if "error" in run:
        raise EngineError(f"vLLM refused {folder}: {run['error']}")
    chain = rates(chain_run["per_prompt"], k)
    engine_rates = rates(run["per_prompt"], k)
    tolerance = TOLERANCE if runtime.temperature == 0 else sampled_tolerance(chain["drafts"])
    report = {
        "head": str(head.source), "head_type": manifest.get("head_type"), "engine_folder": str(folder),
        "method": head.method,
        "rows": {"engine": engine_rates, "ours_chain": chain, "training_estimate": training_estimate(manifest, k),
                 "opening_walk": opening_walk(manifest, k)},
        "agreement": agreement(chain, engine_rates, tolerance),
        "tokens": {"engine_speculative_vs_engine_plain": _identical(run["tokens"], engine_plain["tokens"]),
                   "ours_chain_vs_ours_plain": _identical(chain_run["tokens"], ours["plain"]["tokens"])},
        "speed": {"ours_chain": _speed(chain_run, ours["plain"]), "engine_speculative": _speed(run, engine_plain)},
        "broken": {},
    }
    for name, _, count in head.broken:
        broken = runs[f"{case.name}:{name}"]
        if "error" in broken:
            report["broken"][name] = {"error": broken["error"], "agreement": {"within_tolerance": False}}
            continue
        n = count or len(prompts)
        row = rates(broken["per_prompt"], k)
        report["broken"][name] = {**row, "agreement": agreement(rates(chain_run["per_prompt"][:n], k), row, tolerance),
                                  "tokens": _identical(broken["tokens"], engine_plain["tokens"][:n])}
    groups = _groups([p.get("category") for p in prompts])
    if groups:
        report["categories"] = {}
        for category, indices in groups.items():
            report["categories"][category] = {
                "prompts": len(indices), "ours_chain": rates([chain_run["per_prompt"][i] for i in indices], k),
                "engine": rates([run["per_prompt"][i] for i in indices], k),
                "speedup_vs_plain": _speed(_select(chain_run, indices),
                                           _select(ours["plain"], indices)).get("speedup_vs_plain"),
                "engine_speedup_vs_plain": _speed(_select(run, indices),
                                                  _select(engine_plain, indices)).get("speedup_vs_plain")}
    return report


def _positions(values: Sequence[float]) -> str:
    return " / ".join(f"{v:.3f}" for v in values)


def markdown(report: dict) -> str:
    """The engine report in markdown: per head vLLM, our chain and training's estimate; plain speeds."""
    speed = report["speed"]
    lines = [f"# vLLM {report['engine_version']} beside the specheads runtime", "",
             f"{report['prompts']} prompts x {report['max_new_tokens']} new tokens, K={report['k']}, temperature "
             f"{report['temperature']}, {report['dtype']}, {report['hardware']}.", ""]
    for head in report["heads"]:
        rows = head["rows"]
        lines += [f"## {head['head']} ({head['head_type']}; vLLM `{head['method']}` on `{head['engine_folder']}`)", "",
                  "| row | drafts | mean acceptance length | accepted per position | tokens/s | vs plain |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for label, row, timing in (("vLLM", rows["engine"], head["speed"]["engine_speculative"]),
                                   ("specheads chain", rows["ours_chain"], head["speed"]["ours_chain"])):
            lines.append(f"| {label} | {row['drafts']} | {row['mean_acceptance_length'] or 1:.3f} | "
                         f"{_positions(row['accepted_per_position'])} | {timing['tokens_per_second']:.1f} | "
                         f"{timing.get('speedup_vs_plain', 0):.2f}x |")
        estimate = rows["training_estimate"]
        if estimate:
            lines.append(f"| training estimate | – | {estimate['mean_acceptance_length']:.3f} | "
                         f"{_positions(estimate['accepted_per_position'])} | – | – |")
        walk = rows.get("opening_walk")
        if walk:
            lines.append(f"| held-out walk, first {walk['reply_tokens']:.0f} reply tokens | – | "
                         f"{walk['mean_acceptance_length']:.3f} | "
                         f"{_positions(walk['accepted_per_position'])} | – | – |")
        agree, tokens = head["agreement"], head["tokens"]["engine_speculative_vs_engine_plain"]
        lines += ["", f"Per-position difference vLLM vs specheads: {agree['max_abs_difference']:.4f} (tolerance "
                      f"{agree['tolerance']:.3f}: {'agree' if agree['within_tolerance'] else 'DISAGREE'}); vLLM's "
                      f"speculative output equals its plain output on {tokens['identical']}/{tokens['of']} prompts."]
        for name, row in head["broken"].items():
            if "error" in row:
                lines.append(f"- broken `{name}`: vLLM refused it ({row['error'][:160]})")
            else:
                lines.append(f"- broken `{name}`: vLLM accepted {_positions(row['accepted_per_position'])} "
                             f"(difference {row['agreement']['max_abs_difference']:.3f})")
        if head.get("categories"):
            lines += ["", "| category | prompts | specheads per position | vLLM per position | speedup (ours) | "
                          "speedup (vLLM) |", "| --- | --- | --- | --- | --- | --- |"]
            for category, row in head["categories"].items():
                lines.append(f"| {category} | {row['prompts']} | {_positions(row['ours_chain']['accepted_per_position'])}"
                             f" | {_positions(row['engine']['accepted_per_position'])} | "
                             f"{row['speedup_vs_plain'] or 0:.2f}x | {row['engine_speedup_vs_plain'] or 0:.2f}x |")
        lines.append("")
    if report.get("comparisons"):
        lines += [f"`{report['comparisons'][0]['head']}` minus each other head in vLLM, on the same prompts "
                  "(standard error: paired bootstrap over prompts):", "",
                  "| against | mean acceptance length | first position |", "| --- | --- | --- |"]
        for row in report["comparisons"]:
            cells = [f"{row[key]['difference']:+.3f} ± {row[key]['standard_error'] or 0:.3f}"
                     for key in ("mean_acceptance_length", "first_position")]
            lines.append(f"| {row['against']} | {cells[0]} | {cells[1]} |")
        lines.append("")
    same = report["tokens"]["engine_plain_vs_ours_plain"]
    lines += ["| plain decoding | tokens/s |", "| --- | --- |",
              f"| specheads lean forward | {speed['ours_plain']['tokens_per_second']:.1f} |",
              f"| vLLM | {speed['engine_plain']['tokens_per_second']:.1f} |"]
    if "transformers_generate" in speed:
        lines.append(f"| transformers `generate` | {speed['transformers_generate']['tokens_per_second']:.1f} |")
    lines += ["", f"vLLM's plain output equals ours on {same['identical']}/{same['of']} prompts.", "",
              *[f"- {note}" for note in report["notes"]], ""]
    return "\n".join(lines)
