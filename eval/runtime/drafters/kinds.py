"""Which drafters run a trained head of each kind, keyed by the head's type (`heads.io.head_type`:
the exact class of its config, so a P-EAGLE head is not taken for an EAGLE-3 one).

One entry per kind: the `runtime.drafters` names that run its heads (the same names as the kind's
`drafters` in train/kinds.py) and how to build its chain of `depth` drafts. eval's measurement, the
engine comparison and a serving engine read this table and nothing else about the kind: a new kind's
drafter is its file in this folder plus one line in KIND_DRAFTERS (docs/adding_a_kind.md). A drafter
name with no measurement of its own in `eval.run.build_methods` is measured as that chain.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from eval.runtime.drafters import Drafter
from eval.runtime.drafters.dflash import dflash_chain
from eval.runtime.drafters.eagle import EagleDrafter
from eval.runtime.drafters.medusa import MedusaDrafter
from eval.runtime.drafters.peagle import peagle_chain
from eval.runtime.model import LeanLlama
from heads.io import head_type


class ChainBuilder(Protocol):
    def __call__(self, head: nn.Module, lean: LeanLlama, depth: int, draft_vocab: torch.Tensor | None = None,
                 greedy_drafts: bool = False) -> Drafter:
        """A drafter proposing a chain of `depth` tokens with `head` over `lean`. draft_vocab: (Vd,)
        target ids a drafter reading the target's lm_head drafts over (None: the full vocabulary, or
        a head that maps its own ids). greedy_drafts: argmax drafts at a temperature too, as vLLM's
        default `draft_sample_method: greedy` (still lossless: verified as one-hot drafts)."""


@dataclass(frozen=True)
class KindDrafters:
    drafters: tuple[str, ...]  # runtime.drafters names that run this kind's heads
    chain: ChainBuilder


def eagle_chain(head, lean, depth, draft_vocab=None, greedy_drafts=False) -> EagleDrafter:
    return EagleDrafter(head, lean, mode="chain", depth=depth, top_k=1, total_tokens=2, draft_vocab=draft_vocab,
                        greedy_drafts=greedy_drafts)


def medusa_chain(head, lean, depth, draft_vocab=None, greedy_drafts=False) -> MedusaDrafter:
    """Head k's top-1 token at depth k+1 (Medusa drafts its heads' top tokens at any temperature)."""
    return MedusaDrafter(head, lean, [[0] * d for d in range(1, depth + 1)], draft_vocab)


KIND_DRAFTERS: dict[str, KindDrafters] = {
    "eagle": KindDrafters(("eagle_tree", "eagle_chain"), eagle_chain),
    "eagle3": KindDrafters(("eagle_tree", "eagle_chain"), eagle_chain),
    "medusa": KindDrafters(("medusa",), medusa_chain),
    "dflash": KindDrafters(("dflash_chain",), dflash_chain),
    "peagle": KindDrafters(("peagle_tree", "peagle_chain"), peagle_chain),
}


def head_drafters() -> tuple[str, ...]:
    """Every drafter name some kind's heads run, in table order."""
    return tuple(dict.fromkeys(name for entry in KIND_DRAFTERS.values() for name in entry.drafters))


def kinds_running(name: str) -> list[str]:
    """The head kinds whose heads the drafter `name` runs."""
    return [kind for kind, entry in KIND_DRAFTERS.items() if name in entry.drafters]


def drafters_for(head: nn.Module) -> tuple[str, ...]:
    """The drafter names that run `head` (none for a kind without a drafter)."""
    entry = KIND_DRAFTERS.get(head_type(head.config))
    return entry.drafters if entry else ()


def kind_drafters(head: nn.Module) -> KindDrafters:
    kind = head_type(head.config)
    if kind not in KIND_DRAFTERS:
        raise ValueError(f"no drafter runs a {kind} head (drafters exist for {sorted(KIND_DRAFTERS)}: "
                         "eval/runtime/drafters/kinds.py)")
    return KIND_DRAFTERS[kind]
