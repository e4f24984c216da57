"""A real loader for DFlash: vLLM's `speculators` 0.9.0 (its own venv, scripts/setup_speculators.sh)
loads our `speculators_dflash` export of a head for the embedded SmolLM2 as a DFlashDraftModel, runs
its own block forward at anchors we choose, and its logits match our DflashHead's on the same real
features (scripts/dflash_speculators_check.py)."""
from __future__ import annotations

import pytest
import torch

from tests.speculators_driver import driver

TOLERANCE = 1e-3  # float32 on both sides; only the order of float operations differs
BLOCK = 8


@torch.no_grad()
def _head(target, draft_vocab: torch.Tensor | None = None):
    from heads.dflash import DflashConfig, DflashHead, init_from_target

    size = 0 if draft_vocab is None else draft_vocab.numel()
    config = DflashConfig.from_target(target, num_layers=2, block_size=BLOCK, draft_vocab_size=size)
    torch.manual_seed(0)
    head = init_from_target(DflashHead(config), target, draft_vocab)
    generator = torch.Generator().manual_seed(0)
    for name, p in head.named_parameters():  # every norm away from 1, so a swapped one shows
        if p.dim() == 1:
            p.normal_(1.0, 0.2, generator=generator)
    return head.eval(), config


@pytest.mark.long(10)
@pytest.mark.integration
@pytest.mark.parametrize("vocab", [None, 8192], ids=["target-vocabulary", "draft-vocabulary"])
def test_speculators_loads_our_dflash_export_and_matches_our_logits(tmp_path, smollm2, vocab):
    """Also with a draft vocabulary: its lm_head rows and d2t travel in the file and speculators
    scores the same Vd ids."""
    from safetensors.torch import save_file

    from export import export_head, load_export
    from train.dflash_objective import run_blocks
    from train.objectives import FrozenParts

    compare = driver()
    ids = None if vocab is None else torch.arange(1, 6 * vocab, 6)  # every sixth id: not a prefix of the vocabulary
    head, config = _head(smollm2, ids)
    folder = export_head(head, config, "speculators_dflash", tmp_path / "dflash", smollm2, dtype="float32")
    loaded, _, _ = load_export(folder, smollm2, dtype="float32")
    tokens = torch.tensor([smollm2.tokenizer(compare.TEXT)["input_ids"]])
    hidden = smollm2.features(tokens, layers=config.aux_layer_ids).hidden
    aux = torch.cat([hidden[i] for i in config.aux_layer_ids], dim=-1).float()
    parts = FrozenParts.from_target(smollm2)
    anchors = torch.tensor([0, 3, 11, tokens.shape[1] - BLOCK - 1])
    with torch.no_grad():
        out = run_blocks(loaded.eval(), parts, tokens, aux, anchors[None])
        logits = loaded.logits(out.flatten(1, 2), parts.lm_head_weight)  # (1, A·B, V)
    save_file({"hidden_states": aux.contiguous(), "input_ids": tokens.contiguous(), "anchors": anchors,
               "embed_tokens": parts.embed_weight.float().contiguous(), "lm_head": parts.lm_head_weight.float().clone(),
               "logits": logits.contiguous()}, str(tmp_path / "inputs.safetensors"))
    report = compare.run_script("dflash_speculators_check.py", folder, tmp_path / "inputs.safetensors", smollm2)
    print(f"speculators {report['speculators']} DFlash: max abs logit diff {report['max_abs_diff']:.2e} "
          f"(logits up to {report['max_abs_logit']:.1f}), per slot {report['max_abs_diff_per_slot']}, "
          f"argmax agreement {report['argmax_agreement']}")
    assert report["model_class"] == "DFlashDraftModel" and report["attention"] == "sdpa"
    assert report["block_size"] == BLOCK and report["layers"] == 2 and report["mask_token_id_loaded"] == 0
    assert report["aux_layer_ids_loaded"] == [2, 15, 27]
    assert report["unexpected_keys"] == [] and report["changed_keys"] == []
    assert report["verifier_in_file"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert report["max_abs_diff"] < TOLERANCE, report
    assert report["argmax_agreement"] == 1.0, report
    assert report["use_draft_vocab"] == (vocab is not None) and report["draft_vocab_size"] == (vocab or 49152)
    if vocab is not None:
        assert report["draft_ids"] == ids.tolist()
