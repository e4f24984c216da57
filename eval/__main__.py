"""`python -m eval [head=DIR|release] [runtime.drafters=[...]] [runtime.KEY=...] [model=...] [prompts_file=...] [out=DIR]`

Measures drafters on held-out ShareGPT prompts (or a JSONL of prompts) and writes report.json,
report.md and plots to `out` (a folder holding files eval did not write only with `overwrite=true`).
`head` is a head checkpoint or an export folder; without it only the head-free drafters run
(prompt_lookup, self_speculation). `eagle_tree` and `eagle_chain` run an EAGLE-1/2 or an EAGLE-3
head alike. Every head drafts over the vocabulary it carries (counted when it was trained; EAGLE-3:
its d2t map); a head saved without one drafts over the full vocabulary, with a warning.
`head=release` is the trained EAGLE head shipped in the repository for the embedded default
(SmolLM2-135M-Instruct), the export folder `heads/release/eagle_smollm2_135m/`:

    python -m eval head=release                    # EAGLE-2 tree + chain + prompt lookup vs plain
    python -m eval head=release runtime.drafters=[eagle_tree] runtime.num_prompts=4
    python -m eval head=release engine=vllm engine_k=3   # vLLM runs the head's export beside our chain

On the CPU runtime (conf/runtime/cpu.yaml) the EAGLE tree size is chosen at start from the
verification-cost curve measured on the machine (`runtime.tree_total_tokens=auto`; an integer fixes
it), and `runtime.fallback=true` switches to plain decoding steps while speculation does not pay.
Hydra's flags (`--cfg job`, `--info`, `--help`, `-m`) go anywhere among the overrides; each job of a
multirun writes to `out/<its overrides>`. Hydra and OmegaConf stop here.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.config import DataConfig
from eval.config import RuntimeConfig, check_runtime, wandb_mode
from heads.checks import known_fields
from heads.cli import TaskFlag, exit_status, hydra_argv, interrupted, sweep_output
from heads.target import TargetConfig

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = str(ROOT / "conf")
RELEASE_HEAD_DIR = ROOT / "heads" / "release" / "eagle_smollm2_135m"  # head=release
log = logging.getLogger("eval")


@dataclass
class EvalModelConfig(TargetConfig):
    arch: Any = None  # the model group's shape check (used by training); ignored here


@dataclass
class EvalEntryConfig:
    model: EvalModelConfig = field(default_factory=EvalModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    logger: Any = None  # the logger group: {kind, project, entity, mode, run_name, tags}
    head: str | None = None  # head checkpoint or export folder; None: head-free drafters only
    strict_fingerprint: bool = True
    prompts_file: str | None = None
    out: str = "runs/eval"
    overwrite: bool = False  # let eval replace files in `out` that no earlier eval wrote (eval/out_folder.py)
    progress: bool = True
    engine: str | None = None  # vllm: the serving engine runs the head's export beside our chain (eval/engine_eval.py)
    engine_k: int | None = None  # drafted tokens per step in the engine comparison; None: the head's chain depth


ConfigStore.instance().store(name="eval_schema", node=EvalEntryConfig)


def compose_eval(overrides: list[str] | None = None) -> EvalEntryConfig:
    """Compose conf/eval.yaml with command-line style overrides into the entry's dataclass."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="eval", overrides=list(overrides or [])))


def resolve_head(head: str) -> Path:
    """`head=` value -> folder: the alias `release` names RELEASE_HEAD_DIR; anything else is a path."""
    if head != "release":
        return Path(head)
    if not (RELEASE_HEAD_DIR / "specheads.json").is_file():
        raise FileNotFoundError(f"head=release: no release head export at {RELEASE_HEAD_DIR} (expected an export "
                                "folder with specheads.json); pass head=DIR for another checkpoint or export")
    return RELEASE_HEAD_DIR


def load_eval_head(head: str, target, strict_fingerprint: bool = True):
    """`head=` (a head checkpoint, an export folder or `release`) -> (head in eval mode on the
    target's device, config), through the eval stage's loader."""
    from eval.stage import load_eval_head as load

    return load(resolve_head(head), target, strict_fingerprint)


def check_eval_config(cfg: EvalEntryConfig) -> None:
    """The checks `python -m train` runs on the same settings, before any model loads."""
    known_fields(cfg)
    check_runtime(cfg.runtime)
    if cfg.engine is not None:
        from eval.engine import ENGINES

        if cfg.engine not in ENGINES:
            raise ValueError(f"engine={cfg.engine!r} is not one of {list(ENGINES)}")
        if not cfg.head:
            raise ValueError(f"engine={cfg.engine} measures a head's export: give head=DIR (or head=release)")
        if cfg.engine_k is not None and (isinstance(cfg.engine_k, bool) or cfg.engine_k < 1):
            raise ValueError(f"engine_k={cfg.engine_k!r} must be an int >= 1")
    cfg.model.check()
    cfg.data.check()
    path = cfg.prompts_file or cfg.runtime.prompts_file
    if path and not Path(path).is_file():
        from data.prompts import not_a_file

        raise FileNotFoundError(f"prompts_file={path}: {not_a_file(path)}")


def run(cfg: EvalEntryConfig) -> dict:
    from eval.out_folder import check_out_folder
    from eval.stage import run_eval_stage
    from heads.target import load_target

    runtime = cfg.runtime
    check_eval_config(cfg)
    check_out_folder(cfg.out, cfg.overwrite)  # a user's report.md in `out` is refused before minutes of measuring
    if cfg.head:
        resolve_head(cfg.head)  # a missing release head fails before the target loads
    if runtime.threads:
        import torch

        torch.set_num_threads(runtime.threads)
    target = load_target(TargetConfig(**{f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(TargetConfig)}))
    if cfg.engine:
        from eval.stage import run_engine_stage

        report = run_engine_stage(target, runtime, cfg.data, cfg.out, resolve_head(cfg.head), cfg.engine,
                                  cfg.engine_k, cfg.prompts_file)
        print(Path(report["files"]["markdown"]).read_text())
        return report
    head, head_config = load_eval_head(cfg.head, target, cfg.strict_fingerprint) if cfg.head else (None, None)
    logger = cfg.logger or {}
    if logger.get("kind") == "wandb" and logger.get("mode") != "disabled":
        import wandb

        wandb.init(project=logger.get("project"), entity=logger.get("entity"), mode=wandb_mode(logger.get("mode")),
                   name=logger.get("run_name"), tags=logger.get("tags"), job_type="eval",
                   config={"runtime": dataclasses.asdict(runtime), "head": cfg.head})
    report = run_eval_stage(target, runtime, cfg.data, cfg.out, head, head_config, cfg.prompts_file, cfg.progress)
    print(Path(report["files"]["markdown"]).read_text())
    return report


TASK = TaskFlag()  # Hydra's own errors end before it is set (heads.cli.exit_status)


@hydra.main(config_path=CONF_DIR, config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    TASK.started = True
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    hydra_config = HydraConfig.get()
    if hydra_config.mode == RunMode.MULTIRUN:
        cfg.out = sweep_output(cfg.out, list(hydra_config.overrides.task), "out")
    try:
        run(OmegaConf.to_object(cfg))
    except (ValueError, OSError, OmegaConfBaseException) as error:  # what a user's input can cause
        print(f"eval error: {error}", file=sys.stderr)
        sys.exit(2)


def cli(argv: list[str]) -> int:
    """The command line without the interpreter; returns the exit status."""
    saved, sys.argv = sys.argv, [sys.argv[0] if sys.argv else "eval", *hydra_argv(argv)]
    TASK.started = False
    try:
        main()
    except HydraException as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    except SystemExit as exit_:
        return exit_status(exit_, TASK)
    except KeyboardInterrupt:
        return interrupted("the measurement was not finished and its report not written; run the command again")
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
