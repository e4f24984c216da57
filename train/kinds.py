"""Head kinds: what differs between Medusa, EAGLE-1/2 (and later kinds) behind one small protocol.

The training loop holds one `HeadKind` (from `head_kind(job.heads)`) and calls it; it never asks
which kind it holds. A kind says
- which target states it reads (`feature_layers`: indices into transformers' `hidden_states`,
  FINAL for the final post-norm state); a `FeatureSource` built for those layers returns them
  concatenated along the last dim, in that order;
- how a fresh head is built from the target around its draft vocabulary (`build`; the loop counts
  the vocabulary once, over the training split's loss positions, and every kind stores it in the
  head), which decoder layers of the target that build reads (`init_layers`, for a target loaded
  in parts), and its optimizer groups;
- an optional set-up on training data before the first step (`prepare`: EAGLE's ridge fit of fc);
- optionally, how a head of another kind becomes its start (`adopt`, for trainer.init_from:
  P-EAGLE from an EAGLE-3 head);
- one training step's loss and the figures it logs (`step`, `figures`);
- held-out counts per drafted step or head (`eval_rows`, `eval_counts`), named by `unit`.
A new kind is a class with these members, registered in KINDS.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Protocol

import torch
from torch import nn

from heads.config import Eagle3Options, EagleOptions, HeadsConfig, MedusaOptions
from heads.eagle import EagleConfig, init_from_target as init_eagle, set_fc_by_ridge
from heads.eagle3 import Eagle3Config, default_aux_layer_ids, init_from_target as init_eagle3
from heads.eagle3 import set_fc_by_ridge as set_eagle3_fc_by_ridge
from heads.io import build_head, head_type
from heads.medusa import MedusaConfig, init_from_target as init_medusa
from heads.peagle import PeagleConfig
from heads.vocab import set_draft_vocab
from train.dflash_objective import DflashKind
from train.eagle3_objective import eagle3_ridge_sums, eagle3_step, feature_layers as eagle3_feature_layers
from train.heldout import eagle3_eval_counts, eagle_eval_counts, medusa_eval_counts
from train.objectives import FINAL, FeatureSource, FrozenParts, eagle_step, medusa_step, ridge_sums
from train.peagle_objective import peagle_eval_counts, peagle_step

log = logging.getLogger(__name__)

Rates = dict[str, tuple[float, float]]  # figure name -> (hits, positions)


class HeadKind(Protocol):
    name: str  # the head type of heads.io ("eagle", "medusa"): checkpoints of this kind carry it
    unit: str  # what eval rows count: "step" (a drafted chain's depth) or "head" (Medusa head k)
    drafters: tuple[str, ...]  # the eval drafters that run this kind's heads

    def feature_layers(self, num_layers: int) -> tuple[int, ...]:
        """The target states the kind reads, for a target of `num_layers` decoder layers:
        transformers `hidden_states` indices (i = the stream entering layer i), FINAL = the final
        post-norm state. Sources return them concatenated on the last dim in this order."""

    def init_layers(self) -> list[int]:
        """Decoder layers of the target that `build` reads (shapes or weights)."""

    def build(self, target, vocab: torch.Tensor | None) -> tuple[nn.Module, object]:
        """A fresh head initialised from the target, holding the draft vocabulary `vocab` (sorted
        target ids (Vd,); None: the full vocabulary) -> (head, head config). The losses and the
        drafters read the vocabulary from the head (heads.vocab.draft_ids)."""

    def param_groups(self, head: nn.Module, learning_rate: float) -> list[dict]:
        """AdamW parameter groups."""

    def prepare(self, head: nn.Module, parts: FrozenParts, source: FeatureSource,
                batches: Iterable[dict], world: int, reduce) -> None:
        """Set-up of a fresh head on the first training batches (this process's share; `reduce`
        sums tensors over processes). Not called on resume or trainer.init_from."""

    def step(self, head: nn.Module, parts: FrozenParts, batch: dict, features: torch.Tensor,
             chunk_size: int) -> dict:
        """One micro-batch's loss: a dict with the differentiable `loss` and what `figures` reads."""

    def figures(self, out: dict) -> tuple[dict[str, float], Rates]:
        """A step's output -> (figures averaged over micro-steps, {name: (hits, positions)} summed
        into rates); logged as train/<name>."""

    @property
    def eval_rows(self) -> int:
        """Rows of `eval_counts`: drafted steps or heads."""

    def eval_counts(self, head: nn.Module, parts: FrozenParts, batch: dict, features: torch.Tensor,
                    truths: list | None) -> torch.Tensor:
        """(eval_rows, 3) float [top-1 hits, top-5 hits, positions] on one held-out batch; `truths`
        keeps the target's greedy tokens between evaluations of the same batch."""


def fc_param_groups(head, learning_rate: float, scale: float, leave_out: tuple[str, ...] = ()) -> list[dict]:
    """One group at `learning_rate`, or with scale != 1 two: fc at the scaled rate (a ridge-fitted
    fc is a solution Adam's first, sign-like steps would scramble) and the rest. Parameters named
    in `leave_out` are in neither (the caller groups them)."""
    named = [(name, p) for name, p in head.named_parameters() if name not in leave_out]
    if scale == 1.0:
        return [{"params": [p for _, p in named], "lr": learning_rate}]
    fc = [p for name, p in named if name.startswith("fc.")]
    rest = [p for name, p in named if not name.startswith("fc.")]
    return [{"params": fc, "lr": learning_rate * scale}, {"params": rest, "lr": learning_rate}]


class EagleKind:
    """EAGLE-1/2: reads the final post-norm state, predicts the next one."""

    name, unit, drafters = "eagle", "step", ("eagle_tree", "eagle_chain")

    def __init__(self, options: EagleOptions):
        self.options = options

    def feature_layers(self, num_layers: int) -> tuple[int, ...]:
        return (FINAL,)

    def init_layers(self) -> list[int]:
        init = self.options.init_layer
        return [0] + ([init] if init is not None else [])  # layer 0's shape, init_layer's weights

    def build(self, target, vocab):
        o = self.options
        config = EagleConfig.from_target(target, fc_bias=o.fc_bias)
        head = init_eagle(build_head(config), target, o.init_layer, o.init_fc)
        return (head if vocab is None else set_draft_vocab(head, vocab)), config

    def param_groups(self, head, learning_rate):
        return fc_param_groups(head, learning_rate, self.options.fc_learning_rate_scale)

    def prepare(self, head, parts, source, batches, world, reduce):
        """init_fc=ridge: fit fc on the first ~ridge_tokens counted positions of the training order
        (the batches training starts with, so a memoized source computes them once)."""
        o = self.options
        if o.init_fc != "ridge":
            return
        gram, cross, count = ridge_sums(parts, batches, source, o.ridge_tokens // world)
        count = int(reduce(torch.tensor(float(count), device=gram.device)).item())
        set_fc_by_ridge(head, reduce(gram), reduce(cross), count, o.ridge_penalty)
        log.info("fc initialised by ridge regression on %d positions", count)

    def step(self, head, parts, batch, features, chunk_size):
        return eagle_step(head, parts, batch, features, self.options, chunk_size)

    def figures(self, out):
        hits = out["hits"]
        return ({"feature_loss": float(out["feature_loss"]), "logit_loss": float(out["logit_loss"])},
                {"top1_step0": (float(hits.sum()), float(hits.numel()))})

    @property
    def eval_rows(self) -> int:
        return self.options.eval_steps

    def eval_counts(self, head, parts, batch, features, truths):
        return eagle_eval_counts(head, parts, batch, features, self.options.eval_steps, truths)


class MedusaKind:
    """Medusa-1: K heads on the final post-norm state, head k predicting the token k+2 ahead."""

    name, unit, drafters = "medusa", "head", ("medusa",)

    def __init__(self, options: MedusaOptions):
        self.options = options

    def feature_layers(self, num_layers: int) -> tuple[int, ...]:
        return (FINAL,)

    def init_layers(self) -> list[int]:
        return []

    def build(self, target, vocab):
        o = self.options
        config = MedusaConfig.from_target(target, num_heads=o.num_heads, num_layers=o.num_layers,
                                          share_lm_head=o.share_lm_head)
        head = init_medusa(build_head(config), target)
        return (head if vocab is None else set_draft_vocab(head, vocab)), config

    def param_groups(self, head, learning_rate):
        return [{"params": list(head.parameters())}]

    def prepare(self, head, parts, source, batches, world, reduce):
        pass

    def step(self, head, parts, batch, features, chunk_size):
        return medusa_step(head, parts, batch, features, self.options, chunk_size)

    def figures(self, out):
        means, rates = {}, {}
        for k, (loss, hits) in enumerate(zip(out["head_losses"], out["hits"])):
            means[f"loss_head{k}"] = float(loss)
            rates[f"top1_head{k}"] = (float(hits.sum()), float(hits.numel()))
        return means, rates

    @property
    def eval_rows(self) -> int:
        return self.options.num_heads

    def eval_counts(self, head, parts, batch, features, truths):
        return medusa_eval_counts(head, parts, batch, features, truths)


class Eagle3Kind:
    """EAGLE-3: fc over several target streams, one decoder layer drafting over its own vocabulary,
    trained by the training-time test (train/eagle3_objective.py)."""

    name, unit, drafters = "eagle3", "step", ("eagle_tree", "eagle_chain")

    def __init__(self, options: Eagle3Options):
        self.options = options

    def aux_layer_ids(self, num_layers: int) -> list[int]:
        ids = self.options.aux_layer_ids
        return list(ids) if ids is not None else default_aux_layer_ids(num_layers)

    def feature_layers(self, num_layers: int) -> tuple[int, ...]:
        return eagle3_feature_layers(self.aux_layer_ids(num_layers))

    def init_layers(self) -> list[int]:
        return [0]  # layer 0's shape

    def build(self, target, vocab):
        """Random fc and decoder layer; the draft lm_head starts as the target's rows of `vocab`
        and the final norm as the target's."""
        size = vocab.numel() if vocab is not None else target.vocab_size
        config = Eagle3Config.from_target(target, draft_vocab_size=size,
                                          aux_layer_ids=self.aux_layer_ids(target.num_layers),
                                          norm_before_residual=self.options.norm_before_residual,
                                          norm_before_fc=self.options.norm_before_fc, fc_norm=self.options.fc_norm,
                                          norm_output=self.options.norm_output)
        return init_eagle3(build_head(config), target, vocab), config

    def param_groups(self, head, learning_rate):
        return fc_param_groups(head, learning_rate, self.options.fc_learning_rate_scale)

    def prepare(self, head, parts, source, batches, world, reduce):
        """init_fc=ridge: fit fc on the first ~ridge_tokens counted positions of the training order."""
        o = self.options
        if o.init_fc != "ridge":
            return
        module = getattr(head, "module", head)
        gram, cross, count = eagle3_ridge_sums(parts, batches, source, len(module.config.aux_layer_ids),
                                               module.norm.weight.detach(), o.ridge_tokens // world,
                                               inputs=module.fc_inputs)
        count = int(reduce(torch.tensor(float(count), device=gram.device)).item())
        set_eagle3_fc_by_ridge(module, reduce(gram), reduce(cross), count, o.ridge_penalty)
        log.info("EAGLE-3 fc initialised by ridge regression on %d positions", count)

    def step(self, head, parts, batch, features, chunk_size):
        return eagle3_step(head, parts, batch, features, self.options.ttt_steps, self.options.loss_decay, chunk_size)

    def figures(self, out):
        """Per unrolled step its loss and top-1; out_of_vocab: the share of step 0's counted
        positions whose target top-1 lies outside the draft vocabulary (left out of the loss)."""
        means = {f"loss_step{j}": float(loss) for j, loss in enumerate(out["step_losses"])}
        rates = {f"top1_step{j}": (float(hits.sum()), float(hits.numel())) for j, hits in enumerate(out["hits"])}
        rates["out_of_vocab"] = (float(out["out_of_vocab"][0]), float(out["hits"][0].numel()))
        return means, rates

    @property
    def eval_rows(self) -> int:
        return self.options.eval_steps

    def eval_counts(self, head, parts, batch, features, truths):
        return eagle3_eval_counts(head, parts, batch, features, self.options.eval_steps, truths)


class PeagleKind(Eagle3Kind):
    """P-EAGLE: the EAGLE-3 head plus mask_hidden, K tokens from one forward, trained on COD-sampled
    chains (train/peagle_objective.py). Features, fc groups and the ridge warm start (slot 0 is
    EAGLE-3's step 0) are EAGLE-3's."""

    name, unit, drafters = "peagle", "step", ("peagle_tree", "peagle_chain")

    def build(self, target, vocab):
        """As EAGLE-3's build, with mask_token_id and K; mask_hidden starts random."""
        o = self.options
        size = vocab.numel() if vocab is not None else target.vocab_size
        config = PeagleConfig.from_target(target, draft_vocab_size=size,
                                          aux_layer_ids=self.aux_layer_ids(target.num_layers),
                                          norm_before_residual=o.norm_before_residual,
                                          mask_token_id=o.mask_token_id, speculative_tokens=o.speculative_tokens)
        return init_eagle3(build_head(config), target, vocab), config

    def adopt(self, head, config):
        """An EAGLE-3 head as the start (trainer.init_from): slot 0 is EAGLE-3's step 0, so every
        weight, norm and the draft vocabulary carry over as they are and slot 0 drafts as the
        EAGLE-3 head's first step did; mask_hidden starts as a fresh head's. K and mask_token_id
        come from heads.peagle. Returns (head, config); None for a head of another kind."""
        if head_type(config) != "eagle3":
            return None
        if config.norm_output:
            raise ValueError("trainer.init_from: an EAGLE-3 head with norm_output cannot start a P-EAGLE head "
                             "(its drafter feeds the mask slots' hidden input as it is)")
        o = self.options
        adopted = PeagleConfig(**dataclasses.asdict(config), mask_token_id=o.mask_token_id,
                               speculative_tokens=o.speculative_tokens)
        new = build_head(adopted)
        missing, unexpected = new.load_state_dict(head.state_dict(), strict=False)
        if unexpected or set(missing) != {"mask_hidden"}:
            raise RuntimeError(f"P-EAGLE from an EAGLE-3 head: weights missing {sorted(set(missing) - {'mask_hidden'})}, "
                               f"unexpected {sorted(unexpected)}")
        return new, adopted

    def param_groups(self, head, learning_rate):
        """EAGLE-3's groups at eagle3_learning_rate_scale of the rate, mask_hidden at the full rate."""
        o = self.options
        eagle3 = fc_param_groups(head, learning_rate * o.eagle3_learning_rate_scale, o.fc_learning_rate_scale,
                                 leave_out=("mask_hidden",))
        return eagle3 + [{"params": [head.mask_hidden], "lr": learning_rate}]

    def step(self, head, parts, batch, features, chunk_size):
        return peagle_step(head, parts, batch, features, self.options, chunk_size)

    @property
    def eval_rows(self) -> int:
        return self.options.speculative_tokens

    def eval_counts(self, head, parts, batch, features, truths):
        return peagle_eval_counts(head, parts, batch, features, self.options.eval_anchors, truths)


KINDS = {"eagle": lambda heads: EagleKind(heads.eagle), "medusa": lambda heads: MedusaKind(heads.medusa),
         "eagle3": lambda heads: Eagle3Kind(heads.eagle3), "peagle": lambda heads: PeagleKind(heads.peagle)}
KINDS["dflash"] = lambda heads: DflashKind(heads.dflash)


def head_kind(heads: HeadsConfig) -> HeadKind:
    """The kind object for heads.type."""
    if heads.type not in KINDS:
        raise ValueError(f"heads.type={heads.type!r} is not one of {sorted(KINDS)}")
    return KINDS[heads.type](heads)
