"""What the P-EAGLE and DFlash checks (scripts/peagle_speculators_check.py,
scripts/dflash_speculators_check.py) share, run in the speculators venv: their arguments, loading an
export with `SpeculatorModel.from_pretrained` against a local verifier folder, and the report fields
every check prints (versions, the load audit, how far speculators' logits are from ours)."""
from __future__ import annotations

import argparse
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors import safe_open


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


def arguments(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--export", type=Path, required=True)
    parser.add_argument("--inputs", type=Path, required=True)
    parser.add_argument("--verifier", required=True, help="local folder of the target model")
    return parser.parse_args(argv)


def load_speculator(export: Path, verifier: str):
    """(model in float32, its config, the verifier name the export's config carries). The config's
    hub id cannot be fetched offline, so the local folder stands in for it; flex attention needs a
    GPU, so attention runs through sdpa."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(export)
    named = config.speculators_config.verifier.name_or_path
    config.speculators_config.verifier.name_or_path = verifier
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = SpeculatorModel.from_pretrained(export, config=config, dtype=torch.float32).eval()
    return model, config, named


def common_report(model, export: Path, named: str, theirs: torch.Tensor, ours: torch.Tensor) -> dict:
    """Fields every check reports: versions, the class loaded, weights the file has that the model
    does not take or that changed on loading, and the logit difference over all rows."""
    files = read_tensors(export / "model.safetensors")
    state = model.state_dict()
    theirs, ours = theirs.float(), ours.float()
    return {
        "speculators": version("speculators"), "torch": torch.__version__, "verifier_in_file": named,
        "model_class": type(model).__name__, "mask_token_id_loaded": model.mask_token_id,
        "attention": model.config.transformer_layer_config._attn_implementation,
        "unexpected_keys": sorted(set(files) - set(state)),
        "changed_keys": sorted(k for k, v in files.items() if k in state and not torch.equal(state[k].to(v.dtype), v)),
        "max_abs_diff": float((theirs - ours).abs().max()), "max_abs_logit": float(ours.abs().max()),
        "argmax_agreement": float((theirs.argmax(-1) == ours.argmax(-1)).float().mean()),
    }
