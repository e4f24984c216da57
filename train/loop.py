"""The training loop: frozen target -> features -> head -> loss -> AdamW, on accelerate.

Entry point for the pipeline: `train_heads(job, target, data) -> TrainResult`.
Written for several processes: every process runs the same step count over its own slice of each
global batch (deterministic from seed + epoch), metrics are summed across processes before the
main process logs them, and only the main process writes files.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from heads.eagle3 import Eagle3Head, resize_draft_vocab
from heads.io import head_type, read_head_meta
from heads.vocab import draft_ids, set_draft_vocab, stores_id_list
from train.config import SCHEDULES
from train.checkpoint import (
    TrainingDiverged, find_resume, prune_checkpoints, rng_state, save_checkpoint, set_rng_state,
)
from train.data_order import BatchStream, eval_batches
from train.heldout import run_held_out
from train.kinds import HeadKind, head_kind
from train.metrics import MetricsLogger, gpu_memory_metrics
from train.objectives import (
    FeatureSource, FrozenParts, MemoizedFeatures, OnlineFeatures, frequent_reply_tokens, source_layers,
)
from train.run_identity import run_identity

log = logging.getLogger(__name__)
BEST_METRIC = "eval/acceptance_length"  # higher is better


@dataclass
class TrainResult:
    run_dir: Path
    head_type: str
    steps: int
    stopped: str  # max_steps | max_minutes
    last_checkpoint: Path | None
    best_checkpoint: Path | None  # a native head folder (heads.io.load_head) plus trainer state
    best_eval: dict = field(default_factory=dict)
    final_eval: dict = field(default_factory=dict)
    mixed_precision: str = "no"  # what the head's steps computed in (fp32 master weights either way)


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based): linear warmup to 1
    over warmup_steps, then cosine or linear decay to 0 at total_steps, or constant."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    return _decay(min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)), schedule)


def _decay(progress: float, schedule: str) -> float:
    """The multiplier after warmup, `progress` in [0, 1] of the decay."""
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    raise ValueError(f"trainer.schedule={schedule!r} is not one of {sorted(SCHEDULES)}")


def budget_fraction(step: int, max_steps: int, elapsed_seconds: float, max_minutes: float | None) -> float:
    """How much of the run's budget is spent after `step` optimizer steps and `elapsed_seconds`: the
    larger of the step and the wall-clock fractions (trainer.schedule_clock=minutes), in [0, 1]."""
    by_clock = elapsed_seconds / (60.0 * max_minutes) if max_minutes else 0.0
    return min(1.0, max(step / max_steps, by_clock))


def lr_factor_by_budget(fraction: float, warmup_ratio: float, max_steps: int, schedule: str) -> float:
    """lr_factor over the budget fraction instead of the step: linear warmup over the first
    warmup_ratio of the budget (never below one step's share, so the first step learns), then the
    decay over the rest."""
    if warmup_ratio > 0 and fraction < warmup_ratio:
        return min(1.0, max(fraction, 1.0 / max_steps) / warmup_ratio)
    return _decay(min(1.0, (fraction - warmup_ratio) / max(1e-9, 1.0 - warmup_ratio)), schedule)


def adopt_job_vocab(head, own: torch.Tensor, vocab: torch.Tensor | None, target) -> None:
    """trainer.init_vocab=job: the loaded head drafts over the job's counted ids `vocab` (None: the
    full vocabulary) instead of its own `own`. EAGLE-3 and P-EAGLE keep the lm_head rows of the
    ids they had (heads/eagle3.resize_draft_vocab); EAGLE-1/2 and Medusa score through the target's
    lm_head, so their id list is replaced."""
    module = getattr(head, "module", head)
    ids = vocab if vocab is not None else torch.arange(target.vocab_size)
    if isinstance(module, Eagle3Head):
        kept, new = resize_draft_vocab(module, ids, target)
        detail = f": {kept} lm_head rows kept, {new} from the target's lm_head"
    elif stores_id_list(module.config):
        set_draft_vocab(module, ids)
        detail = ""
    else:
        raise ValueError(f"trainer.init_vocab=job: a {type(module).__name__}'s draft vocabulary cannot be "
                         "replaced (its lm_head rows would have to be rebuilt); use trainer.init_vocab=keep")
    log.info("trainer.init_from: the head's %d-id draft vocabulary becomes the job's %d ids (trainer.init_vocab=job)%s",
             len(own), len(ids), detail)


def build_head_for_job(job, target, kind: HeadKind | None = None, vocab: torch.Tensor | None = None):
    """(head, head config): from trainer.init_from (a checkpoint or any export folder, read by
    `export.load_export` in float32; a head of another kind where the job's kind can `adopt` it),
    else fresh: the head kind's build, initialised from the
    target, around the draft vocabulary `vocab` (sorted ids; None: the full vocabulary). A loaded
    head keeps its own vocabulary, or takes `vocab` under trainer.init_vocab=job (`adopt_job_vocab`);
    a head without one gets `vocab`."""
    kind, source = kind or head_kind(job.heads), job.trainer.init_from
    if source:
        from export import load_export

        head, config, _ = load_export(source, target, dtype="float32")
        if head_type(config) != kind.name:
            adopted = kind.adopt(head, config) if hasattr(kind, "adopt") else None
            if adopted is None:
                raise ValueError(f"trainer.init_from={source} holds a {type(config).__name__}, but heads.type={kind.name}")
            log.info("trainer.init_from: a %s head starts the %s head", head_type(config), kind.name)
            head, config = adopted
        wanted = kind.aux_layer_ids(target.num_layers) if hasattr(kind, "aux_layer_ids") else None
        if wanted is not None and list(config.aux_layer_ids) != wanted:  # the features would not match it
            ids = list(config.aux_layer_ids)
            raise ValueError(f"trainer.init_from={source} reads target layers {ids}, but the job feeds {wanted}: "
                             f"set heads.{kind.name}.aux_layer_ids={ids}")
        own = draft_ids(head)
        if own is None and vocab is not None:
            set_draft_vocab(head, vocab)
            log.info("trainer.init_from: the head had no draft vocabulary; it trains over the %d counted ids",
                     len(vocab))
        elif own is not None and (vocab is None or not torch.equal(own.cpu(), vocab.cpu())):
            if job.trainer.init_vocab == "job":
                adopt_job_vocab(head, own, vocab, target)
            else:
                log.info("trainer.init_from: the head keeps its own %d-id draft vocabulary (heads.draft_vocab_size=%d "
                         "is not applied to it; trainer.init_vocab=job applies it)", len(own),
                         job.heads.draft_vocab_size)
        return head, config
    return kind.build(target, vocab)  # heads.hidden_size was checked against the target (pipeline.check_arch)


def train_heads(job, target, data, source: FeatureSource | None = None, accelerator=None) -> TrainResult:
    """Train the job's head on `data` (PreparedData: .train/.eval rows with input_ids, loss_mask, id)
    against the frozen `target`. `source` supplies target features (default: run the target online).
    Writes <trainer.output_dir>/{checkpoints/, metrics.jsonl, result.json}."""
    from accelerate.utils import gather_object, set_seed

    from train.distributed import (
        full_parameters, gather_head_state, make_accelerator, resolve_mixed_precision, restore_head_state,
    )

    t, kind = job.trainer, head_kind(job.heads)
    start_time = time.time()  # trainer.max_minutes counts set-up (ridge fit) and evaluations too
    accelerator = accelerator or make_accelerator(t, job.deepspeed, target.dtype)
    rank, world, main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    run_dir, device = Path(t.output_dir), accelerator.device
    # the steps' precision: on a CPU this loop autocasts them (make_accelerator), elsewhere accelerate
    precision = resolve_mixed_precision(t, target.dtype) if device.type == "cpu" else str(accelerator.mixed_precision)
    root = run_dir / "checkpoints"
    set_seed(t.seed + rank)

    target.to(device)
    size = job.heads.draft_vocab_size  # counted once here; the head stores it, its loss and drafters read it
    vocab = frequent_reply_tokens(data.train, size, target.vocab_size) if size else None
    # On a CPU the heads train in fp32 whatever the frozen target computes in (heads/dtypes.py).
    fp32_heads = torch.float32 if device.type == "cpu" and target.dtype != torch.float32 else None
    parts = FrozenParts.from_target(target, device, fp32_heads)
    layers = kind.feature_layers(target.num_layers)
    online = source is None  # the target's own dtype then bounds the features' precision
    source = source or OnlineFeatures(target, layers, fp32_heads)
    if source_layers(source) != layers:
        raise ValueError(f"the feature source supplies target layers {source_layers(source)}, but a {kind.name} "
                         f"head reads {layers}")
    eval_source = source
    if t.feature_memory_mb > 0:  # reuse each row's features across epochs and evaluations
        keep = target.dtype if online else None
        source = MemoizedFeatures(source, t.feature_memory_mb, keep)
        eval_source = MemoizedFeatures(eval_source, t.feature_memory_mb, keep)
    head, head_config = build_head_for_job(job, target, kind, vocab)
    head.to(device)
    if device.type == "cpu" and precision in ("bf16", "fp16"):  # fp32 master weights, bf16 matmuls
        low = torch.bfloat16 if precision == "bf16" else torch.float16
        steps_autocast = lambda: torch.autocast("cpu", dtype=low)  # noqa: E731
    else:
        steps_autocast = accelerator.autocast
    optimizer = torch.optim.AdamW(kind.param_groups(head, t.learning_rate), lr=t.learning_rate,
                                  betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.weight_decay)
    warmup = int(t.warmup_ratio * t.max_steps)
    clock = {"elapsed": 0.0}  # seconds spent (schedule_clock=minutes), the same on every process
    if t.schedule_clock == "minutes":
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor_by_budget(
            budget_fraction(s, t.max_steps, clock["elapsed"], t.max_minutes), t.warmup_ratio, t.max_steps,
            t.schedule))
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, warmup, t.max_steps, t.schedule))

    def reduce(tensor):
        return accelerator.reduce(tensor, "sum") if world > 1 else tensor

    unsettled_tokens = 0  # this process's tokens not yet in state["tokens"]

    def settle_tokens() -> None:
        """Add every process's tokens since the last call to state["tokens"]: at each log line and
        before each checkpoint, so a checkpoint saved between log lines counts all its steps."""
        nonlocal unsettled_tokens
        state["tokens"] += int(reduce(torch.tensor([unsettled_tokens], dtype=torch.long, device=device)).item())
        unsettled_tokens = 0

    pad_id = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    stream = BatchStream(data.train, t.batch_size, world, rank, t.seed, pad_id, device)
    held_out = eval_batches(data.eval, t.batch_size, world, rank, t.eval_batches, pad_id, device)
    state = {"step": 0, "tokens": 0, "elapsed_seconds": 0.0, "best": None, "last_eval": {}}

    identity = run_identity(job, target, data.train, world)
    resume, checkpoint = find_resume(t.resume, root, identity, main)  # refuses another run's checkpoints
    if checkpoint is None and not t.init_from:  # a fresh head: the kind's set-up

        def first_batches():  # the batches training starts with, read only if the kind asks
            peek = BatchStream(data.train, t.batch_size, world, rank, t.seed, pad_id, device)
            for _ in range(peek.batches_per_epoch()):
                yield peek.next()

        kind.prepare(head, parts, source, first_batches(), world, reduce)
    if checkpoint is not None:
        meta = read_head_meta(resume)
        if meta["type"] != kind.name:
            raise ValueError(f"trainer.resume: {resume} holds a {meta['type']} head but heads.type={kind.name}")
        head.load_state_dict(checkpoint["model"])
        state.update({k: checkpoint["state"][k] for k in state if k in checkpoint["state"]})
        stream.load_position(checkpoint["state"]["data_position"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        clock["elapsed"] = state["elapsed_seconds"]
    head, optimizer = accelerator.prepare(head, optimizer)
    if checkpoint is not None:
        restore_head_state(accelerator, head, optimizer, checkpoint["optimizer"])
        ranks = checkpoint["rng"]
        if len(ranks) == world:
            set_rng_state(ranks[rank])
        else:  # another process count: a fresh but deterministic stream per rank
            set_seed(t.seed + rank + state["step"])
        log.info("resumed from %s at step %d", resume, state["step"])

    logger = MetricsLogger(run_dir, job.logger, dataclasses.asdict(job), resume_step=state["step"]) if main else None
    best_step = state["best"]["step"] if state["best"] else None
    eval_cache: dict = {}  # the target's greedy tokens on the held-out batches, computed once
    last_saved = resume

    def score_held_out() -> dict:
        model = accelerator.unwrap_model(head).eval()
        with accelerator.autocast():  # a no-op on a CPU: held-out figures in fp32, as the CPU runtime drafts
            metrics = run_held_out(model, kind, parts, eval_source, held_out, reduce, eval_cache)
        head.train()
        return metrics

    def save(step: int, eval_metrics: dict | None) -> Path | None:
        nonlocal last_saved
        settle_tokens()
        # every process agrees before any writes: non-finite weights are not checkpointed (each
        # process checks what it holds, a ZeRO-3 slice or the whole head)
        finite = all(bool(torch.isfinite(p).all()) for p in head.parameters())
        _check_finite(reduce, torch.tensor(0.0 if finite else math.inf, device=device), step - 1, "weights", last_saved)
        rngs = gather_object([rng_state()]) if world > 1 else [rng_state()]
        optimizer_state = gather_head_state(accelerator, head, optimizer)  # collective under ZeRO
        path = None
        with full_parameters(accelerator, head) as module:  # ZeRO-3: whole weights on every process
            if main:
                path = save_checkpoint(root, step, module, head_config, optimizer_state, scheduler.state_dict(),
                                       rngs, {**state, "data_position": stream.position(), "eval": eval_metrics or {},
                                              "run": identity})
                prune_checkpoints(root, t.keep_last, {best_step} if best_step is not None else set(), identity["id"])
        accelerator.wait_for_everyone()
        last_saved = root / path.name if path else root / f"step-{step:08d}"
        return last_saved

    def evaluate_and_track(step: int) -> dict:
        nonlocal best_step
        metrics = state["last_eval"] = score_held_out()
        value = metrics[BEST_METRIC]
        if state["best"] is None or value > state["best"]["value"]:
            state["best"] = {"step": step, "metric": BEST_METRIC, "value": value}
            best_step = step
        if main:
            minutes = (state["elapsed_seconds"] if step else time.time() - start_time) / 60
            logger.log(step, {**metrics, "eval/wall_minutes": minutes})  # since the job's loop started
            log.info("step %d eval: %s", step, _short(metrics))
        return metrics

    from tqdm.auto import tqdm

    bar = tqdm(total=t.max_steps, initial=state["step"], disable=not main, unit="step", dynamic_ncols=True)
    window = _Window()
    start_elapsed = state["elapsed_seconds"]
    stopped, last_eval_step = "max_steps", None
    head.train()
    try:
        if state["step"] == 0 and t.eval_at_start:  # the initialisation's figures; it may stay the best
            last_eval_step = 0
            save(0, evaluate_and_track(0))
        while state["step"] < t.max_steps:
            grad_norm, step_started = torch.tensor(0.0), time.time()
            for _ in range(t.grad_accumulation):
                batch = stream.next()
                with accelerator.accumulate(head):
                    features = source(batch)
                    with steps_autocast():
                        out = kind.step(head, parts, batch, features, t.loss_chunk_size)
                    _check_finite(reduce, out["loss"].detach(), state["step"], "loss", last_saved)
                    accelerator.backward(out["loss"])
                    if accelerator.sync_gradients:
                        grad_norm = torch.as_tensor(accelerator.clip_grad_norm_(head.parameters(), t.max_grad_norm))
                        _check_finite(reduce, grad_norm.detach().float(), state["step"], "gradient norm", last_saved)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                tokens = int(batch["attention_mask"].sum())
                window.add(out, tokens, kind)
                unsettled_tokens += tokens
            scheduler.step()
            window.sums["seconds"] += time.time() - step_started
            state["step"] += 1
            step = state["step"]
            state["elapsed_seconds"] = start_elapsed + time.time() - start_time
            over_budget = t.max_minutes is not None and state["elapsed_seconds"] > 60 * t.max_minutes
            if t.schedule_clock == "minutes":  # processes' clocks differ by ms: all use their mean
                clock["elapsed"] = float(reduce(torch.tensor(state["elapsed_seconds"], device=device))) / world
            over_budget = bool(reduce(torch.tensor(float(over_budget), device=device)) > 0)
            last = step >= t.max_steps or over_budget
            if step % t.log_every == 0 or last:
                metrics = window.flush(reduce, device, world)
                metrics.pop("tokens")  # the window's count, for tokens/s; the run's total is settled below
                settle_tokens()
                metrics.update({"train/lr": scheduler.get_last_lr()[-1], "train/grad_norm": float(grad_norm),
                                "train/tokens_seen": state["tokens"], **gpu_memory_metrics(device)})
                if main:
                    logger.log(step, metrics)
                    bar.set_postfix(loss=f"{metrics['train/loss']:.4g}", tok_s=f"{metrics['train/tokens_per_s']:.0f}")
            bar.update(1)
            eval_metrics = None
            if step % t.eval_every == 0 or last:
                eval_metrics = evaluate_and_track(step)
                last_eval_step = step
            if step % t.save_every == 0 or last or (eval_metrics is not None and best_step == step):
                save(step, eval_metrics)
            if over_budget and step < t.max_steps:
                stopped = "max_minutes"
                break
        if last_eval_step != state["step"]:
            state["last_eval"] = score_held_out()
        best = root / f"step-{best_step:08d}" if best_step is not None else None
        result = TrainResult(run_dir=run_dir, head_type=kind.name, steps=state["step"], stopped=stopped,
                             last_checkpoint=last_saved, best_checkpoint=best,
                             best_eval=(state["best"] or {}), final_eval=state["last_eval"],
                             mixed_precision=precision)
        if main:
            logger.summary({**result.final_eval, "best_step": best_step})
            (run_dir / "result.json").write_text(json.dumps(dataclasses.asdict(result), indent=1, default=str))
            logger.log_checkpoint(result.best_checkpoint or result.last_checkpoint, job.recipe)
    finally:
        bar.close()
        if logger is not None:
            logger.close()
    return result


def _check_finite(reduce, value: torch.Tensor, step: int, what: str, last_saved) -> None:
    bad = reduce((~torch.isfinite(value)).float().reshape(1))
    if bool(bad.item() > 0):
        raise TrainingDiverged(
            f"non-finite {what} at step {step + 1}; stopping. The last good checkpoint is "
            f"{last_saved or 'none (no checkpoint saved yet)'}: lower trainer.learning_rate or "
            f"trainer.max_grad_norm, check the data, then resume from it.")


def _short(metrics: dict) -> str:
    return ", ".join(f"{k.split('/')[-1]}={v:.3f}" for k, v in metrics.items() if "top1" in k or "accept" in k)


class _Window:
    """Sums of per-step figures between two log lines: the kind's figures averaged over
    micro-steps, its (hits, positions) pairs as rates."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.sums: dict[str, float] = {"seconds": 0.0}

    def add(self, out: dict, tokens: int, kind: HeadKind) -> None:
        means, rates = kind.figures(out)
        figures = {"loss": float(out["loss"].detach()), "micro_steps": 1.0, "tokens": float(tokens)}
        figures.update({f"mean:{name}": value for name, value in means.items()})
        for name, (hits, positions) in rates.items():
            figures.update({f"hits:{name}": hits, f"positions:{name}": positions})
        for key, value in figures.items():
            self.sums[key] = self.sums.get(key, 0.0) + value

    def flush(self, reduce, device, world: int) -> dict:
        keys = sorted(self.sums)
        totals = dict(zip(keys, reduce(torch.tensor([self.sums[k] for k in keys], device=device)).tolist()))
        seconds = max(totals.pop("seconds") / world, 1e-9)  # mean wall time of the steps, eval excluded
        micro = totals.pop("micro_steps")
        metrics = {"tokens": totals["tokens"], "train/tokens_per_s": totals.pop("tokens") / seconds,
                   "train/loss": totals.pop("loss") / micro}
        for key, value in totals.items():
            what, _, name = key.partition(":")
            if what == "mean":
                metrics[f"train/{name}"] = value / micro
            elif what == "hits":
                metrics[f"train/{name}"] = value / max(totals[f"positions:{name}"], 1.0)
        self.reset()
        return metrics
