"""Held-out accuracies while training, and the acceptance length they predict.

Both head types are compared with the *target's greedy token* (what greedy verification accepts),
on assistant positions of held-out rows, teacher-forced on the data tokens:
- Medusa head k at position t: its top-1/top-5 vs argmax lm_head(f_{t+k+1}) (the target's choice
  for x_{t+k+2}).
- EAGLE step j (0-based) for the chain starting at t: the head reads the data token x_{t+1+j} and,
  for j >= 1, its *own* predicted feature from step j-1 instead of f_{t+j}; it attends to the
  true features of the context (positions <= t) and to its own earlier chain entries, exactly as
  in speculative decoding (EAGLE-3's "training-time test" mask). Its top-1/top-5 is compared with
  argmax lm_head(f_{t+1+j}).

- EAGLE-3 step j: the same chains (train/eagle3_objective.ttt_unroll: step 0 reads fc(aux_t), step
  j its own step j-1 output); its top-1/top-5 over the draft vocabulary, mapped to target ids
  through d2t, is compared with argmax lm_head(f_{t+1+j}) over the whole vocabulary, so a target
  token outside the draft vocabulary is a miss, as it is when drafting.

Acceptance estimate for a chain of depth d from per-step top-1 accuracies a_0..a_{d-1}:
    tau(d) = 1 + sum_{k=1..d} prod_{j<k} a_j
(one token from the target's own verification step, plus each drafted token that survives; step
j's accuracy stands in for its acceptance given the previous steps were accepted).

That estimate weighs every position alike; a decoding run does not. Greedy chain decoding moves
through an easy stretch in few steps and through a hard one a token a step, so the share of steps
whose first draft is accepted runs below the per-position top-1 (about 0.08 lower for the SmolLM2
release heads in vLLM). `chain_walk` replays greedy chain decoding on the held-out replies
instead: the replies are the target's own greedy output (self-distillation), so the chain at t is
the one the runtime drafts there, and a step that accepts k drafts moves on to t + k + 1, as
verification commits them and the target's own token. Its per-position acceptance and mean
length (`eval/chain_accept_step<j>`, `eval/chain_acceptance_length`) are what an engine's chain of
the same depth reports on such replies.

The same walk over each reply's first OPENING_TOKENS tokens only (`eval/opening_chain_*`) is what an
engine benchmark of that many new tokens a prompt measures: a reply's opening, where it chooses
how to start, is harder to draft than its body, and the whole-reply walk runs above such a
benchmark (docs/results.md: 1.94 against vLLM's 1.80 for the SmolLM2 EAGLE-3 release head at K=3,
the opening walk 1.79).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from train.eagle3_objective import row_index, split_features, ttt_unroll
from train.losses import chain_attention_mask, eagle_position_mask, medusa_position_mask, shift_left, top1
from train.objectives import FrozenParts


OPENING_TOKENS = 64  # the reply length of the engine comparisons in docs/results.md


def acceptance_estimate(accuracies: list[float], depth: int | None = None) -> float:
    """tau = 1 + sum_{k=1..d} prod_{j<k} a_j; d defaults to len(accuracies)."""
    depth = len(accuracies) if depth is None else min(depth, len(accuracies))
    tau, survive = 1.0, 1.0
    for a in accuracies[:depth]:
        survive *= a
        tau += survive
    return tau


def walk_row(hits: torch.Tensor, counted: torch.Tensor) -> list[int]:
    """Drafts accepted at each step of greedy chain decoding over one row: hits (K, n) bool, chain
    t's step j top-1 is the target's token (False where step j does not count); counted (n,) bool,
    chain t predicts an assistant token. In each run of counted chains the first is skipped (it
    predicts the reply's first token, which the target's prefill gives), and a step at t accepts
    the leading hits of hits[:, t] and moves to t + accepted + 1."""
    hits, counted = hits.cpu().tolist(), counted.cpu().tolist()
    depth, n = len(hits), len(counted)
    accepted, t = [], 0
    while t < n:
        if not counted[t] or t == 0 or not counted[t - 1]:
            t += 1
            continue
        k = 0
        while k < depth and t + k < n and counted[t + k] and hits[k][t]:
            k += 1
        accepted.append(k)
        t += k + 1
    return accepted


def opening_mask(counted: torch.Tensor, width: int) -> torch.Tensor:
    """counted (B, n) bool -> (B, n) bool: the first `width` positions of each run of counted
    positions (each reply's first `width` tokens, the prefill's included)."""
    total = counted.long().cumsum(-1)
    before_run = torch.cummax(torch.where(counted, 0, total), -1).values  # count at the run's start
    return counted & (total - before_run <= width)


def chain_walk(hits: torch.Tensor, counted: torch.Tensor, walks: list | None = None,
               opening: int | None = None) -> torch.Tensor:
    """hits (K, B, n) bool, counted (B, n) bool -> (K, 2) float: walk_row over every row, column 0
    the steps that accepted step j's draft, column 1 the steps (the same in every row). `walks`
    collects each row's accepted counts per step. `opening`: two more columns, the same walk over
    each reply's first `opening` tokens only (a draft past them is not counted, as a run of that
    many new tokens stops there)."""
    depth = hits.shape[0]
    counts = torch.zeros(depth, 2 if opening is None else 4)
    masks = [counted] if opening is None else [counted, opening_mask(counted, opening)]
    for column, mask in enumerate(masks):
        for b in range(counted.shape[0]):
            accepted = walk_row(hits[:, b], mask[b])
            if walks is not None and column == 0:
                walks.append(accepted)
            for k in accepted:
                counts[:k, 2 * column] += 1
                counts[:, 2 * column + 1] += 1
    return counts


def _topk_hits(logits: torch.Tensor, truth: torch.Tensor, k: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, V), truth (N,) -> (top-1 hits, top-k hits) counts as 0-d tensors."""
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices  # (N, k)
    return (top[:, 0] == truth).sum(), (top == truth[:, None]).any(-1).sum()


def _greedy(features: torch.Tensor, weight: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """features (N, D) -> argmax tokens (N,), chunked over rows."""
    return torch.cat([top1(F.linear(features[s:s + chunk_size], weight))
                      for s in range(0, features.shape[0], chunk_size)]) if features.shape[0] else \
        torch.zeros(0, dtype=torch.long, device=features.device)


def _count(counts: torch.Tensor, step: int, logits: torch.Tensor, truth: torch.Tensor) -> None:
    top1, top5 = _topk_hits(logits, truth)
    counts[step] += torch.stack([top1, top5, torch.tensor(truth.shape[0], device=truth.device)]).to(counts)


@torch.no_grad()
def eagle_unroll(head: nn.Module, parts: FrozenParts, ids: torch.Tensor, features: torch.Tensor,
                 steps: int) -> list[torch.Tensor]:
    """All chains at once: entry j (B, T-1, D) holds, at index t, the head's feature for position
    t+1+j after reading x_{t+1..t+1+j}, the true features f_{<=t} and its own j earlier outputs."""
    B, T = ids.shape
    n = T - 1
    positions = torch.arange(n, device=ids.device).expand(B, n)
    inputs, past, outputs = features[:, :-1], None, []
    for j in range(min(steps, n)):
        embeds = parts.embed(shift_left(ids[:, 1:], j)).to(inputs.dtype)  # x_{t+1+j}, zeros past the end
        mask = chain_attention_mask(n, j, ids.device)
        predicted, past = head(embeds, inputs, positions + j, attention_mask=mask, past_key_values=past,
                               use_cache=True)
        outputs.append(predicted)
        inputs = predicted
    return outputs


def _kept(truths: list | None, index: int, compute):
    """truths[index] when an earlier evaluation of the batch kept it, else compute() (kept in truths
    when a list is given: indices are asked for in order)."""
    if truths is not None and len(truths) > index:
        return truths[index]
    value = compute()
    if truths is not None:
        truths.append(value)
    return value


def eagle_greedy_grid(parts: FrozenParts, features: torch.Tensor, base_mask: torch.Tensor,
                      truths: list | None = None) -> torch.Tensor:
    """(B, n) long: at t, argmax lm_head(f_{t+1}) where base_mask(t), else 0. Step j scores chain t
    against argmax lm_head(f_{t+1+j}) where base_mask(t+j), i.e. this grid shifted left by j, so
    one projection through the lm_head serves every step (`truths` keeps it, as in eagle_eval_counts)."""
    grid = torch.zeros(base_mask.shape, dtype=torch.long, device=base_mask.device)
    grid[base_mask] = _kept(truths, 0, lambda: _greedy(features[:, 1:][base_mask], parts.lm_head_weight))
    return grid


@torch.no_grad()
def eagle_eval_counts(head: nn.Module, parts: FrozenParts, batch: dict, features: torch.Tensor,
                      steps: int, truths: list | None = None, walks: list | None = None) -> torch.Tensor:
    """(steps, 7) float counts of [top-1 hits, top-5 hits, positions] and chain_walk's four columns
    for one batch. `truths`: a list kept by the caller between evaluations of the same batch (the
    target's greedy tokens); `walks`: as for chain_walk."""
    ids = batch["input_ids"]  # (B, T)
    counts = torch.zeros(steps, 3, device=ids.device)
    base_mask = eagle_position_mask(batch["loss_mask"], batch["attention_mask"])  # (B, n)
    greedy = eagle_greedy_grid(parts, features, base_mask, truths)
    hits = torch.zeros((steps,) + base_mask.shape, dtype=torch.bool, device=ids.device)
    for j, predicted in enumerate(eagle_unroll(head, parts, ids, features, steps)):
        valid = shift_left(base_mask, j)  # chain t at step j predicts the token after position t+1+j
        logits, truth = F.linear(predicted[valid], parts.lm_head_weight), shift_left(greedy, j)[valid]
        _count(counts, j, logits, truth)
        hits[j][valid] = top1(logits) == truth
    return torch.cat([counts, chain_walk(hits, base_mask, walks, OPENING_TOKENS).to(counts)], 1)


@torch.no_grad()
def eagle3_eval_counts(head: nn.Module, parts: FrozenParts, batch: dict, features: torch.Tensor,
                       steps: int, truths: list | None = None) -> torch.Tensor:
    """(steps, 7) float counts of [top-1 hits, top-5 hits, positions] and chain_walk's columns for
    one batch; features (B, T, (n+1)·Ht) as train/eagle3_objective.feature_layers orders them
    (`truths`: as for EAGLE; it keeps one tensor, the target's greedy tokens at every counted
    position)."""
    module = getattr(head, "module", head)
    ids = batch["input_ids"]  # (B, T)
    counts = torch.zeros(steps, 3, device=ids.device)
    aux, final = split_features(features, len(module.config.aux_layer_ids))
    base_mask = eagle_position_mask(batch["loss_mask"], batch["attention_mask"])  # (B, n)
    greedy = _kept(truths, 0, lambda: _greedy(final[:, 1:][base_mask], parts.lm_head_weight))  # (N,) argmax at f_{t+1}
    row_of = row_index(base_mask)  # (B, n)
    hits = torch.zeros((steps,) + base_mask.shape, dtype=torch.bool, device=ids.device)
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
    for j, chains, out, valid in ttt_unroll(head, parts, ids, module.project(aux[:, :-1]), steps, base_mask):
        truth = greedy[shift_left(row_of, j).gather(1, chains)[valid]]  # argmax at f_{t+1+j}
        logits = module.logits(out[valid])  # (N_j, Vd)
        top = module.to_target_ids(logits.topk(min(5, logits.shape[-1]), dim=-1).indices)  # (N_j, 5) target ids
        counts[j] += torch.stack([(top[:, 0] == truth).sum(), (top == truth[:, None]).any(-1).sum(),
                                  torch.tensor(truth.shape[0], device=ids.device)]).to(counts)
        hits[j][rows.expand_as(chains)[valid], chains[valid]] = top[:, 0] == truth
    return torch.cat([counts, chain_walk(hits, base_mask, opening=OPENING_TOKENS).to(counts)], 1)


def _ahead(features: torch.Tensor, k: int) -> torch.Tensor:
    """(B, T, D) features with entry t = f_{t+k}, zeros where t + k >= T (k may exceed T)."""
    out = torch.zeros_like(features)
    if k < features.shape[1]:
        out[:, : features.shape[1] - k] = features[:, k:]
    return out


@torch.no_grad()
def medusa_eval_counts(heads: nn.Module, parts: FrozenParts, batch: dict, features: torch.Tensor,
                       truths: list | None = None) -> torch.Tensor:
    """(K, 7) float counts of [top-1 hits, top-5 hits, positions] and chain_walk's columns (the
    chain of each head's top-1) for one batch (`truths`: as for EAGLE)."""
    module = getattr(heads, "module", heads)
    hidden = heads(features)  # (K, B, T, D)
    K = hidden.shape[0]
    counts = torch.zeros(K, 3, device=features.device)
    hits = torch.zeros((K,) + batch["loss_mask"].shape, dtype=torch.bool, device=features.device)
    for k in range(K):
        valid = medusa_position_mask(batch["loss_mask"], k, batch["attention_mask"])  # (B, T)
        truth = _kept(truths, k, lambda: _greedy(_ahead(features, k + 1)[valid], parts.lm_head_weight))
        logits = F.linear(hidden[k][valid], module.lm_head_weight(k, parts.lm_head_weight))
        _count(counts, k, logits, truth)
        hits[k][valid] = top1(logits) == truth
    counted = medusa_position_mask(batch["loss_mask"], 0, batch["attention_mask"])  # head k at t: x_{t+2+k}
    return torch.cat([counts, chain_walk(hits, counted, opening=OPENING_TOKENS).to(counts)], 1)


def held_out_figures(counts: torch.Tensor, unit: str) -> dict[str, float]:
    """(S, 3), (S, 5) or (S, 7) summed counts -> {eval/top1_<unit><i>, eval/top5_<unit><i>, eval/positions,
    eval/acceptance_length}; unit: "step" (drafted chain depth) or "head" (Medusa head). Columns 3-4,
    where a kind counts them (chain_walk), add eval/chain_accept_<unit><i>, eval/chain_steps and
    eval/chain_acceptance_length; columns 5-6 the same over reply openings (eval/opening_chain_*)."""
    top1 = (counts[:, 0] / counts[:, 2].clamp(min=1)).tolist()
    top5 = (counts[:, 1] / counts[:, 2].clamp(min=1)).tolist()
    metrics = {"eval/positions": float(counts[0, 2])}
    for i, (a1, a5) in enumerate(zip(top1, top5)):
        metrics[f"eval/top1_{unit}{i}"] = a1
        metrics[f"eval/top5_{unit}{i}"] = a5
    metrics["eval/acceptance_length"] = acceptance_estimate(top1)
    if counts.shape[1] >= 5 and counts[0, 4] > 0:
        walked = (counts[:, 3] / counts[0, 4]).tolist()
        for i, a in enumerate(walked):
            metrics[f"eval/chain_accept_{unit}{i}"] = a
        metrics["eval/chain_steps"] = float(counts[0, 4])
        metrics["eval/chain_acceptance_length"] = 1.0 + sum(walked)
    if counts.shape[1] >= 7 and counts[0, 6] > 0:
        walked = (counts[:, 5] / counts[0, 6]).tolist()
        for i, a in enumerate(walked):
            metrics[f"eval/opening_chain_accept_{unit}{i}"] = a
        metrics["eval/opening_chain_acceptance_length"] = 1.0 + sum(walked)
        metrics["eval/opening_tokens"] = float(OPENING_TOKENS)  # on record beside the walk it sizes
    return metrics


@torch.no_grad()
def run_held_out(head: nn.Module, kind, parts: FrozenParts, source, batches, reduce=None,
             cache: dict | None = None) -> dict[str, float]:
    """Sum the head kind's counts (`kind.eval_counts`, (kind.eval_rows, 3, 5 or 7)) over `batches` (this
    process's share, maybe empty), `reduce(counts)` sums them across processes (None: one
    process), and held_out_figures. `cache`: a dict kept between evaluations of the same batches (the
    target's greedy tokens per batch)."""
    counts = torch.zeros(kind.eval_rows, 7, device=parts.lm_head_weight.device)
    for index, batch in enumerate(batches):
        features = source(batch)
        truths = cache.setdefault(index, []) if cache is not None else None
        c = kind.eval_counts(head, parts, batch, features, truths)  # (rows, 3), or (rows, 7) with the walks
        counts[: c.shape[0], : c.shape[1]] += c
    if reduce is not None:
        counts = reduce(counts)
    return held_out_figures(counts.cpu(), kind.unit)
