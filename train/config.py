"""Trainer, logger and DeepSpeed settings (the `trainer`, `logger`, `deepspeed` config groups)."""
from __future__ import annotations

from dataclasses import dataclass

from heads.checks import choice, fraction, positive

SCHEDULES = ("cosine", "linear", "constant")  # trainer.schedule (train.loop.lr_factor)
SCHEDULE_CLOCKS = ("steps", "minutes")  # trainer.schedule_clock (train.loop.budget_fraction)
INIT_VOCABS = ("keep", "job")  # trainer.init_vocab (train.loop.build_head_for_job)
MIXED_PRECISION = ("auto", "no", "bf16", "fp16")  # trainer.mixed_precision (train.distributed)
LOGGER_KINDS = ("wandb", "none")  # logger.kind (train.metrics)
LOGGER_MODES = ("offline", "online", "disabled")  # logger.mode
ZERO_STAGES = (0, 1, 2, 3)  # deepspeed.zero_stage
TARGET_PLACEMENTS = ("auto", "replicate", "split")  # deepspeed.target_placement (train.placement)


@dataclass
class TrainerConfig:
    output_dir: str = "runs/default"
    seed: int = 0
    learning_rate: float = 3e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    weight_decay: float = 0.0
    schedule: str = "cosine"  # cosine | linear | constant
    warmup_ratio: float = 0.05
    max_steps: int = 200
    max_minutes: float | None = None  # wall-clock budget
    # what the warmup and decay are laid out over: "steps" (max_steps), or "minutes": whichever of
    # max_steps and max_minutes the run is nearer to spending, so a run the clock stops still decays
    # to 0 (runs whose step time is not known in advance: a loaded machine, kinds compared at equal
    # minutes). "minutes" needs max_minutes and is not reproducible step for step.
    schedule_clock: str = "steps"
    batch_size: int = 4  # sequences per micro-batch per process
    grad_accumulation: int = 1
    max_grad_norm: float = 0.5
    mixed_precision: str = "auto"  # auto (bf16 on GPU; on CPU as the frozen target computes) | no | bf16 | fp16
    eval_every: int = 50
    eval_batches: int = 8
    eval_at_start: bool = True  # evaluate (and checkpoint) the initialised head before step 1
    save_every: int = 50
    keep_last: int = 2
    resume: str = "auto"  # auto | never | <checkpoint dir>
    init_from: str | None = None  # a checkpoint or any export folder to start the heads from
    # what a head from init_from drafts over: "keep" its own draft vocabulary, or the "job"'s counted one
    # (heads.draft_vocab_size; an EAGLE-3 or P-EAGLE head keeps the lm_head rows of the ids it had)
    init_vocab: str = "keep"
    log_every: int = 10
    dry_run: bool = False  # print the plan (memory, disk, steps) and stop
    num_threads: int | None = None  # torch CPU threads; None: leave torch's default
    feature_memory_mb: float = 0  # >0: keep target features of seen rows in memory (multi-epoch CPU runs)
    loss_chunk_size: int = 1024  # rows per vocabulary-projection chunk in the losses (bounds logits memory)

    def check(self, key: str = "trainer") -> None:
        """Each field's own rule; raises ValueError naming the key."""
        for name in ("learning_rate", "max_steps", "batch_size", "grad_accumulation", "max_grad_norm", "eval_every",
                     "save_every", "keep_last", "loss_chunk_size", "max_minutes", "log_every", "eval_batches"):
            positive(f"{key}.{name}", getattr(self, name))
        positive(f"{key}.num_threads", self.num_threads, allow_zero=True)
        positive(f"{key}.seed", self.seed, allow_zero=True)
        fraction(f"{key}.warmup_ratio", self.warmup_ratio, low_open=False, high_open=True)
        fraction(f"{key}.adam_beta1", self.adam_beta1, low_open=False, high_open=True)
        fraction(f"{key}.adam_beta2", self.adam_beta2, low_open=False, high_open=True)
        choice(f"{key}.schedule", self.schedule, SCHEDULES)
        choice(f"{key}.schedule_clock", self.schedule_clock, SCHEDULE_CLOCKS)
        choice(f"{key}.init_vocab", self.init_vocab, INIT_VOCABS)
        if self.schedule_clock == "minutes" and self.max_minutes is None:
            raise ValueError(f"{key}.schedule_clock=minutes lays the schedule over {key}.max_minutes, which is not set: "
                             f"set {key}.max_minutes, or {key}.schedule_clock=steps to lay it over {key}.max_steps")
        choice(f"{key}.mixed_precision", self.mixed_precision, MIXED_PRECISION)


@dataclass
class LoggerConfig:
    kind: str = "wandb"  # wandb | none
    project: str = "specheads"
    entity: str | None = None
    mode: str = "offline"  # offline (never blocks without network) | online | disabled
    run_name: str | None = None
    tags: list[str] | None = None

    def check(self, key: str = "logger") -> None:
        choice(f"{key}.kind", self.kind, LOGGER_KINDS)
        choice(f"{key}.mode", self.mode, LOGGER_MODES)


@dataclass
class DeepSpeedConfig:
    """DeepSpeed ZeRO settings and the cluster shape the dry-run plan assumes.

    Batch size, accumulation, precision and clipping are not here: they come from `trainer` and
    are written into the generated DeepSpeed dict (one source of truth).
    """

    enabled: bool = False
    zero_stage: int = 2
    offload_optimizer: bool = False  # ZeRO optimizer states in CPU memory
    config_file: str | None = None  # an explicit DeepSpeed JSON overrides the generated one
    num_gpus: int | None = None  # GPUs per node the plan assumes; None: what a launch here gets (train.plan)
    num_nodes: int = 1
    gpu_memory_gb: float = 80.0  # memory of one GPU, for the plan's fit check
    memory_headroom: float = 0.9  # fraction of gpu_memory_gb the plan lets a job use
    gpu_tflops: float = 400.0  # sustained bf16 TFLOPS of one GPU, assumed, for the plan's time estimate
    target_placement: str = "auto"  # auto | replicate | split: the frozen target on each node

    def check(self, key: str = "deepspeed") -> None:
        choice(f"{key}.zero_stage", self.zero_stage, ZERO_STAGES)
        if self.num_gpus is not None:
            positive(f"{key}.num_gpus", self.num_gpus)
        positive(f"{key}.num_nodes", self.num_nodes)
        positive(f"{key}.gpu_memory_gb", self.gpu_memory_gb)
        positive(f"{key}.gpu_tflops", self.gpu_tflops)
        fraction(f"{key}.memory_headroom", self.memory_headroom)
        choice(f"{key}.target_placement", self.target_placement, TARGET_PLACEMENTS)
