"""The data stage: conversations -> split -> chat template + loss mask -> length handling ->
token statistics. `prepare_data` is what the training loop calls.

Rows of `PreparedData.train` / `.eval`: `id: str`, `input_ids: list[int]`, `loss_mask: list[int]`
(see data/template.py for the mask convention), plus `length`, `assistant_tokens`, `truncated`.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from data.config import OVERFLOW_MODES, DataConfig
from data.sources import load_conversations
from data.split import split_indices
from data.template import TemplateMismatch, Tokenized, tokenize_with_mask

log = logging.getLogger(__name__)

_TOKENIZE_VERSION = "2"  # bump when rendering/masking changes, to invalidate map caches


@dataclass
class PreparedData:
    train: "datasets.Dataset"  # noqa: F821
    eval: "datasets.Dataset"  # noqa: F821
    stats: dict


def tokenizer_signature(tokenizer) -> str:
    """Hash of what decides the token ids: vocabulary/merges, special tokens, chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    parts = [backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items())),
             str(tokenizer.chat_template), repr(tokenizer.all_special_tokens)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def apply_overflow(record_id: str, tokens: Tokenized, max_length: int, overflow: str):
    """Pieces `(id, ids, mask, truncated, status)` for one tokenized conversation; status is "ok" or
    why the piece is dropped. Split pieces are named `<id>_0`, `<id>_1`, ..."""
    ids, mask = tokens.input_ids, tokens.loss_mask
    if tokens.length <= max_length:
        pieces = [(record_id, ids, mask, False)]
    elif overflow == "truncate":
        pieces = [(record_id, ids[:max_length], mask[:max_length], True)]
    elif overflow == "drop":
        return [(record_id, [], [], False, "overflow_dropped")]
    elif overflow == "split":
        starts = range(0, len(ids), max_length)
        pieces = [(f"{record_id}_{k}", ids[s:s + max_length], mask[s:s + max_length], False)
                  for k, s in enumerate(starts)]
    else:
        raise ValueError(f"data.overflow={overflow!r} is not one of {OVERFLOW_MODES}")
    return [(*piece, "ok" if sum(piece[2]) else "no_assistant_tokens") for piece in pieces]


def _tokenize_batch(batch, tokenizer, max_length: int, overflow: str, strict: bool) -> dict:
    out: dict[str, list] = {k: [] for k in ("id", "input_ids", "loss_mask", "length",
                                            "assistant_tokens", "truncated", "status")}
    for record_id, messages in zip(batch["id"], batch["messages"]):
        try:
            # split needs every token; truncate and drop never look past max_length
            tokens = tokenize_with_mask(tokenizer, messages, None if overflow == "split" else max_length)
            pieces = apply_overflow(record_id, tokens, max_length, overflow)
        except TemplateMismatch as error:
            if strict:
                raise ValueError(f"record id={record_id!r}: {error}") from None
            pieces = [(record_id, [], [], False, "template_mismatch")]
        for piece_id, piece_ids, piece_mask, truncated, status in pieces:
            for key, value in zip(out, (piece_id, piece_ids, piece_mask, len(piece_ids), sum(piece_mask),
                                        truncated, status)):
                out[key].append(value)
    return out


def _row_features():
    import datasets

    return datasets.Features({
        "id": datasets.Value("string"), "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")), "length": datasets.Value("int32"),
        "assistant_tokens": datasets.Value("int32"), "truncated": datasets.Value("bool"),
        "status": datasets.Value("string")})


def tokenize_conversations(conversations, tokenizer, config: DataConfig, fingerprint: str):
    """datasets.map over conversations (cached by `fingerprint`, `config.num_proc` processes).
    Returns (kept rows, skip counts per reason)."""
    import datasets

    if len(conversations) == 0:
        return datasets.Dataset.from_dict({k: [] for k in _row_features()}, _row_features()).remove_columns(
            "status"), {}
    key = hashlib.sha256("|".join([_TOKENIZE_VERSION, fingerprint, tokenizer_signature(tokenizer),
                                   str(config.max_length), config.overflow,
                                   str(config.skip_bad_records)]).encode()).hexdigest()[:16]
    tokenized = conversations.map(
        _tokenize_batch, batched=True, batch_size=64, remove_columns=conversations.column_names,
        fn_kwargs=dict(tokenizer=tokenizer, max_length=config.max_length, overflow=config.overflow,
                       strict=not config.skip_bad_records),
        num_proc=config.num_proc if config.num_proc > 1 and len(conversations) > 1 else None,
        features=_row_features(), new_fingerprint=key, desc="chat template + loss mask")
    skipped = Counter(s for s in tokenized["status"] if s != "ok")
    if skipped:
        tokenized = tokenized.filter(lambda status: status == "ok", input_columns="status",
                                     new_fingerprint=key + "-ok")
    return tokenized.remove_columns("status"), dict(sorted(skipped.items()))


def token_stats(rows) -> dict:
    lengths = list(rows["length"])
    tokens = sum(lengths)
    return {"records": len(rows), "tokens": tokens, "assistant_tokens": sum(rows["assistant_tokens"]),
            "mean_length": round(tokens / len(lengths), 1) if lengths else 0.0,
            "max_length": max(lengths, default=0), "truncated": sum(rows["truncated"])}


def split_conversations(conversations, config: DataConfig):
    """(train, eval, split stats): split on base ids, then the max_records / max_eval_records caps."""
    train_rows, eval_rows = split_indices(list(conversations["id"]), config.eval_fraction, config.split_seed)
    stats = {"train_conversations_before_cap": len(train_rows), "eval_conversations_before_cap": len(eval_rows)}
    train_rows = train_rows[: config.max_records] if config.max_records is not None else train_rows
    eval_rows = eval_rows[: config.max_eval_records] if config.max_eval_records is not None else eval_rows
    stats.update(train_conversations=len(train_rows), eval_conversations=len(eval_rows))
    return conversations.select(train_rows), conversations.select(eval_rows), stats


def prepare_data(config: DataConfig, tokenizer, run_dir: str | Path | None = None) -> PreparedData:
    """Load, normalise, split, render and mask the configured conversations. Stats are logged,
    returned, and written to `<run_dir>/data_stats.json` when run_dir is given."""
    if config.overflow not in OVERFLOW_MODES:
        raise ValueError(f"data.overflow={config.overflow!r} is not one of {OVERFLOW_MODES}")
    conversations, load_stats = load_conversations(config)
    train_conv, eval_conv, split_stats = split_conversations(conversations, config)
    train, train_skipped = tokenize_conversations(train_conv, tokenizer, config, train_conv._fingerprint)
    held_out, eval_skipped = tokenize_conversations(eval_conv, tokenizer, config, eval_conv._fingerprint)
    stats = {"load": load_stats, "split": split_stats,
             "train": {**token_stats(train), "skipped": train_skipped},
             "eval": {**token_stats(held_out), "skipped": eval_skipped},
             "max_length": config.max_length, "overflow": config.overflow}
    _log_stats(stats)
    if len(train) == 0:
        raise ValueError(f"data: no training records left (load: {load_stats['skipped']}, "
                         f"tokenize: {train_skipped}); check data.source and data.max_length")
    if run_dir is not None:
        write_data_stats(run_dir, stats)
    return PreparedData(train=train, eval=held_out, stats=stats)


def write_data_stats(run_dir: str | Path, stats: dict) -> None:
    """`<run_dir>/data_stats.json`, the data stage's record of what it prepared."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "data_stats.json").write_text(json.dumps(stats, indent=1))


def _log_stats(stats: dict) -> None:
    load = stats["load"]
    if load.get("truncated"):
        log.info("data: salvaged %d complete records from the truncated source", load["complete_records"])
    log.info("data: kept %d conversations, skipped %s; split train %d / eval %d (after caps)",
             load["kept"], load["skipped"] or "none", stats["split"]["train_conversations"],
             stats["split"]["eval_conversations"])
    for side in ("train", "eval"):
        s = stats[side]
        log.info("data[%s]: %d records, %d tokens (%d assistant), mean length %.1f, max %d, truncated %d, "
                 "skipped %s", side, s["records"], s["tokens"], s["assistant_tokens"], s["mean_length"],
                 s["max_length"], s["truncated"], s["skipped"] or "none")
