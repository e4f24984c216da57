import torch

from data.collate import collate
from train.losses import eagle_position_mask
from train.objectives import FrozenParts, MemoizedFeatures, OnlineFeatures, eagle_step, frequent_reply_tokens
from tests.tiny import tiny_target


def _batch(rows):
    batch = collate(rows, 0)
    batch["ids"] = [row["id"] for row in rows]
    return batch


def test_memoized_features_match_online_and_skip_the_target():
    online = OnlineFeatures(tiny_target())
    calls = []

    def counting(batch):
        calls.append(len(batch["ids"]))
        return online(batch)

    rows = [{"id": f"r{i}", "input_ids": list(range(3, 3 + n)), "loss_mask": [1] * n} for i, n in enumerate((5, 9, 7))]
    memo = MemoizedFeatures(counting, max_megabytes=1)
    first = memo(_batch(rows[:2]))
    assert calls == [2]
    again = memo(_batch([rows[1], rows[0]]))  # another batch order and padding length
    assert calls == [2]
    torch.testing.assert_close(again[0, :9], first[1, :9])
    torch.testing.assert_close(again[1, :5], first[0, :5])
    assert (again[1, 5:] == 0).all()
    memo(_batch(rows[1:]))  # r2 unseen: the target runs, and r2 is kept
    assert calls == [2, 2] and set(memo.rows) == {"r0", "r1", "r2"}
    tiny = MemoizedFeatures(counting, max_megabytes=5 * 64 * 4 / 2**20)  # room for 5 positions only
    tiny(_batch(rows[:2]))
    assert set(tiny.rows) == {"r0"}


def test_memoized_features_keep_a_bf16_targets_features_exactly_in_half_the_memory():
    low = tiny_target()
    low.model.to(torch.bfloat16)
    online = OnlineFeatures(low, dtype=torch.float32)  # fp32 heads read widened bf16 features
    rows = [{"id": f"r{i}", "input_ids": list(range(3, 3 + n)), "loss_mask": [1] * n} for i, n in enumerate((5, 9))]
    wide, narrow = MemoizedFeatures(online, 1), MemoizedFeatures(online, 1, torch.bfloat16)
    first = narrow(_batch(rows))
    wide(_batch(rows))
    assert first.dtype == torch.float32 and narrow.rows["r0"].dtype == torch.bfloat16
    assert narrow.used * 2 == wide.used
    again = narrow(_batch(rows[::-1]))  # from memory: fp32 again, bit for bit
    assert again.dtype == torch.float32
    assert torch.equal(again[0, :9], first[1, :9]) and torch.equal(again[1, :5], first[0, :5])


def test_frequent_reply_tokens_counts_assistant_tokens_only_ties_by_id():
    rows = [{"input_ids": [5, 5, 7, 9, 9, 9], "loss_mask": [0, 0, 1, 1, 1, 1]},
            {"input_ids": [3, 7, 2], "loss_mask": [1, 1, 0]}]
    # reply counts: 9 x3, 7 x2, 3 x1 (5 and 2 are prompt tokens)
    assert frequent_reply_tokens(rows, 2, 16).tolist() == [7, 9]
    assert frequent_reply_tokens(rows, 4, 16).tolist() == [0, 3, 7, 9]  # a zero-count tie: lowest id
    assert frequent_reply_tokens(rows, 99, 16).shape == (16,)


def test_eagle_step_scores_the_heads_draft_vocabulary_only():
    from heads.config import EagleOptions
    from heads.eagle import EagleConfig, EagleHead
    from heads.vocab import set_draft_vocab

    target = tiny_target()
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.from_target(target))
    rows = [{"id": "r0", "input_ids": list(range(3, 15)), "loss_mask": [0] * 4 + [1] * 8}]
    batch = _batch(rows)
    features = OnlineFeatures(target)(batch)
    options = EagleOptions(feature_loss_weight=0.0, logit_loss_weight=1.0, input_noise=0.0)
    vocab = torch.tensor([1, 4, 8, 20, 33])
    full = eagle_step(head, FrozenParts.from_target(target), batch, features, options, 4)
    sub = eagle_step(set_draft_vocab(head, vocab), FrozenParts.from_target(target), batch, features, options, 4)
    # by hand: teacher and draft softmax over the five rows only
    parts = FrozenParts.from_target(target)
    mask = eagle_position_mask(batch["loss_mask"], batch["attention_mask"])
    embeds = parts.embed(batch["input_ids"][:, 1:])
    predicted, _ = head(embeds, features[:, :-1], torch.arange(11)[None])
    w = parts.lm_head_weight[vocab]
    p = torch.softmax(features[:, 1:][mask] @ w.T, -1)
    expected = -(p * torch.log_softmax(predicted[mask] @ w.T, -1)).sum(-1).mean()
    torch.testing.assert_close(sub["loss"], expected)
    assert not torch.allclose(full["loss"], sub["loss"])


def test_eagle_step_unrolled_scores_the_heads_own_chain_like_the_evaluation():
    from heads.config import EagleOptions
    from heads.eagle import EagleConfig, EagleHead
    from train.heldout import eagle_unroll
    from train.losses import eagle_loss

    target = tiny_target()
    torch.manual_seed(1)
    head = EagleHead(EagleConfig.from_target(target))
    rows = [{"id": "r0", "input_ids": list(range(3, 17)), "loss_mask": [0] * 3 + [1] * 11},
            {"id": "r1", "input_ids": list(range(40, 50)), "loss_mask": [0] * 2 + [1] * 8}]
    batch = _batch(rows)
    features = OnlineFeatures(target)(batch)
    parts = FrozenParts.from_target(target)
    options = EagleOptions(input_noise=0.0, train_steps=3, unroll_loss_decay=0.5)
    out = eagle_step(head, parts, batch, features, options, 8)
    one = eagle_step(head, parts, batch, features, EagleOptions(input_noise=0.0), 8)
    torch.testing.assert_close(out["feature_loss"], one["feature_loss"])  # step 0 figures are step 0's
    assert out["positions"] == one["positions"]
    # reference: the evaluation's unrolled chains, scored step by step
    chains = eagle_unroll(head, parts, batch["input_ids"], features, 3)
    base = eagle_position_mask(batch["loss_mask"], batch["attention_mask"])
    n, expected = base.shape[1], 0.0
    for j, predicted in enumerate(chains):
        valid = torch.zeros_like(base)
        valid[:, : n - j] = base[:, j:]
        truth = torch.zeros_like(features[:, 1:])
        truth[:, : n - j] = features[:, 1 + j:]
        step = eagle_loss(predicted[valid], truth[valid], None, parts.lm_head_weight, 1.0, 0.1, 8)
        expected += 0.5**j * float(step["loss"])
    assert abs(float(out["loss"].detach()) - expected) < 1e-4 * expected
    assert float(out["loss"].detach()) > float(one["loss"].detach())
    out["loss"].backward()  # gradients reach the head through every step
    assert head.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0


def test_frozen_parts_follow_the_heads_device():
    """A split target's embedding and lm_head lie on its group's first and last GPU: the heads' copy is
    on their own device, and none is made where they already are."""
    target = tiny_target()
    here = FrozenParts.from_target(target, "cpu")
    assert here.embed_weight.data_ptr() == target.embed_tokens.weight.data_ptr()
    moved = FrozenParts.from_target(target, "meta")
    assert moved.embed_weight.device.type == "meta" and moved.lm_head_weight.device.type == "meta"
