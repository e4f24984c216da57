"""Wall-clock readings that mean the same on every device.

CUDA kernels run asynchronously: `time.perf_counter()` around GPU work measures how long the
launches took, not the work. Every timed region of the runtime (calibration, generation, the
speculation gate, the benchmarks) reads its clock through `device_clock`, which waits for the
device's queued work before each reading when the work runs on CUDA, and is a bare
`perf_counter` elsewhere (CPU work is synchronous). The runtime itself times its steps (the
speculation gate decides from them), so the clock lives here; naming the hardware that took a
measurement is eval's (`eval.timing`)."""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import torch


def _cuda_synchronize(device: torch.device) -> None:
    torch.cuda.synchronize(device)


def on_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def module_device(module: torch.nn.Module) -> torch.device:
    """Where a module's work runs: its `output_device` when it has one (a split target's last work,
    which waits for the rest), else its first parameter or buffer's; CPU when it has none."""
    device = getattr(module, "output_device", None)
    if device is not None:
        return torch.device(device)
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def device_clock(device=None) -> Callable[[], float]:
    """A `perf_counter` that first waits for `device`'s queued work when it is a CUDA device."""
    if not on_cuda(device):
        return time.perf_counter
    device = torch.device(device)

    def now() -> float:
        _cuda_synchronize(device)
        return time.perf_counter()

    return now


class Elapsed:
    seconds: float = 0.0


@contextlib.contextmanager
def timed(device=None) -> Iterator[Elapsed]:
    """`with timed(device) as t: ...` then `t.seconds`: the region's wall time, the device's work
    included (synchronised on entry and exit on CUDA)."""
    clock, elapsed = device_clock(device), Elapsed()
    start = clock()
    yield elapsed
    elapsed.seconds = clock() - start
