"""`python -m eval runtime.batch_sizes=[...]`: the batch-size sweep as eval's measurement. Called by
`eval.run.evaluate` when runtime.batch_sizes is set; writes report.json, report.md and the plots
(speedup and TPOT against batch size) to the eval folder, and puts the per-batch-size speculation
policy into the recommended runtime that `export` carries into manifests."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch

from eval.config import RuntimeConfig
from eval.out_folder import claim
from eval.recommend import head_fields, recommended_runtime
from eval.runtime.batch_generate import batch_generate
from eval.runtime.clock import module_device
from eval.runtime.generate import plain_generate
from eval.runtime.linear_paths import timer
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import SamplingConfig
from eval.sweep import PLOT_NAMES, batch_sweep, markdown, plot, sweep_method, sweep_policy
from eval.timing import measured_on


def batch_one_check(lean: LeanLlama, prompts: Sequence[torch.Tensor], max_new_tokens: int, eos=(),
                    rounds: int = 2) -> dict:
    """Plain decoding through today's batch-1 loop and through the batch decoder at batch size 1,
    interleaved per prompt: tokens/s of each (prefill included) and their ratio."""
    clock = timer(module_device(lean))
    seconds, tokens = {"batch_one_loop": 0.0, "batch_decoder": 0.0}, {"batch_one_loop": 0, "batch_decoder": 0}
    for _ in range(rounds):
        for prompt in prompts:
            start = clock()
            tokens["batch_one_loop"] += len(plain_generate(lean, prompt, max_new_tokens, eos_token_ids=eos).tokens)
            middle = clock()
            tokens["batch_decoder"] += len(batch_generate(lean, [prompt], max_new_tokens, eos_token_ids=eos)[0].tokens)
            seconds["batch_one_loop"] += middle - start
            seconds["batch_decoder"] += clock() - middle
    rates = {name: tokens[name] / seconds[name] for name in seconds}
    return {**{f"{name}_tokens_per_second": rate for name, rate in rates.items()},
            "ratio": rates["batch_decoder"] / rates["batch_one_loop"]}


def evaluate_batches(lean: LeanLlama, methods, prompts: Sequence[torch.Tensor], runtime: RuntimeConfig,
                     sampling: SamplingConfig, eos: Sequence[int], max_length: int, out_dir, target=None,
                     head_config=None, extra: dict | None = None, progress: bool = True) -> dict:
    """Sweep `methods` (`eval.run.Method`, plain first) over runtime.batch_sizes; returns the report."""
    sweep_methods = [sweep_method(m.name, m.build, m.settings, m.verification) for m in methods]
    where = measured_on(getattr(target, "device", None))
    plain_generate(lean, prompts[0][:8], 4, sampling, eos)  # warm-up: first-call overheads
    sweep = batch_sweep(lean, sweep_methods, prompts, runtime.batch_sizes, runtime.max_new_tokens, sampling, eos,
                        runtime.seed, max_length, progress)
    policy = sweep_policy(sweep, sweep_methods, where)
    first = {name: figures for name, figures in sweep["rows"][0]["methods"].items()}
    rows = [{"name": m.name, "settings": m.settings, "tokens_per_second": first[m.name]["tokens_per_second"]}
            for m in methods[1:]]
    recommended = recommended_runtime(rows, runtime, extra or {}, where)
    if policy is not None and recommended:
        recommended = dataclasses.replace(recommended, batch_policy=policy.to_dict(),
                                          measured=(*(recommended.measured or ()), "batch_policy"))
    report = {
        "target": getattr(target, "name", "?"),
        "head": None if head_config is None else {"type": type(head_config).__name__, **head_fields(head_config)},
        "num_prompts": len(prompts), "sampling": asdict(sampling), "runtime": asdict(runtime),
        "threads": torch.get_num_threads(), "measured_on": where,
        "notes": [
            "tokens/s = every generated token over the batches' time, prefills included (aggregate); time = wall "
            "time, or with one CPU thread that thread's CPU time (batch_sweep.clock).",
            "τ = tokens committed per sequence per target forward, bonus token included.",
            "step ms = one target forward of the whole batch (plain) or verification forward (speculative); "
            "verify cost = that in plain steps at the same batch size; break-even τ adds the drafting of every "
            "sequence of the batch (drafters run per sequence).",
            "TTFT counts from the batch's start (prefills run one request after another); TPOT = the mean "
            "time between a request's later tokens.",
        ],
        "batch_sweep": sweep,
        "speculation_policy": None if policy is None else policy.to_dict(),
        "recommended_runtime": recommended.to_dict() if recommended else {},  # RecommendedRuntime.from_dict reads it
        **(extra or {}),
    }
    if runtime.batch_one_check:
        report["batch_one_check"] = batch_one_check(lean, prompts[: max(1, min(len(prompts), 4))],
                                                    runtime.max_new_tokens, eos)
    out_dir = Path(out_dir)
    claim(out_dir, ["report.json", "report.md", *PLOT_NAMES])  # a user's report.md there is refused
    files = {"json": out_dir / "report.json", "markdown": out_dir / "report.md", **plot(sweep, out_dir)}
    files["markdown"].write_text(_markdown(report))
    report["files"] = {k: str(v) for k, v in files.items()}
    files["json"].write_text(json.dumps(report, indent=2, default=str))
    return report


def _markdown(report: dict) -> str:
    lines = [markdown(report["batch_sweep"])]
    policy = report.get("speculation_policy")
    if policy:
        lines += [f"## Speculation policy per batch size ({policy['family']}; measured on "
                  f"{(policy.get('measured_on') or {}).get('hardware', '?')})", "",
                  "| batch sizes | draft size | draft length |", "| --- | --- | --- |"]
        for entry in policy["ranges"]:
            upper = "and above" if entry["max_batch"] is None else entry["max_batch"]
            lines.append(f"| {entry['min_batch']} – {upper} | {entry['size'] or 'plain'} | {entry['draft_length']} |")
        lines += ["", f"vLLM `num_speculative_tokens_per_batch_size`: "
                      f"`{policy['vllm']['num_speculative_tokens_per_batch_size']}`; TensorRT-LLM `draft_len_schedule`: "
                      f"`{policy['tensorrt_llm']['draft_len_schedule']}`", ""]
    check = report.get("batch_one_check")
    if check:
        lines.append(f"Batch size 1 through the batch decoder: {check['batch_decoder_tokens_per_second']:.1f} tokens/s, "
                     f"{check['ratio']:.3f}x the batch-1 loop ({check['batch_one_loop_tokens_per_second']:.1f}).")
    return "\n".join(lines) + "\n"
