"""Load a specheads DFlash export (`speculators_dflash`) with vLLM's `speculators` library (0.9.0)
and compare its block logits with specheads' DflashHead on the same blocks.

Runs in the venv of scripts/setup_speculators.sh (it imports only torch, safetensors and
speculators), from the repository root:

    .venv-speculators/bin/python scripts/dflash_speculators_check.py --verifier VERIFIER_DIR \
        --export EXPORT_DIR --inputs INPUTS.safetensors

INPUTS (written by the caller, float32): hidden_states (1, T, n·Ht) the aux streams of positions
0..T-1, input_ids (1, T), anchors (A,) the block anchors, embed_tokens and lm_head (V, H) the
verifier's (the export holds neither, and the hub id in its config cannot be fetched offline;
an export with a draft vocabulary brings its own lm_head rows), logits (1, A·B, V or Vd)
specheads' logits of every slot. DFlashDraftModel draws its anchors at random;
the check hands it these instead and runs its own `_backbone_forward` (fc, hidden_norm, its
anchor-block mask, RoPE positions, its layers and norm). Prints one JSON object.
"""
from __future__ import annotations

import json

import torch

from speculators_load import arguments, common_report, load_speculator, read_tensors


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    args = arguments(__doc__.split("\n\n")[0], argv)
    import speculators.models.dflash.core as dflash_core

    model, config, named = load_speculator(args.export, args.verifier)
    inputs = read_tensors(args.inputs)
    model.embed_tokens.weight.copy_(inputs["embed_tokens"])
    if not model.use_draft_vocab:  # a draft vocabulary's lm_head rows are in the export itself
        model.lm_head.weight.copy_(inputs["lm_head"])
    anchors = inputs["anchors"].long()
    dflash_core.select_anchors = lambda *a, **k: (anchors, torch.ones_like(anchors, dtype=torch.bool))
    ids = inputs["input_ids"].long()
    T, H = ids.shape[1], config.transformer_layer_config.hidden_size
    _, theirs, _, _, _ = model._backbone_forward(
        inputs["hidden_states"], ids, torch.ones(1, T), torch.zeros(1, T, H), torch.zeros_like(ids),
        max_anchors=anchors.numel())
    ours = inputs["logits"]
    B = model.block_size
    diff = (theirs.float() - ours).abs().view(anchors.numel(), B, -1)
    return {
        **common_report(model, args.export, named, theirs, ours),
        "block_size": B, "aux_layer_ids_loaded": list(model.target_layer_ids), "layers": len(model.layers),
        "blocks": int(anchors.numel()), "max_abs_diff_per_slot": [float(diff[:, j].max()) for j in range(B)],
        "draft_vocab_size": int(theirs.shape[-1]), "use_draft_vocab": bool(model.use_draft_vocab),
        "draft_ids": None if model.d2t is None else (torch.arange(model.d2t.numel()) + model.d2t.long()).tolist(),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
