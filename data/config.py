"""Data-stage settings (the `data` config group)."""
from __future__ import annotations

from dataclasses import dataclass, field

from heads.checks import choice, fraction, positive

EMBEDDED_SHAREGPT = "embedded:sharegpt"
FORMATS = ("auto", "json", "jsonl", "hub", "disk")  # data.format (data.sources reads each)
OVERFLOW_MODES = ("truncate", "drop", "split")  # data.overflow (data.pipeline applies them)
MODES = ("online", "offline")  # data.mode
FEATURE_CACHE_DTYPES = ("bfloat16", "float16", "float32")  # data.feature_cache_dtype
GENERATORS = ("auto", "lean", "hf")  # data.regenerate.generator


@dataclass
class RegenerateConfig:
    """Self-distillation: regenerate assistant turns with the target itself."""

    enabled: bool = False
    temperature: float = 0.0
    max_new_tokens: int = 256
    batch_size: int = 32  # replies decoded together (1: one prompt at a time)
    # auto | lean | hf: the runtime's batched decoder over the lean forward (continuous batching;
    # Llama-family targets) or transformers' batched generate; auto takes lean where it loads
    generator: str = "auto"
    shard_size: int = 256
    # keep each conversation up to its N-th assistant turn (None: all): later turns carry long
    # prompts, which cost most of the generation time for few new tokens
    max_turns: int | None = None
    output_dir: str | None = None  # default: <run_dir>/regenerated
    # A folder of shards made earlier (the corpus shipped in data/corpora/, or another machine's
    # output_dir), each `<shard>.jsonl` or `<shard>.jsonl.gz` beside its `.key`: a shard this job
    # lacks is copied from there when its key is this job's, instead of being generated. A relative
    # path that does not exist from the working directory is read from the repository root.
    reuse_from: str | None = None
    # Dtypes besides the job's own whose shards in reuse_from are taken too: greedy replies computed
    # in bf16 differ from fp32 ones only at near-ties, so a CPU without bf16 can train on a corpus
    # shipped in bf16 instead of spending its slowest stage writing it again. Empty: only the job's.
    reuse_dtypes: list[str] = field(default_factory=list)


@dataclass
class DataConfig:
    source: str = EMBEDDED_SHAREGPT  # JSON array / JSONL path, datasets hub name, saved dataset dir
    format: str = "auto"  # auto | json | jsonl | hub | disk
    hub_split: str = "train"
    salvage_truncated: bool = True  # keep the complete records of a JSON array cut mid-record
    skip_bad_records: bool = True  # False: a malformed record is an error naming it
    max_records: int | None = None  # after the split: cap on training conversations
    max_eval_records: int | None = 200
    max_length: int = 2048
    overflow: str = "truncate"  # truncate | drop | split
    eval_fraction: float = 0.02
    split_seed: int = 0
    num_proc: int = 1
    cache_dir: str | None = None  # datasets.map cache; default under the specheads cache
    mode: str = "online"  # online: run the target during training; offline: read the feature cache
    feature_cache_dir: str | None = None  # default: <run_dir>/features
    feature_cache_dtype: str = "bfloat16"
    feature_shard_records: int = 256
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)

    def check(self, key: str = "data") -> None:
        """Each field's own rule; raises ValueError naming the key."""
        choice(f"{key}.format", self.format, FORMATS)
        choice(f"{key}.overflow", self.overflow, OVERFLOW_MODES)
        choice(f"{key}.mode", self.mode, MODES)
        choice(f"{key}.feature_cache_dtype", self.feature_cache_dtype, FEATURE_CACHE_DTYPES)
        positive(f"{key}.max_length", self.max_length)
        positive(f"{key}.max_records", self.max_records)
        positive(f"{key}.max_eval_records", self.max_eval_records, allow_zero=True)
        positive(f"{key}.num_proc", self.num_proc)
        fraction(f"{key}.eval_fraction", self.eval_fraction, high_open=True)
        choice(f"{key}.regenerate.generator", self.regenerate.generator, GENERATORS)
        for dtype in self.regenerate.reuse_dtypes:
            choice(f"{key}.regenerate.reuse_dtypes", dtype, FEATURE_CACHE_DTYPES)
        positive(f"{key}.regenerate.batch_size", self.regenerate.batch_size)
