"""EAGLE-3 through the training loop on the tiny target: its draft vocabulary, figures, resume."""
import json
import shutil

import pytest
import torch

from heads.eagle3 import Eagle3Head
from heads.io import load_head
from train.loop import train_heads
from train.objectives import frequent_reply_tokens
from tests.tiny import tiny_target
from tests.train.loop_fixtures import tiny_data, tiny_job


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _eagle3_job(run_dir, **trainer):
    job = tiny_job(run_dir, "eagle3", **trainer)
    job.heads.draft_vocab_size = 64  # half the tiny vocabulary: some target top-1s fall outside
    job.heads.eagle3.ttt_steps = 3
    return job


def test_the_head_carries_the_training_splits_vocabulary_and_logs_each_step(tmp_path):
    target, data = tiny_target(), tiny_data()
    result = train_heads(_eagle3_job(tmp_path, max_steps=4, eval_every=4, save_every=4), target, data)
    head, config, meta = load_head(result.last_checkpoint, target)
    assert isinstance(head, Eagle3Head) and meta["type"] == "eagle3"
    assert config.aux_layer_ids == [0, 1, 1] and config.draft_vocab_size == 64
    assert torch.equal(head.draft_ids(), frequent_reply_tokens(data.train, 64, 128))
    assert int(head.t2d.sum()) == 64
    train_rows = [r for r in _rows(tmp_path) if "train/loss" in r]
    keys = set().union(*train_rows)
    assert {"train/top1_step0", "train/top1_step1", "train/top1_step2", "train/loss_step0", "train/loss_step2",
            "train/out_of_vocab"} <= keys
    assert all(0.0 < r["train/out_of_vocab"] < 1.0 for r in train_rows)
    assert {f"eval/top1_step{j}" for j in range(4)} <= set(result.final_eval)
    assert result.final_eval["eval/acceptance_length"] >= 1.0


def test_resume_reproduces_the_losses(tmp_path):
    target, data = tiny_target(), tiny_data()
    job = _eagle3_job(tmp_path, keep_last=3)
    train_heads(job, target, data)
    uninterrupted = {r["step"]: r["train/loss"] for r in _rows(tmp_path) if "train/loss" in r}
    shutil.rmtree(tmp_path / "checkpoints" / "step-00000008")  # the run died after its step-4 checkpoint
    train_heads(job, target, data)
    resumed = {r["step"]: r["train/loss"] for r in _rows(tmp_path) if "train/loss" in r}
    for step in range(5, 9):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5)


def test_a_run_refuses_features_without_its_aux_layers(tmp_path):
    from train.objectives import OnlineFeatures

    target = tiny_target()
    with pytest.raises(ValueError, match=r"supplies target layers \(-1,\).*eagle3 head reads \(0, 1, 1, -1\)"):
        train_heads(_eagle3_job(tmp_path, max_steps=1), target, tiny_data(), source=OnlineFeatures(target))


def test_build_starts_the_draft_lm_head_from_the_targets_rows():
    from train.kinds import head_kind

    target = tiny_target()
    kind = head_kind(_eagle3_job("unused").heads)
    vocab = torch.tensor([3, 9, 17, 40, 99])
    head, config = kind.build(target, vocab)
    assert config.draft_vocab_size == 5 and torch.equal(head.draft_ids(), vocab)
    torch.testing.assert_close(head.lm_head.weight, target.lm_head.weight[vocab])
    torch.testing.assert_close(head.norm.weight, target.final_norm.weight)
    full, config = kind.build(target, None)  # draft_vocab_size 0: the whole vocabulary
    assert config.draft_vocab_size == 128 and torch.equal(full.draft_ids(), torch.arange(128))
    assert kind.feature_layers(30) == (0, 1, 1, -1) and kind.init_layers() == [0]
    kind.options.aux_layer_ids = None
    assert kind.feature_layers(30) == (2, 15, 27, -1)  # SmolLM2-135M's defaults
