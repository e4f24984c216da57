"""Runs the stages of one job in order: data -> [regenerate] -> [features] -> train -> eval -> export.

Each stage reads what the previous one wrote to the run folder (`trainer.output_dir`), so a job
that stopped can be run again with the stages it still needs (`stages=[eval,export]`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import torch

from eval.config import wandb_mode
from heads.recommended import RecommendedRuntime
from heads.target import FrozenTarget, load_target
from train.config import LoggerConfig
from train.job import ConfigError, JobConfig
from train.metrics import declare_inputs, log_lineage_artifact, stage_run

log = logging.getLogger(__name__)
NO_LOGGER = LoggerConfig(kind="none")  # processes other than the main one log nothing


def hardware() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}"
    from eval.timing import cpu_hardware

    return cpu_hardware()


def check_arch(job: JobConfig, target: FrozenTarget) -> None:
    """The recipe's architecture numbers (used for planning) must describe the model we loaded."""
    loaded = {
        "hidden_size": target.hidden_size, "num_hidden_layers": target.num_layers,
        "num_attention_heads": target.config.num_attention_heads,
        "num_key_value_heads": getattr(target.config, "num_key_value_heads", target.config.num_attention_heads),
        "intermediate_size": getattr(target.config, "intermediate_size", None), "vocab_size": target.vocab_size,
    }
    for key, value in loaded.items():
        expected = getattr(job.model.arch, key)
        if expected is not None and value is not None and expected != value:
            raise ConfigError(f"model.arch.{key}={expected} but the loaded target {target.name} has {value}")
    if job.heads.hidden_size is not None and job.heads.hidden_size != target.hidden_size:
        raise ConfigError(f"heads.hidden_size={job.heads.hidden_size} differs from the target's {target.hidden_size}")


def load_job_target(job: JobConfig) -> FrozenTarget:
    """The target as this process's stages need it: only its embedding, final norm and lm_head
    (+ EAGLE's init layers) when training reads a finished feature cache, else the whole model,
    split over this process's GPU group when one GPU cannot hold it."""
    from heads.target_parts import load_target_parts
    from train.offline import parts_only_layers
    from train.placement import placed_target_config, rank_device

    layers = parts_only_layers(job)
    if layers is not None:
        return load_target_parts(rank_device(job.model), layers)
    return load_target(placed_target_config(job))


def _write_json(path: Path, values: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(values, indent=2, default=str))
    tmp.replace(path)


def run_job(job: JobConfig) -> dict:
    """Run the configured stages; returns a summary (also written to <run_dir>/job_summary.json).
    The main process holds the run folder's lock meanwhile (train/run_lock.py): a second job into
    the same folder is refused, naming this one's pid."""
    if job.trainer.dry_run:
        from train.plan import format_plan, make_plan

        print(format_plan(make_plan(job)))
        return {"dry_run": True}
    if not _main_process():  # the other processes of a launch write within the main one's lock
        return _run_stages(job)
    from train.run_lock import run_folder_lock

    with run_folder_lock(job.trainer.output_dir):
        return _run_stages(job)


def _run_stages(job: JobConfig) -> dict:
    run_dir = Path(job.trainer.output_dir)
    started = time.time()
    earlier = _earlier_summary(run_dir)
    log.info("job %s: stages %s, run folder %s", job.recipe, job.stages, run_dir)
    if job.logger.kind == "wandb":  # WANDB_MODE may override logger.mode: said once, here
        job = dataclasses.replace(job, logger=dataclasses.replace(job.logger, mode=wandb_mode(job.logger.mode)))
    if "eval" in job.stages:
        from eval.out_folder import check_out_folder

        check_out_folder(run_dir / "eval", written=_eval_files(earlier),  # a user's files there: refused now
                         advice="move them out of it, or the run folder away (trainer.output_dir)")
    target = load_job_target(job)
    check_arch(job, target)
    summary: dict = {"recipe": job.recipe, "target": target.name, "fingerprint": target.fingerprint(),
                     "hardware": hardware()}
    loaded_dtype = target.dtype
    if {"regenerate", "data", "train", "features"} & set(job.stages) or job.data.regenerate.enabled:
        summary["target_dtype"] = frozen_target_dtype(job, target).to_dict()

    if "regenerate" in job.stages or job.data.regenerate.enabled:
        job, regenerated, data_source = on_regenerated_data(job, target)
        summary["regenerated"] = str(regenerated)
    else:
        data_source = job.data.source if job.data.max_records is None else \
            f"{job.data.source}, data.max_records={job.data.max_records}"

    prepared = None
    if {"data", "train", "features"} & set(job.stages):
        from data.pipeline import prepare_data, write_data_stats

        prepared = prepare_data(job.data, target.tokenizer)
        if "train" in job.stages:
            _check_resume(job, target, prepared)  # a refused resume leaves the run folder's data_stats.json
        write_data_stats(run_dir, prepared.stats)
        summary["data"] = prepared.stats
        _log_dataset(job, run_dir, data_source)

    if "eval" in job.stages and {"data", "train", "features"} & set(job.stages):
        _check_eval_prompts(job, target)  # before any training time is spent

    source = None
    if job.data.mode == "offline" and {"train", "features"} & set(job.stages):
        from train.offline import offline_source

        source = offline_source(job, target, prepared)

    if "train" in job.stages:
        from train.loop import train_heads

        # read before training: a newer head written to the init_from path while this one trains
        # (a release head replaced by its successor) must not be recorded as this run's start
        origin = started_from(job.trainer.init_from)
        result = train_heads(job, target, prepared, source=source)
        summary["train"] = {"steps": result.steps, "stopped": result.stopped, "best_eval": result.best_eval,
                            "hardware": hardware(), "recipe": job.recipe, "data_source": data_source,
                            "final_eval": result.final_eval, "target_dtype": summary.get("target_dtype"),
                            "mixed_precision": result.mixed_precision,
                            "best_checkpoint": str(result.best_checkpoint or result.last_checkpoint),
                            "started_from": origin}
        checkpoint = result.best_checkpoint or result.last_checkpoint
        if int(os.environ.get("RANK", "0")) == 0:  # a later stage that fails keeps the training figures
            _write_json(run_dir / "job_summary.json", {**earlier, **summary})
    else:  # the run's own head first: the later stages of a run that started from another head export what it trained
        checkpoint = _latest_checkpoint(run_dir) or (Path(job.trainer.init_from) if job.trainer.init_from else None)
    if {"eval", "export"} & set(job.stages):
        from train.distributed import run_on_main_process

        if checkpoint is None:
            raise FileNotFoundError(f"no trained head found under {run_dir} (run the train stage first)")
        stages = [s for s in ("eval", "export") if s in job.stages]
        if target.dtype != loaded_dtype:  # the runtime chooses its own dtype from the target as loaded
            target = load_job_target(job)
        summary.update(run_on_main_process(
            lambda: _eval_and_export(job, target, checkpoint, run_dir, prepared, {**earlier, **summary}),
            what=" and ".join(stages)))

    summary["wall_seconds"] = round(time.time() - started, 1)  # this run's stages
    summary["stages"] = list(job.stages)
    if "train" in job.stages:  # the job that trained the head, end to end; a later eval-only run keeps it
        summary["job_seconds"] = summary["wall_seconds"]
    if int(os.environ.get("RANK", "0")) == 0:
        _write_json(run_dir / "job_summary.json", {**earlier, **summary})
        print(_final_lines(summary))
    return summary


def frozen_target_dtype(job: JobConfig, target: FrozenTarget):
    """The dtype the frozen target's forwards compute in for self-distillation and the feature pass
    (heads/dtypes.py, the rule `runtime.dtype=auto` follows): with model.dtype=auto on a CPU, fp32
    or bf16 by this CPU's instructions and a measured forward, the target cast in place when bf16
    wins; any other setting or device keeps the dtype it was loaded in. The head trains in fp32."""
    from heads.dtypes import DtypeChoice, choose_cpu_dtype

    loaded = str(target.dtype).removeprefix("torch.")
    if (job.model.dtype != "auto" or target.device.type != "cpu" or target.is_split or target.loaded_in_parts
            or target.dtype != torch.float32):
        return DtypeChoice(loaded, f"as loaded (model.dtype={job.model.dtype}, {target.device.type})")
    choice = choose_cpu_dtype(target.model)
    if choice.dtype == "bfloat16":
        target.model.to(torch.bfloat16)
    log.info("frozen target computes in %s: %s", choice.dtype, choice.reason)
    return choice


def on_regenerated_data(job: JobConfig, target: FrozenTarget) -> tuple[JobConfig, Path, str]:
    """Self-distillation: the target's replies regenerated (or found, shard by shard), and the job
    reading them. Returns (that job, the regenerated JSONL, a description of the data for lineage)."""
    from train.selfdistill import describe_regenerated, regenerate_data, regenerated_dtypes

    regenerated = regenerate_data(job, target, _regenerator(job, target))
    made_in = regenerated_dtypes(job, target)
    if set(made_in) != {str(target.dtype).removeprefix("torch.")}:
        log.warning("the regenerated replies were not all computed in the target's dtype: %s (shards per dtype)",
                    made_in)
    data = dataclasses.replace(job.data, source=str(regenerated), format="jsonl")
    return dataclasses.replace(job, data=data), regenerated, describe_regenerated(job, made_in)


def _check_resume(job: JobConfig, target: FrozenTarget, prepared) -> None:
    """The training loop's resume refusals (train.checkpoint.find_resume), before this job writes
    anything into a run folder that holds another run's checkpoints."""
    from train.checkpoint import check_resume
    from train.distributed import launched_world_size
    from train.run_identity import run_identity

    identity = run_identity(job, target, prepared.train, launched_world_size())
    check_resume(job.trainer.resume, Path(job.trainer.output_dir) / "checkpoints", identity)


def _check_eval_prompts(job: JobConfig, target: FrozenTarget) -> None:
    """Refuse a job whose eval stage would find no prompt, before it trains (a prompts file with
    a bad line is named by its reader here too)."""
    from eval.stage import eval_prompt_ids

    if not eval_prompt_ids(dataclasses.replace(job.runtime, num_prompts=1), job.data, target.tokenizer):
        raise ValueError(
            f"the eval stage would have no prompt: the held-out side of {job.data.source} (data.eval_fraction="
            f"{job.data.eval_fraction}, data.split_seed={job.data.split_seed}) holds no conversation whose prompt "
            f"fits runtime.max_prompt_tokens={job.runtime.max_prompt_tokens}; raise data.eval_fraction, give "
            "runtime.prompts_file, or leave eval out of stages")


def _eval_and_export(job: JobConfig, target: FrozenTarget, checkpoint: Path, run_dir: Path, prepared,
                     known: dict) -> dict:
    """The eval and export stages (one process runs them: train.distributed.run_on_main_process);
    returns their part of the summary. `known`: the summary so far, an earlier run's included."""
    from eval.stage import load_eval_head, run_eval_stage

    head, head_config = load_eval_head(checkpoint, target)
    summary: dict = {}
    if "eval" in job.stages:
        with stage_run(job.logger, run_dir, "eval") as run:
            declare_inputs(run, run_dir, ("checkpoint",))
            summary["eval"] = run_eval_stage(target, job.runtime, job.data, run_dir / "eval", head, head_config)

    if "export" in job.stages:
        from export.writer import export_all
        from train.checkpoint import read_state, trained_data

        known = {**known, **summary}  # an export-only re-run keeps the training run's figures
        trained = trained_data(checkpoint)
        scored = (read_state(checkpoint) or {}).get("eval") or None  # what this checkpoint scored when saved
        if trained is None:
            log.warning("%s records no size of the data it trained on (not a checkpoint, or saved by an older "
                        "specheads): the manifest leaves train_records and train_tokens empty", checkpoint)
        extra = {"training": _training_figures(known, trained, scored), "eval": _eval_figures(known)}
        runtime = (known.get("eval") or {}).get("recommended_runtime")
        if runtime:
            extra["runtime"] = RecommendedRuntime.from_dict(runtime)
        out_root = Path(job.export.out) if job.export.out else run_dir / "export"
        paths = export_all(head, head_config, job.export.formats, out_root, target, job.export.dtype,
                           job.export.native_dtype, extra, job.export.strict_fingerprint, job.export.overwrite)
        summary["export"] = {fmt: str(path) for fmt, path in paths.items()}
        with stage_run(job.logger, run_dir, "export") as run:
            for fmt, path in paths.items():
                log.info("exported %s -> %s", fmt, path)
                log_lineage_artifact(run, run_dir, f"export/{fmt}", f"{job.recipe}-{fmt}", "export",
                                     folders={fmt: path}, metadata={"format": fmt, "path": str(path)},
                                     inputs=("checkpoint",))
    return summary


def _main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _log_dataset(job: JobConfig, run_dir: Path, description: str) -> None:
    """The training data as the job's first W&B artifact (its source file by reference, when local)."""
    with stage_run(job.logger if _main_process() else NO_LOGGER, run_dir, "data") as run:
        source = Path(job.data.source)
        log_lineage_artifact(run, run_dir, "dataset", f"{job.recipe}-data", "dataset",
                             folders={source.name: source} if source.exists() else None,
                             files=[run_dir / "data_stats.json"], metadata={"source": description})


def lean_generate_fn(target: FrozenTarget, max_seq_len: int, seed: int = 0, batch_size: int = 1):
    """Self-distillation with the project's own fast forward (Llama family; None for other
    architectures, which fall back to transformers' generate). batch_size 1: one prompt at a time;
    more: the runtime's batched decoder with continuous batching, so a finished reply's slot takes
    the next prompt at once instead of waiting for the batch's longest reply as a static batch does.
    Greedy replies are the target's greedy replies; sampled ones draw from one generator per reply,
    seeded from torch's global RNG (which data/regenerate.py seeds per shard)."""
    from eval.runtime.batch_generate import BatchDecoder
    from eval.runtime.generate import plain_generate
    from eval.runtime.model import LeanLlama
    from eval.runtime.sampling import SamplingConfig

    try:
        lean = LeanLlama.from_hf(target.model, max_seq_len=max_seq_len)
    except (KeyError, ValueError, NotImplementedError) as error:
        log.info("lean forward unavailable for this target (%s); regenerating with transformers", error)
        return None
    eos = [i for i in {target.config.eos_token_id, target.tokenizer.eos_token_id} if isinstance(i, int)]
    generator = torch.Generator().manual_seed(seed)

    def one_at_a_time(prompts: list[list[int]], max_new_tokens: int, temperature: float) -> list[list[int]]:
        sampling = SamplingConfig(temperature=temperature)
        return [plain_generate(lean, torch.tensor(p, device=target.device), max_new_tokens, sampling, eos,
                               generator).tokens for p in prompts]

    def continuous(prompts: list[list[int]], max_new_tokens: int, temperature: float) -> list[list[int]]:
        if not prompts:
            return []
        sampling = SamplingConfig(temperature=temperature)
        longest = max(len(p) for p in prompts) + max_new_tokens + 1
        decoder = BatchDecoder(lean, min(batch_size, len(prompts)), sampling, eos, max_length=longest)
        results, waiting = [None] * len(prompts), list(range(len(prompts)))[::-1]
        while waiting or decoder.active:
            while waiting and decoder.free:
                index = waiting.pop()
                rng = None
                if temperature > 0:
                    rng = torch.Generator().manual_seed(int(torch.randint(0, 2**62, ()).item()))
                results[index] = decoder.join(torch.tensor(prompts[index], device=target.device), max_new_tokens,
                                              rng, index).result
            decoder.step()
        return [list(result.tokens) for result in results]

    if batch_size <= 1:
        return one_at_a_time
    continuous.batches_itself = True  # data/regenerate.py hands it a whole round, not batch_size slices
    return continuous


def _regenerator(job: JobConfig, target: FrozenTarget):
    """The generate function self-distillation uses (None: transformers' batched generate):
    data.regenerate.generator `lean`, `hf`, or `auto` = lean for Llama-family targets (the faster
    on the CPUs measured, scripts/bench_regenerate.py; one prompt at a time it always is)."""
    config = job.data.regenerate
    if config.generator == "hf" and config.batch_size > 1:
        return None
    return lean_generate_fn(target, job.data.max_length + config.max_new_tokens, job.trainer.seed,
                            config.batch_size)


def _latest_checkpoint(run_dir: Path) -> Path | None:
    from train.checkpoint import latest_valid_checkpoint

    root = run_dir / "checkpoints"
    result = run_dir / "result.json"
    if result.is_file():  # written by the training loop: its best (else last) checkpoint
        values = json.loads(result.read_text())
        for key in ("best_checkpoint", "last_checkpoint"):
            if values.get(key) and (Path(values[key]) / "head_config.json").is_file():
                return Path(values[key])
    return latest_valid_checkpoint(root) if root.is_dir() else None


def _earlier_summary(run_dir: Path) -> dict:
    """The stages an earlier run of this job folder recorded (job_summary.json), with the time of
    the job that trained its head, or {}."""
    path = run_dir / "job_summary.json"
    try:
        values = json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        return {}
    return {key: values[key] for key in ("data", "train", "eval", "job_seconds") if key in values}


def _eval_files(summary: dict) -> list[str]:
    """Names of the files an earlier eval stage of this job wrote, as its job summary lists them."""
    files = ((summary.get("eval") or {}).get("files") or {}).values()
    return [Path(path).name for path in files if isinstance(path, str)]


def _training_figures(summary: dict, trained: dict | None, scored: dict | None = None) -> dict:
    """The manifest's `training` section. `trained`: the size of the data the head trained on, from
    its checkpoint's run identity; the run folder's data stage may have prepared other data since.
    `scored`: the held-out figures the exported checkpoint recorded when it was saved (the best
    checkpoint is exported, and a later evaluation may have scored lower); else the last evaluation."""
    train = summary.get("train") or {}
    data = trained or {}
    return {"recipe": train.get("recipe", summary.get("recipe")), "data_source": train.get("data_source"),
            "steps": train.get("steps"), "held_out": scored or train.get("final_eval"), "best": train.get("best_eval"),
            "train_records": data.get("records"), "train_tokens": data.get("tokens"),
            "hardware": train.get("hardware", summary.get("hardware")),  # where the head was trained
            # the frozen target's dtype for regeneration and features (frozen_target_dtype's choice)
            "target_dtype": train.get("target_dtype", summary.get("target_dtype")),
            "mixed_precision": train.get("mixed_precision"),  # the head's steps (trainer.mixed_precision's choice)
            # a head trained on from another (trainer.init_from): steps counts this run's only
            "started_from": train.get("started_from")}


def started_from(source: str | None) -> dict | None:
    """What a trainer.init_from head had behind it: its path, and the steps and recipe its
    checkpoint state or export manifest records, with the sha256 of the weights an export's manifest
    lists, so the record still names the start after a newer head is written to the same path
    (None without init_from)."""
    if not source:
        return None
    from train.checkpoint import read_state

    out: dict = {"path": str(source)}
    state = read_state(source)
    if state is not None:
        out["steps"] = state.get("step")
        out["tokens"] = state.get("tokens")
        return out
    manifest = Path(source) / "specheads.json"
    if manifest.is_file():
        try:
            listing = json.loads(manifest.read_text())
        except json.JSONDecodeError:
            listing = {}
        training = listing.get("training") or {}
        out.update({key: training.get(key) for key in ("recipe", "steps", "started_from") if training.get(key)})
        weights = (listing.get("files") or {}).get(listing.get("weights_file") or "") or {}
        if weights.get("sha256"):
            out["weights_sha256"] = weights["sha256"]
    return out


def _eval_figures(summary: dict) -> dict:
    report = summary.get("eval") or {}
    # where the eval ran (its report's own record), not the job writing the manifest: an export-only
    # job on other threads or another machine would credit the figures to itself
    measured = (report.get("measured_on") or {}).get("hardware")
    figures = {"hardware": measured or summary.get("hardware"), "threads": report.get("threads")}
    for row in report.get("drafters", []):
        figures[row["name"]] = {key: row.get(key) for key in
                                ("tau", "tokens_per_second", "speedup_vs_plain", "speedup_vs_transformers")}
    if report.get("batch_sweep"):  # a batch-size sweep: per batch size, each drafter against plain
        figures["batch_sweep"] = {
            str(row["batch_size"]): {name: {key: f.get(key) for key in ("tau", "tokens_per_second", "speedup_vs_plain")}
                                     for name, f in row["methods"].items()} for row in report["batch_sweep"]["rows"]}
    return figures


def _final_lines(summary: dict) -> str:
    lines = [f"== {summary['recipe']} on {summary['hardware']} ({summary['wall_seconds']} s) =="]
    if "data" in summary:
        train = summary["data"].get("train", {})
        lines.append(f"data: {train.get('records')} training conversations, {train.get('tokens')} tokens")
    if "train" in summary:
        held = summary["train"].get("final_eval") or {}
        shown = {k.removeprefix("eval/"): round(v, 3) for k, v in held.items()
                 if isinstance(v, (int, float)) and ("top1" in k or "acceptance" in k)}
        lines.append(f"train: {summary['train']['steps']} steps ({summary['train']['stopped']}); held-out {shown}")
    for row in (summary.get("eval") or {}).get("drafters", []):
        lines.append(f"eval {row['name']}: tau {row.get('tau', float('nan')):.2f}, "
                     f"{row.get('speedup_vs_plain') or float('nan'):.2f}x plain, "
                     f"{row.get('speedup_vs_transformers') or float('nan'):.2f}x transformers generate")
    for row in ((summary.get("eval") or {}).get("batch_sweep") or {}).get("rows", []):
        lines.append(f"eval batch {row['batch_size']}: " + ", ".join(
            f"{name} tau {f['tau']:.2f}, {f['speedup_vs_plain']:.2f}x plain"
            for name, f in row["methods"].items() if f.get("speedup_vs_plain") is not None and f.get("tau")))
    if "export" in summary:
        lines.append("export: " + ", ".join(f"{k} -> {v}" for k, v in summary["export"].items()))
    return "\n".join(lines)
