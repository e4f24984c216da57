"""Run logging: `<run_dir>/metrics.jsonl` always, W&B when `logger.kind=wandb` (offline by default,
so it never blocks without a network). Create it on the main process only; others get `None`."""
from __future__ import annotations

import json
import math
import os
import time
import uuid
from pathlib import Path

import torch

from train.config import LoggerConfig


class MetricsLogger:
    def __init__(self, run_dir: str | os.PathLike, config: LoggerConfig, run_config: dict | None = None,
                 resume_step: int = 0):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_after(resume_step)
        self.wandb_run = None
        if config.kind == "wandb" and config.mode != "disabled":
            self.wandb_run = _init_wandb(Path(run_dir), config, run_config)
        elif config.kind not in ("wandb", "none"):
            raise ValueError(f"logger.kind={config.kind!r} is not one of ['none', 'wandb']")

    def _drop_after(self, step: int) -> None:
        """On resume, forget lines the killed run logged after its checkpoint (they are redone)."""
        if not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except ValueError:  # a line cut by a kill
                continue
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict) -> None:
        clean = {k: _plain(v) for k, v in metrics.items()}
        with open(self.path, "a") as handle:
            handle.write(json.dumps({"step": step, "time": round(time.time(), 3), **clean}) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(clean, step=step)

    def summary(self, metrics: dict) -> None:
        if self.wandb_run is not None:
            for key, value in metrics.items():
                self.wandb_run.summary[key] = _plain(value)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _plain(value):
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _init_wandb(run_dir: Path, config: LoggerConfig, run_config: dict | None):
    import wandb

    mode = os.environ.get("WANDB_MODE") or config.mode
    run_id_file = run_dir / "wandb_run_id.txt"  # a resumed job continues the same W&B run
    run_id = run_id_file.read_text().strip() if run_id_file.is_file() else uuid.uuid4().hex[:8]
    run_id_file.write_text(run_id)
    return wandb.init(
        project=config.project, entity=config.entity, name=config.run_name, tags=config.tags,
        config=run_config, dir=str(run_dir), mode=mode, id=run_id, resume="allow",
        settings=wandb.Settings(console="off", silent=True),
    )


def gpu_memory_metrics(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"gpu/memory_allocated_gb": torch.cuda.memory_allocated(device) / 2**30,
            "gpu/max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30}
