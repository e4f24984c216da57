"""Export settings (the `export` config group)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ExportConfig:
    formats: list[str] = field(default_factory=lambda: ["native", "engine"])  # native | eagle | medusa | engine (the head type's own engine layout)
    dtype: str = "bfloat16"  # bfloat16 | float16 | float32
    out: str | None = None  # default: <run_dir>/export/<format>
    ckpt: str | None = None  # for `python -m export`: checkpoint or native export to read
