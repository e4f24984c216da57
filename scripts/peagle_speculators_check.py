"""Load a specheads P-EAGLE export (`speculators_peagle`) with vLLM's `speculators` library (0.9.0)
and compare its draft logits with specheads' PeagleHead on the same rows.

Runs in the venv of scripts/setup_speculators.sh (it imports only torch, safetensors and
speculators), from the repository root:

    .venv-speculators/bin/python scripts/peagle_speculators_check.py --verifier VERIFIER_DIR \
        --export EXPORT_DIR --inputs INPUTS.safetensors

INPUTS (written by the caller, float32): hidden_states (1, T, n·Ht) the aux streams of positions
0..T-1, input_ids (1, T) the token after each position, anchor_pos and depth (R,) the rows to run
(depth 0: every position; depth d > 0: chain anchor_pos at depth d), logits (1, R, Vd) specheads'
draft logits of those rows. PEagleDraftModel.forward draws its rows at random (COD sampling); the
check hands it these rows instead, and reads the logits its lm_head returns, so everything between
(the mask token and mask_hidden, fc, RoPE positions, speculators' own P-EAGLE mask, the layer)
is speculators' code. Prints one JSON object on the last line of stdout.
"""
from __future__ import annotations

import json

import torch

from speculators_load import arguments, common_report, load_speculator, read_tensors


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    args = arguments(__doc__.split("\n\n")[0], argv)
    import speculators.models.peagle.core as peagle_core
    from speculators.losses import resolve_loss_config

    model, config, named = load_speculator(args.export, args.verifier)
    inputs = read_tensors(args.inputs)
    ours = inputs["logits"]
    rows = (inputs["anchor_pos"].long(), inputs["depth"].long())
    peagle_core.generate_cod_sample_indices = lambda **kwargs: rows  # the rows ours ran, not a random draw
    captured = []
    hook = model.lm_head.register_forward_hook(lambda module, a, out: captured.append(out.detach().float()))
    ids = inputs["input_ids"].long()
    T = ids.shape[1]
    try:
        model(hidden_states=inputs["hidden_states"], input_ids=ids, document_ids=torch.zeros_like(ids),
              loss_mask=torch.ones(1, T), verifier_last_hidden_states=torch.zeros(1, T, config.transformer_layer_config.hidden_size),
              num_depths=int(rows[1].max()) + 1,
              loss_config=resolve_loss_config("kl_div", "eager"))  # its fused losses need Triton
    finally:
        hook.remove()
    theirs = captured[0]
    diff = (theirs - ours).abs()
    files = read_tensors(args.export / "model.safetensors")
    return {
        **common_report(model, args.export, named, theirs, ours),
        "mask_hidden_loaded": bool(torch.equal(model.state_dict()["mask_hidden"].float(), files["mask_hidden"].float())),
        "rows": int(rows[0].shape[0]), "depths": int(rows[1].max()) + 1, "draft_vocab": int(ours.shape[-1]),
        "max_abs_diff_per_depth": [float(diff[0, rows[1] == d].max()) for d in range(int(rows[1].max()) + 1)],
    }


if __name__ == "__main__":
    print(json.dumps(main()))
