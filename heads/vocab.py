"""Draft vocabularies: the token ids a draft head scores, chosen by frequency, stored with the head.

Every head kind carries its vocabulary: EAGLE-3 and DFlash as `d2t`/`t2d` (heads/eagle3.py,
heads/dflash.py), EAGLE-1/2 and Medusa as a `draft_vocab` buffer of sorted target ids (config
`draft_vocab_size` = Vd). A head without one (draft_vocab_size 0, or saved before heads stored
one) scores the full vocabulary. `draft_ids` reads it for any head; `set_draft_vocab` installs one.
"""
from __future__ import annotations

import torch
from torch import nn

VOCAB_KEY = "draft_vocab"  # the EAGLE-1/2 and Medusa state-dict key (not in engine weight files)


def most_frequent_ids(counts: torch.Tensor, size: int) -> torch.Tensor:
    """(min(size, len(counts)),) sorted ids of the largest `counts` (V,), ties broken by the lower id."""
    order = torch.sort(-counts, stable=True).indices  # by count, then by id
    return order[: min(size, counts.shape[0])].sort().values


def check_ids(ids: torch.Tensor, vocab_size: int, where: str = "draft vocabulary") -> torch.Tensor:
    """`ids` as int64 (Vd,) on the CPU, or ValueError naming `where`: a draft vocabulary is a
    non-empty, strictly ascending list of ids in [0, vocab_size)."""
    ids = torch.as_tensor(ids)
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"{where}: expected a non-empty 1-D list of integer token ids, got "
                         f"{ids.dtype} of shape {list(ids.shape)}")
    ids = ids.to("cpu", torch.long)
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{where}: token ids must be strictly ascending")
    if not 0 <= int(ids[0]) <= int(ids[-1]) < vocab_size:
        raise ValueError(f"{where}: token ids must lie in [0, {vocab_size}), got [{int(ids[0])}, {int(ids[-1])}]")
    return ids


def stores_id_list(config) -> bool:
    """True when heads of `config` keep their vocabulary as a `draft_vocab` id list (EAGLE-1/2 and
    Medusa with draft_vocab_size > 0); EAGLE-3 keeps d2t/t2d instead."""
    from heads.dflash import DflashConfig
    from heads.eagle3 import Eagle3Config

    return not isinstance(config, (Eagle3Config, DflashConfig)) and bool(getattr(config, "draft_vocab_size", 0))


def draft_ids(head: nn.Module) -> torch.Tensor | None:
    """(Vd,) the sorted target ids the head drafts over, or None: the full vocabulary."""
    module = getattr(head, "module", head)  # DDP / DeepSpeed wrappers
    from heads.dflash import DflashHead
    from heads.eagle3 import Eagle3Head

    if isinstance(module, Eagle3Head):
        config = module.config
        return None if config.draft_vocab_size == config.vocab_size else module.draft_ids()
    if isinstance(module, DflashHead):
        return module.draft_ids()
    return getattr(module, VOCAB_KEY, None)


@torch.no_grad()
def set_draft_vocab(head: nn.Module, ids: torch.Tensor) -> nn.Module:
    """Install sorted target ids (Vd,) as the head's draft vocabulary. EAGLE-3: Vd must be its
    draft_vocab_size (its lm_head has Vd rows). EAGLE-1/2 and Medusa: any Vd; the config's
    draft_vocab_size follows, so a head saved afterwards carries the list."""
    module = getattr(head, "module", head)
    config = module.config
    ids = check_ids(ids, config.vocab_size)
    from heads.dflash import DflashHead, set_draft_vocab as set_dflash
    from heads.eagle3 import Eagle3Head, set_draft_vocab as set_eagle3

    if isinstance(module, Eagle3Head):
        return set_eagle3(module, ids)
    if isinstance(module, DflashHead):
        return set_dflash(module, ids)
    device = next(module.parameters()).device
    if VOCAB_KEY in module._buffers:
        del module._buffers[VOCAB_KEY]
    module.register_buffer(VOCAB_KEY, ids.to(device))
    config.draft_vocab_size = ids.numel()
    return head
