"""Where a greedy output leaves plain greedy decoding, and whether the target's own logits there are
a near-tie.

Speculative decoding is lossless against the target's argmax as the verification forward computes
it. In fp32 that argmax does not depend on how many rows a forward runs, and the outputs are
token-identical. In bf16 (or fp16) the matmul kernels accumulate in a different order for a
one-row decode step and a multi-row verification, each layer's output is rounded to 8 mantissa
bits, and a logit can move by several ulps: where the top two logits are that close, the two
decoders may pick different tokens and continue differently from there on. That is rounding, not
a broken drafter, and a report has to say which of the two a mismatch is.

`divergence` finds the first differing position, recomputes the logits there with one prefill over
the prompt and the plain tokens before it, and calls the divergence a near-tie when the two tokens'
logits are within `TIE_ULPS` ulps of the top logit in the compute dtype. The bounds sit above
row-count noise measured on SmolLM2-135M (AMD EPYC Zen 4, a one-row decode step against a prefill
over the same tokens, 4 prompts x 32 steps): bf16 moved a logit by at most 1.17, 8.6 ulps of the
top logit; fp32 by 1.05e-4, 55 ulps. A drafter that accepts a wrong token leaves a gap of whole
logits in fp32 and is reported as a real mismatch.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

TIE_ULPS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 512, torch.float64: 512}


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` numbers at `value`."""
    info = torch.finfo(dtype)
    return info.eps * 2.0 ** math.floor(math.log2(max(abs(value), info.tiny)))


def tie_tolerance(top_logit: float, dtype: torch.dtype) -> float:
    return TIE_ULPS.get(dtype, 16) * ulp(top_logit, dtype)


@torch.no_grad()
def divergence(lean, prompt: torch.Tensor, reference: Sequence[int], tokens: Sequence[int]) -> dict | None:
    """The first position where `tokens` leaves `reference` (plain greedy output of `prompt`), with
    the target's logit gap there; None when they are equal. An output that stops early or runs
    on (one a prefix of the other) is never a near-tie: an end-of-sequence token or the length
    limit decided it, not a rounding."""
    if list(tokens) == list(reference):
        return None
    position = next((k for k, (a, b) in enumerate(zip(reference, tokens)) if a != b), None)
    if position is None:
        return {"position": min(len(reference), len(tokens)), "plain_token": None, "token": None,
                "logit_gap": None, "tolerance": None, "near_tie": False,
                "why": f"lengths differ ({len(tokens)} tokens against plain's {len(reference)})"}
    dtype = lean.embedding.dtype
    ids = torch.cat([torch.as_tensor(prompt, dtype=torch.long).cpu(),
                     torch.as_tensor(list(reference[:position]), dtype=torch.long)])
    cache = lean.new_cache(ids.shape[0] + 1)
    logits = lean(ids, cache, logits="last").logits[-1].float()
    top = float(logits.max())
    gap = float(logits[reference[position]] - logits[tokens[position]])
    tolerance = tie_tolerance(top, dtype)
    return {"position": position, "plain_token": int(reference[position]), "token": int(tokens[position]),
            "logit_gap": gap, "tolerance": tolerance, "near_tie": abs(gap) <= tolerance,
            "why": f"{str(dtype).removeprefix('torch.')} logits {gap:+.4g} apart "
                   f"({'within' if abs(gap) <= tolerance else 'beyond'} {tolerance:.3g})"}


def classify(lean, prompts: Sequence[torch.Tensor], reference: Sequence[Sequence[int]],
             outputs: Sequence[Sequence[int]]) -> dict:
    """Every mismatch of `outputs` against `reference` (per prompt, outputs[i] from prompts[i %
    len(prompts)]): {"greedy_divergences": [{prompt, position, ...}], "greedy_identical_up_to_ties":
    True when each is a near-tie}."""
    found = []
    for i, tokens in enumerate(outputs):
        index = i % len(prompts)
        found_here = divergence(lean, prompts[index], reference[index], tokens)
        if found_here is not None:
            found.append({"prompt": index, **found_here})
    return {"greedy_divergences": found, "greedy_identical_up_to_ties": all(d["near_tie"] for d in found)}
