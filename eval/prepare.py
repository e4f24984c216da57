"""The lean target a run measures with: its compute dtype (`runtime.dtype`) and the path each linear
layer takes per row count (`runtime.linear_paths`), both chosen at start by measuring on the machine
that runs (docs/performance.md).

dtype "auto" keeps the target's dtype on CUDA, fp32 on a CPU without bf16 instructions (AVX512-BF16
or AMX in /proc/cpuinfo), and otherwise the dtype whose decode step plus one verification (after
each has its own paths) measures faster. Plain decoding, speculative decoding and transformers'
`generate` then all run in that dtype, so losslessness and the speedups are judged within one dtype.
"""
from __future__ import annotations

import copy
import logging
import math
import time
from typing import Mapping, Sequence

import torch
from torch import nn

from eval import linear_paths
from eval.config import RuntimeConfig
from eval.model import LeanLlama

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def candidate_dtypes(setting: str, model_dtype: torch.dtype, device: torch.device,
                     flags: set[str] | None = None) -> tuple[list[torch.dtype], str]:
    """The dtypes to build (more than one: measure and keep the faster) and why."""
    if setting == "target":
        return [model_dtype], "the target's dtype (runtime.dtype=target)"
    if setting != "auto":
        if setting not in DTYPES:
            raise ValueError(f"runtime.dtype must be auto, target, {', '.join(sorted(DTYPES))}; got {setting!r}")
        return [DTYPES[setting]], f"runtime.dtype={setting}"
    if device.type != "cpu":
        return [model_dtype], f"the target's dtype on {device.type}"
    bf16 = sorted(set(BF16_FLAGS) & (cpu_flags() if flags is None else flags))
    if not bf16:
        return [torch.float32], "fp32: this CPU has no bf16 instructions (no avx512_bf16 or amx_bf16)"
    return [torch.float32, torch.bfloat16], f"measured: fp32 vs bf16 (CPU flags {', '.join(bf16)})"


def runtime_sizes(runtime: RuntimeConfig, drafters: Sequence[str] = ()) -> list[int]:
    """Row counts the runtime's forwards will use: 1 (decode), the tree and chain sizes it may
    choose or sweep, prompt-lookup and Medusa trees (root included)."""
    sizes = {1, *runtime.tree_auto_sizes, *runtime.tree_sweep, runtime.chain_depth + 1,
             runtime.prompt_lookup_tokens + 1}
    if isinstance(runtime.tree_total_tokens, int) and not isinstance(runtime.tree_total_tokens, bool):
        sizes.add(runtime.tree_total_tokens)
    if "medusa" in drafters:
        from eval.calibrate import MEDUSA_AUTO_SIZES

        sizes.update(n + 1 for n in MEDUSA_AUTO_SIZES)
    return sorted(n for n in sizes if 1 <= n <= linear_paths.MAX_ROWS)


def verify_size(runtime: RuntimeConfig, sizes: Sequence[int]) -> int:
    """The verification the dtype decision prices beside a decode step: the fixed tree size, or the
    middle of the sizes the tree may take."""
    total = runtime.tree_total_tokens
    if isinstance(total, int) and not isinstance(total, bool) and total in sizes:
        return total
    options = sorted(n for n in (runtime.tree_auto_sizes or sizes) if n in sizes and n > 1) or [max(sizes)]
    return options[len(options) // 2]


def _linears(lean: LeanLlama):
    return [linear for linears in lean.linear_sites().values() for linear in linears]


def snapshot(lean: LeanLlama) -> list:
    """The installed per-row-count callables of every linear layer (`install` puts them back)."""
    return [(linear, linear.table) for linear in _linears(lean)]


def install(tables: list) -> None:
    for linear, table in tables:
        linear.table = table


@torch.no_grad()
def forward_costs(variants: Mapping[str, tuple[LeanLlama, list]], prompt: torch.Tensor, sizes: Sequence[int],
                  repeats: int = 5) -> dict[str, dict[int, float]]:
    """Seconds of one forward over n new tokens (a chain) after `prompt`, per variant and n: the
    minimum over `repeats` rounds, every variant and size timed in turn within a round, on
    `linear_paths.timer` (CPU time with one thread). A variant is (model, `snapshot` of the tables
    to run with)."""
    clock = linear_paths.timer()
    caches = {}
    for name, (lean, tables) in variants.items():
        install(tables)
        caches[name] = cache = lean.new_cache(prompt.shape[0] + max(sizes) + 1)
        lean(prompt, cache, logits="none")
        cache.commit()
    best = {name: {n: math.inf for n in sizes} for name in variants}
    for _ in range(repeats):
        for n in sizes:
            for name, (lean, tables) in variants.items():
                install(tables)
                cache = caches[name]
                start = clock()
                lean(prompt[:1].repeat(n), cache)
                best[name][n] = min(best[name][n], clock() - start)
                cache.truncate(cache.length)
    return best


def _in_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    if next(model.parameters()).dtype == dtype:
        return model
    return copy.deepcopy(model).to(dtype).eval()


def prepare_target(hf_model: nn.Module, runtime: RuntimeConfig, sizes: Sequence[int], prompt: torch.Tensor,
                   max_seq_len: int) -> tuple[LeanLlama, nn.Module, dict]:
    """Build the lean target for a run. Returns (lean forward, the transformers model in the same
    dtype for `generate`, report fields {"dtype": ..., "linear_paths": ...})."""
    start = time.perf_counter()
    device = next(hf_model.parameters()).device
    dtypes, reason = candidate_dtypes(runtime.dtype, next(hf_model.parameters()).dtype, device)
    mode = runtime.linear_paths
    if mode not in ("default", "auto") and mode not in linear_paths.PATHS:
        raise ValueError(f"runtime.linear_paths must be default, auto or one of {sorted(linear_paths.PATHS)}; "
                         f"got {mode!r}")
    sizes = sorted({1, *sizes})
    built, variants, paths_report = {}, {}, {}
    for dtype in dtypes:
        name = dtype_name(dtype)
        model = _in_dtype(hf_model, dtype)
        lean = LeanLlama.from_hf(model, max_seq_len=max_seq_len, attention=runtime.attention,
                                 fuse_projections=runtime.fuse_projections, pack_multi_row=runtime.pack_multi_row)
        built[name] = (model, lean)
        variants[f"{name}/default"] = (lean, snapshot(lean))
        if mode == "auto":
            paths_report[name] = linear_paths.select_paths(lean, sizes, repeats=runtime.linear_paths_repeats,
                                                           budget=runtime.linear_paths_budget, trim=False)
        elif mode != "default":
            linear_paths.force_path(lean, mode)
        if mode != "default":
            variants[f"{name}/chosen"] = (lean, snapshot(lean))
    measure = len(dtypes) > 1 or mode == "auto"
    curves = forward_costs(variants, prompt, sizes, runtime.linear_paths_repeats) if measure else {}
    step = verify_size(runtime, sizes)
    kind = "default" if mode == "default" else "chosen"
    costs = {name: curves[f"{name}/{kind}"][1] + curves[f"{name}/{kind}"][step] for name in built} if curves else {}
    chosen = min(costs, key=costs.get) if len(costs) > 1 else dtype_name(dtypes[0])
    model, lean = built[chosen]
    install(variants[f"{chosen}/{kind}"][1])
    for linear in _linears(lean):
        linear.trim()
    for name, report in paths_report.items():
        if name == chosen:
            report["memory_mb"]["held_after"] = linear_paths.held_bytes(lean.linear_sites()) / 2**20
    dtype_report = {"setting": runtime.dtype, "chosen": chosen, "reason": reason}
    if len(costs) > 1:
        dtype_report.update(verify_size=step, decode_plus_verify_ms={k: 1e3 * v for k, v in costs.items()})
        log.info("runtime dtype %s: decode + verify(%d) %s", chosen, step,
                 {k: f"{1e3 * v:.1f} ms" for k, v in costs.items()})
    fields = {"dtype": dtype_report}
    if measure:
        fields["linear_paths"] = {
            "setting": mode, "dtype": chosen, "threads": torch.get_num_threads(),
            "clock": "thread CPU time" if torch.get_num_threads() == 1 else "wall",
            "verify_curve_ms": {k: {n: 1e3 * t for n, t in row.items()} for k, row in curves.items()},
            "relative": {k: {n: t / row[1] for n, t in row.items()} for k, row in curves.items()},
            **({"by_dtype": paths_report} if paths_report else {}),
            "seconds": time.perf_counter() - start,
        }
        if paths_report:
            log.info("linear paths (%s) per row count: %s", chosen, summary(paths_report[chosen]["chosen"]))
    return lean, model, fields


def summary(chosen: Mapping[str, Mapping[int, str]]) -> dict[int, str]:
    """{n: "site=path, ..."} compacted: one path name where every site agrees."""
    sizes = sorted({n for plan in chosen.values() for n in plan})
    out = {}
    for n in sizes:
        names = {site: plan[n] for site, plan in chosen.items()}
        out[n] = next(iter(names.values())) if len(set(names.values())) == 1 else \
            ", ".join(f"{site}={path}" for site, path in names.items())
    return out
