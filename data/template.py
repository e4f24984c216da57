"""Chat-template rendering and the assistant-only loss mask, derived from the template itself.

Convention: `loss_mask[t] = 1` when token t is part of an assistant reply, i.e. a token the model
must *predict*: every token that holds a character of a reply's content, plus the end-of-turn
token the template emits right after it (`<|im_end|>`, `<|eot_id|>`, `</s>`). System and user
text, the template's headers (`<|im_start|>assistant\\n`) and anything after the end-of-turn token
are 0. The mask is aligned with the labels: the logits at position t-1 are scored on token t when
`loss_mask[t] = 1` (shift by one in the loss, as for `input_ids`).

How the reply spans are found, without guessing from strings: for each assistant turn i the
template renders (a) the history with the generation prompt, (b) the history plus the reply, and
(c) the history plus a sentinel reply. (a) must be a prefix of (b) and (b) of the whole render;
(c) tells what the template writes around a reply (before: usually nothing; after: the end-of-turn
marker), so the reply as rendered (trimmed, for Llama-3) is the middle of (b)'s new part. The whole
render is tokenized once with offsets; a reply's tokens are those overlapping its character span,
and the token starting exactly at the span's end is its end-of-turn token. When the reply's last
token would merge with the template's text (no token boundary there), the record is refused.

Those renders grow with the conversation, so checking every turn is quadratic in turns. A long
conversation rendered whole (data.overflow=split) is aligned instead against one render whose
replies are numbered sentinels, and three of its turns are checked as above (`EXACT_REPLIES`).
"""
from __future__ import annotations

from bisect import bisect_right
from typing import NamedTuple

_SENTINEL = "SPECHEADSREPLYSENTINEL"


class TemplateMismatch(ValueError):
    """The chat template cannot give an exact mask for this conversation."""


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except TemplateError as error:  # e.g. a template that demands alternating user/assistant roles
        raise TemplateMismatch(f"the chat template refused the conversation: {error}") from None


def _turn_span(tokenizer, messages: list[dict], full: str, i: int) -> tuple[int, tuple[int, int]]:
    """(length of the generation-prompt render before turn i, the reply's span in `full`), from
    three renders of the conversation up to turn i; raises TemplateMismatch."""
    head = render(tokenizer, messages[:i], add_generation_prompt=True)
    turn = render(tokenizer, messages[: i + 1])
    probe = render(tokenizer, messages[:i] + [{"role": "assistant", "content": _SENTINEL}])
    if not (full.startswith(turn) and turn.startswith(head) and probe.startswith(head)):
        raise TemplateMismatch(f"turn {i}: the template's renders of growing prefixes are not prefixes "
                               "of each other, so reply positions cannot be derived")
    before, found, after = probe[len(head):].partition(_SENTINEL)
    segment = turn[len(head):]
    if not found or not (segment.startswith(before) and segment.endswith(after)
                         and len(segment) >= len(before) + len(after)):
        raise TemplateMismatch(f"turn {i}: the template does not render the reply between a fixed "
                               f"header {before!r} and end marker {after!r}")
    return len(head), (len(head) + len(before), len(turn) - len(after))


def _aligned_spans(tokenizer, messages: list[dict], full: str, replies: list[int]) -> list[tuple[int, int]] | None:
    """Reply spans from one more render, with every reply replaced by a numbered sentinel: the
    text between sentinels must appear in `full` in order, each reply (as written, or stripped the
    way templates trim) between them. None when the render does not line up that way."""
    marks = {i: f"{_SENTINEL}{n:07d}X" for n, i in enumerate(replies)}
    marked = render(tokenizer, [dict(m, content=marks[i]) if i in marks else m for i, m in enumerate(messages)])
    pieces, position = [], 0
    for i in replies:
        found = marked.find(marks[i], position)
        if found < 0:
            return None
        pieces.append(marked[position:found])
        position = found + len(marks[i])
    pieces.append(marked[position:])
    spans, at = [], 0
    for n, i in enumerate(replies):
        if not full.startswith(pieces[n], at):
            return None
        at += len(pieces[n])
        content = messages[i]["content"]
        for shown in dict.fromkeys((content, content.strip(), content.rstrip(), content.lstrip())):
            if full.startswith(shown, at) and full.startswith(pieces[n + 1], at + len(shown)):
                break
        else:
            return None
        spans.append((at, at + len(shown)))
        at += len(shown)
    return spans if at + len(pieces[-1]) == len(full) else None


# Conversations with more replies than this are not checked turn by turn (three renders of a growing
# prefix per reply: quadratic in turns): their spans come from one aligned render, and the first,
# middle and last replies are checked turn by turn against it.
EXACT_REPLIES = 8


def reply_spans(tokenizer, messages: list[dict], full: str, char_limit: int | None = None) -> list[tuple[int, int]]:
    """Character spans [start, end) of the assistant replies in `full` (the whole render), for the
    turns whose generation prompt ends before `char_limit` (all turns when None)."""
    replies = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if char_limit is None and len(replies) > EXACT_REPLIES:
        spans = _aligned_spans(tokenizer, messages, full, replies)
        checked = sorted({0, len(replies) // 2, len(replies) - 1})
        if spans is not None and all(_turn_span(tokenizer, messages, full, replies[n])[1] == spans[n]
                                     for n in checked):
            return spans
    spans = []
    for i in replies:
        head, span = _turn_span(tokenizer, messages, full, i)
        if char_limit is not None and head >= char_limit:
            break
        spans.append(span)
    return spans


class Tokenized(NamedTuple):
    input_ids: list[int]  # (T,) cut to max_tokens
    loss_mask: list[int]  # (T,)
    length: int  # tokens in the whole render, before any cut


def tokenize_with_mask(tokenizer, messages: list[dict], max_tokens: int | None = None) -> Tokenized:
    """Render `messages` with the tokenizer's chat template and mask the assistant replies.
    With max_tokens, ids and mask are cut to that many tokens and later turns are not examined.
    Needs a fast tokenizer (offsets)."""
    full = render(tokenizer, messages)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    keep = len(ids) if max_tokens is None else min(max_tokens, len(ids))
    char_limit = offsets[keep - 1][1] if 0 < keep < len(ids) else None
    ends = [end for _, end in offsets]
    mask = [0] * len(ids)
    for start, end in reply_spans(tokenizer, messages, full, char_limit):
        t = bisect_right(ends, start)  # first token ending after the reply starts
        while t < len(ids) and offsets[t][0] < end:
            mask[t] = 1
            t += 1
        if t >= len(ids) or offsets[t][0] != end:
            raise TemplateMismatch(f"no token boundary where the reply ending at character {end} meets "
                                   "the template's end-of-turn text")
        mask[t] = 1  # end-of-turn token
    return Tokenized(ids[:keep], mask[:keep], len(ids))


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered with the generation prompt (the model's next turn)."""
    full = render(tokenizer, messages, add_generation_prompt=True)
    return list(tokenizer(full, add_special_tokens=False)["input_ids"])
