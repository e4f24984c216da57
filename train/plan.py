"""Dry-run planner: what a job needs per GPU and on disk, computed from architecture numbers only.

`python -m train +recipe=eagle_llama3_70b trainer.dry_run=true` prints this plan without loading
weights or touching the network. Memory follows the ZeRO paper's accounting (mixed precision:
2 bytes of weights + 2 of gradients + 12 of fp32 master weights and Adam moments per trained
parameter; ZeRO-1 shards the 12, ZeRO-2 also the gradients, ZeRO-3 also the weights). Activation
and token counts are estimates and say so.
"""
from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from data.config import EMBEDDED_SHAREGPT
from train.head_sizes import (  # noqa: F401  (the planner's public names, as callers import them)
    aux_layer_count, decoder_layer_parameter_count, draft_vocab, feature_layers,
    head_parameter_counts, peagle_rows_per_token, require_arch, target_parameter_count,
)
from train.job import JobConfig

GB = 1e9
# The embedded ShareGPT V3 file (cut mid-record) holds 17,671 complete conversations averaging
# ~1,790 tokens (6,441 characters at ~3.6 characters per token), measured once.
EMBEDDED_SHAREGPT_RECORDS = 17_671
SHAREGPT_MEAN_TOKENS = 1_790
# The ShareGPT set the EAGLE and Medusa papers train on, for sources the plan cannot count.
DEFAULT_RECORDS = 68_000
# Vocabulary-sized fp32 tensors alive per token in the loss (logits, softmax, gradient); EAGLE-3:
# per unrolled step over the draft vocabulary, plus the teacher's logits held once.
_VOCAB_TENSORS = {"eagle": 5, "medusa": 3, "eagle3": 3, "peagle": 3}
# Hidden-sized tensors a decoder layer keeps for backward, per token (rough, flash attention).
_LAYER_ACTIVATIONS = 34


@dataclass
class Item:
    name: str
    gigabytes: float
    note: str = ""


@dataclass
class Plan:
    """Memory (GB per GPU) and disk needs of one job; `problems` names what does not fit."""

    recipe: str
    head_type: str
    trainable_parameters: int
    frozen_head_parameters: int  # target pieces the head uses (embedding, lm_head) held beside it
    target_parameters: int
    world_size: int
    num_records: int
    tokens_per_record: float
    records_assumed: bool
    steps_per_epoch: int
    global_batch: int  # sequences per optimizer step, all processes
    max_steps: int = 0
    feature_extraction: list[Item] = field(default_factory=list)  # offline mode only
    extraction_replicas_per_node: int = 0
    processes_per_node: int = 1  # what the launcher's -n must be
    gpus_from: str = ""  # where the GPUs per node came from (planned_gpus)
    training: list[Item] = field(default_factory=list)
    evaluation: list[Item] = field(default_factory=list)  # rank 0, on the GPU of its target group holding most
    cache_bytes: float = 0.0
    cache_layers: int = 1  # target hidden-state layers stored per token
    cache_free_bytes: float | None = None
    gpu_budget_gb: float = 0.0
    extraction_hours: float = 0.0  # estimates: FLOPs / (GPUs computing x deepspeed.gpu_tflops)
    training_hours: float = 0.0
    gpu_tflops: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def training_gb(self) -> float:
        return sum(item.gigabytes for item in self.training)

    @property
    def extraction_gb(self) -> float:
        return sum(item.gigabytes for item in self.feature_extraction)

    @property
    def evaluation_gb(self) -> float:
        return sum(item.gigabytes for item in self.evaluation)


def dflash_queries(job: JobConfig, tokens_per_record: float | None = None) -> int:
    """DFlash's query rows per sequence and step: up to max_anchors blocks of block_size slots
    (anchors lie on loss positions, so a sequence of T tokens holds fewer than T of them)."""
    o = job.heads.dflash
    tokens = tokens_per_record or mean_tokens_per_record(job.data.max_length)
    return int(min(o.max_anchors, max(tokens - o.block_size, 1)) * o.block_size)


def _dflash_activations(job: JobConfig, dtype_bytes: int) -> list[Item]:
    """Every block of a sequence runs at once: each query row keeps L_d layers' activations and
    its vocabulary logits; the dense block mask is (Q, T + Q) per sequence."""
    arch, B, T = job.model.arch, job.trainer.batch_size, job.data.max_length
    Q = dflash_queries(job)
    per_query = _LAYER_ACTIVATIONS * arch.hidden_size * job.heads.dflash.num_layers * dtype_bytes + 3 * arch.vocab_size * 4
    return [Item("activations", B * Q * per_query / GB,
                 f"estimate, micro-batch {B} x {Q} block rows ({job.heads.dflash.max_anchors} anchors x "
                 f"{job.heads.dflash.block_size} slots)"),
            Item("block attention mask", B * Q * (T + Q) * 4 / GB, "dense, as an additive float mask")]


def estimate_records(job: JobConfig) -> tuple[int, bool]:
    """(training records, assumed?) from the data config without reading the data."""
    if job.data.source == EMBEDDED_SHAREGPT:
        available = int(EMBEDDED_SHAREGPT_RECORDS * (1 - job.data.eval_fraction))
        return (min(available, job.data.max_records) if job.data.max_records else available), False
    if job.data.max_records:
        return job.data.max_records, True
    return DEFAULT_RECORDS, True


def mean_tokens_per_record(max_length: int, mean: float = SHAREGPT_MEAN_TOKENS) -> float:
    """Mean length after truncation at max_length, modelling lengths as exponential: E[min(X, L)]."""
    return mean * (1 - math.exp(-max_length / mean))


def _bytes_per_element(dtype: str) -> int:
    return 4 if dtype in ("float32", "fp32", "no") else 2


def _zero_states(trainable: int, stage: int, world: int, mixed: bool, offload: bool) -> list[Item]:
    weight_bytes, grad_bytes, optim_bytes = (2, 2, 12) if mixed else (4, 4, 8)
    shard = lambda on: world if on else 1  # noqa: E731 - a one-line table of who shards what
    items = [
        Item("head weights", trainable * weight_bytes / shard(stage >= 3) / GB, f"ZeRO-{stage}" if stage >= 3 else "replicated"),
        Item("head gradients", trainable * grad_bytes / shard(stage >= 2) / GB, f"sharded /{world}" if stage >= 2 else "replicated"),
    ]
    optimizer = trainable * optim_bytes / shard(stage >= 1) / GB
    note = ("fp32 master + Adam m, v" if mixed else "Adam m, v") + (f", sharded /{world}" if stage >= 1 else "")
    if offload:
        optimizer, note = 0.0, note + ", offloaded to CPU memory"
    items.append(Item("optimizer states", optimizer, note))
    return items


def _target_placement(job: JobConfig, target_gb: float, budget_gb: float, reserve_gb: float) -> int:
    """GPUs one copy of the target spans: 1 = replicated on every GPU, else a power of two."""
    gpus = job.deepspeed.num_gpus
    if job.deepspeed.target_placement == "replicate":
        return 1
    need = math.ceil(target_gb / max(budget_gb - reserve_gb, 1e-9))
    if job.deepspeed.target_placement == "split":
        need = max(need, 2)
    span = 1
    while span < min(need, gpus):
        span *= 2
    return min(span, gpus)


def _sizes(job: JobConfig) -> tuple[int, float, float, float]:
    """(bytes per element, usable GB per GPU, target GB, GB of one no-grad target forward)."""
    arch, trainer = require_arch(job.model.arch), job.trainer
    dtype_bytes = 2 if trainer.mixed_precision != "no" else 4
    budget = job.deepspeed.gpu_memory_gb * job.deepspeed.memory_headroom
    target_gb = target_parameter_count(arch) * dtype_bytes / GB
    # no-grad target forward: the kept feature layers plus one decoder layer's transients
    D, B, T = arch.hidden_size, trainer.batch_size, job.data.max_length
    forward_gb = B * T * (feature_layers(job) * D + 4 * D + 2 * arch.intermediate_size) * dtype_bytes / GB
    return dtype_bytes, budget, target_gb, forward_gb


def planned_gpus(job: JobConfig) -> tuple[JobConfig, str]:
    """(job with deepspeed.num_gpus set, where the count came from). A recipe for a cluster names
    its GPUs; unset, the count is what launching the job here gives: a process per GPU of this
    machine (scripts/launch_single_node.sh), one process on a machine without one or with
    model.device=cpu, as a plain `python -m train` runs."""
    if job.deepspeed.num_gpus is not None:
        return job, f"deepspeed.num_gpus={job.deepspeed.num_gpus}"
    gpus = 0 if job.model.device.startswith("cpu") else torch.cuda.device_count()
    where = (f"this machine's {gpus} GPU(s)" if gpus else
             "no GPU here: 1 process; deepspeed.num_gpus=N plans a node of N GPUs")
    return replace(job, deepspeed=replace(job.deepspeed, num_gpus=max(gpus, 1))), where


def target_span(job: JobConfig) -> int:
    """GPUs one copy of the whole target spans when it runs (feature extraction in offline mode,
    every step online; offline with the target kept loaded for eval, it shares its GPUs with the
    training): 1 = replicated on every GPU, else split over a group of that many GPUs.
    Decided by deepspeed.target_placement, deepspeed.num_gpus and gpu_memory_gb."""
    job, _ = planned_gpus(job)
    dtype_bytes, budget, target_gb, forward_gb = _sizes(job)
    if job.data.mode == "offline" and not whole_target_resident(job):
        return _target_placement(job, target_gb, budget, forward_gb)
    training = sum(i.gigabytes for i in _head_items(job, job.deepspeed.num_gpus * job.deepspeed.num_nodes, dtype_bytes))
    if job.data.mode == "offline":  # the target stays loaded while the head trains from the cache
        return _target_placement(job, target_gb, budget, max(forward_gb, training))
    return _target_placement(job, target_gb, budget, training + forward_gb)


def _head_items(job: JobConfig, world: int, dtype_bytes: int) -> list[Item]:
    """Per-GPU memory of the head's training: frozen target pieces, ZeRO states, activations."""
    arch, ds, B, T = job.model.arch, job.deepspeed, job.trainer.batch_size, job.data.max_length
    trainable, frozen = head_parameter_counts(job)
    items = [Item("frozen embedding + lm_head", frozen * dtype_bytes / GB, "the target's, read by the head")] if frozen else []
    stage = ds.zero_stage if ds.enabled else 0
    items += _zero_states(trainable, stage, world if ds.enabled else 1, dtype_bytes == 2, ds.offload_optimizer and ds.enabled)
    if job.heads.type == "dflash":
        return items + _dflash_activations(job, dtype_bytes)
    if job.heads.type == "eagle3":  # every unrolled step keeps a layer's activations and its Vd logits
        steps = job.heads.eagle3.ttt_steps
        head_layers, vocab_bytes = steps, (_VOCAB_TENSORS["eagle3"] * steps + 1) * draft_vocab(job) * 4
    elif job.heads.type == "peagle":  # one layer over the depth-0 rows and the COD mask rows, all scored
        rows = peagle_rows_per_token(job)
        head_layers, vocab_bytes = rows, (_VOCAB_TENSORS["peagle"] * rows + 1) * draft_vocab(job) * 4
    else:
        vocab_tensors = _VOCAB_TENSORS[job.heads.type] * (job.heads.medusa.num_heads if job.heads.type == "medusa" else 1)
        head_layers = 1 if job.heads.type == "eagle" else job.heads.medusa.num_layers
        vocab_bytes = vocab_tensors * arch.vocab_size * 4
    per_token = _LAYER_ACTIVATIONS * arch.hidden_size * head_layers * dtype_bytes + vocab_bytes
    items.append(Item("activations", B * T * per_token / GB, f"estimate, micro-batch {B} x {T} tokens"))
    if job.heads.type == "peagle":  # the mask rows' dense block mask and their fp32 attention scores
        M = (peagle_rows_per_token(job) - 1) * T
        items.append(Item("block attention", B * M * (T + M) * (1 + 4 * arch.num_attention_heads) / GB,
                          f"estimate, dense: {M:,.0f} mask rows x {T + M:,.0f} keys per sequence"))
    return items


def whole_target_resident(job: JobConfig) -> bool:
    """Whether an offline job keeps the whole target loaded while it trains: a stage after the cache
    runs it (eval, regeneration), so the job loads it once for all (train.offline.parts_only_layers)."""
    return job.data.regenerate.enabled or not set(job.stages) <= {"data", "features", "train", "export"}


def _eval_items(job: JobConfig, span: int, target_gb: float, dtype_bytes: int) -> list[Item]:
    """Memory of the eval stage on the busiest GPU of rank 0's target group (the last: it holds the
    lm_head, the head and the drafters' state). The lean runtime computes each layer where it lies
    on the target's own weights (eval.runtime.placement), so the stage holds the target, one KV cache and
    the head; transformers' generate builds a cache of its own size only after the lean one is freed."""
    arch, runtime = job.model.arch, job.runtime
    head_dim = arch.hidden_size // arch.num_attention_heads
    total = runtime.tree_total_tokens if isinstance(runtime.tree_total_tokens, int) else 0
    positions = runtime.max_prompt_tokens + runtime.max_new_tokens + max([total, *runtime.tree_auto_sizes,
                                                                           *runtime.tree_sweep, 64]) + 8
    kv_bytes = 2 * arch.num_hidden_layers * arch.num_key_value_heads * head_dim * positions * dtype_bytes
    trainable, _ = head_parameter_counts(job)
    prefill = runtime.max_prompt_tokens * (4 * arch.hidden_size + 2 * arch.intermediate_size) * dtype_bytes
    where = "whole, on one GPU" if span == 1 else f"split across {span} GPUs, used in place (no weight copies)"
    return [
        Item("frozen target shard", target_gb / span, where),
        Item("KV cache", kv_bytes / span / GB, f"{positions} positions; each layer's on its own GPU"),
        Item("head", 2 * trainable * 4 / GB, "fp32 weights and its lean runtime's fused copies"),
        Item("forward transients", (prefill + arch.vocab_size * 4) / GB, "estimate: one prompt's prefill"),
    ]


def make_plan(job: JobConfig, num_records: int | None = None, tokens_per_record: float | None = None,
              cache_dir: str | None = None) -> Plan:
    """Plan the job's memory per GPU, feature-cache size and steps per epoch; no weights, no network.

    num_records / tokens_per_record: counts from prepared data when the caller has them; otherwise
    estimated from the data config (and marked as assumed when the source cannot be counted).
    With the target split across S GPUs (online mode), one training process drives S GPUs, so the
    data-parallel world is num_gpus * num_nodes / S.
    """
    arch = require_arch(job.model.arch)
    job, gpus_from = planned_gpus(job)
    ds, trainer = job.deepspeed, job.trainer
    dtype_bytes, budget, target_gb, forward_gb = _sizes(job)
    B, T, D = trainer.batch_size, job.data.max_length, arch.hidden_size
    layers = feature_layers(job)
    offline = job.data.mode == "offline"

    span = target_span(job)
    resident = offline and whole_target_resident(job)
    # a split target fits num_gpus / span times on a node: features (and a target kept for eval) cap the processes
    processes = ds.num_gpus // span if span > 1 and (resident or "features" in job.stages) else ds.num_gpus
    world = processes * ds.num_nodes
    training = _head_items(job, world, dtype_bytes)
    if resident:
        where = "replicated per GPU" if span == 1 else f"split across {span} GPUs per process"
        training.insert(0, Item("frozen target shard", target_gb / span, f"loaded whole for the eval stage, {where}"))
    elif offline:
        if job.heads.type == "eagle":  # the target is loaded in parts (train.offline.parts_only_layers)
            init = job.heads.eagle.init_layer
            count = len({0, init % arch.num_hidden_layers}) if init is not None else 1
            layer_gb = decoder_layer_parameter_count(arch) * dtype_bytes / GB
            training.insert(1, Item("target decoder layers", count * layer_gb,
                                    f"{count} of {arch.num_hidden_layers}: layer 0's shape, heads.eagle.init_layer's weights"))
        elif job.heads.type in ("eagle3", "dflash", "peagle"):
            layer_gb = decoder_layer_parameter_count(arch) * dtype_bytes / GB
            training.insert(1, Item("target decoder layers", layer_gb, f"1 of {arch.num_hidden_layers}: layer 0's shape"))
    if offline:
        rest = "the target kept for eval" if resident else "the rest of the target not loaded"
        training.append(Item("feature batch", B * T * D * layers * dtype_bytes / GB,
                             f"{layers} layer(s) read from the cache; {rest}"))
    else:
        world //= span
        training = _head_items(job, world, dtype_bytes)
        where = "replicated per GPU" if span == 1 else f"split across {span} GPUs per process (pipeline)"
        training.insert(0, Item("frozen target shard", target_gb / span, where))
        training.append(Item("target forward (no grad)", forward_gb, "features of one micro-batch"))

    assumed = False
    if num_records is None:
        num_records, assumed = estimate_records(job)
    if tokens_per_record is None:
        tokens_per_record = mean_tokens_per_record(T)
    trainable, frozen = head_parameter_counts(job)
    global_batch = B * trainer.grad_accumulation * world
    plan = Plan(
        recipe=job.recipe, head_type=job.heads.type, trainable_parameters=trainable,
        frozen_head_parameters=frozen, target_parameters=target_parameter_count(arch), world_size=world,
        num_records=num_records, tokens_per_record=tokens_per_record, records_assumed=assumed,
        steps_per_epoch=max(1, math.ceil(num_records / global_batch)), global_batch=global_batch,
        training=training, gpu_budget_gb=budget, max_steps=trainer.max_steps,
        processes_per_node=world // ds.num_nodes if offline else processes // span if span > 1 else processes,
        gpus_from=gpus_from,
    )
    if "eval" in job.stages:
        plan.evaluation = _eval_items(job, span, target_gb, dtype_bytes)
    # time: a forward costs 2 FLOPs per parameter and token, a training step 6; a split copy computes
    # its layers one GPU after another, so it runs at one GPU's rate; EAGLE-3 unrolls its head ttt_steps times
    tflops = ds.gpu_tflops * 1e12
    tokens = num_records * tokens_per_record
    if offline:
        plan.extraction_hours = 2 * plan.target_parameters * tokens / (ds.num_gpus // span * ds.num_nodes * tflops) / 3600
    unrolled = {"eagle3": job.heads.eagle3.ttt_steps, "peagle": peagle_rows_per_token(job)}.get(job.heads.type, 1)
    step = 6 * trainable * unrolled * global_batch * tokens_per_record
    if job.heads.type == "dflash":  # the head runs on its block rows, not on the sequence
        step = 6 * trainable * global_batch * dflash_queries(job, tokens_per_record)
    if not offline:
        step += 2 * plan.target_parameters * global_batch * tokens_per_record
    plan.training_hours = trainer.max_steps * step / (world * tflops) / 3600
    plan.gpu_tflops = ds.gpu_tflops
    if offline:
        span = target_span(job)
        plan.extraction_replicas_per_node = max(1, ds.num_gpus // span)
        where = ("replicated per GPU" if span == 1
                 else f"split across {span} GPUs; {plan.extraction_replicas_per_node} copies per node")
        plan.feature_extraction = [
            Item("frozen target shard", target_gb / span, where),
            Item("target forward (no grad)", forward_gb, f"micro-batch {B} x {T}"),
        ]
        cache_element = 4 if job.data.feature_cache_dtype == "float32" else 2
        # hidden states + input ids (int32) + loss mask (1 byte) per token
        plan.cache_bytes = num_records * tokens_per_record * (D * layers * cache_element + 4 + 1)
        plan.cache_layers = layers
        plan.cache_free_bytes = _free_bytes(cache_dir or job.data.feature_cache_dir or trainer.output_dir)
    _check(plan, job)
    return plan


def _free_bytes(path: str) -> float | None:
    folder = Path(path).expanduser().resolve()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return float(shutil.disk_usage(folder).free)
    except OSError:
        return None


def _check(plan: Plan, job: JobConfig) -> None:
    ds = job.deepspeed
    if plan.training_gb > plan.gpu_budget_gb:
        biggest = max(plan.training, key=lambda item: item.gigabytes)
        hint = (" (try data.mode=offline, a smaller trainer.batch_size, or deepspeed.zero_stage=3)"
                if biggest.name == "frozen target shard" else " (try a smaller trainer.batch_size or data.max_length)")
        plan.problems.append(
            f"training needs {plan.training_gb:.1f} GB per GPU > {plan.gpu_budget_gb:.1f} GB usable "
            f"(deepspeed.gpu_memory_gb={ds.gpu_memory_gb:g} x {ds.memory_headroom:g}); largest: {biggest.name} "
            f"{biggest.gigabytes:.1f} GB{hint}")
    if plan.evaluation_gb > plan.gpu_budget_gb:
        plan.problems.append(f"eval needs {plan.evaluation_gb:.1f} GB on a GPU > {plan.gpu_budget_gb:.1f} GB usable")
    if plan.extraction_gb > plan.gpu_budget_gb:
        plan.problems.append(
            f"feature extraction needs {plan.extraction_gb:.1f} GB per GPU > {plan.gpu_budget_gb:.1f} GB usable "
            f"even split across {ds.num_gpus} GPUs")
    if plan.cache_free_bytes is not None and plan.cache_bytes > plan.cache_free_bytes:
        plan.problems.append(
            f"feature cache needs {plan.cache_bytes / GB:,.0f} GB on disk; {plan.cache_free_bytes / GB:,.0f} GB free "
            f"where it would be written (data.feature_cache_dir)")
    if ds.enabled and ds.zero_stage == 0:
        plan.problems.append("deepspeed.enabled with zero_stage=0 shards nothing; use DDP (deepspeed=none)")


def _duration(hours: float) -> str:
    return f"{hours:,.1f} h" if hours >= 1 else f"{hours * 60:.0f} min"


def format_plan(plan: Plan) -> str:
    """The plan as a table for the terminal."""
    lines = [
        f"dry run: {plan.recipe} ({plan.head_type} head), {plan.world_size} data-parallel process(es) ({plan.gpus_from})",
        f"  head parameters: {plan.trainable_parameters:,} trainable"
        + (f" + {plan.frozen_head_parameters:,} frozen (target embedding/lm_head)" if plan.frozen_head_parameters else ""),
        f"  target parameters: {plan.target_parameters:,}",
        f"  data: {plan.num_records:,} records{' (assumed)' if plan.records_assumed else ''}, "
        f"~{plan.tokens_per_record:,.0f} tokens each (estimate)",
        f"  steps per epoch: {plan.steps_per_epoch:,} (global batch {plan.global_batch:,} sequences per optimizer step); "
        f"trainer.max_steps {plan.max_steps:,} = {plan.max_steps / plan.steps_per_epoch:,.1f} epochs",
    ]
    if plan.feature_extraction:
        lines.append(f"  feature extraction, per GPU ({plan.extraction_gb:.1f} / {plan.gpu_budget_gb:.1f} GB usable):")
        lines += [f"    {i.name:<28} {i.gigabytes:8.2f} GB  {i.note}" for i in plan.feature_extraction]
        free = "unknown" if plan.cache_free_bytes is None else f"{plan.cache_free_bytes / GB:,.0f} GB free"
        lines.append(f"  feature cache on disk: {plan.cache_bytes / GB:,.1f} GB, {plan.cache_layers} layer(s) per token ({free})")
    lines.append(f"  training, per GPU ({plan.training_gb:.1f} / {plan.gpu_budget_gb:.1f} GB usable):")
    lines += [f"    {i.name:<28} {i.gigabytes:8.2f} GB  {i.note}" for i in plan.training]
    lines.append(f"  time (compute only, estimate at deepspeed.gpu_tflops={plan.gpu_tflops:g} sustained per GPU): "
                 + (f"feature extraction {_duration(plan.extraction_hours)}, " if plan.feature_extraction else "")
                 + f"training {_duration(plan.training_hours)} for {plan.max_steps:,} steps")
    if plan.evaluation:
        lines.append(f"  eval, rank 0, its busiest GPU ({plan.evaluation_gb:.1f} / {plan.gpu_budget_gb:.1f} GB usable; "
                     f"peak = target + KV cache + head):")
        lines += [f"    {i.name:<28} {i.gigabytes:8.2f} GB  {i.note}" for i in plan.evaluation]
    if plan.world_size == 1:  # one process needs no launcher
        lines.append(f"  launch: 1 process (python -m train +recipe={plan.recipe})")
    else:
        lines.append(f"  launch: {plan.processes_per_node} process(es) per node "
                     f"(scripts/launch_single_node.sh -n {plan.processes_per_node} +recipe={plan.recipe})")
    if plan.problems:
        lines.append("  does not fit:")
        lines += [f"    - {problem}" for problem in plan.problems]
    else:
        lines.append("  fits.")
    return "\n".join(lines)
