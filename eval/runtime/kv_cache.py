"""A preallocated KV cache for the lean forward: fixed capacity, no reallocation per step.

The cache holds `length` committed entries in slots [0, length). A forward over N new tokens writes
their keys/values into slots [length, length + N) ("pending"); after verification `compact` keeps
the accepted ones, moved in place to consecutive slots, and drops the rest.

A target split across devices keeps each layer's entries on the device that computes the layer:
one buffer per run of consecutive layers on one device.
"""
from __future__ import annotations

from typing import Sequence

import torch


class KVCache:
    """k, v: (L, Hkv, S, hd) buffers; S = max_length fixed at construction. `device`: one device, or
    one per layer (a split target); then k and v are lists of per-layer (Hkv, S, hd) views into one
    buffer per run of consecutive layers on one device (`k[layer]` reads alike either way)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_length: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | Sequence = "cpu"):
        if isinstance(device, (str, torch.device)):
            devices = [torch.device(device)] * num_layers
        else:
            devices = [torch.device(d) for d in device]
            if len(devices) != num_layers:
                raise ValueError(f"KV cache: {len(devices)} devices for {num_layers} layers")
        runs = [1]
        for previous, current in zip(devices, devices[1:]):
            if current == previous:
                runs[-1] += 1
            else:
                runs.append(1)
        buffers, start = [], 0
        for count in runs:
            shape = (count, num_kv_heads, max_length, head_dim)
            where = devices[start] if devices else "cpu"
            buffers.append((torch.zeros(shape, dtype=dtype, device=where), torch.zeros(shape, dtype=dtype, device=where)))
            start += count
        self._hold(buffers)

    def _hold(self, buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """buffers: (k, v) per run of layers on one device, each (L_run, Hkv, S, hd)."""
        self.buffers = buffers
        self._k_layers = [layer for k, _ in buffers for layer in k]  # (Hkv, S, hd) views, one per layer
        self._v_layers = [layer for _, v in buffers for layer in v]
        self.k, self.v = buffers[0] if len(buffers) == 1 else (self._k_layers, self._v_layers)
        self.length = 0
        self.pending = 0

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor) -> "KVCache":
        """A cache over existing (L, Hkv, S, hd) buffers (one sequence's slice of a `BatchKVCache`)."""
        cache = cls.__new__(cls)
        cache._hold([(k, v)])
        return cache

    @property
    def max_length(self) -> int:
        return self.buffers[0][0].shape[2]

    def reserve(self, n: int) -> None:
        """Start a forward over n new tokens (they go to slots [length, length + n))."""
        if self.length + n > self.max_length:
            raise ValueError(f"KV cache full: {self.length} + {n} > max_length {self.max_length}")
        self.pending = n

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """k_new, v_new: (Hkv, N, hd) for the pending slots of one layer."""
        end = self.length + k_new.shape[1]
        self._k_layers[layer][:, self.length:end] = k_new
        self._v_layers[layer][:, self.length:end] = v_new

    def compact(self, accepted: Sequence[int] | torch.Tensor) -> None:
        """Keep the pending entries `accepted` (indices into the last forward's N tokens, in path
        order), moved in place to slots [length, length + A); discard the other pending entries."""
        accepted = accepted.tolist() if torch.is_tensor(accepted) else list(accepted)
        count = len(accepted)
        if any(not 0 <= i < self.pending for i in accepted):
            raise ValueError(f"compact: indices {accepted} outside the {self.pending} pending entries")
        if accepted != list(range(count)):  # a prefix of the pending block is already in place
            target = slice(self.length, self.length + count)
            for k, v in self.buffers:
                source = torch.tensor(accepted, device=k.device) + self.length
                k[:, :, target] = k.index_select(2, source)
                v[:, :, target] = v.index_select(2, source)
        self.length += count
        self.pending = 0

    def commit(self) -> None:
        """Keep all pending entries (plain decoding, prefill)."""
        self.length += self.pending
        self.pending = 0

    def truncate(self, length: int) -> None:
        """Forget committed entries beyond `length` (a drafter rolling back its own cache)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate: {length} not in [0, {self.length}]")
        self.length = length
        self.pending = 0
