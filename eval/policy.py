"""Choosing the speculation policy per batch size from a batch-size sweep's throughput: the
measurement's half of it. The policy itself and the drafter that follows it step by step are the
runtime's (`eval.runtime.drafters.policy`).
"""
from __future__ import annotations

from typing import Mapping

from eval.runtime.drafters.policy import SpeculationPolicy

PAYS_MARGIN = 0.02  # at break-even plain decoding wins: same speed, less work


def choose_policy(family: str, plain: Mapping[int, float], points: Mapping[int, Mapping[int, float]],
                  draft_lengths: Mapping[int, int], measured_on: dict | None = None) -> SpeculationPolicy:
    """plain: {batch size: plain tokens/s}; points: {batch size: {draft size: tokens/s}} for the
    family; draft_lengths: {draft size: draft length}. Each measured batch size gets the size with
    the most tokens/s if it beats plain by PAYS_MARGIN, else 0; a size covers batch sizes up to the
    next measured one; beyond the largest measured batch size, speculation is on only if it paid
    there (and then stays off past twice that size: not measured)."""
    sizes = sorted(plain)
    chosen = {}
    for batch in sizes:
        candidates = points.get(batch, {})
        best = max(candidates, key=candidates.get, default=None)
        pays = best is not None and candidates[best] > plain[batch] * (1.0 + PAYS_MARGIN)
        chosen[batch] = best if pays else 0
    ranges: list[dict] = []
    for i, batch in enumerate(sizes):
        upper = sizes[i + 1] - 1 if i + 1 < len(sizes) else (2 * batch - 1 if chosen[batch] else None)
        size = chosen[batch]
        entry = {"min_batch": 1 if i == 0 else batch, "max_batch": upper, "size": size,
                 "draft_length": draft_lengths.get(size, 0) if size else 0}
        if ranges and ranges[-1]["size"] == size:
            ranges[-1]["max_batch"] = upper
        else:
            ranges.append(entry)
    if ranges[-1]["max_batch"] is not None:
        ranges.append({"min_batch": ranges[-1]["max_batch"] + 1, "max_batch": None, "size": 0, "draft_length": 0})
    return SpeculationPolicy(family, ranges, measured_on)
