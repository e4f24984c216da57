"""Where a measurement was taken: the device type and the hardware's name, down to the CPU's
vector ISA, which every timing and every setting chosen from timings carries. The clocks
themselves are the runtime's (`eval.runtime.clock`)."""
from __future__ import annotations

import torch


def measured_on(device) -> dict:
    """Where timings were taken, for the settings chosen from them: {"device_type", "hardware"}."""
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        return {"device_type": "cuda", "hardware": torch.cuda.get_device_name(device)}
    return {"device_type": device.type, "hardware": cpu_hardware()}


def cpu_hardware() -> str:
    """'CPU <model> (<ISA>), <n> threads': how timings taken on the CPU name their hardware."""
    return f"CPU {cpu_description()}, {torch.get_num_threads()} threads"


def cpu_info() -> tuple[str, set[str]]:
    """(the CPU's model name, its feature flags) from /proc/cpuinfo; the name falls back to the
    platform's, the flags to an empty set where there is no such file."""
    import platform

    name, flags = "", set()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return name or platform.processor() or platform.machine() or "unknown CPU", flags


def cpu_description() -> str:
    """The CPU's model name and the vector ISA torch's kernels use on it, e.g. 'AMD EPYC (AVX2)' or
    'Intel Xeon ... (AVX512, AMX)': verification cost differs by ISA, so every timing names it."""
    name, flags = cpu_info()
    extras = [torch.backends.cpu.get_cpu_capability()] + (["AMX"] if "amx_tile" in flags else [])
    return f"{name} ({', '.join(extras)})"
