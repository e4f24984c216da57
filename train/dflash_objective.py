"""DFlash's training step and held-out counts, and its head kind (registered in train/kinds.py).

Features: as EAGLE-3 (train/eagle3_objective.feature_layers): the aux streams, then the final
post-norm state the teacher's argmax comes from, (B, T, (n+1)·Ht).

Alignment (no shift; the speculators reference objective): an anchor a is a loss-mask position
that is not among its row's last B. Its block is [x_a, mask x (B-1)] at positions a..a+B-1 and
sees the context c_s = hidden_norm(fc(aux_s)) for s < a, plus its own block (both directions).
Slot j is scored against the target's greedy token at a+j-1 (argmax lm_head(final_{a+j-1}), the
target's choice for x_{a+j}); it counts when x_{a+j} is an assistant token and j >= 1 (slot 0 is
the anchor itself). Up to `max_anchors` anchors per row are drawn at random each step; all of a
row's blocks run side by side in one forward under one dense (A·B, T + A·B) mask.
Loss: CE with the dpace slot weights, Σ m·w·CE / Σ m (`dpace_weights`). A head with its own draft
vocabulary scores Vd ids: a slot whose greedy token lies outside it is left out of the CE (it
keeps its place in the dpace prefix as a slot predicted with no confidence) and counts as a miss.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from heads.config import DflashOptions
from heads.dflash import DflashConfig, block_tokens, init_from_target
from heads.eagle3 import default_aux_layer_ids
from heads.io import build_head
from train.eagle3_objective import feature_layers as aux_feature_layers, split_features
from train.heldout import _greedy, _kept
from train.objectives import FrozenParts, vocab_index
from train.losses import top1

log = logging.getLogger(__name__)


def select_anchors(loss_mask: torch.Tensor, attention_mask: torch.Tensor, max_anchors: int, block_size: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to max_anchors random anchors per row among its loss positions, leaving out the row's
    last block_size positions -> (anchors (B, A) long ascending, valid (B, A) bool); A = the most
    anchors any row got (at least 1); unused entries are anchor 0 and not valid."""
    mask = loss_mask.bool() & attention_mask.bool()  # (B, T)
    lengths = attention_mask.sum(-1)
    T = mask.shape[1]
    mask &= torch.arange(T, device=mask.device) < (lengths - block_size)[:, None]
    picks = []
    for row in mask:
        where = row.nonzero().squeeze(-1)
        order = torch.randperm(where.numel(), generator=generator, device="cpu").to(where.device)
        picks.append(where[order[:max_anchors]].sort().values)
    A = max(1, max(p.numel() for p in picks))
    anchors = torch.zeros(mask.shape[0], A, dtype=torch.long, device=mask.device)
    valid = torch.zeros(mask.shape[0], A, dtype=torch.bool, device=mask.device)
    for b, p in enumerate(picks):
        anchors[b, : p.numel()], valid[b, : p.numel()] = p, True
    return anchors, valid


def block_attention_mask(anchors: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """anchors (B, A) -> bool (B, 1, A·Bk, T + A·Bk): a block's queries see the context before
    its anchor and every slot of their own block."""
    B, A = anchors.shape
    device = anchors.device
    anchor_of_query = anchors.repeat_interleave(block_size, dim=1)  # (B, Q)
    context = torch.arange(context_length, device=device) < anchor_of_query[..., None]  # (B, Q, T)
    block_of = torch.arange(A * block_size, device=device) // block_size  # (Q,)
    own = (block_of[:, None] == block_of[None, :]).expand(B, -1, -1)  # (B, Q, Q)
    return torch.cat([context, own], dim=-1)[:, None]


def run_blocks(head: nn.Module, parts: FrozenParts, ids: torch.Tensor, aux: torch.Tensor, anchors: torch.Tensor):
    """Every block of every row in one forward: ids (B, T), aux (B, T, n·Ht), anchors (B, A) ->
    out (B, A, Bk, D), the pre-norm outputs of each block's slots."""
    module = getattr(head, "module", head)
    config: DflashConfig = module.config
    B, T = ids.shape
    Bk = config.block_size
    context = module.project(aux)  # (B, T, D)
    positions = torch.arange(T, device=ids.device).expand(B, T)
    tokens = block_tokens(ids.gather(1, anchors), Bk, config.mask_token_id)  # (B, A, Bk)
    block_positions = (anchors[..., None] + torch.arange(Bk, device=ids.device)).flatten(1)  # (B, A·Bk)
    mask = block_attention_mask(anchors, T, Bk)
    embeds = parts.embed(tokens.flatten(1)).to(context.dtype)  # (B, A·Bk, D)
    out = head(embeds, block_positions, module.context_kv(context, positions), attention_mask=mask)
    return out.view(B, anchors.shape[1], Bk, -1)


def slot_targets(final: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (counted (B, A, Bk) bool, rows (B, A, Bk) long): slot j of anchor a counts when a is
    valid, j >= 1 and x_{a+j} is an assistant token; it is scored at the target's position a+j-1."""
    T = final.shape[1]
    offsets = torch.arange(block_size, device=anchors.device)
    at = anchors[..., None] + offsets  # (B, A, Bk) positions of the slots
    counted = valid[..., None] & (offsets >= 1) & (at < T)
    counted &= loss_mask.bool().gather(1, at.clamp(max=T - 1).flatten(1)).view_as(at)
    return counted, (at - 1).clamp(0, T - 1)


def dpace_weights(ce: torch.Tensor, counted: torch.Tensor, alpha: float) -> torch.Tensor:
    """ce, counted (..., Bk) -> slot weights (..., Bk), no gradient: s_j = (1-α)·exp(-CE_j) + α
    (1 where not counted), w_j = Σ_{i>=j} m_i Π_{l<=i} s_l, zero where not counted. A slot weighs
    more while the slots before it are predicted confidently, as acceptance reaches it only then."""
    with torch.no_grad():
        m = counted.to(ce.dtype)
        s = torch.where(counted, (1 - alpha) * torch.exp(-ce) + alpha, torch.ones_like(ce))
        prefix = torch.cumprod(s, dim=-1)
        return (prefix * m).flip(-1).cumsum(-1).flip(-1) * m


def dflash_step(head: nn.Module, parts: FrozenParts, batch: dict, features: torch.Tensor, options: DflashOptions,
                chunk_size: int, generator: torch.Generator | None = None) -> dict:
    """One micro-batch's loss -> {loss, hits (B, A, Bk) bool, counted (B, A, Bk) bool, positions}."""
    module = getattr(head, "module", head)
    config: DflashConfig = module.config
    ids = batch["input_ids"]
    aux, final = split_features(features, len(config.aux_layer_ids))
    anchors, valid = select_anchors(batch["loss_mask"], batch["attention_mask"], options.max_anchors,
                                    config.block_size, generator)
    counted, rows = slot_targets(final, batch["loss_mask"], anchors, valid, config.block_size)
    truth = _greedy(final.gather(1, rows.flatten(1)[..., None].expand(-1, -1, final.shape[-1]))
                    .view(*rows.shape, -1)[counted], parts.lm_head_weight)  # (N,)
    out = run_blocks(head, parts, ids, aux, anchors)[counted]  # (N, D)
    labels, inside = truth, torch.ones_like(truth, dtype=torch.bool)
    if config.own_vocab:  # target ids -> rows of the head's Vd logits; -1 outside
        labels = vocab_index(module.draft_ids(), config.vocab_size).to(truth.device)[truth]
        inside = labels >= 0
    ce, hits = [], []
    for start in range(0, out.shape[0], chunk_size):
        logits = module.logits(out[start:start + chunk_size], parts.lm_head_weight).float()  # (n, V or Vd)
        label = labels[start:start + logits.shape[0]]
        ce.append(F.cross_entropy(logits, label.clamp(min=0), reduction="none"))
        hits.append((top1(logits.detach()) == label) & (label >= 0))
    ce = torch.cat(ce) if ce else out.sum(-1) * 0.0
    ce = torch.where(inside, ce, torch.zeros_like(ce))
    hits = torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool, device=ids.device)
    full = torch.zeros(counted.shape, dtype=ce.dtype, device=ids.device)
    full[counted] = torch.where(inside, ce.detach(), torch.full_like(ce, float("inf")))  # weight exp(-inf) = 0
    weights = dpace_weights(full, counted, options.dpace_alpha)[counted]
    loss = (weights * ce).sum() / max(int(counted.sum()), 1)
    hit_grid = torch.zeros_like(counted)
    hit_grid[counted] = hits
    return {"loss": loss, "hits": hit_grid, "counted": counted, "positions": int(counted.sum()),
            "out_of_vocab": int((~inside).sum())}


@torch.no_grad()
def dflash_eval_counts(head: nn.Module, parts: FrozenParts, batch: dict, features: torch.Tensor,
                       options: DflashOptions, truths: list | None = None) -> torch.Tensor:
    """(Bk-1, 3) float counts of [top-1 hits, top-5 hits, positions] of slots 1..Bk-1 (row i =
    drafted token i = slot i+1) over a fixed draw of `eval_anchors` anchors per row, the same at
    every evaluation of the batch (`truths` keeps the target's greedy tokens between them)."""
    module = getattr(head, "module", head)
    config: DflashConfig = module.config
    ids = batch["input_ids"]
    aux, final = split_features(features, len(config.aux_layer_ids))
    anchors, valid = select_anchors(batch["loss_mask"], batch["attention_mask"], options.eval_anchors,
                                    config.block_size, torch.Generator().manual_seed(0))
    counted, rows = slot_targets(final, batch["loss_mask"], anchors, valid, config.block_size)
    truth = _kept(truths, 0, lambda: _greedy(final.gather(
        1, rows.flatten(1)[..., None].expand(-1, -1, final.shape[-1])).view(*rows.shape, -1)[counted],
        parts.lm_head_weight))
    out = run_blocks(head, parts, ids, aux, anchors)[counted]  # (N, D)
    slot = torch.arange(config.block_size, device=ids.device).expand_as(counted)[counted]  # (N,)
    counts = torch.zeros(config.block_size - 1, 3, device=ids.device)
    for start in range(0, out.shape[0], 1024):
        logits = module.logits(out[start:start + 1024], parts.lm_head_weight)
        top = module.to_target_ids(logits.topk(min(5, logits.shape[-1]), dim=-1).indices)  # (n, 5) target ids
        label, index = truth[start:start + top.shape[0]], slot[start:start + top.shape[0]] - 1
        counts[:, 0].index_add_(0, index, (top[:, 0] == label).to(counts))
        counts[:, 1].index_add_(0, index, (top == label[:, None]).any(-1).to(counts))
        counts[:, 2].index_add_(0, index, torch.ones_like(label, dtype=counts.dtype))
    return counts


class DflashKind:
    """DFlash: fc over several target streams as EAGLE-3, L_d decoder layers drafting a block of
    B-1 tokens in one forward, over the target's vocabulary or a draft vocabulary of its most
    frequent ids (heads.draft_vocab_size). Held-out row i is drafted token i."""

    name, unit, drafters = "dflash", "step", ("dflash_chain",)

    def __init__(self, options: DflashOptions):
        self.options = options

    def aux_layer_ids(self, num_layers: int) -> list[int]:
        ids = self.options.aux_layer_ids
        return list(ids) if ids is not None else default_aux_layer_ids(num_layers)

    def feature_layers(self, num_layers: int) -> tuple[int, ...]:
        return aux_feature_layers(self.aux_layer_ids(num_layers))

    def init_layers(self) -> list[int]:
        return [0]  # layer 0's shape

    def build(self, target, vocab):
        """Random fc and decoder layers; the final norm starts as the target's, and with a draft
        vocabulary (`vocab`, sorted ids) the head's lm_head as the target's rows of those ids."""
        o = self.options
        size = vocab.numel() if vocab is not None and vocab.numel() < target.vocab_size else 0
        config = DflashConfig.from_target(target, aux_layer_ids=self.aux_layer_ids(target.num_layers),
                                          num_layers=o.num_layers, block_size=o.block_size,
                                          mask_token_id=o.mask_token_id, draft_vocab_size=size)
        return init_from_target(build_head(config), target, vocab if size else None), config

    def param_groups(self, head, learning_rate):
        """Everything but a draft vocabulary's lm_head rows (the target's, frozen)."""
        return [{"params": [p for name, p in head.named_parameters() if not name.startswith("lm_head.")]}]

    def prepare(self, head, parts, source, batches, world, reduce):
        pass

    def step(self, head, parts, batch, features, chunk_size):
        return dflash_step(head, parts, batch, features, self.options, chunk_size)

    def figures(self, out):
        """Top-1 of each drafted token (slot j+1 as top1_step{j}) over the step's counted slots."""
        hits, counted = out["hits"], out["counted"]
        rates = {f"top1_step{j - 1}": (float(hits[..., j].sum()), float(counted[..., j].sum()))
                 for j in range(1, hits.shape[-1])}
        rates["out_of_vocab"] = (float(out.get("out_of_vocab", 0)), float(out["positions"]))
        return {}, rates

    @property
    def eval_rows(self) -> int:
        return self.options.block_size - 1

    def eval_counts(self, head, parts, batch, features, truths):
        return dflash_eval_counts(head, parts, batch, features, self.options, truths)
