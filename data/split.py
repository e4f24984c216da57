"""Deterministic train/eval split on a conversation's base id, so that every piece of one
conversation (`abc`, `abc_0`, `abc_1`, `abc_1_2`) lands on the same side."""
from __future__ import annotations

import hashlib
import re

_PIECE_SUFFIX = re.compile(r"(_\d+)+$")


def base_id(record_id: str) -> str:
    """`abc_1` -> `abc`; an id made only of digits and underscores is its own base."""
    return _PIECE_SUFFIX.sub("", record_id) or record_id


def is_eval(record_id: str, eval_fraction: float, seed: int) -> bool:
    """True for the held-out side: a hash of (seed, base id) mapped to [0, 1) falls below the
    fraction. Independent of record order and of the other records."""
    digest = hashlib.sha256(f"{seed}:{base_id(record_id)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


def split_indices(ids: list[str], eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train row indices, eval row indices), each in source order."""
    train, held_out = [], []
    for index, record_id in enumerate(ids):
        (held_out if is_eval(record_id, eval_fraction, seed) else train).append(index)
    return train, held_out
