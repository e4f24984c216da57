"""Self-distillation: the target rewrites the assistant turns of the training data, so the head
learns the target's own continuations rather than another model's replies.

`regenerate_data(job, target, generate_fn=None)` regenerates `data.source` (data/regenerate.py does
the work, sharded and resumable) and returns the ShareGPT JSONL that `data.source` then points to.
The orchestrator (train/pipeline.py) may pass the lean runtime's generator (library modules of
train/ do not import eval/); the default is transformers' `generate`. Under torchrun every rank
writes its own shards and rank 0 merges them.
"""
from __future__ import annotations

from pathlib import Path

from train.offline import rank_world, wait_for


def eos_ids(target) -> list[int]:
    eos = getattr(target.model.generation_config, "eos_token_id", None) or target.config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def target_identity(target) -> dict:
    """What identifies the target's replies: its weights' fingerprint and its tokenizer."""
    tokenizer = target.tokenizer_hash() if target.tokenizer is not None else None
    return {"fingerprint": target.fingerprint()["id"], "tokenizer": tokenizer}


def job_records(job) -> list[dict]:
    """The records the job's regenerate stage rewrites: the first data.max_records of data.source."""
    from data.sources import load_conversations

    conversations, _ = load_conversations(job.data)
    limit = job.data.max_records or len(conversations)
    return [conversations[i] for i in range(min(limit, len(conversations)))]


def shard_keys(job, target, dtype: str) -> dict[str, str]:
    """The key of every shard job's regenerate stage writes, by shard file name, for the target's
    replies computed in `dtype` (what a shipped corpus must hold to be reused by the job)."""
    from data.regenerate import shard_key, shard_names

    config = job.data.regenerate
    records = job_records(job)
    size = config.shard_size
    return {name: shard_key(records[s * size:(s + 1) * size], config, job.data.max_length, job.trainer.seed,
                            target_identity(target), dtype)
            for s, name in enumerate(shard_names(len(records), size))}


def regenerate_data(job, target, generate_fn=None) -> Path:
    """Self-distillation stage: regenerate the assistant turns of `data.source` with the target into
    data.regenerate.output_dir (default <run_dir>/regenerated); returns regenerated.jsonl, for
    `data.source`. Resumes at the first missing shard."""
    from data.regenerate import hf_generate_fn, merge_shards, regenerate, shard_names

    config = job.data.regenerate
    directory = Path(config.output_dir or Path(job.trainer.output_dir) / "regenerated")
    records = job_records(job)
    if generate_fn is None:
        pad = target.config.pad_token_id if target.config.pad_token_id is not None else 0
        generate_fn = hf_generate_fn(target.model, pad, eos_ids(target))
    rank, world = rank_world()
    regenerate(records, target.tokenizer, generate_fn, directory, config, max_prompt_tokens=job.data.max_length,
               rank=rank, world_size=world, seed=job.trainer.seed, target_identity=target_identity(target),
               dtype=str(target.dtype).removeprefix("torch."))
    wait_for([directory / name for name in shard_names(len(records), config.shard_size)], "regenerated shards")
    merged = directory / "regenerated.jsonl"
    if rank == 0:
        merge_shards(directory, len(records), config.shard_size)
    wait_for([merged], "merged regenerated data")
    return merged


def regenerated_dtypes(job, target) -> dict[str, int]:
    """How many of the job's regenerated shards hold replies computed in each dtype: the target's
    own, or one of data.regenerate.reuse_dtypes where shards made elsewhere were reused."""
    from data.regenerate import shard_dtypes

    config = job.data.regenerate
    own = str(target.dtype).removeprefix("torch.")
    directory = Path(config.output_dir or Path(job.trainer.output_dir) / "regenerated")
    return shard_dtypes(job_records(job), directory, config, [own, *config.reuse_dtypes],
                        max_prompt_tokens=job.data.max_length, seed=job.trainer.seed,
                        target_identity=target_identity(target))


def describe_regenerated(job, dtypes: dict[str, int] | None = None) -> str:
    """What a self-distilled training set is, for manifests: its prompts' source and how the
    replies were made (`dtypes`: shards per dtype the target computed the replies in)."""
    config = job.data.regenerate
    turns = ("every assistant turn" if config.max_turns is None else "the first assistant turn"
             if config.max_turns == 1 else f"the first {config.max_turns} assistant turns")
    how = "greedy" if config.temperature == 0 else f"sampled at temperature {config.temperature}"
    limit = "" if job.data.max_records is None else f" of the first {job.data.max_records} conversations"
    computed = ""
    if dtypes:
        total = sum(dtypes.values())
        computed = "; computed in " + " and ".join(
            dtype if count == total else f"{dtype} ({count} of {total} shards)" for dtype, count in dtypes.items())
    return (f"{job.data.source}: {turns}{limit} regenerated by the target itself ({how}, at most "
            f"{config.max_new_tokens} new tokens each{computed}; self-distillation)")
