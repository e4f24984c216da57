"""The dtype the frozen target computes in on a CPU, for every stage that runs it.

One rule for the data stage (self-distillation), training (the feature pass, online or into the
offline cache) and the runtime (`runtime.dtype=auto`, eval/prepare.py): fp32 on a CPU without bf16
instructions (AVX512-BF16 or AMX), where bf16 matmuls are emulated and run several times slower;
otherwise the dtype whose forward measures faster on this machine. The trainable head keeps fp32
master weights either way; only the frozen target's forward changes.
"""
from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# Above this the second copy a measurement needs costs more memory than the choice is worth; a big
# target on a bf16 CPU is bound by reading its weights, which bf16 halves.
MEASURE_MAX_BYTES = 4 * 2**30
# Below this a forward is mostly per-op overhead, and the choice is noise (and test models stay fp32).
MEASURE_MIN_BYTES = 64 * 2**20


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def bf16_flags(flags: set[str] | None = None) -> list[str]:
    """The bf16 instruction flags this CPU has (sorted; empty: none)."""
    return sorted(set(BF16_FLAGS) & (cpu_flags() if flags is None else flags))


@dataclass
class DtypeChoice:
    """What the frozen target computes in, and why (written to job summaries and manifests)."""

    dtype: str
    reason: str
    ms: dict = field(default_factory=dict)  # measured forward per dtype, when measured

    def to_dict(self) -> dict:
        return asdict(self)


def _forward_ms(model: nn.Module, ids: torch.Tensor, repeats: int) -> float:
    with torch.no_grad():
        model(input_ids=ids)  # warm-up: first-call allocations and kernel selection
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            model(input_ids=ids)
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def _model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def choose_cpu_dtype(model: nn.Module, flags: set[str] | None = None, batch: int = 4, tokens: int = 128,
                     repeats: int = 2, measure=None, min_bytes: int = MEASURE_MIN_BYTES) -> DtypeChoice:
    """fp32 or bf16 for a float32 causal LM on the CPU. With bf16 instructions, a training-shaped
    forward (batch x tokens, the shape of regeneration prefills and feature passes) is timed on the
    model and on a bf16 copy, and the faster wins. measure(model, ids) -> ms replaces the timer in
    tests."""
    found = bf16_flags(flags)
    if not found:
        return DtypeChoice("float32", "fp32: this CPU has no bf16 instructions (no avx512_bf16 or amx_bf16)")
    if _model_bytes(model) < min_bytes:
        return DtypeChoice("float32", f"fp32: a target under {min_bytes >> 20} MB gains nothing measurable")
    if _model_bytes(model) > MEASURE_MAX_BYTES:
        return DtypeChoice("bfloat16", f"bf16: CPU flags {', '.join(found)}, and a target this size is bound by "
                                       "reading its weights (not measured: a second copy would not fit comfortably)")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 1000
    ids = torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(0))
    timer = measure or (lambda m, x: _forward_ms(m, x, repeats))
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    ms = {"float32": timer(model, ids), "bfloat16": timer(bf16, ids)}
    del bf16
    pick = min(ms, key=ms.get)
    return DtypeChoice(pick, f"measured on this CPU (flags {', '.join(found)}): forward of {batch}x{tokens} tokens "
                             f"fp32 {ms['float32']:.0f} ms, bf16 {ms['bfloat16']:.0f} ms", ms)
