"""`python -m export ckpt=DIR format=eagle out=DIR [dtype=bfloat16] [base=MODEL] [overwrite=true]` (Hydra,
config conf/export/default.yaml) and `python -m export validate DIR [base=MODEL]`.

ckpt: a head checkpoint or any export folder. format: one of native, eagle, eagle_vllm, eagle3,
eagle3_vllm, speculators, medusa, medusa_vllm (written into `out`); without it every entry of `formats` is written to `out/<format>`. eval_report: an eval report.json whose recommended
runtime the manifests carry (a batch-size sweep's holds the speculation policy per batch size);
default: the checkpoint's own measured record. base: the
base model (hub id, local folder, GGUF file, `embedded:smollm2-135m-instruct`); default: the
target the head was trained on. An existing `out` is replaced only when it is an earlier export of
the same format and head type (overwrite=true: any export); a folder that is not an export is
never replaced. Hydra's flags (`--cfg job`, `--info`, `--help`, `-m`) go anywhere among the
overrides; each job of a multirun writes to `out/<its overrides>`. Hydra and OmegaConf stop here.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from export.config import ExportConfig
from heads.cli import TaskFlag, exit_status, hydra_argv, interrupted, sweep_output
from heads.recommended import RecommendedRuntime

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf" / "export")
USAGE = "usage: python -m export ckpt=DIR format=FORMAT out=DIR [dtype=...] [base=MODEL] [overwrite=true]\n" \
        "       python -m export validate DIR [base=MODEL]"


def load_base(spec: str):
    from heads.target import TargetConfig, load_target

    return load_target(TargetConfig(name_or_path=spec, device="cpu"))


def _report_runtime(path: str) -> RecommendedRuntime:
    """The recommended runtime of an eval report.json (e.g. a batch-size sweep's, with its policy)."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"eval_report={path}: cannot read an eval report.json ({error})") from error
    runtime = report.get("recommended_runtime") if isinstance(report, dict) else None
    if not isinstance(runtime, dict) or not runtime:
        raise ValueError(f"eval_report={path}: no recommended_runtime in it (a report of `python -m eval` with a head)")
    return RecommendedRuntime.from_dict(runtime)


def run_export(cfg: ExportConfig) -> dict[str, Path]:
    from export import ExportError, export_all, export_head, load_export
    from export.manifest import runtime_from_manifest

    if not cfg.ckpt or not cfg.out:
        raise ExportError("ckpt=... and out=... are required\n" + USAGE)
    head, config, manifest = load_export(cfg.ckpt, None, dtype="float32")
    target = load_base(cfg.base or config.target_name)
    extra = {key: manifest.get(key) for key in ("training", "eval") if isinstance(manifest.get(key), dict)}
    if cfg.eval_report:
        runtime = _report_runtime(cfg.eval_report)
    else:
        runtime = runtime_from_manifest(manifest.get("runtime"))
    if runtime is not None:
        extra["runtime"] = runtime
    if cfg.format is None:
        return export_all(head, config, cfg.formats, cfg.out, target, cfg.dtype, cfg.native_dtype, extra,
                          cfg.strict_fingerprint, cfg.overwrite)
    dtype = (cfg.native_dtype or cfg.dtype) if cfg.format == "native" else cfg.dtype
    return {cfg.format: export_head(head, config, cfg.format, cfg.out, target, dtype, extra, cfg.strict_fingerprint,
                                    cfg.overwrite)}


# What a user's input can cause (ExportError, HeadMismatchError and HeadFileError are ValueErrors;
# a missing or unreadable path an OSError): a message, not a traceback.
_EXPECTED = (ValueError, OSError, OmegaConfBaseException)


VALIDATE_HELP = """Check an export folder: each file's sha256, every key, shape, dtype and config field against
its format, and with base=MODEL the base model's fingerprint, tokenizer and copied tensors. A head
checkpoint folder (head_config.json, no specheads.json) is checked by loading it: a training
checkpoint's files against the sha256 its trainer_state.json recorded. Exit status: 0 valid,
1 invalid (each problem named), 2 a usage error or a path that does not exist."""


def _validate_checkpoint(folder: str, target) -> dict:
    from export import load_export

    _, _, manifest = load_export(folder, target, dtype=None)
    return {"folder": folder, "format": "checkpoint", "head_type": manifest["type"], "base_checked": target is not None}


def run_validate(args: list[str]) -> int:
    from export import ExportValidationError, validate_export
    from export.manifest import MANIFEST_NAME
    from heads.io import CONFIG_NAME

    if {"--help", "-h"} & set(args):
        print(f"{USAGE}\n\n{VALIDATE_HELP}")
        return 0
    folders = [arg for arg in args if "=" not in arg]
    options = dict(arg.split("=", 1) for arg in args if "=" in arg)
    if len(folders) != 1 or set(options) - {"base"}:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        target = load_base(options["base"]) if options.get("base") else None
    except _EXPECTED as error:
        print(f"export error: base={options['base']}: {error}", file=sys.stderr)
        return 2
    folder = Path(folders[0])
    checkpoint = not (folder / MANIFEST_NAME).is_file() and (folder / CONFIG_NAME).is_file()
    try:
        summary = _validate_checkpoint(str(folder), target) if checkpoint else validate_export(folder, target)
    except OSError as error:  # no such folder: nothing to judge
        print(f"export error: {error}", file=sys.stderr)
        return 2
    except (ExportValidationError, ValueError) as error:  # a damaged head or one for another base
        print(f"INVALID {error}", file=sys.stderr)
        return 1
    print(json.dumps({"valid": True, **summary}, indent=2))
    return 0


def to_export_config(cfg: DictConfig) -> ExportConfig:
    merged = OmegaConf.merge(OmegaConf.structured(ExportConfig), cfg)
    return OmegaConf.to_object(merged)


TASK = TaskFlag()  # Hydra's own errors end before it is set (heads.cli.exit_status)


@hydra.main(config_path=CONF_DIR, config_name="default", version_base="1.3")
def main(cfg: DictConfig) -> None:
    TASK.started = True
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    hydra_config = HydraConfig.get()
    if hydra_config.mode == RunMode.MULTIRUN and cfg.out:
        cfg.out = sweep_output(cfg.out, list(hydra_config.overrides.task), "out")
    try:
        paths = run_export(to_export_config(cfg))
    except _EXPECTED as error:
        print(f"export error: {error}", file=sys.stderr)
        sys.exit(2)
    for fmt, path in paths.items():
        print(f"{fmt}: {path}")


def cli(argv: list[str]) -> int:
    """The command line without the interpreter: `validate ...` or Hydra overrides."""
    if argv and argv[0] == "validate":
        return run_validate(argv[1:])
    saved, sys.argv = sys.argv, [sys.argv[0] if sys.argv else "export", *hydra_argv(argv)]
    TASK.started = False
    try:
        main()
    except HydraException as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    except SystemExit as exit_:
        return exit_status(exit_, TASK)
    except KeyboardInterrupt:
        return interrupted("an export is renamed into place only when whole: out holds the previous export or nothing, "
                           "never half of one; run the command again")
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
