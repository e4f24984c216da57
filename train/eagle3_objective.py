"""EAGLE-3's training step: the training-time test, unrolled over all chains of a batch at once.

Features: EAGLE-3 reads several target streams, so its FeatureSource returns the layers
`aux_layer_ids + [-1]` concatenated on the last axis: (B, T, (n+1)·Ht), the n aux streams in
fc's order, then the final post-norm state the teacher's logits come from (`feature_layers`).
Position alignment and the loss: train/losses.py (EAGLE-3). Step j feeds the head's own pre-norm
output of step j-1 back as its hidden input, without detaching it: the gradient of every step
reaches fc and the earlier steps through the fed-back states, as in the reference trainers.
"""
from __future__ import annotations

import torch
from torch import nn

from train.losses import chain_attention_mask, draft_vocab_teacher, eagle3_loss, eagle_position_mask, shift_left
from train.objectives import FrozenParts


def feature_layers(aux_layer_ids) -> list[int]:
    """The target layers EAGLE-3 reads, in the order its features are concatenated: the aux
    streams (transformers' hidden_states numbering) and -1, the final post-norm state."""
    return [*aux_layer_ids, -1]


def split_features(features: torch.Tensor, num_aux: int) -> tuple[torch.Tensor, torch.Tensor]:
    """features (B, T, (n+1)·Ht) -> aux (B, T, n·Ht), final (B, T, Ht)."""
    width = features.shape[-1] // (num_aux + 1)
    if width * (num_aux + 1) != features.shape[-1]:
        raise ValueError(f"EAGLE-3 features of width {features.shape[-1]} do not hold {num_aux} aux layers "
                         "plus the final state")
    return features[..., : num_aux * width], features[..., num_aux * width:]


def teacher_rows(final: torch.Tensor, base: torch.Tensor, lm_head_weight: torch.Tensor, t2d: torch.Tensor,
                 chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's draft-vocabulary logits once per batch, for every step: final (B, T, D), base
    (B, T-1) bool step 0's counted chains. Chain t at step j is scored at the target's position
    t+1+j, which is step 0's chain t+j, so step j reads row shift_left(row_of, j).
    Returns (logits (N, Vd), in_vocab (N,) bool, row_of (B, T-1) long: -1 where not counted)."""
    logits, in_vocab = draft_vocab_teacher(final[:, 1:][base], lm_head_weight, t2d, chunk_size)
    row_of = base.flatten().long().cumsum(0).view_as(base) - 1
    return logits, in_vocab, torch.where(base, row_of, -1)


def ttt_unroll(head: nn.Module, parts: FrozenParts, ids: torch.Tensor, hidden: torch.Tensor, steps: int):
    """Yield (j, out (B, n, D)) for j < steps: chain t at step j reads x_{t+1+j} at position t+j
    and its own step j-1 output (step 0: `hidden` (B, n, D) = fc(aux_t)); it attends to the true
    context (step-0 entries <= t) and its own chain. ids (B, T); n = T-1."""
    B, T = ids.shape
    n = T - 1
    positions = torch.arange(n, device=ids.device).expand(B, n)
    past = None
    for j in range(max(1, min(steps, n))):
        tokens = shift_left(ids[:, 1:], j)  # (B, n) x_{t+1+j}, zeros past the end
        out, past = head(parts.embed(tokens).to(hidden.dtype), hidden, positions + j,
                         attention_mask=chain_attention_mask(n, j, ids.device), past_key_values=past,
                         use_cache=steps > 1)  # (B, n, D)
        yield j, out
        hidden = out


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
    teacher, in_vocab, row_of = teacher_rows(final, base, parts.lm_head_weight, module.t2d, chunk_size)
    hidden = module.project(aux[:, :-1])  # (B, n, D) h_t
    states, rows = [], []
    for j, out in ttt_unroll(head, parts, ids, hidden, steps):
        valid = shift_left(base, j)  # (B, n) chain t counts iff x_{t+2+j} is an assistant token
        states.append(module.norm(out[valid]))  # (N_j, D)
        rows.append(shift_left(row_of, j)[valid])  # (N_j,) its teacher rows
    result = eagle3_loss(states, module.lm_head.weight, teacher, in_vocab, rows, decay, chunk_size)
    result["positions"] = int(base.sum())
    return result
