"""The value checks config dataclasses run on their own fields, before any model loads. Each raises
ValueError naming the key (`python -m train` reports it as a ConfigError)."""
from __future__ import annotations

import dataclasses
import difflib
from typing import Iterable


def choice(key: str, value, allowed: Iterable) -> None:
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not one of {sorted(allowed, key=str)}")


def positive(key: str, value, allow_zero: bool = False) -> None:
    """None passes (an unset option); otherwise > 0, or >= 0 with allow_zero."""
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{key}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def fraction(key: str, value, low_open: bool = True, high_open: bool = False) -> None:
    """value in (0, 1] by default; the flags say which ends are excluded."""
    low_ok = value > 0.0 if low_open else value >= 0.0
    high_ok = value < 1.0 if high_open else value <= 1.0
    if not (low_ok and high_ok):
        raise ValueError(f"{key}={value} must be in {'(' if low_open else '['}0, 1{')' if high_open else ']'}")


def known_fields(config, key: str = "") -> None:
    """Refuse an attribute of a config dataclass, or of one nested in it, that is none of its
    fields: a Hydra `+trainer.learnin_rate=...` adds one, and no code would ever read it."""
    names = [field.name for field in dataclasses.fields(config)]
    prefix = f"{key}." if key else ""
    for name in sorted(set(getattr(config, "__dict__", {})) - set(names)):
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {prefix}{close[0]}?" if close else f"the settings here are {sorted(names)}"
        raise ValueError(f"{prefix}{name} is not a setting: {hint}")
    for name in names:
        value = getattr(config, name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            known_fields(value, prefix + name)
