"""DFlash's objective: anchors, the block mask, dpace weights, the step and the held-out counts."""
import json

import pytest
import torch

from heads.config import DflashOptions
from train.dflash_objective import (DflashKind, block_attention_mask, dflash_eval_counts, dflash_step, dpace_weights,
                                    run_blocks, select_anchors, slot_targets)
from heads.io import load_head
from train.loop import train_heads
from train.objectives import FINAL, FrozenParts, OnlineFeatures
from tests.tiny import tiny_target
from tests.train.loop_fixtures import tiny_data, tiny_job


def setup(block_size=4, T=20, B=2):
    target = tiny_target()
    options = DflashOptions(aux_layer_ids=[0, 1], num_layers=2, block_size=block_size, max_anchors=6, eval_anchors=5)
    kind = DflashKind(options)
    head, _ = kind.build(target, None)
    ids = torch.randint(3, 128, (B, T))
    attention = torch.ones(B, T, dtype=torch.long)
    attention[1, T - 5:] = 0
    loss = attention.clone()
    loss[:, :3] = 0
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss, "ids": ["a", "b"]}
    features = OnlineFeatures(target, kind.feature_layers(2))(batch)
    return target, kind, head, batch, features


def test_anchors_lie_on_loss_positions_before_the_last_block():
    loss = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0, 0, 0, 0]])
    attention = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])
    anchors, valid = select_anchors(loss, attention, 100, 3, torch.Generator().manual_seed(0))
    assert anchors[0][valid[0]].tolist() == [2, 3, 4, 5, 6]  # t < 10 - 3
    assert anchors[1][valid[1]].tolist() == [1, 2]  # t < 6 - 3
    few, ok = select_anchors(loss, attention, 2, 3)
    assert ok.sum(-1).tolist() == [2, 2] and bool((few[:, 1] > few[:, 0]).all())


def test_a_block_sees_the_context_before_its_anchor_and_its_whole_self():
    mask = block_attention_mask(torch.tensor([[2, 5]]), 8, 3)[0, 0]  # (6, 8 + 6)
    assert mask.shape == (6, 14)
    assert mask[:3, :8].sum(-1).tolist() == [2, 2, 2] and mask[3:, :8].sum(-1).tolist() == [5, 5, 5]
    assert bool(mask[:3, 8:11].all()) and not bool(mask[:3, 11:].any()) and bool(mask[3:, 11:].all())


def test_dpace_weights_follow_the_formula():
    ce = torch.tensor([[0.0, 0.5, 1.0, 2.0]])
    counted = torch.tensor([[False, True, True, True]])
    alpha = 0.5
    s = [1.0] + [(1 - alpha) * float(torch.exp(-c)) + alpha for c in ce[0, 1:]]
    prefix = [s[0], s[0] * s[1], s[0] * s[1] * s[2], s[0] * s[1] * s[2] * s[3]]
    expected = [0.0, prefix[1] + prefix[2] + prefix[3], prefix[2] + prefix[3], prefix[3]]
    assert torch.allclose(dpace_weights(ce, counted, alpha)[0], torch.tensor(expected))


def test_each_block_in_the_batch_equals_it_run_alone_on_its_own_context():
    target, kind, head, batch, features = setup()
    parts = FrozenParts.from_target(target)
    aux = features[..., : 2 * 64]
    anchors = torch.tensor([[3, 9], [4, 7]])
    together = run_blocks(head, parts, batch["input_ids"], aux, anchors)  # (B, 2, Bk, D)
    for b in range(2):
        for a in range(2):
            anchor = int(anchors[b, a])
            alone = run_blocks(head, parts, batch["input_ids"][b:b + 1, :anchor + 4], aux[b:b + 1, :anchor + 4],
                               torch.tensor([[anchor]]))
            assert torch.allclose(together[b, a], alone[0, 0], atol=1e-5)


def test_slots_are_scored_at_the_position_before_them():
    target, kind, head, batch, features = setup()
    final = features[..., 2 * 64:]
    anchors, valid = torch.tensor([[3], [14]]), torch.tensor([[True], [True]])
    counted, rows = slot_targets(final, batch["loss_mask"], anchors, valid, 4)
    assert rows[0, 0].tolist() == [2, 3, 4, 5]
    assert counted[0, 0].tolist() == [False, True, True, True]
    assert counted[1, 0].tolist() == [False, False, False, False]  # row 1 ends at 15: slots 15.. are padding


def test_step_trains_every_part_and_counts_its_slots():
    target, kind, head, batch, features = setup()
    out = dflash_step(head, FrozenParts.from_target(target), batch, features, kind.options, 7)
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and out["positions"] == int(out["counted"].sum()) > 0
    assert not bool(out["counted"][..., 0].any())
    for name, p in head.named_parameters():
        assert p.grad is not None and bool(p.grad.abs().sum() > 0), name
    means, rates = kind.figures(out)
    assert set(rates) == {"top1_step0", "top1_step1", "top1_step2", "out_of_vocab"}
    assert rates["out_of_vocab"] == (0.0, float(out["positions"]))  # the full vocabulary: nothing outside


def test_held_out_counts_are_one_row_per_drafted_token_and_repeat():
    target, kind, head, batch, features = setup()
    parts = FrozenParts.from_target(target)
    truths = []
    first = dflash_eval_counts(head, parts, batch, features, kind.options, truths)
    again = dflash_eval_counts(head, parts, batch, features, kind.options, truths)
    assert first.shape == (3, 3) and torch.equal(first, again) and len(truths) == 1
    assert bool((first[:, 0] <= first[:, 1]).all() and (first[:, 1] <= first[:, 2]).all())


def test_the_kind_reads_aux_streams_and_the_final_state():
    kind = DflashKind(DflashOptions())
    assert kind.feature_layers(30) == (2, 15, 27, FINAL) and kind.eval_rows == 15


def test_a_draft_vocabulary_scores_its_rows_and_leaves_other_tokens_out():
    target, kind, full, batch, features = setup()
    vocab = torch.arange(0, 128, 2)  # the even ids
    head, config = kind.build(target, vocab)
    assert config.draft_vocab_size == 64 and torch.equal(head.draft_ids(), vocab)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[vocab])
    head.load_state_dict(full.state_dict(), strict=False)  # the same layers: logits are the full head's columns
    out = torch.randn(5, config.hidden_size)
    torch.testing.assert_close(head.logits(out), full.logits(out, target.lm_head.weight)[:, vocab])
    assert torch.equal(head.to_target_ids(torch.tensor([0, 3])), torch.tensor([0, 6]))
    parts = FrozenParts.from_target(target)
    torch.manual_seed(0)
    step = dflash_step(head, parts, batch, features, kind.options, 7, torch.Generator().manual_seed(1))
    reference = dflash_step(full, parts, batch, features, kind.options, 7, torch.Generator().manual_seed(1))
    assert torch.equal(step["counted"], reference["counted"])  # the same anchors and slots
    outside = step["out_of_vocab"]
    assert 0 < outside < step["positions"] and torch.isfinite(step["loss"])
    # a slot whose target token is odd can never be hit; the full head's hits on even tokens carry over only
    # where its argmax was even, so the vocabulary head hits at least those
    assert int(step["hits"].sum()) <= step["positions"] - outside
    step["loss"].backward()
    assert head.lm_head.weight.grad is None and head.fc.weight.grad.abs().sum() > 0  # the target's rows stay frozen
    trained = {id(p) for group in kind.param_groups(head, 1e-3) for p in group["params"]}
    assert id(head.lm_head.weight) not in trained and id(head.fc.weight) in trained
    counts = dflash_eval_counts(head, parts, batch, features, kind.options, [])
    assert bool((counts[:, 0] <= counts[:, 1]).all() and (counts[:, 1] <= counts[:, 2]).all())


def test_the_loop_trains_and_evaluates_a_dflash_head(tmp_path):
    job = tiny_job(tmp_path, "dflash", max_steps=2, eval_every=2, save_every=2)
    job.heads.dflash.aux_layer_ids, job.heads.dflash.block_size, job.heads.dflash.max_anchors = [0, 1], 4, 8
    result = train_heads(job, tiny_target(), tiny_data())
    assert result.head_type == "dflash"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"eval/top1_step0", "eval/top1_step2", "eval/acceptance_length"} <= set(rows[-1])


def test_the_loop_trains_a_dflash_head_over_a_draft_vocabulary(tmp_path):
    job = tiny_job(tmp_path, "dflash", max_steps=2, eval_every=2, save_every=2)
    job.heads.dflash.aux_layer_ids, job.heads.dflash.block_size, job.heads.dflash.max_anchors = [0, 1], 4, 8
    job.heads.draft_vocab_size = 48
    result = train_heads(job, tiny_target(), tiny_data())
    head, config, _ = load_head(result.last_checkpoint)
    assert config.draft_vocab_size == 48 and head.draft_ids().numel() == 48
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("train/out_of_vocab" in row for row in rows) and "eval/top1_step0" in rows[-1]
