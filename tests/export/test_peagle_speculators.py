"""A real loader for P-EAGLE: vLLM's `speculators` 0.9.0 (its own venv, scripts/setup_speculators.sh)
loads our `speculators_peagle` export of a head for the embedded SmolLM2 as a PEagleDraftModel, runs
its own forward on rows we choose (every depth-0 row and every chain at depths 1..K-1, its P-EAGLE
mask, its mask token and mask_hidden) and its logits match our PeagleHead's on the same real
features (scripts/peagle_speculators_check.py)."""
from __future__ import annotations

import pytest
import torch

from tests.speculators_driver import driver

TOLERANCE = 1e-3  # float32 on both sides; only the order of float operations differs
K = 4


@torch.no_grad()
def _head(target):
    from heads.eagle3 import init_from_target
    from heads.peagle import PeagleConfig, PeagleHead

    generator = torch.Generator().manual_seed(0)
    config = PeagleConfig.from_target(target, draft_vocab_size=4096, norm_before_residual=True, speculative_tokens=K)
    torch.manual_seed(0)
    head = init_from_target(PeagleHead(config), target,
                            torch.randperm(config.vocab_size, generator=generator)[:4096].sort().values)
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):  # a swapped norm must show
        getattr(head.midlayer, name).weight.normal_(1.0, 0.2, generator=generator)
    return head.eval(), config


@torch.no_grad()
def _our_rows(head, target, embedding):
    """Our logits (1, R, Vd) for every depth-0 row and every full chain, with their (anchor, depth)."""
    from train.objectives import FrozenParts
    from train.peagle_objective import context_forward, slot_forward

    tokens = torch.tensor([target.tokenizer(driver().TEXT)["input_ids"]])
    T = tokens.shape[1] - 1
    layers = head.config.aux_layer_ids
    hidden_states = target.features(tokens[:, :-1], layers=layers).hidden
    aux = torch.cat([hidden_states[i] for i in layers], dim=-1).float()  # (1, T, n·Ht)
    parts = FrozenParts(embedding, target.lm_head.weight.detach().float())
    out, past = context_forward(head, parts, tokens, head.project(aux))
    chains = torch.arange(T - K + 1)
    anchors, depths = chains.repeat_interleave(K - 1), torch.arange(1, K).repeat(chains.numel())
    slots = slot_forward(head, parts, past, anchors[None], depths[None], aux.dtype)
    logits = head.logits(torch.cat([out, slots], 1))
    return {"hidden_states": aux.contiguous(), "input_ids": tokens[:, 1:].contiguous(),
            "anchor_pos": torch.cat([torch.arange(T), anchors]), "depth": torch.cat([torch.zeros(T, dtype=torch.long), depths]),
            "logits": logits.contiguous()}


@pytest.mark.long(10)
@pytest.mark.integration
def test_speculators_loads_our_peagle_export_and_matches_our_logits(tmp_path, smollm2):
    from safetensors.torch import load_file, save_file

    from export import export_head, load_export

    compare = driver()
    head, config = _head(smollm2)
    folder = export_head(head, config, "speculators_peagle", tmp_path / "peagle", smollm2, dtype="bfloat16")
    loaded, _, _ = load_export(folder, smollm2, dtype="float32")
    embedding = load_file(str(folder / "model.safetensors"))["embed_tokens.weight"].float()
    save_file(_our_rows(loaded.eval(), smollm2, embedding), str(tmp_path / "inputs.safetensors"))
    report = compare.run_script("peagle_speculators_check.py", folder, tmp_path / "inputs.safetensors", smollm2)
    print(f"speculators {report['speculators']} {report['model_class']}: max abs logit diff per depth "
          f"{report['max_abs_diff_per_depth']} (logits up to {report['max_abs_logit']:.1f}), argmax agreement "
          f"{report['argmax_agreement']}")
    assert report["model_class"] == "PEagleDraftModel" and report["mask_token_id_loaded"] == 0
    assert report["unexpected_keys"] == [] and report["changed_keys"] == [] and report["mask_hidden_loaded"]
    assert report["depths"] == K and report["draft_vocab"] == 4096
    assert report["max_abs_diff"] < TOLERANCE, report
    assert report["argmax_agreement"] == 1.0, report
