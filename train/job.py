"""The whole job's configuration as one dataclass tree, and the checks that run before heavy work."""
from __future__ import annotations

from dataclasses import dataclass, field

from data.config import DataConfig
from eval.config import RuntimeConfig, check_runtime
from export.config import ExportConfig
from export.formats import FORMAT_NAMES, get_format
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


def _choice(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {sorted(allowed)}")


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def validate_job(job: JobConfig) -> JobConfig:
    """Check values and cross-field consistency; raise ConfigError naming the key. Cheap: no I/O."""
    _choice("stages", None, [None]) if not isinstance(job.stages, list) else None
    for stage in job.stages:
        _choice("stages[]", stage, {"data", "features", "regenerate", "train", "eval", "export"})
    _choice("heads.type", job.heads.type, {"eagle", "eagle3", "medusa"})
    _positive("heads.medusa.num_heads", job.heads.medusa.num_heads)
    _positive("heads.medusa.num_layers", job.heads.medusa.num_layers)
    if not 0.0 < job.heads.medusa.loss_decay <= 1.0:
        raise ConfigError(f"heads.medusa.loss_decay={job.heads.medusa.loss_decay} must be in (0, 1]")
    _positive("heads.eagle.feature_loss_weight", job.heads.eagle.feature_loss_weight, allow_zero=True)
    _positive("heads.eagle.logit_loss_weight", job.heads.eagle.logit_loss_weight, allow_zero=True)
    _positive("heads.eagle.input_noise", job.heads.eagle.input_noise, allow_zero=True)
    _positive("heads.eagle.eval_steps", job.heads.eagle.eval_steps)
    _choice("heads.eagle.init_fc", job.heads.eagle.init_fc, {"feature", "random", "ridge"})
    _positive("heads.eagle.ridge_tokens", job.heads.eagle.ridge_tokens)
    _positive("heads.eagle.ridge_penalty", job.heads.eagle.ridge_penalty, allow_zero=True)
    _positive("heads.eagle.train_steps", job.heads.eagle.train_steps)
    _positive("heads.eagle.unroll_loss_decay", job.heads.eagle.unroll_loss_decay, allow_zero=True)
    _positive("heads.eagle.fc_learning_rate_scale", job.heads.eagle.fc_learning_rate_scale, allow_zero=True)
    _positive("heads.draft_vocab_size", job.heads.draft_vocab_size, allow_zero=True)
    e3 = job.heads.eagle3
    _positive("heads.eagle3.ttt_steps", e3.ttt_steps)
    _positive("heads.eagle3.eval_steps", e3.eval_steps)
    if not 0.0 < e3.loss_decay <= 1.0:
        raise ConfigError(f"heads.eagle3.loss_decay={e3.loss_decay} must be in (0, 1]")
    layers = job.model.arch.num_hidden_layers
    if e3.aux_layer_ids is not None:
        if not e3.aux_layer_ids:
            raise ConfigError("heads.eagle3.aux_layer_ids is empty: EAGLE-3 reads at least one target layer "
                              "(null: the default [2, L//2, L-3])")
        if layers is not None and any(not 0 <= i < layers for i in e3.aux_layer_ids):
            raise ConfigError(f"heads.eagle3.aux_layer_ids={e3.aux_layer_ids} must lie in [0, {layers}) "
                              f"(model.arch.num_hidden_layers={layers}; id i is the stream entering layer i)")
    arch_hidden = job.model.arch.hidden_size
    if job.heads.hidden_size is not None and arch_hidden is not None and job.heads.hidden_size != arch_hidden:
        raise ConfigError(
            f"heads.hidden_size={job.heads.hidden_size} differs from the target's hidden size "
            f"model.arch.hidden_size={arch_hidden}; the heads read the target's features"
        )
    _choice("model.dtype", job.model.dtype, {"auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"})
    _choice("data.format", job.data.format, {"auto", "json", "jsonl", "hub", "disk"})
    _choice("data.overflow", job.data.overflow, {"truncate", "drop", "split"})
    _choice("data.mode", job.data.mode, {"online", "offline"})
    _choice("data.feature_cache_dtype", job.data.feature_cache_dtype, {"bfloat16", "float16", "float32"})
    _positive("data.max_length", job.data.max_length)
    _positive("data.max_records", job.data.max_records)
    _positive("data.max_eval_records", job.data.max_eval_records, allow_zero=True)
    _positive("data.num_proc", job.data.num_proc)
    if not 0.0 < job.data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction={job.data.eval_fraction} must be in (0, 1)")
    t = job.trainer
    _positive("trainer.learning_rate", t.learning_rate)
    _positive("trainer.max_steps", t.max_steps)
    _positive("trainer.batch_size", t.batch_size)
    _positive("trainer.grad_accumulation", t.grad_accumulation)
    _positive("trainer.max_grad_norm", t.max_grad_norm)
    _positive("trainer.eval_every", t.eval_every)
    _positive("trainer.save_every", t.save_every)
    _positive("trainer.keep_last", t.keep_last)
    _positive("trainer.loss_chunk_size", t.loss_chunk_size)
    _positive("trainer.max_minutes", t.max_minutes)
    _positive("trainer.log_every", t.log_every)
    _positive("trainer.eval_batches", t.eval_batches)
    _positive("trainer.num_threads", t.num_threads, allow_zero=True)
    _positive("trainer.seed", t.seed, allow_zero=True)
    if not 0.0 <= t.warmup_ratio < 1.0:
        raise ConfigError(f"trainer.warmup_ratio={t.warmup_ratio} must be in [0, 1)")
    for key, beta in (("trainer.adam_beta1", t.adam_beta1), ("trainer.adam_beta2", t.adam_beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"{key}={beta} must be in [0, 1)")
    _choice("trainer.schedule", t.schedule, {"cosine", "linear", "constant"})
    _choice("trainer.mixed_precision", t.mixed_precision, {"auto", "no", "bf16", "fp16"})
    _choice("deepspeed.zero_stage", job.deepspeed.zero_stage, {0, 1, 2, 3})
    _positive("deepspeed.num_gpus", job.deepspeed.num_gpus)
    _positive("deepspeed.num_nodes", job.deepspeed.num_nodes)
    _positive("deepspeed.gpu_memory_gb", job.deepspeed.gpu_memory_gb)
    _positive("deepspeed.gpu_tflops", job.deepspeed.gpu_tflops)
    if not 0.0 < job.deepspeed.memory_headroom <= 1.0:
        raise ConfigError(f"deepspeed.memory_headroom={job.deepspeed.memory_headroom} must be in (0, 1]")
    _choice("deepspeed.target_placement", job.deepspeed.target_placement, {"auto", "replicate", "split"})
    if (job.deepspeed.enabled and job.deepspeed.zero_stage == 3 and job.heads.type == "medusa"
            and not job.heads.medusa.share_lm_head):
        raise ConfigError("deepspeed.zero_stage=3 with Medusa heads that own their lm_heads "
                          "(heads.medusa.share_lm_head=false): the loss reads those weights outside forward, "
                          "where ZeRO-3 holds a slice of them; use deepspeed=zero2 or share_lm_head=true")
    _choice("logger.kind", job.logger.kind, {"wandb", "none"})
    _choice("logger.mode", job.logger.mode, {"offline", "online", "disabled"})
    try:
        check_runtime(job.runtime)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    for fmt in job.export.formats:
        _choice("export.formats[]", fmt, {*FORMAT_NAMES, "engine"})
        if fmt not in ("native", "engine") and get_format(fmt).head_type != job.heads.type:
            raise ConfigError(f"export.formats contains {fmt!r}, a layout of {get_format(fmt).head_type} heads, "
                              f"but heads.type={job.heads.type}")
    _choice("export.dtype", job.export.dtype, {"bfloat16", "float16", "float32"})
    if job.export.native_dtype is not None:
        _choice("export.native_dtype", job.export.native_dtype, {"bfloat16", "float16", "float32"})
    return job
