"""Run logging: `<run_dir>/metrics.jsonl` always, W&B when `logger.kind=wandb` (offline by default,
so it never blocks without a network). Create it on the main process only; others get `None`.

W&B layout of a job: one run per stage (job_type data, train, eval, export), grouped under the
job's id (`<run_dir>/wandb_run_id.txt`, also the train run's id). Artifacts carry the lineage
dataset -> checkpoint -> export: each stage run declares the artifacts it read and logs the one it
made (`log_lineage_artifact`); `<run_dir>/wandb_artifacts.json` remembers what the job logged, so a
re-run of later stages finds its inputs. An offline run cannot declare inputs to W&B
(`use_artifact` needs the server): it lists them in its config (`lineage_inputs`), and
scripts/wandb_dashboard.py declares them after `wandb sync`.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
import uuid
from pathlib import Path

import torch

from train.config import LOGGER_KINDS, LoggerConfig


class MetricsLogger:
    def __init__(self, run_dir: str | os.PathLike, config: LoggerConfig, run_config: dict | None = None,
                 resume_step: int = 0):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_after(resume_step)
        self.wandb_run = None
        if config.kind == "wandb" and config.mode != "disabled":
            self.wandb_run = _init_wandb(Path(run_dir), config, run_config)
        elif config.kind not in LOGGER_KINDS:
            raise ValueError(f"logger.kind={config.kind!r} is not one of {sorted(LOGGER_KINDS)}")

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

    def log_checkpoint(self, path: str | os.PathLike | None, name: str) -> None:
        """The head the job keeps, as the train run's output artifact (input: the job's dataset)."""
        if self.wandb_run is not None and path is not None:
            log_lineage_artifact(self.wandb_run, self.path.parent, "checkpoint", f"{name}-checkpoint", "model",
                                 folders={"checkpoint": path}, metadata={"path": str(path)}, inputs=("dataset",))

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


def job_id(run_dir: Path) -> str:
    """The job's W&B id: its train run's id and its stage runs' group (kept across resumes)."""
    path = Path(run_dir) / "wandb_run_id.txt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(uuid.uuid4().hex[:8])
    return path.read_text().strip()


def _init_wandb(run_dir: Path, config: LoggerConfig, run_config: dict | None):
    import wandb

    run_id = job_id(run_dir)  # a resumed job continues the same W&B run
    return wandb.init(
        project=config.project, entity=config.entity, name=config.run_name, tags=config.tags,
        config=run_config, dir=str(run_dir), mode=config.mode, id=run_id,
        resume="allow", group=run_id, job_type="train", settings=wandb.Settings(console="off", silent=True),
    )


@contextlib.contextmanager
def stage_run(config: LoggerConfig, run_dir: str | os.PathLike, job_type: str, run_config: dict | None = None):
    """A W&B run for one stage of the job (data, eval, export), in the job's group; yields None
    when W&B logging is off. While it is open, `wandb.run` is set (eval's report logs to it)."""
    if config.kind != "wandb" or config.mode == "disabled":
        yield None
        return
    import wandb

    run_dir = Path(run_dir)
    run = wandb.init(project=config.project, entity=config.entity, tags=config.tags, config=run_config,
                     dir=str(run_dir), mode=config.mode, group=job_id(run_dir),
                     job_type=job_type, name=f"{config.run_name}-{job_type}" if config.run_name else None,
                     settings=wandb.Settings(console="off", silent=True))
    try:
        yield run
    finally:
        run.finish()


LINEAGE_FILE = "wandb_artifacts.json"


def artifact_name(text: str) -> str:
    """W&B artifact names allow letters, digits, '-', '_' and '.'."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.")[:120] or "unnamed"


def log_lineage_artifact(run, run_dir: str | os.PathLike, role: str, name: str, artifact_type: str,
                         folders: dict[str, str | os.PathLike] | None = None, files: list | None = None,
                         metadata: dict | None = None, inputs: tuple[str, ...] = ()) -> dict | None:
    """Declare the artifacts this job logged under `inputs` (roles, e.g. "dataset") as read by
    `run`, and log `folders` ({name: path}, by reference: checksummed, never copied) plus small
    `files` as artifact `name`, remembered in <run_dir>/wandb_artifacts.json under `role`.
    Returns the record (name, type, digest, version when known), or None without a run."""
    if run is None:
        return None
    import wandb

    run_dir = Path(run_dir)
    used = declare_inputs(run, run_dir, inputs)
    artifact = wandb.Artifact(artifact_name(name), type=artifact_type, metadata={**(metadata or {}), "inputs": used})
    for folder_name, folder in (folders or {}).items():
        artifact.add_reference(Path(folder).resolve().as_uri(), name=folder_name)
    for path in files or []:
        artifact.add_file(str(path))
    logged = run.log_artifact(artifact)
    record = {"name": artifact.name, "type": artifact_type, "digest": artifact.digest}
    if not _offline(run):
        logged.wait()
        record["version"] = logged.version
    records = {**read_lineage(run_dir), role: record}
    tmp = run_dir / f".{LINEAGE_FILE}.tmp"
    tmp.write_text(json.dumps(records, indent=1))
    tmp.replace(run_dir / LINEAGE_FILE)
    return record


def read_lineage(run_dir: str | os.PathLike) -> dict:
    path = Path(run_dir) / LINEAGE_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def declare_inputs(run, run_dir: str | os.PathLike, roles: tuple[str, ...]) -> list[dict]:
    """The artifacts this job logged under `roles`, declared as read by `run`: in its config
    (`lineage_inputs`, always) and, online, through `use_artifact` (an offline run cannot;
    scripts/wandb_dashboard.py declares them after `wandb sync`). Returns their records."""
    records = read_lineage(run_dir)
    used = [records[role] for role in roles if role in records]
    if run is None or not used:
        return used
    run.config.update({"lineage_inputs": used}, allow_val_change=True)
    if not _offline(run):
        for record in used:
            if record.get("version"):
                run.use_artifact(f"{record['name']}:{record['version']}", type=record["type"])
    return used


def _offline(run) -> bool:
    return bool(getattr(getattr(run, "settings", None), "_offline", False))


def gpu_memory_metrics(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"gpu/memory_allocated_gb": torch.cuda.memory_allocated(device) / 2**30,
            "gpu/max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30}
