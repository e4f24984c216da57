"""The eval stage's one door: `python -m eval` and the training pipeline's eval stage both call
`run_eval_stage`, so a head is measured the same way wherever the command starts.

It owns what both routes need before the measurement: the prompts (a JSONL file, else the held-out
side of the data split), the head (`export.load_export`: a native checkpoint or any export folder)
and the drafters that fit it. The head's draft vocabulary is read from the head itself by
`eval.run.evaluate` (heads.vocab.draft_ids); nothing here counts one.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

from data.config import DataConfig
from eval.config import RuntimeConfig

log = logging.getLogger(__name__)
HEAD_FREE = ("prompt_lookup", "self_speculation")  # what runs when no head is given


def eval_prompt_records(runtime: RuntimeConfig, data: DataConfig, tokenizer, prompts_file: str | None = None
                        ) -> list[dict]:
    """Up to runtime.num_prompts prompts (`{"id", "prompt_ids", "category", ...}`): from
    `prompts_file` (else runtime.prompts_file), a JSONL of prompts, or from the held-out side of
    `data`'s split."""
    from data.prompts import eval_prompts, load_prompt_file

    path = prompts_file or runtime.prompts_file
    if path:
        prompts = load_prompt_file(path, tokenizer, runtime.max_prompt_tokens)
    else:
        prompts = eval_prompts(data, tokenizer, runtime.num_prompts, runtime.max_prompt_tokens)
    return prompts[: runtime.num_prompts]


def eval_prompt_ids(runtime: RuntimeConfig, data: DataConfig, tokenizer, prompts_file: str | None = None
                    ) -> list[list[int]]:
    """eval_prompt_records' prompts as token ids."""
    return [p["prompt_ids"] for p in eval_prompt_records(runtime, data, tokenizer, prompts_file)]


def load_eval_head(folder: str | os.PathLike, target, strict_fingerprint: bool = True):
    """A head checkpoint or an export folder -> (head in eval mode, float32, on the target's
    device; its config). Refuses a head trained for another target."""
    from export import load_export

    head, config, _ = load_export(Path(folder), target, strict_fingerprint, dtype="float32")
    return head.to(target.device).eval(), config


def select_drafters(names: Sequence[str], head) -> list[str]:
    """The configured drafters that can run with `head`: a head drafter only when the head is of
    its kind; without a head, the head-free drafters take the head drafters' place."""
    from eval.run import HEAD_DRAFTERS

    if head is None:
        kept = [name for name in names if name not in HEAD_DRAFTERS]
        if len(kept) < len(names):
            kept += [name for name in HEAD_FREE if name not in kept]
            log.info("no head: running head-free drafters only: %s", kept)
        return kept
    kept = [name for name in names if name not in HEAD_DRAFTERS or isinstance(head, HEAD_DRAFTERS[name])]
    dropped = [name for name in names if name not in kept]
    if dropped:
        log.info("drafters %s do not run a %s head; measuring %s", dropped, type(head).__name__, kept)
    return kept


def run_engine_stage(target, runtime: RuntimeConfig, data: DataConfig, out_dir: str | os.PathLike,
                     head_folder: str | os.PathLike, engine: str = "vllm", k: int | None = None,
                     prompts_file: str | None = None) -> dict:
    """The engine comparison (eval/engine_eval.py) of one head folder on the eval prompts: the
    engine's acceptance beside our runtime's chain at the same K and training's estimate."""
    from eval.engine_eval import measure_engine

    prompts = eval_prompt_records(runtime, data, target.tokenizer, prompts_file)
    report = measure_engine(target, [head_folder], prompts, runtime, out_dir, k, engine,
                            transformers=runtime.compare_transformers)
    report["files"] = {"json": str(Path(out_dir) / "report.json"), "markdown": str(Path(out_dir) / "report.md")}
    return report


def run_eval_stage(target, runtime: RuntimeConfig, data: DataConfig, out_dir: str | os.PathLike, head=None,
                   head_config=None, prompts_file: str | None = None, progress: bool = True) -> dict:
    """Measure the drafters of `runtime.drafters` that fit `head` (None: head-free drafters only)
    on the eval prompts with the frozen `target` (heads.target.FrozenTarget); writes report.json,
    report.md and plots into `out_dir` and returns the report (eval.run.evaluate)."""
    from eval.run import evaluate

    drafters = select_drafters(list(runtime.drafters), head)
    prompts = eval_prompt_ids(runtime, data, target.tokenizer, prompts_file)
    return evaluate(target, prompts, drafters, runtime, head=head, head_config=head_config, out_dir=out_dir,
                    progress=progress)
