"""The draft vocabulary is counted once by the loop, stored in the head of every kind, and read
back from the head by the losses and the eval drafters."""
import json
import logging

import pytest
import torch
import torch.nn.functional as F

from eval.config import RuntimeConfig
from eval.run import build_methods, evaluate
from eval.runtime.model import LeanLlama
from heads.config import MedusaOptions
from heads.eagle import EagleConfig, EagleHead, init_from_target
from heads.io import load_head
from heads.medusa import MedusaConfig, MedusaHeads
from heads.vocab import draft_ids, set_draft_vocab
from tests.tiny import tiny_target
from tests.train.loop_fixtures import tiny_data, tiny_job
from train.loop import build_head_for_job, train_heads
from train.losses import medusa_position_mask
from train.objectives import FrozenParts, OnlineFeatures, frequent_reply_tokens, medusa_step

VOCAB = torch.tensor([3, 5, 8, 13, 21, 34, 55, 89, 100, 120])


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_the_loop_counts_the_vocabulary_once_and_saves_it_in_the_head(tmp_path, kind):
    target, data = tiny_target(), tiny_data()
    job = tiny_job(tmp_path, kind, max_steps=2)
    job.heads.draft_vocab_size = 40
    result = train_heads(job, target, data)
    head, config, _ = load_head(result.last_checkpoint, target)
    expected = frequent_reply_tokens(data.train, 40, target.vocab_size)
    assert config.draft_vocab_size == 40 and torch.equal(draft_ids(head), expected)
    assert json.loads((result.last_checkpoint / "head_config.json").read_text())["config"]["draft_vocab_size"] == 40


def test_without_a_size_the_head_keeps_the_full_vocabulary(tmp_path):
    result = train_heads(tiny_job(tmp_path, "medusa", max_steps=1), tiny_target(), tiny_data())
    head, config, _ = load_head(result.last_checkpoint)
    assert config.draft_vocab_size == 0 and draft_ids(head) is None


def test_init_from_keeps_a_heads_own_vocabulary_and_gives_one_to_a_head_without(tmp_path):
    target, data = tiny_target(), tiny_data()
    without = train_heads(tiny_job(tmp_path / "a", max_steps=1), target, data).last_checkpoint
    job = tiny_job(tmp_path / "b", init_from=str(without))
    job.heads.draft_vocab_size = 40
    counted = frequent_reply_tokens(data.train, 40, target.vocab_size)
    head, config = build_head_for_job(job, target, vocab=counted)
    assert torch.equal(draft_ids(head), counted) and config.draft_vocab_size == 40
    own = train_heads(job, target, data).last_checkpoint  # now a checkpoint with 40 ids
    job = tiny_job(tmp_path / "c", init_from=str(own))
    head, _ = build_head_for_job(job, target, vocab=VOCAB)
    assert torch.equal(draft_ids(head), counted)  # not replaced by another count


@pytest.mark.parametrize("share", [True, False])
def test_medusa_loss_is_a_cross_entropy_over_the_heads_vocabulary(share):
    target = tiny_target()
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig.from_target(target, num_heads=2, share_lm_head=share))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    ids = torch.tensor([[1, 3, 5, 8, 9, 13, 21, 40, 34, 55, 89, 100]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.tensor([[0] * 3 + [1] * 9]),
             "ids": ["r"]}
    features = OnlineFeatures(target)(batch)
    parts = FrozenParts.from_target(target)
    options = MedusaOptions(num_heads=2, loss_decay=0.5)
    full = medusa_step(heads, parts, batch, features, options, 4)
    out = medusa_step(set_draft_vocab(heads, VOCAB), parts, batch, features, options, 4)
    index = {int(t): i for i, t in enumerate(VOCAB)}
    expected, misses = 0.0, []
    for k in range(2):
        mask = medusa_position_mask(batch["loss_mask"], k)[0]
        labels = ids[0, k + 2:][mask[: 12 - (k + 2)]]
        hidden = heads.hidden_one(k, features)[0][mask]
        weight = heads.lm_head_weight(k, target.lm_head.weight)[VOCAB]
        inside = torch.tensor([int(t) in index for t in labels])
        rows = torch.tensor([index[int(t)] for t in labels[inside]])
        expected = expected + 0.5**k * F.cross_entropy(hidden[inside] @ weight.T, rows)
        misses.append(int((~inside).sum()))
        assert out["hits"][k].shape == labels.shape and not out["hits"][k][~inside].any()
    torch.testing.assert_close(out["loss"], expected)
    assert out["out_of_vocab"] == misses and misses[0] > 0  # 1 and 9 lie outside the vocabulary
    assert not torch.allclose(full["loss"], out["loss"])
    out["loss"].backward()
    if not share:
        grad = heads.lm_head_weight(0).grad
        outside = torch.ones(target.vocab_size, dtype=torch.bool)
        outside[VOCAB] = False
        assert grad[outside].abs().sum() == 0 and grad[VOCAB].abs().sum() > 0


def test_eval_drafts_over_the_heads_vocabulary(tmp_path):
    target = tiny_target()
    head = set_draft_vocab(init_from_target(EagleHead(EagleConfig.from_target(target)), target), VOCAB).eval()
    lean = LeanLlama.from_hf(target.model, max_seq_len=64)
    runtime = RuntimeConfig(tree_total_tokens=6, tree_sweep=[], max_new_tokens=6, threads=1, compare_transformers=False)
    methods, _ = build_methods(["eagle_chain"], runtime, lean, head=head)
    assert methods[1].settings["draft_vocab"] == len(VOCAB)
    drafter = methods[1].build()
    assert torch.equal(drafter.vocab, VOCAB)
    prompt = torch.tensor([3, 5, 8, 13, 21])
    report = evaluate(target, [prompt.tolist()], ["eagle_chain"], runtime, head=head, head_config=head.config,
                      out_dir=tmp_path / "with", progress=False)
    assert report["draft_vocab"] == {"size": len(VOCAB), "source": "the head"}
    assert report["drafters"][0]["greedy_identical"] is True


def test_a_head_without_a_vocabulary_drafts_over_the_full_one_and_says_so(tmp_path, caplog):
    target = tiny_target()
    head = init_from_target(EagleHead(EagleConfig.from_target(target)), target).eval()
    runtime = RuntimeConfig(tree_total_tokens=6, tree_sweep=[], max_new_tokens=6, threads=1, compare_transformers=False)
    with caplog.at_level(logging.WARNING, logger="eval.run"):
        report = evaluate(target, [[3, 5, 8, 13, 21]], ["eagle_chain"], runtime, head=head, head_config=head.config,
                          out_dir=tmp_path, progress=False)
    assert report["draft_vocab"] == {"size": target.vocab_size, "source": "none stored: the full vocabulary"}
    assert "carries no draft vocabulary" in caplog.text and "full vocabulary of 128 tokens" in caplog.text
    assert "draft_vocab" not in report["drafters"][0]["settings"]


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
def test_init_vocab_job_resizes_an_eagle3_heads_vocabulary_around_the_jobs_ids(tmp_path, kind):
    target, data = tiny_target(), tiny_data()
    def job_for(folder, **trainer):
        job = tiny_job(folder, kind, **trainer)
        if kind == "peagle":  # the tiny target has 2 layers
            job.heads.peagle.aux_layer_ids = [0, 1, 1]
        return job

    job = job_for(tmp_path / "a", max_steps=1)
    job.heads.draft_vocab_size = 20
    small = frequent_reply_tokens(data.train, 20, target.vocab_size)
    first = train_heads(job, target, data).last_checkpoint
    trained, _, _ = load_head(first, target)
    job = job_for(tmp_path / "b", max_steps=1, init_from=str(first))
    job.heads.draft_vocab_size = 40
    wide = frequent_reply_tokens(data.train, 40, target.vocab_size)
    assert bool(torch.isin(small, wide).all()) and len(small) == 20  # the tiny data counts 40 ids or more
    head, config = build_head_for_job(job, target, vocab=wide)  # by default the head keeps its own
    assert config.draft_vocab_size == 20 and torch.equal(draft_ids(head), small)
    job.trainer.init_vocab = "job"
    head, config = build_head_for_job(job, target, vocab=wide)
    assert config.draft_vocab_size == 40 and torch.equal(draft_ids(head), wide)
    assert head.lm_head.weight.shape[0] == 40 and head.d2t.shape == (40,) and int(head.t2d.sum()) == 40
    kept = torch.isin(wide, small)
    # the rows it trained are kept, id for id; the new ones are the target's, carried by the map
    # the kept rows fit
    from heads.eagle3 import row_map

    assert torch.equal(head.lm_head.weight[kept], trained.lm_head.weight)
    mapped = target.lm_head.weight[wide[~kept]].double() @ row_map(target.lm_head.weight[small], trained.lm_head.weight)
    assert torch.allclose(head.lm_head.weight[~kept], mapped.float(), atol=1e-5)
    assert torch.equal(head.to_target_ids(torch.arange(40)), wide)
    # a run from the resized head trains, saves and loads at the new size
    job.heads.draft_vocab_size = 40
    again, config, _ = load_head(train_heads(job, target, data).last_checkpoint, target)
    assert config.draft_vocab_size == 40 and torch.equal(draft_ids(again), wide)


def test_new_rows_are_the_targets_carried_by_the_map_the_kept_rows_obey():
    """A head whose trained rows are the target's times some matrix M gets new rows = target rows @ M."""
    from heads.eagle3 import Eagle3Config, Eagle3Head, init_from_target, resize_draft_vocab

    target = tiny_target()
    torch.manual_seed(0)
    old = torch.arange(100)  # 100 ids, more than the hidden size 64: M is determined
    head = init_from_target(Eagle3Head(Eagle3Config.from_target(target, draft_vocab_size=100, aux_layer_ids=[0, 1])),
                            target, old)
    M = torch.randn(64, 64) / 8
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[old].float() @ M)
    wide = torch.arange(3, 128)  # drops ids 0-2, adds 100-127
    kept, new = resize_draft_vocab(head, wide, target)
    assert (kept, new) == (97, 28) and head.config.draft_vocab_size == 125
    assert torch.allclose(head.lm_head.weight[97:], target.lm_head.weight[100:].float() @ M, atol=1e-3)
    assert torch.equal(head.lm_head.weight[:97], target.lm_head.weight[3:100].float() @ M)
    assert torch.equal(head.to_target_ids(torch.arange(125)), wide)


def test_init_vocab_job_gives_an_eagle_head_the_jobs_ids_and_a_dflash_head_is_refused(tmp_path):
    target, data = tiny_target(), tiny_data()
    job = tiny_job(tmp_path / "a", max_steps=1)
    job.heads.draft_vocab_size = 20
    eagle = train_heads(job, target, data).last_checkpoint
    job = tiny_job(tmp_path / "b", init_from=str(eagle))
    job.trainer.init_vocab = "job"
    head, config = build_head_for_job(job, target, vocab=VOCAB)
    assert torch.equal(draft_ids(head), VOCAB) and config.draft_vocab_size == len(VOCAB)

    job = tiny_job(tmp_path / "c", "dflash", max_steps=1)
    job.heads.dflash.aux_layer_ids, job.heads.dflash.block_size, job.heads.dflash.max_anchors = [0, 1], 4, 8
    job.heads.draft_vocab_size = 48
    dflash = train_heads(job, target, data).last_checkpoint
    job = tiny_job(tmp_path / "d", "dflash", init_from=str(dflash))
    job.heads.dflash.aux_layer_ids = [0, 1]
    job.trainer.init_vocab = "job"
    with pytest.raises(ValueError, match="trainer.init_vocab=job: a DflashHead"):
        build_head_for_job(job, target, vocab=VOCAB)


def test_init_vocab_takes_only_keep_or_job():
    from train.config import TrainerConfig

    with pytest.raises(ValueError, match="trainer.init_vocab"):
        TrainerConfig(init_vocab="resize").check()
