"""Load a specheads DFlash export (`speculators_dflash`) with vLLM's `speculators` library (0.9.0)
and compare its block logits with specheads' DflashHead on the same blocks.

Runs in the venv of scripts/setup_speculators.sh (it imports only torch, safetensors and
speculators), from the repository root:

    .venv-speculators/bin/python scripts/dflash_speculators_check.py --verifier VERIFIER_DIR \
        --export EXPORT_DIR --inputs INPUTS.safetensors

INPUTS (written by the caller, float32): hidden_states (1, T, n·Ht) the aux streams of positions
0..T-1, input_ids (1, T), anchors (A,) the block anchors, embed_tokens and lm_head (V, H) the
verifier's (the export holds neither, and the hub id in its config cannot be fetched offline),
logits (1, A·B, V) specheads' logits of every slot. DFlashDraftModel draws its anchors at random;
the check hands it these instead and runs its own `_backbone_forward` (fc, hidden_norm, its
anchor-block mask, RoPE positions, its layers and norm). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors import safe_open


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", type=Path, required=True)
    parser.add_argument("--inputs", type=Path, required=True)
    parser.add_argument("--verifier", required=True, help="local folder of the target model")
    args = parser.parse_args(argv)
    import speculators.models.dflash.core as dflash_core
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(args.export)
    named = config.speculators_config.verifier.name_or_path
    config.speculators_config.verifier.name_or_path = args.verifier
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention needs a GPU
    model = SpeculatorModel.from_pretrained(args.export, config=config, dtype=torch.float32).eval()
    inputs = read_tensors(args.inputs)
    model.embed_tokens.weight.copy_(inputs["embed_tokens"])
    model.lm_head.weight.copy_(inputs["lm_head"])
    anchors = inputs["anchors"].long()
    dflash_core.select_anchors = lambda *a, **k: (anchors, torch.ones_like(anchors, dtype=torch.bool))
    ids = inputs["input_ids"].long()
    T, H = ids.shape[1], config.transformer_layer_config.hidden_size
    _, theirs, _, _, _ = model._backbone_forward(
        inputs["hidden_states"], ids, torch.ones(1, T), torch.zeros(1, T, H), torch.zeros_like(ids),
        max_anchors=anchors.numel())
    ours = inputs["logits"]
    files = read_tensors(args.export / "model.safetensors")
    state = model.state_dict()
    B = model.block_size
    diff = (theirs.float() - ours).abs().view(anchors.numel(), B, -1)
    return {
        "speculators": version("speculators"), "torch": torch.__version__, "verifier_in_file": named,
        "model_class": type(model).__name__, "block_size": B, "mask_token_id_loaded": model.mask_token_id,
        "aux_layer_ids_loaded": list(model.target_layer_ids), "layers": len(model.layers),
        "attention": model.config.transformer_layer_config._attn_implementation,
        "unexpected_keys": sorted(set(files) - set(state)),
        "changed_keys": sorted(k for k, v in files.items() if k in state and not torch.equal(state[k].to(v.dtype), v)),
        "blocks": int(anchors.numel()), "max_abs_diff_per_slot": [float(diff[:, j].max()) for j in range(B)],
        "max_abs_diff": float(diff.max()), "max_abs_logit": float(ours.abs().max()),
        "argmax_agreement": float((theirs.argmax(-1) == ours.argmax(-1)).float().mean()),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
