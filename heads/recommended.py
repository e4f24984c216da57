"""The runtime settings recommended for a head, with where each came from.

One record travels unchanged from the eval that chose it (`eval.run`) through the job summary into
every export manifest (`export.manifest.recommended_runtime` adds the engines' flag names) and back
out of a manifest for a re-export (`export.manifest.runtime_from_manifest`). It lives here, below
both eval and export, because both read it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

# Settings eval chooses from its timings when asked to; a record that does not say which were
# timed (written before records said so) counts these as measured.
TIMED = ("total_tokens", "medusa_choices")
MEASURED, CONFIGURED, DEFAULT = "measured", "configured", "default (not measured)"
UNRECORDED_HARDWARE = {"device_type": "unknown", "hardware": "not recorded"}


@dataclass(frozen=True)
class RecommendedRuntime:
    """EAGLE heads (EAGLE-1/2 and EAGLE-3): the tree (top_k, depth, total_tokens) and chain_depth;
    Medusa heads: medusa_choices (paths of head ranks); either: batch_policy. A setting left None was not set by eval:
    readers fill in a default and label it so. `measured` names the settings chosen from timings
    (the others were configured; None: not recorded, read as TIMED); `measured_on` is the hardware
    that timed them (eval.timing.measured_on)."""

    top_k: int | None = None
    depth: int | None = None
    total_tokens: int | None = None
    chain_depth: int | None = None
    medusa_choices: tuple[tuple[int, ...], ...] | None = None
    measured: tuple[str, ...] | None = None
    measured_on: dict | None = None
    batch_policy: dict | None = None  # when to speculate per batch size (eval.policy, from a batch-size sweep)

    def __post_init__(self):  # lists from JSON become tuples: the record is hashable and compares by value
        if self.medusa_choices is not None:
            object.__setattr__(self, "medusa_choices", tuple(tuple(int(i) for i in p) for p in self.medusa_choices))
        if self.measured is not None:
            object.__setattr__(self, "measured", tuple(self.measured))

    def source(self, key: str) -> str:
        """MEASURED, CONFIGURED or DEFAULT for one setting."""
        if getattr(self, key) is None:
            return DEFAULT
        return MEASURED if key in (TIMED if self.measured is None else self.measured) else CONFIGURED

    def provenance(self, keys: tuple[str, ...]) -> tuple[dict, str, dict | None]:
        """(per-key source, overall source, hardware) over `keys`: overall is MEASURED when any
        key was measured, else CONFIGURED when any was configured, else DEFAULT; the hardware is
        given only for a measured record (UNRECORDED_HARDWARE when it was not kept)."""
        sources = {key: self.source(key) for key in keys}
        overall = next((kind for kind in (MEASURED, CONFIGURED) if kind in sources.values()), DEFAULT)
        where = (self.measured_on or dict(UNRECORDED_HARDWARE)) if overall == MEASURED else None
        return sources, overall, where

    def to_dict(self) -> dict:
        """The set fields as JSON values (report.json, job_summary.json, a checkpoint's meta)."""
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name == "medusa_choices":
                value = [list(path) for path in value]
            elif f.name == "measured":
                value = list(value)
            values[f.name] = value
        return values

    @classmethod
    def from_dict(cls, values: dict) -> "RecommendedRuntime":
        """The inverse of to_dict; unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"recommended runtime: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**values)
