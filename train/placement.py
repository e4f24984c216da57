"""Where the frozen target goes in each process of a multi-GPU job.

Replicated (it fits one GPU): each process loads its copy onto its own GPU (cuda:LOCAL_RANK).
Split (one GPU cannot hold it, e.g. the 70B target on 80 GB GPUs): the node's GPUs form groups of
`span` (train.plan.target_span decides it from deepspeed.target_placement and the GPU memory);
process r loads its copy with device_map="auto" and max_memory on group r only, so a node of 8
GPUs runs 8 / span copies (launch feature extraction with -n 8/span).
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

log = logging.getLogger(__name__)


def target_gpu_group(local_rank: int, gpus_per_node: int, span: int) -> list[int]:
    """The GPUs one process's copy of a split target occupies: process r of a node with
    gpus_per_node // span processes gets GPUs [r*span, (r+1)*span). span 1 = replicated."""
    if span < 1 or gpus_per_node % span:
        raise ValueError(f"a target split across {span} GPUs does not tile a node of {gpus_per_node}")
    if not 0 <= local_rank < gpus_per_node // span:
        raise ValueError(f"local rank {local_rank} out of range: a node holds {gpus_per_node // span} copies "
                         f"of a target split across {span} GPUs (launch with -n {gpus_per_node // span})")
    return list(range(local_rank * span, (local_rank + 1) * span))


def target_max_memory(local_rank: int, gpus_per_node: int, span: int, gpu_memory_gb: float,
                      headroom: float = 0.9) -> dict[int, str]:
    """`max_memory` for transformers' `from_pretrained(device_map="auto", max_memory=...)` that
    places this process's copy of the target on its GPU group only (pipeline split of the layers)."""
    budget = f"{int(gpu_memory_gb * headroom)}GiB"
    return {gpu: budget for gpu in target_gpu_group(local_rank, gpus_per_node, span)}


def rank_device(model, local_rank: int | None = None):
    """The target config with device "auto" pinned to this process's GPU (cuda:LOCAL_RANK), so the
    ranks of a node do not all load their copies onto cuda:0 first; unchanged without CUDA."""
    if model.device != "auto" or model.device_map is not None or not torch.cuda.is_available():
        return model
    rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    return dataclasses.replace(model, device=f"cuda:{rank}")


def placed_target_config(job, local_rank: int | None = None, gpus_per_node: int | None = None,
                         gpu_memory_gb: float | None = None):
    """job.model for this process: unchanged when it names a device_map itself or without CUDA;
    on this process's GPU (rank_device) when the whole target fits one GPU (train.plan.target_span
    == 1); else device_map="auto" with max_memory on this process's GPU group (target_gpu_group),
    so the target is split across it. GPU count and memory default to this machine's (the plan's
    deepspeed.num_gpus / gpu_memory_gb describe the cluster being planned)."""
    from train.plan import target_span

    model = job.model
    if model.device_map is not None or (gpus_per_node is None and not torch.cuda.is_available()):
        return model
    rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    gpus = gpus_per_node or torch.cuda.device_count()
    memory = gpu_memory_gb or torch.cuda.get_device_properties(rank % gpus).total_memory / 1e9
    here = dataclasses.replace(job, deepspeed=dataclasses.replace(job.deepspeed, num_gpus=gpus, gpu_memory_gb=memory))
    try:
        span = target_span(here)
    except ValueError as error:  # model.arch incomplete: the size of the target is unknown before loading
        if job.deepspeed.target_placement == "split":
            raise ValueError(f"deepspeed.target_placement=split: {error}, or set model.device_map") from None
        span = 1
    if span == 1:
        return rank_device(model, rank)
    # max_memory is written in GiB: convert the GB (1e9) figure the plan uses
    budget = target_max_memory(rank, gpus, span, memory * 1e9 / 2**30, job.deepspeed.memory_headroom)
    log.info("target split across GPUs %s (%d per copy)", sorted(budget), span)
    return dataclasses.replace(model, device_map="auto", max_memory=budget)
