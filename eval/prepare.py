"""The lean target a run measures with: its compute dtype (`runtime.dtype`) and the path each linear
layer takes per row count (`runtime.linear_paths`), both chosen at start by measuring on the machine
that runs (docs/performance.md).

dtype "auto" keeps the target's dtype on CUDA, fp32 on a CPU without bf16 instructions (AVX512-BF16
or AMX in /proc/cpuinfo), and otherwise the dtype whose decode step plus one verification (after
each has its own paths) measures faster. A target whose weights may not be copied (split across
devices, not on the CPU, or short of memory: `eval.runtime.placement.weight_copies_allowed`) keeps its own
dtype, and its linear layers choose only among the paths that read its weights in place. Plain decoding, speculative decoding and transformers'
`generate` then all run in that dtype, so losslessness and the speedups are judged within one dtype.
"""
from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import nn

from eval.config import RuntimeConfig
from eval.runtime import linear_paths, placement
from eval.runtime.model import LeanLlama
from eval.timing import cpu_info
from heads.dtypes import bf16_flags  # one rule with the data and training stages

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return cpu_info()[1]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def candidate_dtypes(setting: str, model_dtype: torch.dtype, device: torch.device,
                     flags: set[str] | None = None, copies: bool = True) -> tuple[list[torch.dtype], str]:
    """The dtypes to build (more than one: measure and keep the faster) and why. copies=False (the
    target's weights may not be copied): the target's dtype only, since another is a second model."""
    if setting == "target":
        return [model_dtype], "the target's dtype (runtime.dtype=target)"
    if setting != "auto":
        if setting not in DTYPES:
            raise ValueError(f"runtime.dtype must be auto, target, {', '.join(sorted(DTYPES))}; got {setting!r}")
        if not copies and DTYPES[setting] != model_dtype:
            raise ValueError(f"runtime.dtype={setting}: the target ({dtype_name(model_dtype)}) is used in place "
                             f"(eval.runtime.placement.weight_copies_allowed), and another dtype would copy all of it; "
                             f"use runtime.dtype=target or load the target in {setting} (model.dtype)")
        return [DTYPES[setting]], f"runtime.dtype={setting}"
    if not copies:
        return [model_dtype], "the target's dtype (its weights are used in place)"
    if device.type != "cpu":
        return [model_dtype], f"the target's dtype on {device.type}"
    bf16 = bf16_flags(cpu_flags() if flags is None else flags)
    if not bf16:
        return [torch.float32], "fp32: this CPU has no bf16 instructions (no avx512_bf16 or amx_bf16)"
    return [torch.float32, torch.bfloat16], f"measured: fp32 vs bf16 (CPU flags {', '.join(bf16)})"


def runtime_sizes(runtime: RuntimeConfig, drafters: Sequence[str] = ()) -> list[int]:
    """Row counts the runtime's forwards will use: 1 (decode), the tree and chain sizes it may
    choose or sweep, prompt-lookup, Medusa and P-EAGLE trees (root included)."""
    sizes = {1, *runtime.tree_auto_sizes, *runtime.tree_sweep, runtime.chain_depth + 1,
             runtime.prompt_lookup_tokens + 1}
    if isinstance(runtime.tree_total_tokens, int) and not isinstance(runtime.tree_total_tokens, bool):
        sizes.add(runtime.tree_total_tokens)
    if "peagle_tree" in drafters and runtime.peagle_tree_tokens != "auto":  # auto: among tree_auto_sizes
        sizes.add(runtime.peagle_tree_tokens)
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
    """What every linear layer runs per row count (`install` puts it back)."""
    return [(linear, linear.table, linear.needed, linear.plan, linear.beyond) for linear in _linears(lean)]


def install(tables: list) -> None:
    for linear, table, needed, plan, beyond in tables:
        linear.table, linear.needed, linear.plan, linear.beyond = table, needed, plan, beyond


@torch.no_grad()
def forward_costs(variants: Mapping[str, tuple[LeanLlama, list]], prompt: torch.Tensor, sizes: Sequence[int],
                  repeats: int = 5) -> dict[str, dict[int, float]]:
    """Seconds of one forward over n new tokens (a chain) after `prompt`, per variant and n: the
    minimum over `repeats` rounds, every variant and size timed in turn within a round, on
    `linear_paths.timer` (CPU time with one thread). A variant is (model, `snapshot` of what its
    linear layers run)."""
    clock = linear_paths.timer(next(iter(variants.values()))[0].embedding.device)
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


def head_in_dtype(head: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of a draft head whose parameters are in `dtype` (`runtime.head_dtype=runtime`: the
    target's chosen dtype, so that a head behind a bf16 target reads half the bytes per draft step
    and runs the kernels measured for bf16). Floating buffers stay as they are: RoPE's inverse
    frequencies lose their low digits in bf16. The head itself is unchanged."""
    if all(p.dtype == dtype for p in head.parameters()):
        return head
    copied = copy.deepcopy(head)
    for parameter in copied.parameters():
        if parameter.is_floating_point():
            parameter.data = parameter.data.to(dtype)
    return copied.eval()


@dataclass
class Candidate:
    """The target built in one dtype: the transformers model, its lean forward, what the linear
    layers run with the default rule and with the chosen paths, and the path report."""

    model: nn.Module
    lean: LeanLlama
    default: list
    chosen: list | None = None
    paths: dict | None = None


def build_candidates(hf_model: nn.Module, runtime: RuntimeConfig, sizes: Sequence[int],
                     max_seq_len: int) -> tuple[dict[str, Candidate], str]:
    """One Candidate per dtype `runtime.dtype` allows, each with its paths (`runtime.linear_paths`:
    measured, forced or the default rule). Returns ({dtype name: Candidate}, why these dtypes)."""
    device = next(hf_model.parameters()).device
    keys, devices = placement.locate(hf_model)
    copies, weights_note = placement.weight_copies_allowed(
        devices, keys, sum(p.numel() * p.element_size() for p in hf_model.parameters()))
    dtypes, reason = candidate_dtypes(runtime.dtype, next(hf_model.parameters()).dtype, device, copies=copies)
    mode = runtime.linear_paths
    if mode not in ("default", "auto") and mode not in linear_paths.PATHS:
        raise ValueError(f"runtime.linear_paths must be default, auto or one of {sorted(linear_paths.PATHS)}; "
                         f"got {mode!r}")
    built = {}
    for dtype in dtypes:
        model = _in_dtype(hf_model, dtype)
        lean = LeanLlama.from_hf(model, max_seq_len=max_seq_len, attention=runtime.attention,
                                 fuse_projections=runtime.fuse_projections, pack_multi_row=runtime.pack_multi_row,
                                 weight_copies=copies)
        lean.weights_note = weights_note
        candidate = built[dtype_name(dtype)] = Candidate(model, lean, snapshot(lean))
        if mode == "auto":
            candidate.paths = linear_paths.select_paths(lean, sizes, repeats=runtime.linear_paths_repeats,
                                                        budget=runtime.linear_paths_budget, trim=False)
        elif mode != "default":
            linear_paths.force_path(lean, mode)
        if mode != "default":
            candidate.chosen = snapshot(lean)
    return built, reason


def curve_variants(built: Mapping[str, Candidate]) -> dict[str, tuple[LeanLlama, list]]:
    """`forward_costs` variants: "<dtype>/default" and, where paths were chosen, "<dtype>/chosen"."""
    variants = {}
    for name, candidate in built.items():
        variants[f"{name}/default"] = (candidate.lean, candidate.default)
        if candidate.chosen is not None:
            variants[f"{name}/chosen"] = (candidate.lean, candidate.chosen)
    return variants


def finish(built: Mapping[str, Candidate], curves: Mapping[str, Mapping[int, float]], runtime: RuntimeConfig,
           sizes: Sequence[int], reason: str, seconds: float = 0.0) -> tuple[LeanLlama, nn.Module, dict]:
    """Keep the dtype whose decode step plus one verification (`verify_size`) measured faster in
    `curves`, install its paths, drop the layouts they do not use. Returns (lean forward, the
    transformers model in the same dtype, report fields {"dtype": ..., "linear_paths": ...})."""
    step = verify_size(runtime, sizes)
    kind = {name: "default" if c.chosen is None else "chosen" for name, c in built.items()}
    costs = {name: curves[f"{name}/{kind[name]}"][1] + curves[f"{name}/{kind[name]}"][step] for name in built} \
        if curves else {}
    chosen = min(costs, key=costs.get) if len(costs) > 1 else next(iter(built))
    candidate = built[chosen]
    install(candidate.chosen or candidate.default)
    for linear in _linears(candidate.lean):
        linear.trim()
    if candidate.paths:
        candidate.paths["memory_mb"]["held_after"] = linear_paths.held_bytes(candidate.lean.linear_sites()) / 2**20
    dtype_report = {"setting": runtime.dtype, "chosen": chosen, "reason": reason}
    if len(costs) > 1:
        dtype_report.update(verify_size=step, decode_plus_verify_ms={k: 1e3 * v for k, v in costs.items()})
        log.info("runtime dtype %s: decode + verify(%d) %s", chosen, step,
                 {k: f"{1e3 * v:.1f} ms" for k, v in costs.items()})
    fields = {"dtype": dtype_report, "weights": candidate.lean.weights_note, "placement": candidate.lean.placement()}
    if curves:
        paths_report = {name: c.paths for name, c in built.items() if c.paths}
        fields["linear_paths"] = {
            "setting": runtime.linear_paths, "dtype": chosen, "threads": torch.get_num_threads(),
            "clock": linear_paths.clock_name(candidate.lean.embedding.device),
            "verify_curve_ms": {k: {n: 1e3 * t for n, t in row.items()} for k, row in curves.items()},
            "relative": {k: {n: t / row[1] for n, t in row.items()} for k, row in curves.items()},
            **({"by_dtype": paths_report} if paths_report else {}),
            "seconds": seconds,
        }
        if candidate.paths:
            log.info("linear paths (%s) per row count: %s", chosen, summary(candidate.paths["chosen"]))
    return candidate.lean, candidate.model, fields


def prepare_target(hf_model: nn.Module, runtime: RuntimeConfig, sizes: Sequence[int], prompt: torch.Tensor,
                   max_seq_len: int) -> tuple[LeanLlama, nn.Module, dict]:
    """Build the lean target for a run (`build_candidates`, cost curves when there is a choice or
    paths were measured, `finish`). Returns (lean forward, the transformers model in the same dtype
    for `generate`, report fields)."""
    start = time.perf_counter()
    sizes = sorted({1, *sizes})
    built, reason = build_candidates(hf_model, runtime, sizes, max_seq_len)
    measure = len(built) > 1 or runtime.linear_paths == "auto"
    curves = forward_costs(curve_variants(built), prompt, sizes, runtime.linear_paths_repeats) if measure else {}
    return finish(built, curves, runtime, sizes, reason, time.perf_counter() - start)


def summary(chosen: Mapping[str, Mapping[int, str]]) -> dict[int, str]:
    """{n: "site=path, ..."} compacted: one path name where every site agrees."""
    sizes = sorted({n for plan in chosen.values() for n in plan})
    out = {}
    for n in sizes:
        names = {site: plan[n] for site, plan in chosen.items()}
        out[n] = next(iter(names.values())) if len(set(names.values())) == 1 else \
            ", ".join(f"{site}={path}" for site, path in names.items())
    return out
