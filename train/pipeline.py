"""Runs the stages of one job in order: data -> [features] -> train -> eval -> export."""
from __future__ import annotations

import logging

from train.job import JobConfig

log = logging.getLogger(__name__)


def run_job(job: JobConfig) -> None:
    log.info("job %s: stages %s", job.recipe, job.stages)
    raise NotImplementedError("stages are being built")
