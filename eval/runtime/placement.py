"""Where the lean forward's parts compute, and whose weights it runs on.

A target split across devices (transformers' `hf_device_map`: a 70B target over a GPU group) is
computed where it lies: `locate` reads the device of the embedding, each decoder layer and the head
(final norm + lm_head), `stages` groups the layers into runs between boundaries, and `move` carries
the activations across each boundary. `weight_copies_allowed` is the rule for layout copies (the
module docstring of eval.runtime.model); `fuse_in_place` fuses q|k|v and gate|up inside the transformers
model, so the fused tensor replaces the parts instead of doubling them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import nn


def move(tensors: tuple, device: torch.device) -> tuple:
    """Carry tensors (None passes) across a device boundary of a split target: once per boundary
    per forward, with the activations and what every layer reads (rotary tables, tree mask)."""
    return tuple(None if tensor is None else tensor.to(device) for tensor in tensors)


@dataclass(frozen=True)
class Stage:
    """Decoder layers [start, end) computing on `device`; `cross`: activations move there first."""

    start: int
    end: int
    device: torch.device
    cross: bool


def _unit_device(module: nn.Module, name: str) -> torch.device:
    devices = {t.device for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()}
    if len(devices) != 1:
        raise ValueError(f"lean forward: {name} has weights on {sorted(map(str, devices)) or 'no device'}; "
                         f"each decoder layer must sit on one device")
    device = devices.pop()
    if device.type == "meta":
        raise ValueError(f"lean forward: {name} is offloaded (its weights are on 'meta': device_map put it on "
                         f"the CPU or disk); the lean runtime computes each layer where its weights are, so give "
                         f"the target's devices enough memory (model.max_memory) to hold every layer")
    return device


def _map_key(device_map: Mapping[str, Any], name: str):
    """The device map's entry for module `name`: the longest prefix naming it ("" names all)."""
    matches = [prefix for prefix in device_map if prefix == "" or name == prefix or name.startswith(prefix + ".")]
    if not matches:
        raise ValueError(f"lean forward: the device map names no device for {name}")
    return device_map[max(matches, key=len)]


def _device_of_key(key) -> torch.device:
    return torch.device(f"cuda:{key}" if isinstance(key, int) else key)


def locate(hf_model: nn.Module, device_map: Mapping[str, Any] | None = None,
           devices: Mapping[Any, Any] | None = None) -> tuple[list, list[torch.device]]:
    """(keys, devices) of the embedding, each decoder layer and the head (final norm + lm_head), in
    that order. device_map: {module name prefix: key} as transformers' `hf_device_map` writes it
    (default: the model's own, else each part's weight device); a boundary is where the key changes.
    devices: key -> device (default: int i -> cuda:i, a name -> that device); each part must lie on
    its device. A map whose keys differ while the devices agree (tests: all "cpu") still moves the
    activations at every boundary."""
    inner = hf_model.model
    names = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(len(inner.layers))), "lm_head"]
    # the head is where the lm_head is (the final norm's few weights follow it there)
    parts = [inner.embed_tokens, *inner.layers, hf_model.get_output_embeddings()]
    actual = [_unit_device(part, name) for part, name in zip(parts, names)]
    device_map = device_map if device_map is not None else getattr(hf_model, "hf_device_map", None)
    if not device_map:
        return [str(d) for d in actual], actual
    keys = [_map_key(device_map, name) for name in names]
    wanted = [_device_of_key(devices[key] if devices is not None and key in devices else key) for key in keys]
    for name, want, have in zip(names, wanted, actual):
        if want != have and not (want.type == have.type == "cpu"):
            raise ValueError(f"lean forward: {name} lies on {have}, the device map says {want}")
    return keys, actual


def weight_copies_allowed(devices: Sequence[torch.device], keys: Sequence, weight_bytes: int,
                          available_bytes: int | None = None) -> tuple[bool, str]:
    """Whether the lean forward may hold weight copies in other layouts (module docstring), and why."""
    kinds = sorted({d.type for d in devices} - {"cpu"})
    if kinds:
        return False, f"the target's own weights (on {', '.join(kinds)}: no layout copies)"
    if len(set(keys)) > 1:
        return False, "the target's own weights (split across devices: no layout copies)"
    if available_bytes is None:
        available_bytes = _available_memory()
    if available_bytes is not None and 2 * weight_bytes > available_bytes:
        return False, (f"the target's own weights (two more copies, {2 * weight_bytes / 2**30:.1f} GiB, exceed the "
                       f"{available_bytes / 2**30:.1f} GiB of memory available)")
    return True, "layout copies allowed (CPU, one piece, memory for two more copies)"


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def stages(keys: Sequence, devices: Sequence[torch.device], num_layers: int) -> tuple[list[Stage], Stage]:
    """Runs of consecutive layers on one key (of the first num_layers) and the head's stage;
    keys/devices: embedding, layers, head (as `locate` gives them)."""
    stages, previous = [], keys[0]
    for i in range(num_layers):
        key = keys[1 + i]
        if stages and key == previous:
            stages[-1] = Stage(stages[-1].start, i + 1, stages[-1].device, stages[-1].cross)
        else:
            stages.append(Stage(i, i + 1, devices[1 + i], key != previous))
        previous = key
    return stages, Stage(num_layers, num_layers, devices[-1], keys[-1] != previous)


# -- weights used in place --------------------------------------------------------------------------
def _adjacent(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor whose consecutive rows `tensors` are (views of one storage, in order), or None."""
    first = tensors[0]
    offset = first.storage_offset()
    for tensor in tensors:
        if (not tensor.is_contiguous() or tensor.shape[1:] != first.shape[1:] or tensor.storage_offset() != offset
                or tensor.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        offset += tensor.numel()
    rows = sum(tensor.shape[0] for tensor in tensors)
    return first.as_strided((rows, *first.shape[1:]), (first[0].numel(), *first.stride()[1:]), first.storage_offset())


def fuse_in_place(params: Sequence[nn.Parameter | None], rows: Sequence[int]) -> torch.Tensor | None:
    """Concatenate `params` (weights or biases of linear layers reading one input; None: a missing
    bias, zeros) into one tensor and make each parameter a view of its rows, so the model holds the
    fused tensor instead of the parts. Parameters already fused this way are reused as they are."""
    present = [p for p in params if p is not None]
    if not present:
        return None
    if len(present) == len(params):
        fused = _adjacent([p.detach() for p in params])
        if fused is not None:
            return fused
    parts = [p.detach() if p is not None else present[0].new_zeros(n) for p, n in zip(params, rows)]
    fused = torch.cat(parts)
    start = 0
    for p, n in zip(params, rows):
        if p is not None:
            p.data = fused[start:start + n]
        start += n
    return fused
