import pytest
import torch
import torch.nn.functional as F

from data.collate import collate
from heads.eagle3 import Eagle3Config, Eagle3Head, init_from_target
from train.eagle3_objective import eagle3_step, feature_layers, later_chains, row_index, split_features, ttt_unroll
from train.losses import draft_vocab_teacher, eagle3_loss
from train.objectives import FrozenParts, OnlineFeatures
from tests.tiny import tiny_target

AUX = [0, 1, 3]


@pytest.fixture(scope="module")
def target():
    return tiny_target(num_hidden_layers=4)


def _head(target, vocab: torch.Tensor, seed: int = 0, **options) -> Eagle3Head:
    torch.manual_seed(seed)
    config = Eagle3Config.from_target(target, draft_vocab_size=vocab.numel(), aux_layer_ids=AUX, **options)
    head = init_from_target(Eagle3Head(config), target, vocab)
    with torch.no_grad():  # fc's input norms away from ones, so that a skipped or swapped one shows
        for name, weight in head.named_parameters():
            if name.startswith(("input_norm.", "fc_norm.")):
                weight.normal_(1.0, 0.3)
    return head


def _batch():
    rows = [{"id": "a", "input_ids": list(range(3, 17)), "loss_mask": [0] * 3 + [1] * 9 + [0, 1]},
            {"id": "b", "input_ids": list(range(60, 70)), "loss_mask": [0] * 2 + [1] * 8}]  # padded to 14
    batch = collate(rows, 0)
    batch["ids"] = [row["id"] for row in rows]
    return batch


def _reference(head, target, batch, features, steps, decay, evaluation=False):
    """Chain by chain, as a KV-cached draft loop runs it: per step the mean soft-CE over counted
    chains whose target top-1 is a draft id, the hits among all counted chains, the out-of-vocab
    count."""
    parts = FrozenParts.from_target(target)
    ids, loss_mask, attention = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
    aux, final = split_features(features, len(AUX))
    t2d = head.t2d
    sums, counts, hits, outside = [0.0] * steps, [0] * steps, [0] * steps, [0] * steps
    greedy, chains = [0] * steps, [0] * steps  # the evaluation's top-1 vs the target's greedy token
    for b in range(ids.shape[0]):
        T = int(attention[b].sum())
        for t in range(T - 2):
            pos = torch.arange(t + 1)[None]
            out, kv = head(parts.embed(ids[b:b + 1, 1:t + 2]), head.project(aux[b:b + 1, : t + 1]), pos,
                           use_cache=True)
            out = out[:, -1:]
            for j in range(steps):
                if t + 2 + j >= T:  # the chain ran off the row's end
                    break
                if j:  # norm_output: the state the draft scored goes back, not the pre-norm one
                    hidden = head.norm(out) if head.config.norm_output else out
                    out, kv = head(parts.embed(ids[b:b + 1, t + 1 + j: t + 2 + j]), hidden, torch.tensor([[t + j]]),
                                   past_key_values=kv, use_cache=True)
                if not loss_mask[b, t + 2 + j]:
                    continue
                full = final[b, t + 1 + j] @ parts.lm_head_weight.T  # (V,)
                draft = head.logits(out[0, 0])  # (Vd,)
                chains[j] += 1
                greedy[j] += int(head.to_target_ids(draft.argmax()) == full.argmax())
                if not t2d[full.argmax()]:
                    outside[j] += 1
                    continue
                p = torch.softmax(full[t2d], -1)
                sums[j] = sums[j] - (p * torch.log_softmax(draft, -1)).sum()
                counts[j] += 1
                hits[j] += int(draft.argmax() == full[t2d].argmax())
    losses = [s / max(c, 1) for s, c in zip(sums, counts)]
    if evaluation:
        return greedy, chains
    return sum(decay**j * loss for j, loss in enumerate(losses)), losses, hits, outside


def test_feature_layers_and_split():
    assert feature_layers([2, 15, 27]) == (2, 15, 27, -1)
    x = torch.arange(2 * 3 * 8.0).view(2, 3, 8)
    aux, final = split_features(x, 3)
    assert aux.shape == (2, 3, 6) and torch.equal(final, x[..., 6:])
    with pytest.raises(ValueError, match="aux layers"):
        split_features(torch.zeros(1, 2, 7), 2)


def test_later_steps_run_only_the_chains_they_score():
    counted = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1, 0, 0]], dtype=torch.bool)
    # steps 1..2 score chain t when counted[t+1] or counted[t+2]
    chains = later_chains(counted, 3)
    assert chains[0].tolist() == [0, 1, 2, 4, 5]
    assert chains[1, :2].tolist() == [3, 4] and len(set(chains[1].tolist())) == 5  # then padding chains
    assert later_chains(counted, 1).shape == (2, 1)
    assert row_index(counted).tolist() == [[-1, -1, 0, 1, -1, -1, 2, -1], [-1, -1, -1, -1, -1, 3, -1, -1]]


@pytest.mark.parametrize("options", [{}, {"norm_before_fc": True, "norm_output": True},
                                     {"fc_norm": True, "norm_before_residual": True}, {"norm_output": True}])
def test_step_matches_a_chain_by_chain_draft_loop(target, options):
    """Ids, positions, targets and the loss mask shift by one per step; out-of-vocab positions are
    left out of the loss and counted; steps weigh decay**j; the EAGLE-3.1 options as a draft loop
    runs them."""
    vocab = torch.randperm(128)[:64].sort().values  # about half the target's top-1s fall outside
    head = _head(target, vocab, **options)
    batch = _batch()
    features = OnlineFeatures(target, feature_layers(AUX))(batch)
    assert features.shape == (2, 14, 4 * 64)
    parts = FrozenParts.from_target(target)
    out = eagle3_step(head, parts, batch, features, steps=3, decay=0.5, chunk_size=5)
    total, losses, hits, outside = _reference(head, target, batch, features, 3, 0.5)
    assert out["out_of_vocab"] == outside and min(outside) > 0
    assert [int(h.sum()) for h in out["hits"]] == hits
    assert [h.numel() for h in out["hits"]] == [10 + 8, 10 + 7, 9 + 6]  # chains t with x_{t+2+j} an assistant token
    assert out["positions"] == 18
    for ours, theirs in zip(out["step_losses"], losses):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["loss"], total, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["loss"], sum(0.5**j * loss for j, loss in enumerate(out["step_losses"])))


def test_one_step_is_the_teacher_forced_loss_over_the_whole_vocabulary(target):
    head = _head(target, torch.arange(128))  # Vd = V: nothing is out of vocabulary
    batch = _batch()
    features = OnlineFeatures(target, feature_layers(AUX))(batch)
    out = eagle3_step(head, FrozenParts.from_target(target), batch, features, steps=1, decay=0.8, chunk_size=4)
    aux, final = split_features(features, len(AUX))
    parts = FrozenParts.from_target(target)
    predicted, _ = head(parts.embed(batch["input_ids"][:, 1:]), head.project(aux[:, :-1]), torch.arange(13)[None])
    mask = batch["loss_mask"][:, 2:].bool() & batch["attention_mask"][:, 2:].bool()
    mask = torch.cat([mask, torch.zeros(2, 1, dtype=torch.bool)], 1)  # (B, T-1)
    p = torch.softmax(target.lm_head(final[:, 1:][mask]), -1)
    expected = -(p * torch.log_softmax(head.logits(predicted[mask]), -1)).sum(-1).mean()
    torch.testing.assert_close(out["loss"], expected)
    assert out["out_of_vocab"] == [0] and len(out["step_losses"]) == 1


def test_gradients_flow_through_the_fed_back_hidden(target):
    head = _head(target, torch.arange(0, 128, 2))
    batch = _batch()
    features = OnlineFeatures(target, feature_layers(AUX))(batch)
    parts = FrozenParts.from_target(target)
    aux, _ = split_features(features, len(AUX))
    counted = torch.ones(2, 13, dtype=torch.bool)
    outs = [out for _, _, out, _ in ttt_unroll(head, parts, batch["input_ids"], head.project(aux[:, :-1]), 2, counted)]
    (grad,) = torch.autograd.grad(outs[1].sum(), outs[0], retain_graph=True)
    assert grad.abs().sum() > 0  # step 1 depends on step 0's output through its hidden input
    out = eagle3_step(head, parts, batch, features, steps=3, decay=0.8, chunk_size=8)
    out["loss"].backward()
    for name, param in head.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_draft_vocab_teacher_and_loss_by_hand():
    final = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    weight = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 0.5], [0.0, 0.0]])  # logits rows: [2,0,1,0], [0,3,.5,0], [2,3,1.5,0]
    t2d = torch.tensor([True, False, True, True])
    for chunk in (1, 2, 8):
        logits, in_vocab = draft_vocab_teacher(final, weight, t2d, chunk)
        torch.testing.assert_close(logits, torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.5, 0.0], [2.0, 1.5, 0.0]]))
        assert in_vocab.tolist() == [True, False, False]  # target top-1 ids 0, 1, 1
    draft_weight = torch.eye(3, 2)  # draft logits [h0, h1, 0]
    hidden = torch.tensor([[0.0, 1.0], [5.0, 0.0]], requires_grad=True)
    rows = torch.tensor([0, 2])
    out = eagle3_loss([hidden, hidden[:1]], draft_weight, logits, in_vocab, [rows, rows[:1]], decay=0.5)
    p = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), 0)
    q = torch.log_softmax(torch.tensor([0.0, 1.0, 0.0]), 0)
    step = -(p * q).sum()
    torch.testing.assert_close(out["step_losses"][0], step)  # row 2 (top-1 outside) is left out of the mean
    torch.testing.assert_close(out["loss"], step * 1.5)
    assert out["out_of_vocab"] == [1, 0]
    assert [h.tolist() for h in out["hits"]] == [[False, False], [False]]
    out["loss"].backward()
    assert hidden.grad[1].abs().sum() == 0 and hidden.grad[0].abs().sum() > 0


def test_held_out_counts_match_the_draft_loop_and_miss_outside_the_vocabulary(target):
    from train.heldout import eagle3_eval_counts, held_out_figures

    vocab = torch.randperm(128)[:64].sort().values
    head = _head(target, vocab, seed=3).eval()
    batch = _batch()
    features = OnlineFeatures(target, feature_layers(AUX))(batch)
    parts = FrozenParts.from_target(target)
    truths: list = []
    counts = eagle3_eval_counts(head, parts, batch, features, 3, truths)
    greedy, chains = _reference(head, target, batch, features, 3, 0.0, evaluation=True)
    assert counts[:, 0].tolist() == greedy and counts[:, 2].tolist() == chains == [18, 17, 15]
    assert (counts[:, 1] >= counts[:, 0]).all()
    torch.testing.assert_close(eagle3_eval_counts(head, parts, batch, features, 3, truths), counts)  # cached truths
    # a target token outside the draft vocabulary is a miss even in the top-5
    outside = int((~head.t2d[truths[0]]).sum())
    assert 0 < outside and counts[0, 1] <= counts[0, 2] - outside
    metrics = held_out_figures(counts, "step")
    assert set(metrics) >= {"eval/top1_step0", "eval/top5_step2", "eval/acceptance_length"}
