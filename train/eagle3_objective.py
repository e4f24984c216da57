"""EAGLE-3's training step: the training-time test, unrolled over all chains of a batch at once.

Features: EAGLE-3 reads several target streams, so its FeatureSource returns the layers
`aux_layer_ids + [-1]` concatenated on the last axis: (B, T, (n+1)·Ht), the n aux streams in
fc's order, then the final post-norm state the teacher's logits come from (`feature_layers`).
Position alignment and the loss: train/losses.py (EAGLE-3). Step j feeds the head's own output of
step j-1 back as its hidden input (`feedback`: pre-norm, or normed under norm_output), without
detaching it: the gradient of every step reaches fc and the earlier steps through the fed-back
states, as in the reference trainers.
"""
from __future__ import annotations

import torch
from torch import nn

from train.losses import draft_vocab_teacher, eagle3_loss, eagle_position_mask, shift_left
from train.objectives import FINAL, FrozenParts, normal_equations


def feature_layers(aux_layer_ids) -> tuple[int, ...]:
    """The target states EAGLE-3 reads, in the order its features are concatenated: the aux
    streams (transformers' hidden_states numbering) and FINAL, the final post-norm state."""
    return (*aux_layer_ids, FINAL)


def split_features(features: torch.Tensor, num_aux: int) -> tuple[torch.Tensor, torch.Tensor]:
    """features (B, T, (n+1)·Ht) -> aux (B, T, n·Ht), final (B, T, Ht)."""
    width = features.shape[-1] // (num_aux + 1)
    if width * (num_aux + 1) != features.shape[-1]:
        raise ValueError(f"EAGLE-3 features of width {features.shape[-1]} do not hold {num_aux} aux layers "
                         "plus the final state")
    return features[..., : num_aux * width], features[..., num_aux * width:]


def row_index(counted: torch.Tensor) -> torch.Tensor:
    """counted (B, n) bool -> (B, n) long: the index of each counted chain among counted[counted]
    (row-major), -1 elsewhere. Chain t at step j is scored at the target's position t+1+j, which
    is step 0's chain t+j: its row is shift_left(row_index, j)[t]."""
    rows = counted.flatten().long().cumsum(0).view_as(counted) - 1
    return torch.where(counted, rows, -1)


def teacher_rows(final: torch.Tensor, base: torch.Tensor, lm_head_weight: torch.Tensor, t2d: torch.Tensor,
                 chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's draft-vocabulary logits once per batch, for every step: final (B, T, D), base
    (B, T-1) bool step 0's counted chains -> (logits (N, Vd), in_vocab (N,) bool), rows in
    `row_index(base)` order."""
    return draft_vocab_teacher(final[:, 1:][base], lm_head_weight, t2d, chunk_size)


def later_chains(counted: torch.Tensor, steps: int) -> torch.Tensor:
    """counted (B, n) bool, step 0's counted chains -> (B, A) long: per row, the chains that count
    at some step 1..steps-1 (t with counted[t+j]) first, in order, then the others as padding;
    A = the most such chains in a row (at least 1)."""
    later = torch.zeros_like(counted)
    for j in range(1, steps):
        later |= shift_left(counted, j)
    width = max(1, int(later.sum(-1).max()))
    order = torch.sort((~later).to(torch.int8), dim=-1, stable=True).indices  # counted-later chains first
    return order[:, :width]


def ttt_unroll(head: nn.Module, parts: FrozenParts, ids: torch.Tensor, hidden: torch.Tensor, steps: int,
               counted: torch.Tensor):
    """Yield (j, chains (B, A_j) long, out (B, A_j, D), valid (B, A_j) bool) for j < steps.

    Step 0 runs every position t < n = T-1: input x_{t+1}, hidden (B, n, D) = project(aux_t), causal
    (chains = 0..n-1). Later steps run only the chains that count at some later step
    (`later_chains`; the others would cost compute and score nothing): chain t at step j reads
    x_{t+1+j} at position t+j and feedback(its own step j-1 output), and attends to the true context
    (step-0 entries <= t) and its own entries of steps 1..j. valid: chain t counts at step j
    (counted[t+j], counted (B, n) bool being step 0's counted chains)."""
    B, T = ids.shape
    n = T - 1
    feedback = getattr(head, "module", head).feedback
    steps = max(1, min(steps, n))
    chains = torch.arange(n, device=ids.device).expand(B, n)
    out, past = head(parts.embed(ids[:, 1:]).to(hidden.dtype), hidden, chains, use_cache=steps > 1)  # (B, n, D)
    yield 0, chains, out, counted
    if steps == 1:
        return
    chains = later_chains(counted, steps)  # (B, A)
    A, D = chains.shape[1], out.shape[-1]
    hidden = feedback(out.gather(1, chains[..., None].expand(B, A, D)))  # (B, A, D), gradient kept
    context = torch.arange(n, device=ids.device) <= chains[..., None]  # (B, A, n) keys s <= t
    own = torch.eye(A, dtype=torch.bool, device=ids.device).expand(B, A, A)
    for j in range(1, steps):
        tokens = shift_left(ids[:, 1:], j).gather(1, chains)  # (B, A) x_{t+1+j}
        mask = torch.cat([context] + [own] * j, -1)[:, None]  # (B, 1, A, n + A·j)
        out, past = head(parts.embed(tokens).to(hidden.dtype), hidden, chains + j, attention_mask=mask,
                         past_key_values=past, use_cache=True)  # (B, A, D)
        yield j, chains, out, shift_left(counted, j).gather(1, chains)
        hidden = feedback(out)


def eagle3_step(head: nn.Module, parts: FrozenParts, batch: dict, features: torch.Tensor, steps: int,
                decay: float, chunk_size: int) -> dict:
    """One training step's loss: the head unrolled `steps` times on its own outputs, each step
    weighted decay**j (train/losses.eagle3_loss). features (B, T, (n+1)·Ht) as `feature_layers`
    orders them. Returns eagle3_loss's dict plus `positions` (step 0's counted chains, in and out
    of the draft vocabulary)."""
    module = getattr(head, "module", head)  # the draft norm and lm_head are read outside forward
    config = module.config
    ids = batch["input_ids"]  # (B, T)
    aux, final = split_features(features, len(config.aux_layer_ids))
    base = eagle_position_mask(batch["loss_mask"], batch["attention_mask"])  # (B, n)
    teacher, in_vocab = teacher_rows(final, base, parts.lm_head_weight, module.t2d, chunk_size)
    row_of = row_index(base)  # (B, n)
    hidden = module.project(aux[:, :-1])  # (B, n, D) h_t
    states, rows = [], []
    for j, chains, out, valid in ttt_unroll(head, parts, ids, hidden, steps, base):
        states.append(module.norm(out[valid]))  # (N_j, D), chain t counts iff x_{t+2+j} is an assistant token
        rows.append(shift_left(row_of, j).gather(1, chains)[valid])  # (N_j,) its teacher rows
    result = eagle3_loss(states, module.lm_head.weight, teacher, in_vocab, rows, decay, chunk_size)
    result["positions"] = int(base.sum())
    return result


@torch.no_grad()
def eagle3_ridge_sums(parts: FrozenParts, batches, source, num_aux: int, norm_weight: torch.Tensor, max_tokens: int,
                      inputs=None):
    """Σ x xᵀ (n·Ht, n·Ht), Σ x yᵀ (n·Ht, Ht) and the row count over step 0's counted chains of
    `batches` (x = inputs(aux_t), what fc reads: the head's `fc_inputs`, None for aux_t itself;
    y = final_{t+1} / norm_weight: the target's next post-norm state with its norm's weight divided
    out, which the draft's norm puts back), stopping after ~max_tokens rows. Float64 sums."""
    scale = norm_weight.double()

    def pairs():
        for batch in batches:
            aux, final = split_features(source(batch), num_aux)  # (B, T, n·Ht), (B, T, Ht)
            mask = eagle_position_mask(batch["loss_mask"], batch["attention_mask"])  # (B, T-1)
            x = aux[:, :-1][mask]  # (N, n·Ht)
            # The norms run in the features' dtype, as in training, before the sums go to float64.
            x = (inputs(x) if inputs is not None else x).double()
            yield x, final[:, 1:][mask].double() / scale  # (N, n·Ht), (N, Ht)

    return normal_equations(pairs(), max_tokens)
