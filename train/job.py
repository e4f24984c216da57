"""The whole job's configuration as one dataclass tree, and the checks that run before heavy work."""
from __future__ import annotations

from dataclasses import dataclass, field

from data.config import DataConfig
from eval.config import RuntimeConfig, check_runtime
from export.config import ExportConfig
from export.formats import get_format
from heads.checks import choice, known_fields
from heads.config import HeadsConfig
from heads.target import TargetConfig
from train.config import DeepSpeedConfig, LoggerConfig, TrainerConfig


@dataclass
class TargetArch:
    """Architecture numbers of the target, for recipes planned without weights (dry runs). Any
    field left None is read from the loaded model."""

    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None


@dataclass
class ModelConfig(TargetConfig):
    arch: TargetArch = field(default_factory=TargetArch)


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    stages: list[str] = field(default_factory=lambda: ["data", "train", "eval", "export"])
    recipe: str = "eagle_smollm2_135m"


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key."""


STAGES = ("data", "features", "regenerate", "train", "eval", "export")


def validate_job(job: JobConfig) -> JobConfig:
    """Check every value before heavy work (no I/O); raise ConfigError naming the key. Each config
    section checks its own fields (`check()`, `eval.config.check_runtime`); this function adds the
    rules that relate fields of different sections."""
    try:
        known_fields(job)
        if not isinstance(job.stages, list):
            raise ValueError(f"stages={job.stages!r} must be a list of {list(STAGES)}")
        for stage in job.stages:
            choice("stages[]", stage, STAGES)
        if not job.stages:  # it would load the target and exit 0 having done nothing
            raise ValueError(f"stages=[] runs nothing: name at least one of {list(STAGES)}")
        for section in (job.model, job.heads, job.data, job.trainer, job.deepspeed, job.logger, job.export):
            section.check()
        check_runtime(job.runtime)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    arch = job.model.arch
    aux = job.heads.eagle3.aux_layer_ids
    if aux and arch.num_hidden_layers is not None and any(not 0 <= i < arch.num_hidden_layers for i in aux):
        raise ConfigError(f"heads.eagle3.aux_layer_ids={aux} must lie in [0, {arch.num_hidden_layers}) "
                          f"(model.arch.num_hidden_layers={arch.num_hidden_layers}; id i is the stream entering "
                          "layer i)")
    if job.heads.hidden_size is not None and arch.hidden_size is not None and job.heads.hidden_size != arch.hidden_size:
        raise ConfigError(
            f"heads.hidden_size={job.heads.hidden_size} differs from the target's hidden size "
            f"model.arch.hidden_size={arch.hidden_size}; the heads read the target's features"
        )
    if (job.deepspeed.enabled and job.deepspeed.zero_stage == 3 and job.heads.type == "medusa"
            and not job.heads.medusa.share_lm_head):
        raise ConfigError("deepspeed.zero_stage=3 with Medusa heads that own their lm_heads "
                          "(heads.medusa.share_lm_head=false): the loss reads those weights outside forward, "
                          "where ZeRO-3 holds a slice of them; use deepspeed=zero2 or share_lm_head=true")
    for fmt in job.export.formats:
        if fmt not in ("native", "engine") and get_format(fmt).head_type != job.heads.type:
            raise ConfigError(f"export.formats contains {fmt!r}, a layout of {get_format(fmt).head_type} heads, "
                              f"but heads.type={job.heads.type}")
    threads, runtime_threads = job.trainer.num_threads, job.runtime.threads
    if runtime_threads and runtime_threads != threads:
        raise ConfigError(f"runtime.threads={runtime_threads} differs from trainer.num_threads={threads}: "
                          "python -m train sets the process's threads once, for every stage (set trainer.num_threads)")
    return job
