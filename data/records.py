"""One raw record -> a normalised conversation, or a named reason why it is skipped.

A normalised conversation is `{"id": str, "messages": [{"role": "system"|"user"|"assistant",
"content": str}, ...]}` whose first non-system turn is never an assistant turn and which has at
least one assistant reply. Two input shapes are accepted: ShareGPT (`conversations` with
`from`/`value`) and OpenAI (`messages` with `role`/`content`).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}

# Skip reasons. BAD_REASONS are malformed records: an error unless skip_bad_records is set.
BAD_REASONS = ("invalid_json", "not_utf8", "lone_surrogate", "not_an_object", "missing_conversations", "bad_turn",
               "unknown_role")
EMPTY = "empty_conversation"  # no turns, or every turn blank
NO_REPLY = "no_assistant_reply"  # nothing left to learn from after leading assistant turns are dropped


class RecordError(ValueError):
    """A malformed record, named by its position in the source and its id."""

    def __init__(self, reason: str, index: int, record_id: Any, detail: str):
        self.reason = reason
        super().__init__(f"record {index} (id={record_id!r}) is malformed [{reason}]: {detail}")


class SkipCounter:
    """Counts skipped records per reason (and dropped leading assistant turns); raises on bad
    records unless told to skip them."""

    def __init__(self, skip_bad_records: bool):
        self.skip_bad_records = skip_bad_records
        self.counts: Counter[str] = Counter()
        self.leading_assistant_turns_dropped = 0
        self.kept = 0

    def bad(self, reason: str, index: int, record_id: Any, detail: str) -> None:
        if not self.skip_bad_records:
            raise RecordError(reason, index, record_id, detail)
        self.counts[reason] += 1

    def as_dict(self) -> dict:
        return {
            "kept": self.kept,
            "skipped": dict(sorted(self.counts.items())),
            "skipped_total": sum(self.counts.values()),
            "leading_assistant_turns_dropped": self.leading_assistant_turns_dropped,
        }


def _turns(record: dict) -> tuple[list | None, str, str]:
    """(raw turns, role key, content key) for either input shape."""
    if "conversations" in record:
        return record["conversations"], "from", "value"
    if "messages" in record:
        return record["messages"], "role", "content"
    return None, "", ""


def normalise(record: Any, index: int, counter: SkipCounter) -> dict | None:
    """Normalise one raw record; returns None (and counts why) when it is skipped."""
    if not isinstance(record, dict):
        counter.bad("not_an_object", index, None, f"expected an object, got {type(record).__name__}")
        return None
    raw_id = record.get("id")
    record_id = f"row{index}" if raw_id is None else str(raw_id)
    turns, role_key, content_key = _turns(record)
    if not isinstance(turns, list):
        detail = "no 'conversations' or 'messages' field" if turns is None else (
            f"'conversations'/'messages' is {type(turns).__name__}, expected a list")
        counter.bad("missing_conversations", index, record_id, detail)
        return None
    messages = []
    for position, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get(content_key), str) or role_key not in turn:
            counter.bad("bad_turn", index, record_id,
                        f"turn {position} needs a '{role_key}' and a string '{content_key}', got {turn!r:.120}")
            return None
        role = ROLES.get(str(turn[role_key]).lower())
        if role is None:
            counter.bad("unknown_role", index, record_id, f"turn {position} has role {turn[role_key]!r}")
            return None
        messages.append({"role": role, "content": turn[content_key]})
    if not any(m["content"].strip() for m in messages):
        counter.counts[EMPTY] += 1
        return None
    messages = _drop_leading_assistant(messages, counter)
    if not any(m["role"] == "assistant" for m in messages):
        counter.counts[NO_REPLY] += 1
        return None
    counter.kept += 1
    return {"id": record_id, "messages": messages}


def _drop_leading_assistant(messages: list[dict], counter: SkipCounter) -> list[dict]:
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system):]
    start = 0
    while start < len(rest) and rest[start]["role"] == "assistant":
        start += 1
    counter.leading_assistant_turns_dropped += start
    return system + rest[start:]
