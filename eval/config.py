"""Runtime/evaluation settings (the `runtime` config group)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    # Tokens per verification, root included: an int, or "auto" = chosen at start from this machine's
    # measured verification-cost curve and the head's acceptance per budget (eval.run.choose_tree_budget).
    tree_total_tokens: Any = 16
    tree_auto_sizes: list[int] = field(default_factory=lambda: [2, 3, 4, 6, 8, 12, 16, 24, 32])  # "auto" candidates
    medusa_choices: str = "auto"  # auto (from measured head accuracies) | mc_sim_7b_63 | JSON list
    typical_acceptance: bool = False  # Medusa's typical acceptance: LOSSY
    compare_transformers: bool = True
    threads: int | None = None
    tree_sweep: list[int] = field(default_factory=lambda: [4, 8, 16, 32])  # eagle_tree total_tokens sweep
    draft_layers: int | None = None  # self_speculation: target layers in the draft; None = a quarter
    prompt_lookup_tokens: int = 8  # prompt_lookup: longest drafted chain
    draft_vocab_size: int = 0  # EAGLE-1/2 and Medusa drafts over the N most frequent training-reply tokens; 0 = full vocabulary (EAGLE-3 heads carry their own)
    seed: int = 0  # sampling generators (one per prompt, the same for every method)
    fuse_projections: bool = True  # lean forward: fused q|k|v and gate|up matmuls (LeanLlama.from_hf)
    # Never speculate at a loss: EAGLE, Medusa and prompt-lookup steps fall back to plain decoding while
    # measured tokens per speculative step do not beat its measured cost in plain steps; probes after
    # 2, 4, 8, ... plain steps, at most every fallback_probe_every.
    fallback: bool = False
    fallback_probe_every: int = 16
    pack_multi_row: bool = True  # lean forward on CPU fp32: oneDNN-packed weights for N >= 2 tokens
