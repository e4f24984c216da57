"""`python -m train [+recipe=NAME] [key=value ...]`: the Hydra entry point of a whole job.

Hydra and OmegaConf stop here: the composed config becomes a `JobConfig` dataclass tree, is
validated before any heavy work, and the library code receives plain dataclasses. Hydra's flags
(`--cfg job`, `--info`, `--help`, `-m`) go anywhere among the overrides. Each job of a multirun
(`-m trainer.learning_rate=1e-3,3e-4`) writes to `trainer.output_dir/<its overrides>`.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from heads.cli import TaskFlag, exit_status, hydra_argv, interrupted, sweep_output
from train.job import ConfigError, JobConfig, validate_job

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")

ConfigStore.instance().store(name="job_schema", node=JobConfig)


def to_job(cfg: DictConfig) -> JobConfig:
    """Structured DictConfig -> validated JobConfig dataclass."""
    job = OmegaConf.to_object(cfg)
    assert isinstance(job, JobConfig), type(job)
    return validate_job(job)


def compose_job(overrides: list[str] | None = None) -> JobConfig:
    """Compose conf/config.yaml with command-line style overrides, without running a job."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides or []))
    return to_job(cfg)


TASK = TaskFlag()  # Hydra's own errors end before it is set (heads.cli.exit_status)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from train.pipeline import run_job

    TASK.started = True
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    hydra_config = HydraConfig.get()
    if hydra_config.mode == RunMode.MULTIRUN:
        cfg.trainer.output_dir = sweep_output(cfg.trainer.output_dir, list(hydra_config.overrides.task),
                                              "trainer.output_dir")
    try:
        job = to_job(cfg)
    except (ConfigError, OmegaConfBaseException) as error:
        print(f"config error: {error}", file=sys.stderr)
        sys.exit(2)
    from train.checkpoint import TrainingDiverged

    if job.trainer.num_threads:  # one setting for every stage of the job (validate_job: runtime.threads agrees)
        import torch

        torch.set_num_threads(job.trainer.num_threads)
    try:
        run_job(job)
    except (ValueError, OSError, TrainingDiverged) as error:  # bad input, a refused resume, a diverged run
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def cli(argv: list[str]) -> int:
    """The command line without the interpreter; returns the exit status."""
    saved, sys.argv = sys.argv, [sys.argv[0] if sys.argv else "train", *hydra_argv(argv)]
    TASK.started = False
    try:
        main()
    except HydraException as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    except SystemExit as exit_:
        return exit_status(exit_, TASK)
    except KeyboardInterrupt:
        return interrupted("checkpoints and feature or regenerated shards are renamed into place only when "
                           "whole, so what trainer.output_dir holds is usable; the same command continues from "
                           "it (trainer.resume=auto)")
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
