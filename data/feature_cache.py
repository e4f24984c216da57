"""Offline feature cache: the frozen target's hidden states written once, read for many epochs.

Layout of a cache folder:
    spec.json                   what is being written (layers, dtype, hidden size, target, shard size);
                                a resume with a different spec is refused instead of mixing caches
    shard-00000.safetensors     records [0, S), S = shard_records: flat tensors over the shard's
                                tokens: input_ids (N,) int32, loss_mask (N,) uint8,
                                hidden.<layer> (N, D) in the cache dtype, offsets (R+1,) int64;
                                metadata: ids
    index.json                  spec + per shard: file, record ids, tokens (written last)

Each shard is written to a temporary name and renamed, so a shard file exists only when complete:
an interrupted run resumes at the first missing shard. A shard whose size disagrees with its own
safetensors header (truncated or damaged later) is not counted as done: it is written again, with
a WARNING naming it; index.json records each shard's size, checked when the cache is opened. Rank r of W writes shards r, r+W, ...
(disjoint), and any rank's `write_index` after all of them finish (the caller's barrier) lists them.
Layer numbers follow `TargetFeatures`: 0 = embeddings, i = output of decoder layer i-1, -1 = the
final post-norm state.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

import torch

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_SPEC_VERSION = 1


class CacheSpaceError(OSError):
    """The disk cannot hold the cache."""


class FeatureTarget(Protocol):
    """What the cache needs of the frozen target (heads.target.FrozenTarget has it)."""

    hidden_size: int
    num_layers: int

    def features(self, input_ids, attention_mask=None, layers=(-1,), return_logits=False): ...


@dataclass
class CacheSpec:
    layers: list[int]
    hidden_size: int
    dtype: str = "bfloat16"
    shard_records: int = 256
    num_records: int = 0
    target: dict = field(default_factory=dict)  # the target's fingerprint
    version: int = _SPEC_VERSION


def _element_bytes(dtype: str) -> int:
    return torch.empty(0, dtype=_DTYPES[dtype]).element_size()


def estimate_cache_bytes(num_tokens: int, hidden_size: int, num_layers: int, dtype: str = "bfloat16") -> int:
    """tokens x hidden x layers x bytes, plus ids (4 B) and mask (1 B) per token."""
    return int(num_tokens * (hidden_size * num_layers * _element_bytes(dtype) + 5))


def check_disk(directory: str | os.PathLike, needed_bytes: int, margin: float = 1.05) -> None:
    """Raise CacheSpaceError if the filesystem holding `directory` has less than needed x margin free."""
    folder = Path(directory).resolve()
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if needed_bytes * margin > free:
        raise CacheSpaceError(
            f"feature cache needs {needed_bytes / 1e9:,.2f} GB (x{margin} margin) but {folder} has "
            f"{free / 1e9:,.2f} GB free; set data.feature_cache_dir to a larger disk")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _atomic_json(path: Path, value: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def shard_problem(path: Path) -> str | None:
    """Why a shard file is not whole (naming it), or None: its size must be what its safetensors
    header describes (8-byte length, JSON header, data). Reads the header only."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if size < 8 or 8 + length > size:
                return f"{path}: {size} bytes, shorter than its own header (truncated)"
            header = json.loads(handle.read(length))
        end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    except OSError as error:
        return f"{path}: cannot be read ({error})"
    except (ValueError, TypeError, KeyError, AttributeError):
        return f"{path}: its safetensors header is damaged"
    if size != 8 + length + end:
        return f"{path}: {size} bytes, its header describes {8 + length + end} (truncated or damaged)"
    return None


def _shard_done(path: Path) -> bool:
    if not path.is_file():
        return False
    problem = shard_problem(path)
    if problem:
        log.warning("feature cache: %s; writing the shard again", problem)
    return problem is None


def _check_spec(directory: Path, spec: CacheSpec) -> None:
    path = directory / "spec.json"
    if path.is_file():
        existing = json.loads(path.read_text())
        if existing.get("top_k") == 0:  # caches once recorded an unused top-k logits option, always 0
            del existing["top_k"]
        if existing != asdict(spec):
            changed = sorted(k for k in set(existing) | set(asdict(spec)) if existing.get(k) != asdict(spec).get(k))
            raise ValueError(f"{directory} holds a feature cache with a different spec ({', '.join(changed)}); "
                             "delete it or choose another data.feature_cache_dir")
    else:
        _atomic_json(path, asdict(spec))


@torch.no_grad()
def _shard_tensors(target: FeatureTarget, rows: Sequence[dict], spec: CacheSpec, batch_size: int,
                   pad_id: int, device, advance=lambda records: None) -> dict[str, torch.Tensor]:
    """`advance(n)` after each batch of n records (a progress bar's update)."""
    dtype = _DTYPES[spec.dtype]
    parts: dict[str, list[torch.Tensor]] = {}
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        longest = max(len(row["input_ids"]) for row in chunk)
        ids = torch.full((len(chunk), longest), pad_id, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(chunk), longest), dtype=torch.long)  # (B, T)
        for b, row in enumerate(chunk):
            ids[b, :len(row["input_ids"])] = torch.as_tensor(row["input_ids"])
            mask[b, :len(row["input_ids"])] = 1
        out = target.features(ids.to(device), mask.to(device), layers=spec.layers)
        hidden = {layer: out.hidden[layer % (target.num_layers + 1)] for layer in spec.layers}  # (B, T, D)
        for b, row in enumerate(chunk):
            n = len(row["input_ids"])
            parts.setdefault("input_ids", []).append(torch.as_tensor(row["input_ids"], dtype=torch.int32))
            parts.setdefault("loss_mask", []).append(torch.as_tensor(row["loss_mask"], dtype=torch.uint8))
            for layer in spec.layers:
                parts.setdefault(f"hidden.{layer}", []).append(hidden[layer][b, :n].to("cpu", dtype))
        advance(len(chunk))
    tensors = {key: torch.cat(value).contiguous() for key, value in parts.items()}
    lengths = torch.tensor([0] + [len(row["input_ids"]) for row in rows])
    tensors["offsets"] = torch.cumsum(lengths, 0).to(torch.int64)
    return tensors


def write_feature_cache(directory: str | os.PathLike, target: FeatureTarget, rows: Sequence[dict],
                        layers: Sequence[int] = (-1,), hidden_size: int | None = None, dtype: str = "bfloat16",
                        shard_records: int = 256, batch_size: int = 8, pad_id: int = 0,
                        rank: int = 0, world_size: int = 1, target_fingerprint: dict | None = None,
                        device: str | torch.device = "cpu", progress: bool = True) -> dict:
    """Write this rank's shards of `rows` (id, input_ids, loss_mask) under `directory`, skipping
    shards already complete. Prints the size estimate first and refuses when the disk cannot hold
    the missing shards. Returns {"written": [...], "skipped": [...], "estimate_bytes": n}.
    Call `write_index(directory)` once every rank is done."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    if dtype not in _DTYPES:
        raise ValueError(f"data.feature_cache_dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hidden_size = hidden_size or target.hidden_size
    layers = list(dict.fromkeys(layers))  # a layer asked for twice (small targets' EAGLE-3 defaults) is stored once
    spec = CacheSpec(layers=layers, hidden_size=hidden_size, dtype=dtype, shard_records=shard_records,
                     num_records=len(rows), target=dict(target_fingerprint or {}))
    if rank == 0:
        _check_spec(directory, spec)
    shards = range(rank, -(-len(rows) // shard_records), world_size)
    missing = [s for s in shards if not _shard_done(directory / shard_name(s))]
    tokens = lambda s: sum(len(r["input_ids"]) for r in rows[s * shard_records:(s + 1) * shard_records])  # noqa: E731
    total = estimate_cache_bytes(sum(len(r["input_ids"]) for r in rows), hidden_size, len(layers), dtype)
    needed = estimate_cache_bytes(sum(tokens(s) for s in missing), hidden_size, len(layers), dtype)
    message = (f"feature cache {directory}: {len(rows):,} records, {total / 1e9:,.2f} GB in all "
               f"(tokens x {hidden_size} hidden x {len(layers)} layer(s) x {_element_bytes(dtype)} B); "
               f"rank {rank}: {len(missing)} of {len(shards)} shard(s) to write, {needed / 1e9:,.2f} GB")
    log.info(message)
    if progress and rank == 0:
        print(message, flush=True)
    check_disk(directory, needed)
    written = []
    # Counted in records, updated per batch: a shard of a large target takes minutes.
    records = sum(min(shard_records, len(rows) - s * shard_records) for s in missing)
    bar = tqdm(total=records, desc=f"features rank {rank}", unit="record", disable=not progress)
    for s in missing:
        chunk = rows[s * shard_records:(s + 1) * shard_records]
        tensors = _shard_tensors(target, chunk, spec, batch_size, pad_id, device, bar.update)
        tmp = directory / f".{shard_name(s)}.tmp-{os.getpid()}"
        save_file(tensors, str(tmp), metadata={"ids": json.dumps([str(r["id"]) for r in chunk])})
        os.replace(tmp, directory / shard_name(s))
        written.append(s)
    bar.close()
    return {"written": written, "skipped": [s for s in shards if s not in written], "estimate_bytes": total}


def write_index(directory: str | os.PathLike) -> Path:
    """List the complete shards in index.json (atomically); raises if a shard is missing."""
    from safetensors import safe_open

    directory = Path(directory)
    spec = json.loads((directory / "spec.json").read_text())
    count = -(-spec["num_records"] // spec["shard_records"])
    missing = [shard_name(s) for s in range(count) if not (directory / shard_name(s)).is_file()]
    if missing:
        raise FileNotFoundError(f"{directory}: shards not written yet: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    damaged = [problem for problem in (shard_problem(directory / shard_name(s)) for s in range(count)) if problem]
    if damaged:
        raise ValueError(f"{directory}: damaged shards ({'; '.join(damaged[:3])}); run the data stage again, it "
                         "writes them again")
    shards = []
    for s in range(count):
        with safe_open(str(directory / shard_name(s)), framework="pt") as handle:
            ids = json.loads(handle.metadata()["ids"])
            offsets = handle.get_slice("offsets")
            end = offsets.get_shape()[0]
            tokens = int(offsets[end - 1:end][0])
        shards.append({"file": shard_name(s), "ids": ids, "tokens": tokens,
                       "bytes": (directory / shard_name(s)).stat().st_size})
    index = {**spec, "num_tokens": sum(s["tokens"] for s in shards), "shards": shards}
    _atomic_json(directory / "index.json", index)
    return directory / "index.json"


def _size_problem(directory: Path, shard: dict) -> str | None:
    path = directory / shard["file"]
    size = path.stat().st_size if path.is_file() else None
    if size != shard["bytes"]:
        return f"{path}: {size if size is not None else 'missing'}, index.json recorded {shard['bytes']} bytes"
    return None


def unfinished(directory: str | os.PathLike) -> str | None:
    """Why the cache in `directory` cannot be read as it stands (no index.json, or a shard it lists
    missing or damaged since), or None. A job asks before it loads the target: writing a shard
    again needs the whole target, reading a finished cache only its parts."""
    directory = Path(directory)
    try:
        shards = json.loads((directory / "index.json").read_text()).get("shards", [])
    except (OSError, ValueError, AttributeError) as error:
        return f"{directory / 'index.json'}: not readable ({error})"
    for shard in shards:  # indexes written before shard sizes were recorded: their headers tell
        problem = _size_problem(directory, shard) if "bytes" in shard else shard_problem(directory / shard["file"])
        if problem:
            return problem
    return None


class FeatureCache(torch.utils.data.Dataset):
    """Read a finished cache (its folder or index.json): `cache[i]` or `cache.by_id(id)` -> {id, input_ids (T,) int64,
    loss_mask (T,) int64, hidden {layer: (T, D)}}.
    Shards are memory-mapped; a record costs one slice per tensor."""

    def __init__(self, directory: str | os.PathLike):
        directory = Path(directory)
        directory = directory.parent if directory.name == "index.json" else directory
        index_path = directory / "index.json"
        if not index_path.is_file():
            raise FileNotFoundError(f"{directory} has no index.json: the feature cache was not finished "
                                    "(run the data stage again; it resumes at the first missing shard)")
        self.directory = directory
        self.index = json.loads(index_path.read_text())
        for shard in self.index["shards"]:  # a cheap stat: a shard cut after the index was written
            if "bytes" in shard and (problem := _size_problem(directory, shard)):
                raise ValueError(f"{problem}; run the data stage again (it rewrites damaged shards)")
        self.layers: list[int] = self.index["layers"]
        self.dtype = _DTYPES[self.index["dtype"]]
        self._where: list[tuple[int, int]] = []
        for s, shard in enumerate(self.index["shards"]):
            self._where += [(s, j) for j in range(len(shard["ids"]))]
        self._ids = [i for shard in self.index["shards"] for i in shard["ids"]]
        self._position = {record_id: n for n, record_id in enumerate(self._ids)}
        self._handles: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self._where)

    @property
    def ids(self) -> list[str]:
        return list(self._ids)

    def _handle(self, s: int):
        from safetensors import SafetensorError, safe_open

        if s not in self._handles:
            path = self.directory / self.index["shards"][s]["file"]
            try:
                self._handles[s] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as error:
                raise ValueError(f"{path}: not a readable feature shard ({error}); run the data stage again "
                                 "(it rewrites damaged shards)") from None
        return self._handles[s]

    def __getitem__(self, n: int) -> dict:
        s, j = self._where[n]
        handle = self._handle(s)
        offsets = handle.get_slice("offsets")[j:j + 2]
        a, b = int(offsets[0]), int(offsets[1])
        record = {"id": self._ids[n],
                  "input_ids": handle.get_slice("input_ids")[a:b].long(),
                  "loss_mask": handle.get_slice("loss_mask")[a:b].long(),
                  "hidden": {layer: handle.get_slice(f"hidden.{layer}")[a:b] for layer in self.layers}}
        return record

    def by_id(self, record_id: str) -> dict:
        try:
            return self[self._position[str(record_id)]]
        except KeyError:
            raise KeyError(f"record {record_id!r} is not in the feature cache {self.directory}") from None
