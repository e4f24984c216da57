"""Distillation losses (pure functions) and the position alignment they assume.

Alignment for a sequence x_0..x_{T-1} with target features f_0..f_{T-1} (f_t predicts x_{t+1}):
- EAGLE, position t in [0, T-1): input (embed(x_{t+1}), f_t), output f̂_{t+1}, regressed onto
  f_{t+1}; its logits are matched to the target's at t+1 (which predict x_{t+2}). The position
  counts when x_{t+2} is an assistant token.
- Medusa head k, position t: predicts x_{t+k+2} from f_t; counts when that token is an assistant
  token.
- EAGLE-3, chain t at unrolled step j (0-based): input (embed(x_{t+1+j}), h) at position t+j, where
  h = fc(aux_t) at step 0 and the head's own step j-1 output after; its logits over the draft
  vocabulary are matched to the target's at t+1+j (from f_{t+1+j}, restricted to the draft
  vocabulary). The chain counts at step j when x_{t+2+j} is an assistant token and the target's
  top-1 at t+1+j lies in the draft vocabulary (step 0 is EAGLE's alignment; step j is it shifted
  by j).
Vocabulary projections run only on the counted positions, in chunks of `chunk_size` rows, because
the (N, V) logits of a 49k vocabulary dominate the cost of a step on CPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def add_uniform_noise(features: torch.Tensor, amplitude: float, generator: torch.Generator | None = None):
    """features + U(-amplitude/2, amplitude/2), elementwise (EAGLE's input noise)."""
    if amplitude <= 0:
        return features
    noise = torch.rand(features.shape, generator=generator, device=features.device, dtype=features.dtype)
    return features + (noise - 0.5) * amplitude


def eagle_position_mask(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """loss_mask (B, T) -> bool (B, T-1): position t counts iff x_{t+2} is a (real) assistant token."""
    mask = loss_mask.bool()
    if attention_mask is not None:
        mask = mask & attention_mask.bool()
    out = torch.zeros_like(mask[:, 1:])  # (B, T-1)
    out[:, :-1] = mask[:, 2:]
    return out


def shift_left(x: torch.Tensor, j: int) -> torch.Tensor:
    """x (B, n, ...) -> (B, n, ...) with entry t = x[:, t + j], zeros past the end: what chain t
    reads or is scored against at unrolled step j."""
    out = torch.zeros_like(x)
    out[:, : x.shape[1] - j] = x[:, j:]
    return out


def chain_attention_mask(n: int, step: int, device) -> torch.Tensor | None:
    """Bool (1, 1, n, n*(step+1)) mask for unrolled step `step` of n chains at once: chain t sees
    the true context (step-0 entries <= t) and its own entries of steps 1..step; None (causal) at
    step 0."""
    if step == 0:
        return None
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(n, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)[None, None]


def medusa_position_mask(loss_mask: torch.Tensor, k: int, attention_mask: torch.Tensor | None = None):
    """bool (B, T): position t counts for head k iff x_{t+k+2} is a (real) assistant token."""
    mask = loss_mask.bool()
    if attention_mask is not None:
        mask = mask & attention_mask.bool()
    out = torch.zeros_like(mask)
    shift = k + 2
    if shift < mask.shape[1]:
        out[:, :-shift] = mask[:, shift:]
    return out


def chunked_logits(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int):
    """Yield (start, logits (n, V)) for rows of hidden (N, D) in chunks."""
    for start in range(0, hidden.shape[0], chunk_size):
        yield start, F.linear(hidden[start:start + chunk_size], weight)


def top1(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...,) index of the first largest entry, as argmax gives; torch.max's reduction
    runs 1.4x (fp32) to 2.7x (bf16) faster than argmax's on CPU over a 49,152-id vocabulary."""
    return logits.max(-1).indices


def cross_entropy_chunked(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean CE of softmax(hidden @ weight.T) against labels; hidden (N, D), weight (V, D), labels (N,).
    Returns (loss, top-1 hits (N,) bool)."""
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0, torch.zeros(0, dtype=torch.bool, device=hidden.device)
    total, hits = 0.0, []
    for start, logits in chunked_logits(hidden, weight, chunk_size):
        chunk_labels = labels[start:start + logits.shape[0]]
        total = total + F.cross_entropy(logits.float(), chunk_labels, reduction="sum")
        hits.append(top1(logits.detach()) == chunk_labels)
    return total / hidden.shape[0], torch.cat(hits)


def soft_cross_entropy_chunked(hidden: torch.Tensor, weight: torch.Tensor, target_logits: torch.Tensor | None,
                               target_features: torch.Tensor | None = None,
                               chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over rows of -Σ_v p_v log q_v, q = softmax(hidden @ weight.T), p = softmax(target_logits)
    or, when those are None, softmax(target_features @ weight.T) computed chunk by chunk (the
    teacher's logits are never held whole). hidden / target_features (N, D), target_logits (N, V).
    Returns (loss, hits (N,) bool: argmax q == argmax p)."""
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0, torch.zeros(0, dtype=torch.bool, device=hidden.device)
    total, hits = 0.0, []
    for start, logits in chunked_logits(hidden, weight, chunk_size):
        stop = start + logits.shape[0]
        with torch.no_grad():
            teacher = (target_logits[start:stop] if target_logits is not None
                       else F.linear(target_features[start:stop], weight)).float()
        p = torch.softmax(teacher, -1)  # (n, V)
        total = total - (p * torch.log_softmax(logits.float(), -1)).sum()
        hits.append(top1(logits.detach()) == top1(teacher))
    return total / hidden.shape[0], torch.cat(hits)


def feature_regression_loss(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """SmoothL1 (beta 1) averaged over D, then over rows; predicted/target (N, D)."""
    if predicted.shape[0] == 0:
        return predicted.sum() * 0.0
    return F.smooth_l1_loss(predicted.float(), target.float(), reduction="none").mean(-1).mean()


def eagle_loss(predicted: torch.Tensor, target_features: torch.Tensor, target_logits: torch.Tensor | None,
               lm_head_weight: torch.Tensor, feature_loss_weight: float, logit_loss_weight: float,
               chunk_size: int = 1024) -> dict[str, torch.Tensor]:
    """EAGLE-1/2 loss on the counted rows only: predicted f̂ (N, D), target f (N, D), the target's
    logits at f (N, V) or None (then lm_head(f), chunked), frozen lm_head (V, D).
    Returns {loss, feature_loss, logit_loss, hits}."""
    feature = feature_regression_loss(predicted, target_features)
    if logit_loss_weight > 0:
        logit, hits = soft_cross_entropy_chunked(predicted, lm_head_weight, target_logits, target_features,
                                                 chunk_size)
    else:
        logit = predicted.sum() * 0.0
        with torch.no_grad():
            teacher = target_logits if target_logits is not None else F.linear(target_features, lm_head_weight)
            hits = top1(F.linear(predicted, lm_head_weight)) == top1(teacher)
    return {"loss": feature_loss_weight * feature + logit_loss_weight * logit,
            "feature_loss": feature.detach(), "logit_loss": logit.detach(), "hits": hits}


def medusa_loss(head_hidden: list[torch.Tensor], lm_head_weights: list[torch.Tensor], labels: list[torch.Tensor],
                decay: float, chunk_size: int = 1024) -> dict[str, torch.Tensor | list]:
    """Σ_k decay**k CE_k. For head k: hidden (N_k, D) at its counted rows, lm_head (V, D), labels (N_k,).
    Returns {loss, head_losses [K], hits [K] of bool (N_k,)}."""
    total, losses, hits = 0.0, [], []
    for k, (hidden, weight, label) in enumerate(zip(head_hidden, lm_head_weights, labels)):
        loss, hit = cross_entropy_chunked(hidden, weight, label, chunk_size)
        total = total + decay**k * loss
        losses.append(loss.detach())
        hits.append(hit)
    return {"loss": total, "head_losses": losses, "hits": hits}


@torch.no_grad()
def draft_vocab_teacher(final: torch.Tensor, lm_head_weight: torch.Tensor, t2d: torch.Tensor,
                        chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's view of counted rows for a draft-vocabulary loss: final post-norm states (N, D),
    the target's lm_head (V, D), t2d bool (V,) marking the Vd draft ids. Returns (logits (N, Vd)
    float32 over the draft ids in ascending target-id order, in_vocab (N,) bool: whether the
    target's top-1 over the whole vocabulary is a draft id). Full-vocabulary logits exist one chunk
    of rows at a time."""
    t2d = t2d.to(final.device)
    kept, in_vocab = [], []
    for _, logits in chunked_logits(final, lm_head_weight.to(final.dtype), chunk_size):
        in_vocab.append(t2d[top1(logits)])
        kept.append(logits[:, t2d].float())  # (n, Vd)
    if not kept:
        return final.new_zeros(0, int(t2d.sum()), dtype=torch.float32), torch.zeros(0, dtype=torch.bool,
                                                                                   device=final.device)
    return torch.cat(kept), torch.cat(in_vocab)


def eagle3_loss(hidden: list[torch.Tensor], lm_head_weight: torch.Tensor, teacher_logits: torch.Tensor,
                in_vocab: torch.Tensor, rows: list[torch.Tensor], decay: float, chunk_size: int = 1024) -> dict:
    """Σ_j decay**j · soft-CE_j over the draft vocabulary. teacher_logits (M, Vd) and in_vocab (M,)
    bool hold the target's view of M positions once; step j scores the head's normed outputs at
    its counted rows, hidden[j] (N_j, D), through the draft lm_head (Vd, D) against teacher rows
    rows[j] (N_j,) long. Rows whose target top-1 lies outside the draft vocabulary are left out of
    the mean (the draft can never propose it) and count as misses in `hits`.
    Returns {loss, step_losses [S], hits [S] of bool (N_j,), out_of_vocab [S] ints}."""
    total, losses, hits, outside = 0.0, [], [], []
    teacher_top = top1(teacher_logits)  # (M,) once: the steps score overlapping rows
    for j, (states, index) in enumerate(zip(hidden, rows)):
        keep = in_vocab[index]  # (N_j,)
        states, index = states[keep], index[keep]
        loss = states.sum() * 0.0
        agree = []
        for start, logits in chunked_logits(states, lm_head_weight, chunk_size):
            with torch.no_grad():
                teacher = teacher_logits[index[start:start + logits.shape[0]]]  # (n, Vd)
            p = torch.softmax(teacher, -1)
            loss = loss - (p * torch.log_softmax(logits.float(), -1)).sum()
            agree.append(top1(logits.detach()) == teacher_top[index[start:start + logits.shape[0]]])
        loss = loss / max(states.shape[0], 1)
        total = total + decay**j * loss
        full = torch.zeros_like(keep)
        if agree:
            full[keep] = torch.cat(agree)
        losses.append(loss.detach())
        hits.append(full)
        outside.append(int((~keep).sum()))
    return {"loss": total, "step_losses": losses, "hits": hits, "out_of_vocab": outside}


def kl_divergence_chunked(hidden: torch.Tensor, lm_head_weight: torch.Tensor, teacher_logits: torch.Tensor,
                          rows: torch.Tensor, chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(p || q), p = softmax(teacher_logits[rows]), q = softmax(hidden @ lm_head_weight.T)
    (P-EAGLE's loss, speculators' `kl_div`): hidden (N, D) normed draft states, lm_head (Vd, D),
    teacher_logits (M, Vd), rows (N,) long. Returns (kl (N,) differentiable, hits (N,) bool:
    argmax q == argmax p)."""
    losses, hits = [], []
    for start, logits in chunked_logits(hidden, lm_head_weight, chunk_size):
        with torch.no_grad():
            teacher = teacher_logits[rows[start:start + logits.shape[0]]].float()  # (n, Vd)
            log_p = torch.log_softmax(teacher, -1)
        losses.append((log_p.exp() * (log_p - torch.log_softmax(logits.float(), -1))).sum(-1))
        hits.append(top1(logits.detach()) == top1(teacher))
    if not losses:
        return hidden.sum(-1) * 0.0, torch.zeros(0, dtype=torch.bool, device=hidden.device)
    return torch.cat(losses), torch.cat(hits)
