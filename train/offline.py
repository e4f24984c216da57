"""Offline mode: a `FeatureSource` that reads the feature cache (data/feature_cache.py) instead of
running the frozen target, so `train_heads(..., source=OfflineFeatures(cache))` trains on cached
hidden states with the same losses as online mode.
"""
from __future__ import annotations

import torch

from data.feature_cache import FeatureCache


class OfflineFeatures:
    """batch (input_ids (B, T), attention_mask, loss_mask, ids [B]) -> cached features (B, T, D).

    layer: the cached layer to return (-1: the final post-norm state). dtype: what the heads
    compute in (the cache may hold bf16). Checks that the cached token ids are the batch's, so a
    cache built from other data or another tokenizer fails loudly instead of training on noise.
    """

    def __init__(self, cache: FeatureCache, layer: int = -1, dtype: torch.dtype = torch.float32):
        if layer not in cache.layers:
            raise ValueError(f"feature cache {cache.directory} holds layers {cache.layers}, not {layer}")
        self.cache, self.layer, self.dtype = cache, layer, dtype

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
            hidden = record["hidden"][self.layer]  # (n, D)
            if out is None:
                out = torch.zeros(B, T, hidden.shape[-1], dtype=self.dtype)  # (B, T, D)
            out[b, :n] = hidden.to(self.dtype)
        return out.to(ids.device)
