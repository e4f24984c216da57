"""One training step's math for each head type, and the seam that supplies target features.

`FeatureSource` is the one function the loop calls to get the frozen target's view of a batch:
the target states a head kind reads (`HeadKind.feature_layers`: the final post-norm state for
EAGLE-1/2 and Medusa; several residual streams plus the final state for EAGLE-3), concatenated
along the last dim. The target's logits are never materialised whole: the losses project only the
counted rows through the frozen lm_head, chunk by chunk. `OnlineFeatures` runs the target under
no_grad; an offline cache reader (train/offline.py) implements the same protocol.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from heads.config import EagleOptions, MedusaOptions
from heads.vocab import draft_ids, most_frequent_ids
from train.losses import (
    add_uniform_noise, chain_attention_mask, eagle_loss, eagle_position_mask, medusa_loss, medusa_position_mask,
    shift_left,
)


FINAL = -1  # the target's final post-norm state (what its lm_head reads); other layer ids index `hidden_states`


class FeatureSource(Protocol):
    layers: tuple[int, ...]  # the target states it returns, in order (FINAL or hidden_states indices)

    def __call__(self, batch: dict) -> torch.Tensor:
        """batch: input_ids (B, T), attention_mask (B, T), loss_mask (B, T), ids [B] -> the target's
        states at `layers` concatenated on the last dim (B, T, len(layers)·D), on the batch's
        device. With layers == (FINAL,) (EAGLE-1/2, Medusa): the final post-norm features (B, T, D)."""


def source_layers(source) -> tuple[int, ...]:
    """What a source returns; a bare callable (tests, wrappers) supplies the final state."""
    return tuple(getattr(source, "layers", (FINAL,)))


class OnlineFeatures:
    """Run the frozen target on each batch (online mode). layers: transformers' hidden_states
    numbering (i = the stream entering decoder layer i), -1 = the final post-norm state."""

    def __init__(self, target, layers: tuple[int, ...] = (FINAL,), dtype: torch.dtype | None = None):
        self.target, self.layers, self.dtype = target, tuple(layers), dtype  # dtype: the features' (None: the target's)

    def __call__(self, batch: dict) -> torch.Tensor:
        out = self.target.features(batch["input_ids"], batch["attention_mask"], layers=self.layers)
        states = [out.hidden[layer % (self.target.num_layers + 1)] for layer in self.layers]  # each (B, T, D)
        states = states[0] if len(states) == 1 else torch.cat(states, -1)
        return states if self.dtype is None else states.to(self.dtype)


class MemoizedFeatures:
    """Keep each row's features in memory after its first forward (keyed by row id), up to
    `max_megabytes`; later epochs and repeated evaluations skip the target. For small CPU jobs
    that reuse a few thousand rows many times; a disk cache for large jobs is the offline mode."""

    def __init__(self, source: FeatureSource, max_megabytes: float, store_dtype: torch.dtype | None = None):
        """store_dtype: the rows' dtype in memory (None: as the source returns them). A bf16 target's
        features widened to fp32 for fp32 heads are kept in bf16, exactly, in half the memory."""
        self.source, self.budget, self.store_dtype = source, max_megabytes * 2**20, store_dtype
        self.layers = source_layers(source)
        self.rows: dict[str, torch.Tensor] = {}
        self.used = 0
        self.dtype: torch.dtype | None = None  # what the source returns, and so what this returns

    def __call__(self, batch: dict) -> torch.Tensor:
        ids, lengths = batch["ids"], batch["attention_mask"].sum(-1).tolist()
        if all(i in self.rows for i in ids):
            first = self.rows[ids[0]]
            out = first.new_zeros(len(ids), batch["input_ids"].shape[1], first.shape[-1],
                                  dtype=self.dtype)  # (B, T, D)
            for b, (i, n) in enumerate(zip(ids, lengths)):
                out[b, :n] = self.rows[i]
            return out
        features = self.source(batch)  # (B, T, D)
        self.dtype = features.dtype
        kept = features if self.store_dtype is None else features.to(self.store_dtype)
        for b, (i, n) in enumerate(zip(ids, lengths)):
            size = n * kept.shape[-1] * kept.element_size()
            if i not in self.rows and self.used + size <= self.budget:
                self.rows[i] = kept[b, :n].clone()
                self.used += size
        return features


@dataclass
class FrozenParts:
    """What the heads borrow from the target: embedding (V, D) and lm_head (V, D) weights."""

    embed_weight: torch.Tensor
    lm_head_weight: torch.Tensor

    def __post_init__(self):
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_target(cls, target, device=None, dtype: torch.dtype | None = None) -> "FrozenParts":
        """device: where the heads train; a split target's embedding and lm_head, which lie on the
        first and last GPU of its group, are copied there (no copy where they already are).
        dtype: the heads' compute dtype where it differs from the target's (a bf16 target feeding
        fp32 heads on a CPU)."""
        embed, lm_head = target.embed_tokens.weight.detach(), target.lm_head.weight.detach()
        if device is not None:
            embed, lm_head = embed.to(device), lm_head.to(device)
        if dtype is not None:
            embed, lm_head = embed.to(dtype), lm_head.to(dtype)
        return cls(embed, lm_head)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.embed_weight)

    def vocab_rows(self, ids: torch.Tensor | None) -> torch.Tensor:
        """lm_head rows (Vd, D) of a draft vocabulary's ids (Vd,); the whole lm_head for None.
        The last vocabulary's rows are kept: a head's vocabulary does not change while it trains."""
        if ids is None:
            return self.lm_head_weight
        if self._rows is None or not torch.equal(self._rows[0], ids.to(self._rows[0].device)):
            ids = ids.to(self.lm_head_weight.device)
            self._rows = (ids.clone(), self.lm_head_weight[ids].contiguous())
        return self._rows[1]


def vocab_index(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Sorted draft ids (Vd,) -> (V,) long: each target id's row in the draft vocabulary, -1 outside."""
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
    index[ids] = torch.arange(ids.numel(), device=ids.device)
    return index


def frequent_reply_tokens(rows, size: int, vocab_size: int) -> torch.Tensor:
    """(min(size, V),) sorted ids of the most frequent assistant tokens of `rows` (dicts with
    input_ids and loss_mask; ties broken by id): the vocabulary a draft head is scored over."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in rows:
        ids, mask = torch.as_tensor(row["input_ids"]), torch.as_tensor(row["loss_mask"]).bool()
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return most_frequent_ids(counts, size)


def normal_equations(pairs, max_tokens: int):
    """Σ x xᵀ, Σ x yᵀ and the row count over (x (N, F), y (N, D)) pairs, float64, stopping after the
    pair that passes ~max_tokens rows (pairs may be a generator: later ones are never computed)."""
    gram = cross = None
    rows = 0
    for x, y in pairs:
        gram = x.T @ x if gram is None else gram + x.T @ x
        cross = x.T @ y if cross is None else cross + x.T @ y
        rows += x.shape[0]
        if rows >= max_tokens:
            break
    return gram, cross, rows


@torch.no_grad()
def ridge_sums(parts: FrozenParts, batches, source: FeatureSource, max_tokens: int):
    """Σ x xᵀ (2D+1, 2D+1), Σ x yᵀ (2D+1, D) and the row count over counted positions of `batches`
    (x = [embed(x_{t+1}), f_t, 1], y = f_{t+1}), stopping after ~max_tokens rows. Float64 sums."""
    def pairs():
        for batch in batches:
            features = source(batch).double()  # (B, T, D)
            mask = eagle_position_mask(batch["loss_mask"], batch["attention_mask"])  # (B, T-1)
            x = torch.cat([parts.embed(batch["input_ids"][:, 1:]).double(), features[:, :-1]], -1)[mask]
            yield torch.cat([x, torch.ones_like(x[:, :1])], -1), features[:, 1:][mask]  # (N, 2D+1), (N, D)

    return normal_equations(pairs(), max_tokens)


def eagle_step(head: nn.Module, parts: FrozenParts, batch: dict, features: torch.Tensor,
               options: EagleOptions, chunk_size: int) -> dict:
    """EAGLE step over the T-1 positions of a batch (alignment: train/losses.py). Step 0 is
    teacher-forced (the head reads the target's f_t); with options.train_steps = S > 1 the head
    is unrolled S steps as in speculative decoding (train/heldout.py's chains, EAGLE-3's
    training-time test): step j reads the data token x_{t+1+j} and its own step j-1 output
    (detached), attends to the true context and its own chain, and is scored against f_{t+1+j}
    with weight unroll_loss_decay**j. The logit loss runs over the head's draft vocabulary (the
    target's distribution restricted to it; the full vocabulary for a head without one).
    Returns step 0's {feature_loss, logit_loss, hits}, the weighted total `loss`, and
    `positions` (step 0's counted rows)."""
    ids = batch["input_ids"]  # (B, T)
    B, T = ids.shape
    n = T - 1
    base = eagle_position_mask(batch["loss_mask"], batch["attention_mask"])  # (B, n)
    inputs = add_uniform_noise(features[:, :-1], options.input_noise)  # (B, n, D) f_t
    positions = torch.arange(n, device=ids.device).expand(B, n)
    steps = max(1, min(options.train_steps, n))
    loss_weight = parts.vocab_rows(draft_ids(head))  # (Vd, D)
    past, out, total = None, {}, 0.0
    for j in range(steps):
        tokens = shift_left(ids[:, 1:], j)  # (B, n) x_{t+1+j}
        predicted, past = head(parts.embed(tokens).to(inputs.dtype), inputs, positions + j,
                               attention_mask=chain_attention_mask(n, j, ids.device), past_key_values=past,
                               use_cache=steps > 1)  # (B, n, D) f̂_{t+1+j}
        valid = shift_left(base, j)
        truth = shift_left(features[:, 1:], j)  # f_{t+1+j}
        step = eagle_loss(predicted[valid], truth[valid], None, loss_weight, options.feature_loss_weight,
                          options.logit_loss_weight, chunk_size)
        total = total + options.unroll_loss_decay**j * step["loss"]
        out = out or {**step, "positions": int(valid.sum())}
        inputs = predicted.detach()
    out["loss"] = total
    return out


def medusa_step(heads: nn.Module, parts: FrozenParts, batch: dict, features: torch.Tensor,
                options: MedusaOptions, chunk_size: int) -> dict:
    """Medusa-1 step: head k at position t against the data token x_{t+k+2}, a cross-entropy over
    the heads' draft vocabulary (the full vocabulary for heads without one). A position whose
    token lies outside the vocabulary is left out of the loss and counts as a miss in `hits`.
    Returns medusa_loss's dict (hits over every counted position), `positions` (counted rows of
    head 0) and `out_of_vocab` [K] (positions left out of each head's loss)."""
    ids = batch["input_ids"]  # (B, T)
    hidden = heads(features)  # (K, B, T, D)
    module = getattr(heads, "module", heads)
    vocab = draft_ids(heads)
    index = None if vocab is None else vocab_index(vocab.to(ids.device), module.config.vocab_size)
    shared = parts.vocab_rows(vocab)  # (Vd, D): the target's lm_head rows, for share_lm_head
    rows, weights, labels, inside = [], [], [], []
    for k in range(hidden.shape[0]):
        mask = medusa_position_mask(batch["loss_mask"], k, batch["attention_mask"])  # (B, T)
        shifted = torch.zeros_like(ids)  # (B, T) x_{t+k+2}
        if k + 2 < ids.shape[1]:
            shifted[:, : ids.shape[1] - (k + 2)] = ids[:, k + 2:]
        label = shifted[mask]  # (N_k,) target ids
        own = module.lm_head_weight(k, shared)  # (V or Vd, D)
        kept = torch.ones_like(label, dtype=torch.bool) if index is None else index[label] >= 0
        if index is not None:
            label = index[label]  # draft-vocabulary rows; -1 outside (dropped below)
            if not module.config.share_lm_head:
                own = own[vocab.to(own.device)]  # (Vd, D): the gradient reaches these rows only
        inside.append(kept)
        rows.append(hidden[k][mask][kept])
        labels.append(label[kept])
        weights.append(own)
    out = medusa_loss(rows, weights, labels, options.loss_decay, chunk_size)
    out["hits"] = [_scatter_hits(hits, kept) for hits, kept in zip(out["hits"], inside)]
    out["positions"] = int(inside[0].numel())
    out["out_of_vocab"] = [int((~kept).sum()) for kept in inside]
    return out


def _scatter_hits(hits: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """hits (N',) of the kept rows -> (N,) over all rows, False where a row was left out."""
    if hits.shape[0] == kept.shape[0]:
        return hits
    out = torch.zeros_like(kept)
    out[kept] = hits
    return out
