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


def prompt_limit(runtime: RuntimeConfig, max_positions: int | None = None) -> tuple[int, str]:
    """(the longest prompt eval takes, what sets it): runtime.max_prompt_tokens, or fewer when the
    model's positions leave less room before runtime.max_new_tokens. A longer prompt would run
    past the positions the model was trained for and stop after a token or two."""
    limit, source = runtime.max_prompt_tokens, f"runtime.max_prompt_tokens={runtime.max_prompt_tokens}"
    if max_positions is not None and max_positions - runtime.max_new_tokens < limit:
        limit = max_positions - runtime.max_new_tokens
        source = (f"the model's max_position_embeddings={max_positions} less "
                  f"runtime.max_new_tokens={runtime.max_new_tokens}")
    if limit < 1:
        raise ValueError(f"runtime.max_new_tokens={runtime.max_new_tokens} leaves no room for a prompt in the model's "
                         f"{max_positions} positions")
    return limit, source


def eval_prompt_records(runtime: RuntimeConfig, data: DataConfig, tokenizer, prompts_file: str | None = None,
                        max_positions: int | None = None) -> list[dict]:
    """Up to runtime.num_prompts prompts (`{"id", "prompt_ids", "category", ...}`): from
    `prompts_file` (else runtime.prompts_file), a JSONL of prompts, or from the held-out side of
    `data`'s split. Prompts longer than `prompt_limit` are refused (a file's, naming the line) or
    passed over (held-out ones, counted in the log)."""
    from data.prompts import eval_prompts, load_prompt_file

    limit, source = prompt_limit(runtime, max_positions)
    path = prompts_file or runtime.prompts_file
    if path:
        prompts = load_prompt_file(path, tokenizer, limit, source)
    else:
        prompts = eval_prompts(data, tokenizer, runtime.num_prompts, limit)
    return prompts[: runtime.num_prompts]


def eval_prompt_ids(runtime: RuntimeConfig, data: DataConfig, tokenizer, prompts_file: str | None = None,
                    max_positions: int | None = None) -> list[list[int]]:
    """eval_prompt_records' prompts as token ids."""
    return [p["prompt_ids"] for p in eval_prompt_records(runtime, data, tokenizer, prompts_file, max_positions)]


def _target_positions(target) -> int | None:
    return getattr(target.config, "max_position_embeddings", None)


def load_eval_head(folder: str | os.PathLike, target, strict_fingerprint: bool = True):
    """A head checkpoint or an export folder -> (head in eval mode, float32, on the target's
    device; its config). Refuses a head trained for another target."""
    from export import load_export

    head, config, _ = load_export(Path(folder), target, strict_fingerprint, dtype="float32")
    return head.to(target.device).eval(), config


def select_drafters(names: Sequence[str], head) -> list[str]:
    """The configured drafters that can run with `head`: a head drafter only when the head is of
    its kind; without a head, the head-free drafters take the head drafters' place."""
    from eval.runtime.drafters.kinds import drafters_for, head_drafters

    if head is None:
        kept = [name for name in names if name not in head_drafters()]
        if len(kept) < len(names):
            kept += [name for name in HEAD_FREE if name not in kept]
            log.info("no head: running head-free drafters only: %s", kept)
        return kept
    fits = drafters_for(head)
    kept = [name for name in names if name not in head_drafters() or name in fits]
    dropped = [name for name in names if name not in kept]
    if not kept:  # only the plain baseline would run: a report without the head it was asked to measure
        raise ValueError(f"runtime.drafters={list(names)}: none of them runs a {type(head).__name__} head; "
                         f"use runtime.drafters={list(fits)}")
    if dropped:
        log.info("drafters %s do not run a %s head; measuring %s", dropped, type(head).__name__, kept)
    return kept


def engine_heads(target, folders: Sequence, work: str | os.PathLike) -> list:
    """Head folders (or (folder, broken cases) pairs) -> eval.engine_eval.EngineHead each: the head
    read by the one head loader, and the folder of the layout vLLM loads for it (the folder itself
    when it is one, its subfolder of that layout as a release head has, else an export of the
    head into `work`)."""
    from eval.engine import VLLM_LAYOUTS, VLLM_METHODS
    from eval.engine_eval import EngineHead
    from export import export_head, load_export
    from export.manifest import MANIFEST_NAME
    from export.validate import read_manifest
    from heads.io import head_type

    heads = []
    for index, item in enumerate(folders):
        folder, broken = (item, ()) if isinstance(item, (str, os.PathLike)) else item
        folder = Path(folder)
        head, config, manifest = load_export(folder, target, dtype="float32")
        layout = VLLM_LAYOUTS[head_type(config)]
        engine_folder, fmt = folder, manifest.get("format")
        if fmt not in VLLM_METHODS and (folder / layout / MANIFEST_NAME).is_file():
            engine_folder, fmt = folder / layout, read_manifest(folder / layout)["format"]
        if fmt not in VLLM_METHODS:
            engine_folder = Path(work) / f"engine_export_{index}" / layout
            log.info("exporting %s as %s into %s for the engine", folder, layout, engine_folder)
            engine_folder, fmt = export_head(head, config, layout, engine_folder, target, dtype="float32"), layout
        heads.append(EngineHead(folder, head, manifest, engine_folder, VLLM_METHODS[fmt], list(broken)))
    return heads


def run_engine_comparison(target, folders: Sequence, prompts: Sequence[dict], runtime: RuntimeConfig,
                          out_dir: str | os.PathLike, k: int | None = None, engine: str = "vllm",
                          transformers: bool = True) -> dict:
    """The engine comparison (eval/engine_eval.py) of head folders on `prompts`: the engine's
    acceptance beside our runtime's chain at the same K and training's estimate."""
    from eval.engine_eval import measure_engine
    from eval.out_folder import claim

    claim(out_dir, ["engine_exports"])
    heads = engine_heads(target, folders, Path(out_dir) / "engine_exports")
    return measure_engine(target, heads, prompts, runtime, out_dir, k, engine, transformers)


def run_engine_stage(target, runtime: RuntimeConfig, data: DataConfig, out_dir: str | os.PathLike,
                     head_folder: str | os.PathLike, engine: str = "vllm", k: int | None = None,
                     prompts_file: str | None = None) -> dict:
    """`python -m eval head=DIR engine=vllm`: the engine comparison of one head on the eval prompts."""
    prompts = eval_prompt_records(runtime, data, target.tokenizer, prompts_file, _target_positions(target))
    report = run_engine_comparison(target, [head_folder], prompts, runtime, out_dir, k, engine,
                                   runtime.compare_transformers)
    report["files"] = {"json": str(Path(out_dir) / "report.json"), "markdown": str(Path(out_dir) / "report.md")}
    return report


def run_eval_stage(target, runtime: RuntimeConfig, data: DataConfig, out_dir: str | os.PathLike, head=None,
                   head_config=None, prompts_file: str | None = None, progress: bool = True) -> dict:
    """Measure the drafters of `runtime.drafters` that fit `head` (None: head-free drafters only)
    on the eval prompts with the frozen `target` (heads.target.FrozenTarget); writes report.json,
    report.md and plots into `out_dir` and returns the report (eval.run.evaluate)."""
    from eval.run import evaluate

    drafters = select_drafters(list(runtime.drafters), head)
    prompts = eval_prompt_ids(runtime, data, target.tokenizer, prompts_file, _target_positions(target))
    return evaluate(target, prompts, drafters, runtime, head=head, head_config=head_config, out_dir=out_dir,
                    progress=progress)
