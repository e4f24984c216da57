"""The data stage's offline products, seen from the training side.

- Offline mode: `offline_source(job, target, prepared)` writes (or resumes) the feature cache
  (data/feature_cache.py) and returns `OfflineFeatures`, a `FeatureSource` that reads it instead
  of running the target, with the same losses as online mode. Once the cache is finished,
  `parts_only_layers(job)` says the job needs only the target's embedding, final norm, lm_head
  (and EAGLE's init layers): `heads.target_parts.load_target_parts` loads just those.
Self-distillation, the data stage's other product made with the target, is train/selfdistill.py.

Under torchrun every rank calls these; ranks write disjoint shards and meet on the files
(no process group exists yet at this stage), so a shared filesystem is assumed across nodes.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from data.feature_cache import FeatureCache, shard_name, unfinished, write_feature_cache, write_index
from train.kinds import head_kind

log = logging.getLogger(__name__)


class OfflineFeatures:
    """batch (input_ids (B, T), attention_mask, loss_mask, ids [B]) -> cached features (B, T, n·D).

    layers: the cached states to return, concatenated on the last dim in this order (FINAL = -1:
    the final post-norm state). dtype: what the heads compute in (the cache may hold bf16). Checks
    that the cached token ids are the batch's, so a cache built from other data or another
    tokenizer fails loudly instead of training on noise.
    """

    def __init__(self, cache: FeatureCache, layers: tuple[int, ...] = (-1,), dtype: torch.dtype = torch.float32):
        missing = [layer for layer in layers if layer not in cache.layers]
        if missing:
            raise ValueError(f"feature cache {cache.directory} holds layers {cache.layers}, not {missing} "
                             "(delete it or choose another data.feature_cache_dir)")
        self.cache, self.layers, self.dtype = cache, tuple(layers), dtype

    def __call__(self, batch: dict) -> torch.Tensor:
        ids = batch["input_ids"]  # (B, T)
        B, T = ids.shape
        out = None
        for b, record_id in enumerate(batch["ids"]):
            record = self.cache.by_id(record_id)
            n = len(record["input_ids"])
            if n > T or not torch.equal(record["input_ids"], ids[b, :n].cpu()):
                raise ValueError(f"feature cache {self.cache.directory}: record {record_id!r} holds other tokens "
                                 "than the batch (stale cache? delete it and run the data stage again)")
            states = [record["hidden"][layer] for layer in self.layers]  # each (n, D)
            hidden = states[0] if len(states) == 1 else torch.cat(states, -1)  # (n, len(layers)·D)
            if out is None:
                out = torch.zeros(B, T, hidden.shape[-1], dtype=self.dtype)  # (B, T, len(layers)·D)
            out[b, :n] = hidden.to(self.dtype)
        return out.to(ids.device)


def rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def wait_for(paths: list[Path], what: str, poll_seconds: float = 2.0) -> None:
    """File barrier: other ranks are still writing their shards."""
    last_log = time.time()
    while True:
        missing = [p for p in paths if not p.exists()]
        if not missing:
            return
        if time.time() - last_log > 60:
            log.info("waiting for %d %s from other ranks (e.g. %s)", len(missing), what, missing[0].name)
            last_log = time.time()
        time.sleep(poll_seconds)


def feature_cache_dir(job) -> Path:
    return Path(job.data.feature_cache_dir or Path(job.trainer.output_dir) / "features")


def offline_source(job, target, prepared, layers: tuple[int, ...] | None = None) -> OfflineFeatures:
    """Build (or finish) the feature cache of prepared.train + prepared.eval and read it back.
    `layers`: the target states to cache (None: those the job's head kind reads). Prints the
    size estimate first; refuses when the disk cannot hold it."""
    if layers is None:
        layers = head_kind(job.heads).feature_layers(target.num_layers)
    directory = feature_cache_dir(job)
    rows = list(prepared.train) + list(prepared.eval)
    rank, world = rank_world()
    pad_id = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    write_feature_cache(directory, target, rows, layers=tuple(layers), dtype=job.data.feature_cache_dtype,
                        shard_records=job.data.feature_shard_records, batch_size=job.trainer.batch_size,
                        pad_id=pad_id, rank=rank, world_size=world, target_fingerprint=target.fingerprint(),
                        device=target.device)
    shards = -(-len(rows) // job.data.feature_shard_records)
    wait_for([directory / shard_name(s) for s in range(shards)], "feature shards")
    if rank == 0:
        write_index(directory)
    wait_for([directory / "index.json"], "feature index")
    cache = FeatureCache(directory)
    written_by = cache.index.get("target") or {}
    if written_by.get("id") and written_by["id"] != target.fingerprint()["id"]:
        raise ValueError(f"feature cache {directory} was written by another target (fingerprint {written_by['id']}, "
                         f"this one {target.fingerprint()['id']}); delete it or choose another data.feature_cache_dir")
    return OfflineFeatures(cache, layers=tuple(layers), dtype=target.dtype)


def parts_only_layers(job) -> list[int] | None:
    """The decoder layers the job still reads from the target when its feature cache is finished
    and no stage runs the target: those its head kind's build reads (EAGLE: layer 0, whose shape
    the head copies, and heads.eagle.init_layer, its initial weights; Medusa: none); none with
    trainer.init_from.
    None when the job needs the whole target: online mode, an unfinished or damaged cache,
    regeneration, eval."""
    stages = set(job.stages)
    runs_target = job.data.regenerate.enabled or not stages <= {"data", "features", "train", "export"}
    if job.data.mode != "offline" or runs_target:
        return None
    problem = unfinished(feature_cache_dir(job))
    if problem:  # a missing or damaged shard: only the whole target can write it again
        log.info("feature cache: %s; loading the whole target", problem)
        return None
    if job.trainer.init_from:
        return []
    return head_kind(job.heads).init_layers()
