"""Runtime/evaluation settings (the `runtime` config group)."""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

from eval.runtime.drafters.kinds import head_drafters

log = logging.getLogger(__name__)


@dataclass
class RuntimeConfig:
    drafters: list[str] = field(default_factory=lambda: ["eagle_tree", "eagle_chain", "prompt_lookup"])
    attention: str = "auto"  # auto (triton on CUDA, reference elsewhere) | reference | triton
    temperature: float = 0.0
    top_k: int = 0  # sampling filter; 0 = off
    top_p: float = 1.0
    max_new_tokens: int = 64
    num_prompts: int = 8
    prompts_file: str | None = None  # JSONL of prompts; default: held-out ShareGPT split
    max_prompt_tokens: int = 256
    chain_depth: int = 4
    tree_top_k: int = 4  # EAGLE-2 expansion width
    tree_depth: int = 4
    # Tokens per verification, root included: an int, or "auto" = the size of tree_auto_sizes whose greedy
    # runs on the calibration prompts go fastest on this machine (eval.calibrate.eagle_tree_budget).
    tree_total_tokens: Any = 16
    tree_auto_sizes: list[int] = field(default_factory=lambda: [2, 3, 4, 6, 8, 12, 16, 24, 32])  # "auto" candidates
    medusa_choices: str = "auto"  # auto (from measured head accuracies) | mc_sim_7b_63 | JSON list
    typical_acceptance: bool = False  # Medusa's typical acceptance: LOSSY
    compare_transformers: bool = True
    threads: int | None = None  # torch CPU threads, set by `python -m eval` (a train job: trainer.num_threads)
    tree_sweep: list[int] = field(default_factory=lambda: [4, 8, 16, 32])  # eagle_tree total_tokens sweep
    # peagle_tree: tokens per verification, root included, over chain_depth slots (the nodes are
    # chosen per step from the slots' top tokens, eval/runtime/drafters/peagle.py); "auto": the size of
    # tree_auto_sizes whose greedy runs on the calibration prompts go fastest (eval.calibrate)
    peagle_tree_tokens: Any = 8
    draft_layers: int | None = None  # self_speculation: target layers in the draft; None = a quarter
    prompt_lookup_tokens: int = 8  # prompt_lookup: longest drafted chain
    seed: int = 0  # sampling generators (one per prompt, the same for every method)
    fuse_projections: bool = True  # lean forward: fused q|k|v and gate|up matmuls (LeanLlama.from_hf)
    # Never speculate at a loss: EAGLE, Medusa and prompt-lookup steps fall back to plain decoding while
    # measured tokens per speculative step do not beat its measured cost in plain steps; probes after
    # 2, 4, 8, ... plain steps, at most every fallback_probe_every.
    fallback: bool = False
    fallback_probe_every: int = 16
    pack_multi_row: bool = True  # lean forward on CPU (fp32, bf16): oneDNN-packed weights for N >= 2 tokens (default rule)
    # The target's compute dtype in eval (plain, speculative and transformers' generate alike): target (as
    # loaded) | auto (measured decode + verify step: fp32, or bf16 on CPUs with AVX512-BF16/AMX) | float32 | bfloat16.
    dtype: str = "target"
    # The draft head's dtype in eval: float32 (as trained and exported for training) | runtime (the
    # target's dtype above: a bf16 target's head drafts in bf16 too, as vLLM runs a draft model).
    head_dtype: str = "float32"
    # How each linear layer runs each row count: default (one rule for every machine) | auto (the fastest
    # path measured per layer role and row count at start, eval.runtime.linear_paths) | a path name (forced).
    linear_paths: str = "default"
    linear_paths_budget: float = 3.0  # weight copies the chosen layouts may hold (memory shared with the model: 0)
    linear_paths_repeats: int = 5  # measurement rounds (minimum taken) for paths and cost curves
    # A batch-size sweep instead of the batch-1 comparison: plain and each drafter (fallback off) at each
    # batch size, the crossover and a speculation policy per batch size (eval/batch_eval.py); [] = off.
    batch_sizes: list[int] = field(default_factory=list)
    batch_one_check: bool = True  # the sweep also times batch size 1 through the batch decoder vs the batch-1 loop


HEAD_FREE_DRAFTERS = ("prompt_lookup", "draft_model", "self_speculation")  # drafters that need no trained head
DRAFTERS = (*head_drafters(), *HEAD_FREE_DRAFTERS)  # the head drafters: one table per kind, the runtime's


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_runtime(r: RuntimeConfig) -> None:
    """Raise ValueError naming the first `runtime.*` value that cannot work (no I/O; run before
    any model loads). Used by `python -m train` and `python -m eval` alike."""
    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise ValueError(f"runtime.{key}={getattr(r, key)!r} {what}")

    need(r.attention in ("auto", "reference", "triton"), "attention", "is not one of ['auto', 'reference', 'triton']")
    for drafter in r.drafters:
        if drafter not in DRAFTERS:
            raise ValueError(f"runtime.drafters[]={drafter!r} is not one of {sorted(DRAFTERS)}")
    need(isinstance(r.temperature, (int, float)) and math.isfinite(r.temperature) and r.temperature >= 0,
         "temperature", "must be a finite number >= 0 (0: greedy)")
    need(isinstance(r.top_p, (int, float)) and 0.0 < r.top_p <= 1.0, "top_p", "must be in (0, 1]")
    need(_is_int(r.top_k) and r.top_k >= 0, "top_k", "must be an int >= 0 (0: off)")
    need(r.tree_total_tokens == "auto" or (_is_int(r.tree_total_tokens) and r.tree_total_tokens >= 2),
         "tree_total_tokens", "must be an int >= 2 (the root plus at least one drafted token) or 'auto'")
    need(all(_is_int(n) and n >= 2 for n in r.tree_auto_sizes), "tree_auto_sizes", "must hold ints >= 2")
    need(r.peagle_tree_tokens == "auto" or (_is_int(r.peagle_tree_tokens) and r.peagle_tree_tokens >= 2),
         "peagle_tree_tokens", "must be an int >= 2 (the root plus at least one drafted token) or 'auto'")
    for key in ("tree_depth", "tree_top_k", "chain_depth", "max_new_tokens", "num_prompts", "max_prompt_tokens",
                "prompt_lookup_tokens", "fallback_probe_every"):
        need(_is_int(getattr(r, key)) and getattr(r, key) >= 1, key, "must be an int >= 1")
    need(_is_int(r.seed) and r.seed >= 0, "seed", "must be an int >= 0")
    need(r.threads is None or (_is_int(r.threads) and r.threads >= 0), "threads", "must be null or an int >= 0")
    need(r.dtype in ("auto", "target", "float32", "fp32", "bfloat16", "bf16"), "dtype",
         "is not one of ['auto', 'target', 'float32', 'bfloat16']")
    need(r.head_dtype in ("float32", "runtime"), "head_dtype", "is not one of ['float32', 'runtime']")
    need(r.linear_paths in ("auto", "default", "gemv_t", "linear", "tall", "rows", "dnnl"), "linear_paths",
         "is not one of ['auto', 'default'] or a path (gemv_t, linear, tall, rows, dnnl)")
    need(isinstance(r.linear_paths_budget, (int, float)) and r.linear_paths_budget >= 1, "linear_paths_budget",
         "must be >= 1 (weight copies)")
    need(all(_is_int(b) and b >= 1 for b in r.batch_sizes), "batch_sizes", "must hold ints >= 1")
    need(list(r.batch_sizes) == sorted(set(r.batch_sizes)), "batch_sizes", "must be ascending without repeats")
    need(_is_int(r.linear_paths_repeats) and r.linear_paths_repeats >= 1, "linear_paths_repeats", "must be an int >= 1")


def wandb_mode(configured: str, environ=None) -> str:
    """The W&B mode a job uses: the `WANDB_MODE` environment variable when set (a cluster's way
    to keep every job offline), else `logger.mode`. Logged either way; an environment variable
    that turns an offline or disabled setting into uploads is a WARNING. Applied once by the
    entry points (`python -m train`'s pipeline, `python -m eval`), which pass the result to
    `wandb.init(mode=...)`; library code passes logger.mode as it is."""
    environ = os.environ if environ is None else environ
    override = environ.get("WANDB_MODE")
    if not override or override == configured:
        log.info("W&B mode %s (logger.mode%s)", configured, ", WANDB_MODE agrees" if override else "")
        return configured
    uploads = override in ("online", "run") and configured in ("offline", "disabled", "dryrun")
    log.log(logging.WARNING if uploads else logging.INFO, "W&B mode %s from the WANDB_MODE environment variable, "
            "not logger.mode=%s%s", override, configured, ": this run uploads to W&B" if uploads else "")
    return override
