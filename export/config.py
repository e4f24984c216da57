"""Export settings (the `export` config group; also the whole config of `python -m export`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from heads.checks import choice


@dataclass
class ExportConfig:
    # native | eagle (SGLang) | eagle_vllm | eagle3 (SGLang, TensorRT-LLM) | eagle3_vllm | speculators |
    # medusa (TensorRT-LLM) | medusa_vllm | engine (every engine layout of the head type)
    formats: list[str] = field(default_factory=lambda: ["native", "engine"])
    dtype: str = "bfloat16"  # bfloat16 | float16 | float32, for the engine layouts
    native_dtype: str | None = "float32"  # native keeps full precision so training can resume; None: `dtype`
    out: str | None = None  # job: default <run_dir>/export/<format>; `python -m export`: the folder (or root)
    ckpt: str | None = None  # for `python -m export`: checkpoint or export folder to read
    format: str | None = None  # for `python -m export`: one format into `out` (None: `formats` into out/<fmt>)
    eval_report: str | None = None  # for `python -m export`: report.json whose recommended runtime manifests carry
    base: str | None = None  # base model spec (hub id, folder, GGUF, embedded:...); None: the head's target
    strict_fingerprint: bool = True  # refuse a head whose target fingerprint differs from the base model's
    # replace an existing export of another format or head type at `out` (a folder that is not an
    # export is never replaced; an earlier export of the same format always is)
    overwrite: bool = False

    def check(self, key: str = "export") -> None:
        """Each field's own rule; raises ValueError naming the key."""
        from export.formats import DTYPES, FORMAT_NAMES

        for fmt in self.formats:
            choice(f"{key}.formats[]", fmt, (*FORMAT_NAMES, "engine"))
        choice(f"{key}.dtype", self.dtype, DTYPES)
        if self.native_dtype is not None:
            choice(f"{key}.native_dtype", self.native_dtype, DTYPES)
