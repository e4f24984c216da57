"""Prompts for the speculative-decoding eval: held-out conversations cut before their first
assistant reply, or a user JSONL of prompts."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from data.config import DataConfig
from data.records import ROLES
from data.sources import LONE_SURROGATE, NOT_UTF8, has_lone_surrogate, load_conversations, read_text
from data.split import split_indices
from data.template import prompt_ids

log = logging.getLogger(__name__)


def _prompt(record_id: str, messages: list[dict], reference: str | None, tokenizer,
            category: str | None = None) -> dict:
    return {"id": record_id, "prompt_ids": prompt_ids(tokenizer, messages), "messages": messages,
            "reference": reference, "category": category}


def eval_prompts(config: DataConfig, tokenizer, n: int, max_prompt_tokens: int) -> list[dict]:
    """Up to n held-out prompts (the eval side of the split, never in training): each is
    `{"id", "prompt_ids": list[int], "messages", "reference": str}` where messages run up to the
    first assistant reply (rendered with the generation prompt) and reference is that reply.
    Prompts longer than max_prompt_tokens are passed over (and counted in the log)."""
    conversations, _ = load_conversations(config)
    _, held_out = split_indices(list(conversations["id"]), config.eval_fraction, config.split_seed)
    prompts, too_long = [], 0
    for row in conversations.select(held_out):
        if len(prompts) >= n:
            break
        messages = row["messages"]
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt = _prompt(row["id"], messages[:first], messages[first]["content"], tokenizer)
        if len(prompt["prompt_ids"]) > max_prompt_tokens:
            too_long += 1
            continue
        prompts.append(prompt)
    log.info("eval prompts: %d from %d held-out conversations (%d longer than %d tokens passed over)",
             len(prompts), len(held_out), too_long, max_prompt_tokens)
    return prompts


def load_prompt_file(path: str | Path, tokenizer, max_prompt_tokens: int | None = None,
                     limit_source: str = "runtime.max_prompt_tokens") -> list[dict]:
    """Prompts from a JSONL file of `{"prompt": str}` or `{"messages": [{"role", "content"}]}`
    (optional "id", "reference", "category": reports give a row per category). A trailing
    assistant message becomes the reference. Malformed lines and over-long prompts are errors
    naming the line, and `limit_source` (what sets max_prompt_tokens)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"prompts file {path}: {not_a_file(path)}")
    text, bom, clean = read_text(path)  # a UTF-8 byte-order mark is accepted
    bad = None if clean else NOT_UTF8.search(text)
    if bad is not None:
        line = text.count("\n", 0, bad.start()) + 1
        raise ValueError(f"{path} line {line}: bytes that are not UTF-8 at byte "
                         f"{bom + len(text[:bad.start()].encode('utf-8', 'surrogateescape'))}")
    prompts = []
    for line_number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path} line {line_number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: invalid JSON ({error.msg})") from None
        if has_lone_surrogate(item):
            raise ValueError(f"{where}: {LONE_SURROGATE}")
        reference = item.get("reference") if isinstance(item, dict) else None
        if isinstance(item, dict) and isinstance(item.get("prompt"), str):
            messages = [{"role": "user", "content": item["prompt"]}]
        elif isinstance(item, dict) and isinstance(item.get("messages"), list) and item["messages"]:
            messages = [_message(m, where) for m in item["messages"]]
            if messages[-1]["role"] == "assistant":
                reference = messages.pop()["content"]
            if not messages:
                raise ValueError(f"{where}: no messages before the assistant reply")
        else:
            raise ValueError(f"{where}: expected {{'prompt': str}} or {{'messages': [...]}}")
        category = item.get("category")
        if category is not None and not isinstance(category, str):
            raise ValueError(f"{where}: 'category' must be a string, got {category!r:.60}")
        prompt = _prompt(str(item.get("id", f"line{line_number}")), messages, reference, tokenizer, category)
        if max_prompt_tokens is not None and len(prompt["prompt_ids"]) > max_prompt_tokens:
            raise ValueError(f"{where}: prompt has {len(prompt['prompt_ids'])} tokens > {max_prompt_tokens} "
                             f"({limit_source})")
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"prompts file {path}: no prompts in it")
    return prompts


def not_a_file(path: str | Path) -> str:
    """Why `path`, which is not a regular file, cannot be read as a prompts file."""
    if Path(path).is_dir():
        return "a folder, not a JSONL file"
    return "not a regular file (a FIFO, socket or device)" if Path(path).exists() else "no such file"


def _message(message, where: str) -> dict:
    if not (isinstance(message, dict) and isinstance(message.get("content"), str)
            and str(message.get("role", "")).lower() in ROLES):
        raise ValueError(f"{where}: bad message {message!r:.120} (needs a known 'role' and a string 'content')")
    return {"role": ROLES[message["role"].lower()], "content": message["content"]}
