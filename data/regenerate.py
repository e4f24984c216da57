"""Self-distillation: rewrite every assistant turn with the target's own reply.

Heads learn to predict the target, so training text the target would have written raises
acceptance (only ~62% of ShareGPT next tokens are SmolLM2's greedy choice). Conversations are
taken in batches; turn by turn, each pending assistant turn is replaced by what the target
generates for the conversation so far (with the earlier turns already regenerated).

Output: ShareGPT-style JSONL shards `regenerated-00000.jsonl` (`{"id", "conversations": [{"from",
"value"}]}`), each written to a temporary name and renamed, so an interrupted run resumes at the
first missing shard; rank r of W writes shards r, r+W, ...; `merge_shards` concatenates them into
`regenerated.jsonl`, which `data.source` can point to. Each shard has a sidecar
`regenerated-00000.jsonl.key` naming what it was made from (its records' ids and the generation
settings); a shard whose key does not match the current job (other settings, another target), or
that has no key, is written again instead of being reused. A job's last shard that holds fewer
records than a whole shard is named for its count (`regenerated-00001-first128.jsonl`): a job asking
for fewer records reads or writes that file, never the complete shard a larger job made. Shards
made elsewhere (`data.regenerate.reuse_from`, e.g. the corpus shipped in data/corpora/) are copied
in where their keys are this job's.

The generator is a callable so the caller can pass the fast runtime (eval.runtime.generate) without data/
importing eval/; `hf_generate_fn` wraps transformers' `generate`.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable, Sequence

import torch

from data.config import RegenerateConfig
from data.template import TemplateMismatch, prompt_ids

log = logging.getLogger(__name__)

# (prompts as token-id lists, max_new_tokens, temperature) -> generated token ids per prompt,
# without the prompt and cut after the end-of-turn token.
GenerateFn = Callable[[list[list[int]], int, float], list[list[int]]]
_FROM = {"system": "system", "user": "human", "assistant": "gpt"}


def hf_generate_fn(model, pad_id: int, eos_ids: Sequence[int]) -> GenerateFn:
    """Batched transformers `generate` (left-padded prompts) as a GenerateFn."""
    eos = set(eos_ids)

    @torch.no_grad()
    def generate(prompts: list[list[int]], max_new_tokens: int, temperature: float) -> list[list[int]]:
        device = next(model.parameters()).device
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)  # (B, T) left-padded
        mask = torch.zeros_like(ids)
        for b, prompt in enumerate(prompts):
            ids[b, longest - len(prompt):] = torch.as_tensor(prompt)
            mask[b, longest - len(prompt):] = 1
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {"do_sample": False}
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             pad_token_id=pad_id, eos_token_id=sorted(eos) or None, **sampling)
        replies = []
        for row in out[:, longest:].tolist():
            end = next((i for i, token in enumerate(row) if token in eos), None)
            replies.append(row[:end + 1] if end is not None else row)
        return replies

    return generate


def shard_name(index: int, records: int | None = None, shard_size: int | None = None) -> str:
    """A shard's file name. A job's last shard holding fewer records than `shard_size` (max_records
    not a multiple of it) has its own name, so it never replaces the complete shard that a job
    building a larger corpus in the same folder wrote there."""
    if records is not None and shard_size is not None and records < shard_size:
        return f"regenerated-{index:05d}-first{records}.jsonl"
    return f"regenerated-{index:05d}.jsonl"


def shard_names(num_records: int, shard_size: int) -> list[str]:
    """The shards that hold the first `num_records` records, in order."""
    count = -(-num_records // shard_size)
    return [shard_name(s, min(shard_size, num_records - s * shard_size), shard_size) for s in range(count)]


def _turn_limit(messages: list[dict], max_turns: int | None) -> int:
    """Length of the conversation kept: everything up to its max_turns-th assistant turn."""
    seen = 0
    for i, message in enumerate(messages):
        seen += message["role"] == "assistant"
        if max_turns is not None and seen == max_turns:
            return i + 1
    return len(messages)


def _regenerate_batch(records: list[dict], tokenizer, generate_fn: GenerateFn, config: RegenerateConfig,
                      max_prompt_tokens: int, on_replies: Callable[[int], None] = lambda n: None) -> list[dict]:
    """Regenerate a shard's records turn by turn; each round's prompts go to `generate_fn` in
    batches of config.batch_size, sorted by length. on_replies(n): n replies written."""
    conversations = [[dict(m) for m in r["messages"]] for r in records]
    cut = [_turn_limit(c, config.max_turns) for c in conversations]  # conversations end here
    position = [0] * len(records)
    while True:
        pending = []
        for b, messages in enumerate(conversations):
            while position[b] < cut[b] and messages[position[b]]["role"] != "assistant":
                position[b] += 1
            if position[b] < cut[b]:
                pending.append(b)
        if not pending:
            break
        prompts, asked = [], []
        for b in pending:
            try:
                prompt = prompt_ids(tokenizer, conversations[b][:position[b]])
            except TemplateMismatch:
                prompt = []
            if not prompt or len(prompt) + config.max_new_tokens > max_prompt_tokens:
                cut[b] = position[b]  # keep the conversation up to here
                continue
            prompts.append(prompt)
            asked.append(b)
        # Similar lengths side by side: a left-padded batch computes every row to its longest prompt.
        order = sorted(range(len(prompts)), key=lambda j: len(prompts[j]))
        prompts, asked = [prompts[j] for j in order], [asked[j] for j in order]
        # A generator that batches itself (continuous batching) takes the whole round at once.
        step = (len(prompts) or 1) if getattr(generate_fn, "batches_itself", False) else config.batch_size
        for start in range(0, len(prompts), step):
            replies = generate_fn(prompts[start:start + step], config.max_new_tokens, config.temperature)
            for b, reply in zip(asked[start:start + step], replies):
                conversations[b][position[b]]["content"] = tokenizer.decode(reply, skip_special_tokens=True).strip()
                position[b] += 1
            on_replies(len(replies))
    out = []
    for record, messages, end in zip(records, conversations, cut):
        kept = messages[:end]
        while kept and kept[-1]["role"] != "assistant":  # a question left without its reply
            kept.pop()
        if kept:
            out.append({"id": record["id"], "conversations": [{"from": _FROM[m["role"]], "value": m["content"]}
                                                              for m in kept]})
    return out


def shard_key(records: Sequence[dict], config: RegenerateConfig, max_prompt_tokens: int, seed: int,
              target_identity: dict | None = None, dtype: str = "float32") -> str:
    """What a shard is made from: its records' ids, in order, the target that wrote the replies
    (`target_identity`: its fingerprint and tokenizer hash), the dtype it computed in, and every
    sampling setting that changes them (a digest, written beside the shard)."""
    # Greedy replies do not depend on the seed: it is keyed as 0 there, so a training run with another
    # trainer.seed reuses a greedy corpus instead of writing it again.
    settings = {"temperature": config.temperature, "max_new_tokens": config.max_new_tokens,
                "max_turns": config.max_turns, "max_prompt_tokens": max_prompt_tokens,
                "seed": seed if config.temperature > 0 else 0,
                "sampling": "top_k=0, top_p=1" if config.temperature > 0 else "greedy",
                "target": target_identity or {}}
    if dtype != "float32":  # fp32 keys stay those of shards written before the dtype was chosen
        settings["dtype"] = dtype
    payload = json.dumps({"ids": [str(r["id"]) for r in records], "settings": settings}, sort_keys=True)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:32]


def _shard_done(output_dir: Path, name: str, keys: Sequence[str]) -> bool:
    """A shard can be reused when it exists and its key is one of `keys` (the job's own first). A
    shard without a key (from before keys existed, or whose key was removed) was made by an unknown
    target with unknown settings: written again, like a mismatch."""
    shard = output_dir / name
    if not shard.is_file():
        return False
    key_file = shard.with_name(shard.name + ".key")
    if key_file.is_file() and key_file.read_text(encoding="utf-8").strip() in keys:
        return True
    why = "has no key file (unknown target and settings)" if not key_file.is_file() else \
        "was made from other records, settings or another target than this job's"
    log.warning("regenerate: %s %s; writing it again", shard, why)
    return False


def _reuse_folder(location: str) -> Path:
    path = Path(location).expanduser()
    if not path.is_absolute() and not path.exists():
        path = Path(__file__).resolve().parent.parent / path
    if not path.is_dir():
        raise FileNotFoundError(f"data.regenerate.reuse_from: {location} is not a folder")
    return path


def _reuse_shard(source: Path, output_dir: Path, name: str, key: str) -> bool:
    """Copy shard `name` from `source` (plain or gzipped) into output_dir when source's key for it
    is `key`; whether it did."""
    key_file = source / f"{name}.key"
    plain, packed = source / name, source / f"{name}.gz"
    if not key_file.is_file() or not (plain.is_file() or packed.is_file()):
        return False
    if key_file.read_text(encoding="utf-8").strip() != key:
        log.info("regenerate: %s was made by another target, dtype or settings than this job's; not reused", key_file)
        return False
    with gzip.open(packed, "rb") if packed.is_file() else open(plain, "rb") as read:
        _install_shard(output_dir, name, key, lambda write: shutil.copyfileobj(read, write))
    return True


def _reuse_shard_in_any(source: Path, output_dir: Path, name: str, keys: dict[str, str]) -> str | None:
    """Copy shard `name` from `source` under the first of `keys` ({dtype: key}) that source holds
    for it; the dtype it was made in, None where none matched."""
    return next((dtype for dtype, key in keys.items() if _reuse_shard(source, output_dir, name, key)), None)


def _install_shard(output_dir: Path, name: str, key: str, fill: Callable) -> None:
    """Write shard `name` (fill(binary handle) writes its bytes) and its key, each under a
    temporary name and renamed, the key first: a shard is never on disk beside a stale key."""
    tmp = output_dir / f".{name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as handle:
        fill(handle)
    key_tmp = output_dir / f".{name}.key.tmp-{os.getpid()}"
    key_tmp.write_text(key + "\n", encoding="utf-8")
    os.replace(key_tmp, output_dir / f"{name}.key")
    os.replace(tmp, output_dir / name)


def regenerate(records: Sequence[dict], tokenizer, generate_fn: GenerateFn, output_dir: str | os.PathLike,
               config: RegenerateConfig, max_prompt_tokens: int = 2048, rank: int = 0, world_size: int = 1,
               seed: int = 0, progress: bool = True, target_identity: dict | None = None,
               dtype: str = "float32") -> dict:
    """Regenerate the assistant turns of normalised records (`{"id", "messages": [{"role",
    "content"}]}`) into this rank's missing shards of `output_dir`. A conversation stops before a
    turn whose prompt plus max_new_tokens exceeds max_prompt_tokens (dropped if no reply is left).
    Sampling is seeded per shard, so a resumed run writes what an uninterrupted one would; shards
    written by another target (`target_identity`) or other settings are written again; with
    config.reuse_from, a missing shard whose key that folder holds is copied from there.
    Returns {"written": [...], "skipped": [...]}; call `merge_shards` after every rank is done."""
    from tqdm.auto import tqdm

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    size = config.shard_size
    shards = range(rank, -(-len(records) // size), world_size)
    # Each shard's key per dtype it may hold, the job's own first: the others are those of
    # config.reuse_dtypes, accepted only where the job reuses shards made elsewhere.
    dtypes = [dtype, *(d for d in dict.fromkeys(config.reuse_dtypes) if d != dtype and config.reuse_from)]
    accepted = {s: {d: shard_key(records[s * size:(s + 1) * size], config, max_prompt_tokens, seed, target_identity, d)
                    for d in dtypes} for s in shards}
    keys = {s: accepted[s][dtype] for s in shards}
    names = shard_names(len(records), size)
    missing = [s for s in shards if not _shard_done(output_dir, names[s], list(accepted[s].values()))]
    if config.reuse_from and missing:
        source = _reuse_folder(config.reuse_from)
        copied = {s: _reuse_shard_in_any(source, output_dir, names[s], accepted[s]) for s in missing}
        reused = {s: made_in for s, made_in in copied.items() if made_in is not None}
        if reused:
            log.info("regenerate: %d shard(s) copied from %s", len(reused), source)
        foreign = sorted(s for s, d in reused.items() if d != dtype)
        if foreign:
            log.warning("regenerate: shard(s) %s hold replies the target computed in %s, not this job's %s "
                        "(data.regenerate.reuse_dtypes)", foreign, sorted({reused[s] for s in foreign}), dtype)
        missing = [s for s in missing if s not in reused]
    turns = {s: sum(m["role"] == "assistant" for r in records[s * size:(s + 1) * size]
                    for m in r["messages"][:_turn_limit(r["messages"], config.max_turns)]) for s in missing}
    log.info("regenerate: %d of %d shard(s) to write on rank %d (%d assistant turns), temperature %g, "
             "max %d new tokens", len(missing), len(shards), rank, sum(turns.values()), config.temperature,
             config.max_new_tokens)
    bar = tqdm(total=sum(turns.values()), desc=f"regenerate rank {rank}", unit="reply", disable=not progress)
    written = []
    try:
        for s in missing:
            torch.manual_seed(seed + s)
            done = bar.n
            shard = records[s * size:(s + 1) * size]
            rows = _regenerate_batch(shard, tokenizer, generate_fn, config, max_prompt_tokens, bar.update)
            bar.update(turns[s] - (bar.n - done))  # turns cut for length count as done
            if len(rows) < len(shard):
                log.info("regenerate: shard %d keeps %d of %d conversations; the others have no reply left "
                         "(a first prompt longer than %d - %d new tokens, or a template mismatch)",
                         s, len(rows), len(shard), max_prompt_tokens, config.max_new_tokens)
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
            _install_shard(output_dir, names[s], keys[s], lambda handle: handle.write(text.encode("utf-8")))
            written.append(s)
    finally:
        bar.close()
    return {"written": written, "skipped": [s for s in shards if s not in written]}


def shard_dtypes(records: Sequence[dict], output_dir: str | os.PathLike, config: RegenerateConfig, dtypes: Sequence[str],
                 max_prompt_tokens: int = 2048, seed: int = 0, target_identity: dict | None = None) -> dict[str, int]:
    """How many of output_dir's shards hold replies the target computed in each of `dtypes`, read
    from their keys (a shard whose key matches none counts under "unknown"): what a job trained on,
    for its manifest, where shards made in another dtype were reused (config.reuse_dtypes)."""
    output_dir, size = Path(output_dir), config.shard_size
    counts: dict[str, int] = {}
    for s, name in enumerate(shard_names(len(records), size)):
        key_file = output_dir / f"{name}.key"
        held = key_file.read_text(encoding="utf-8").strip() if key_file.is_file() else None
        made_in = next((d for d in dict.fromkeys(dtypes) if held == shard_key(
            records[s * size:(s + 1) * size], config, max_prompt_tokens, seed, target_identity, d)), "unknown")
        counts[made_in] = counts.get(made_in, 0) + 1
    return counts


def merge_shards(output_dir: str | os.PathLike, num_records: int, shard_size: int) -> Path:
    """Concatenate every shard, in order, into output_dir/regenerated.jsonl (atomically)."""
    output_dir = Path(output_dir)
    names = shard_names(num_records, shard_size)
    missing = [name for name in names if not (output_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{output_dir}: shards not written yet: {missing[:5]}")
    target = output_dir / "regenerated.jsonl"
    tmp = output_dir / f".regenerated.jsonl.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as out:
        for name in names:
            out.write((output_dir / name).read_text(encoding="utf-8"))
    os.replace(tmp, target)
    return target
