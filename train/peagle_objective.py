"""P-EAGLE's training step and held-out counts (heads/peagle.py), as speculators trains it
(FORMATS.md "P-EAGLE", "Training").

Features and the EAGLE shift are EAGLE-3's (train/eagle3_objective.py): row t < n = T-1 reads
x_{t+1} and project(aux_t) at position t, and its teacher is the target at t+1 (predicting
x_{t+2}); it counts when x_{t+2} is an assistant token (`eagle_position_mask`, `base` below).
Chain a at depth d >= 1 is a mask row: it reads `mask_token_id` and project(mask_hidden) at
position a+d and is scored against the target at a+d+1, counting when base[a+d] does. In drafting
(eval), a = the last committed row and depth d is the (d+1)-th drafted token.

COD sampling (`cod_rows`): depth 0 keeps every row; the seeds are at most `max_anchors` counted
rows, and depth d keeps int(max(ratio**d, ratio_min) · (seeds - d)) chains drawn from those that
survived depth d-1 and still count at a+d. A mask row attends to the depth-0 rows s <= a and to
its own chain's rows of depths 1..d (`heads.peagle.slot_attention_mask`): the depth-0 rows run
first, causal, with a cache, and all mask rows then run in one forward over that cache with the
dense block mask (B, 1, M, n + M), which our sizes afford. The loss is KL(p_target || q_draft) over
the draft vocabulary, averaged over every counted row of every depth, with no depth decay.
"""
from __future__ import annotations

import torch
from torch import nn

from heads.peagle import slot_attention_mask
from train.eagle3_objective import row_index, split_features, teacher_rows
from train.heldout import _greedy, _kept
from train.losses import eagle_position_mask, kl_divergence_chunked
from train.objectives import FrozenParts


def cod_chains(counted: torch.Tensor, depths: int, ratio: float, ratio_min: float, max_anchors: int,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's COD draw: counted (n,) bool -> the mask rows (anchors (M,), depths (M,)
    long, depths in 1..depths-1, ordered by depth then anchor). Row (a, d) has a+d counted, and
    (a, d-1) is a row too for d >= 2."""
    n, device = counted.shape[0], counted.device
    seeds = counted.nonzero()[:, 0]  # positions p = a + d that count
    if seeds.numel() > max_anchors:
        seeds = seeds[torch.randperm(seeds.numel(), generator=generator, device="cpu")[:max_anchors].to(device)].sort().values
    pool, anchors, levels = seeds, [], []
    for d in range(1, depths):
        size = int(max(0, seeds.numel() - d) * max(ratio**d, ratio_min))
        if size <= 0:
            break
        if pool.numel() > size:
            pool = pool[torch.randperm(pool.numel(), generator=generator, device="cpu")[:size].to(device)].sort().values
        pool = pool[pool >= d]  # the anchor lies inside the sequence
        anchors.append(pool - d)
        levels.append(torch.full_like(pool, d))
        pool = pool + 1
        pool = pool[pool < n]
        pool = pool[counted[pool]]
    if not anchors:
        return counted.new_zeros(0, dtype=torch.long), counted.new_zeros(0, dtype=torch.long)
    return torch.cat(anchors), torch.cat(levels)


def pad_rows(rows: list[tuple[torch.Tensor, torch.Tensor]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence (anchors (M_b,), depths (M_b,)) -> (B, M) each, M = max(1, max M_b); padding
    rows have anchor -1 and depth 1."""
    width = max([1] + [a.numel() for a, _ in rows])
    anchors = torch.full((len(rows), width), -1, dtype=torch.long, device=device)
    depths = torch.ones((len(rows), width), dtype=torch.long, device=device)
    for b, (a, d) in enumerate(rows):
        anchors[b, : a.numel()], depths[b, : d.numel()] = a, d
    return anchors, depths


def context_forward(head: nn.Module, parts: FrozenParts, ids: torch.Tensor, hidden: torch.Tensor):
    """The depth-0 rows of every position t < n, causal: ids (B, T), hidden (B, n, D) =
    project(aux_t) -> (out (B, n, D), their (k, v))."""
    n = ids.shape[1] - 1
    positions = torch.arange(n, device=ids.device).expand(ids.shape[0], n)
    return head(parts.embed(ids[:, 1:]).to(hidden.dtype), hidden, positions, use_cache=True)


def slot_forward(head: nn.Module, parts: FrozenParts, past, anchors: torch.Tensor, depths: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """All mask rows (anchors, depths (B, M); anchor -1 = padding) in one forward over the
    depth-0 rows' cache `past` -> out (B, M, D)."""
    module = getattr(head, "module", head)
    B, M = anchors.shape
    embeds, hidden = module.slot_inputs(parts.embed, 1, dtype)  # (1, D) each; every mask row reads the same
    mask = slot_attention_mask(anchors, depths, past[0].shape[2])  # (B, 1, M, n + M)
    out, _ = head(embeds.expand(B, M, -1), hidden.expand(B, M, -1), (anchors + depths).clamp(min=0),
                  attention_mask=mask, past_key_values=past)
    return out


def cod_rows(base: torch.Tensor, depths: int, ratio: float, ratio_min: float, max_anchors: int,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """base (B, n) bool -> the batch's COD mask rows, padded: (anchors (B, M), depths (B, M))."""
    rows = [cod_chains(base[b], depths, ratio, ratio_min, max_anchors, generator) for b in range(base.shape[0])]
    return pad_rows(rows, base.device)


def peagle_step(head: nn.Module, parts: FrozenParts, batch: dict, features: torch.Tensor, options,
                chunk_size: int, generator: torch.Generator | None = None) -> dict:
    """One training step's loss over a COD draw of the batch. options: heads.config.PeagleOptions.
    Returns {loss, step_losses [K] (mean KL per depth), hits [K] bool, out_of_vocab [K] ints,
    positions (depth 0's counted rows)}."""
    module = getattr(head, "module", head)  # the draft norm, lm_head and mask_hidden are read outside forward
    ids = batch["input_ids"]  # (B, T)
    aux, final = split_features(features, len(module.config.aux_layer_ids))
    base = eagle_position_mask(batch["loss_mask"], batch["attention_mask"])  # (B, n)
    teacher, in_vocab = teacher_rows(final, base, parts.lm_head_weight, module.t2d, chunk_size)
    row_of = row_index(base)  # (B, n)
    hidden = module.project(aux[:, :-1])  # (B, n, D)
    out, past = context_forward(head, parts, ids, hidden)
    K = module.config.speculative_tokens
    anchors, depths = cod_rows(base, K, options.down_sample_ratio, options.down_sample_ratio_min,
                               options.max_anchors, generator)
    slots = slot_forward(head, parts, past, anchors, depths, hidden.dtype)  # (B, M, D)
    real = anchors >= 0
    where = (anchors + depths).clamp(max=base.shape[1] - 1)
    states = torch.cat([out[base], slots[real]])  # (N, D)
    rows = torch.cat([row_of[base], row_of.gather(1, where)[real]])  # (N,) teacher rows
    level = torch.cat([torch.zeros_like(row_of[base]), depths[real]])  # (N,)
    kl, hits = kl_divergence_chunked(module.norm(states), module.lm_head.weight, teacher, rows, chunk_size)
    hits = hits & in_vocab[rows]
    result = {"loss": kl.sum() / max(kl.shape[0], 1), "step_losses": [], "hits": [], "out_of_vocab": []}
    for d in range(K):
        at = level == d
        result["step_losses"].append(kl.detach()[at].mean() if bool(at.any()) else kl.new_zeros(()))
        result["hits"].append(hits[at])
        result["out_of_vocab"].append(int((~in_vocab[rows[at]]).sum()))
    result["positions"] = int(base.sum())
    return result


@torch.no_grad()
def peagle_eval_counts(head: nn.Module, parts: FrozenParts, batch: dict, features: torch.Tensor,
                       eval_anchors: int, truths: list | None = None) -> torch.Tensor:
    """(K, 3) float counts of [top-1 hits, top-5 hits, positions] per drafted position for one
    batch, every chain scored (no COD draw): chain a at depth d as the drafter runs it, against
    the target's greedy token at a+d+1 over the whole vocabulary. Chains run eval_anchors at a
    time; `truths` as for EAGLE-3 (train/heldout.py)."""
    module = getattr(head, "module", head)
    ids = batch["input_ids"]  # (B, T)
    K = module.config.speculative_tokens
    counts = torch.zeros(K, 3, device=ids.device)
    aux, final = split_features(features, len(module.config.aux_layer_ids))
    base = eagle_position_mask(batch["loss_mask"], batch["attention_mask"])  # (B, n)
    greedy = _kept(truths, 0, lambda: _greedy(final[:, 1:][base], parts.lm_head_weight))  # (N,) argmax at f_{t+1}
    row_of = row_index(base)  # (B, n)
    hidden = module.project(aux[:, :-1])
    out, past = context_forward(head, parts, ids, hidden)

    def count(depth: int, states: torch.Tensor, truth: torch.Tensor) -> None:
        logits = module.logits(states)  # (N, Vd)
        top = module.to_target_ids(logits.topk(min(5, logits.shape[-1]), dim=-1).indices)  # (N, 5) target ids
        counts[depth] += torch.stack([(top[:, 0] == truth).sum(), (top == truth[:, None]).any(-1).sum(),
                                      torch.tensor(truth.shape[0], device=ids.device)]).to(counts)

    count(0, out[base], greedy[row_of[base]])
    B, n = base.shape
    if K == 1:
        return counts
    levels = torch.arange(1, K, device=ids.device)
    for start in range(0, n, eval_anchors):
        chains = torch.arange(start, min(start + eval_anchors, n), device=ids.device)
        anchors = chains.repeat_interleave(K - 1).expand(B, -1)  # (B, M) every depth of each chain
        depths = levels.repeat(chains.numel()).expand(B, -1)
        where = anchors + depths
        valid = (where < n) & base.gather(1, where.clamp(max=n - 1))
        if not bool(valid.any()):
            continue
        slots = slot_forward(head, parts, past, anchors, depths, hidden.dtype)  # (B, M, D)
        rows = row_of.gather(1, where.clamp(max=n - 1))
        for d in range(1, K):
            at = valid & (depths == d)
            count(d, slots[at], greedy[rows[at]])
    return counts
