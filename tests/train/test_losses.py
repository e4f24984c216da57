import math

import pytest
import torch

from train.losses import (
    add_uniform_noise, cross_entropy_chunked, eagle_loss, eagle_position_mask, feature_regression_loss,
    medusa_loss, medusa_position_mask, soft_cross_entropy_chunked,
)


def test_position_masks():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 0, 0]])  # position 4 is padding
    assert eagle_position_mask(loss_mask).tolist() == [[True, True, True, False, False]]
    assert eagle_position_mask(loss_mask, attention).tolist() == [[True, True, False, False, False]]
    assert medusa_position_mask(loss_mask, 0).tolist() == [[True, True, True, False, False, False]]
    assert medusa_position_mask(loss_mask, 1).tolist() == [[True, True, False, False, False, False]]
    assert not medusa_position_mask(loss_mask, 5).any()


def test_cross_entropy_by_hand():
    hidden = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # logits row0 [1,0,1], row1 [0,2,2]
    labels = torch.tensor([0, 1])
    ce0 = -1.0 + math.log(2 * math.e + 1)
    ce1 = -2.0 + math.log(1 + 2 * math.e**2)
    for chunk in (1, 2, 8):
        loss, hits = cross_entropy_chunked(hidden, weight, labels, chunk)
        assert loss.item() == pytest.approx((ce0 + ce1) / 2, rel=1e-6)
        assert hits.tolist() == [True, True]  # argmax picks the first of tied maxima


def test_soft_cross_entropy_by_hand_and_from_features():
    hidden = torch.tensor([[1.0, 0.0]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    teacher_logits = torch.tensor([[0.0, math.log(3.0)]])  # p = [1/4, 3/4]
    q = torch.softmax(torch.tensor([1.0, 0.0]), 0)
    expected = -(0.25 * q[0].log() + 0.75 * q[1].log())
    loss, hits = soft_cross_entropy_chunked(hidden, weight, teacher_logits)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert hits.tolist() == [False]
    features = torch.tensor([[0.0, math.log(3.0)]])  # weight is the identity: same logits
    loss2, _ = soft_cross_entropy_chunked(hidden, weight, None, features)
    assert loss2.item() == pytest.approx(expected.item(), rel=1e-6)


def test_soft_ce_gradient_is_q_minus_p():
    hidden = torch.randn(3, 4, requires_grad=True)
    weight = torch.randn(5, 4)
    teacher = torch.randn(3, 5)
    loss, _ = soft_cross_entropy_chunked(hidden, weight, teacher, chunk_size=2)
    loss.backward()
    q = torch.softmax(hidden.detach() @ weight.T, -1)
    p = torch.softmax(teacher, -1)
    torch.testing.assert_close(hidden.grad, (q - p) @ weight / 3)


def test_smooth_l1_by_hand():
    predicted = torch.tensor([[0.0, 0.0], [3.0, 0.5]])
    target = torch.zeros(2, 2)
    # rows: [0, 0] -> 0; [|3|-0.5=2.5, 0.5*0.25=0.125] -> mean 1.3125; mean over rows 0.65625
    assert feature_regression_loss(predicted, target).item() == pytest.approx(0.65625)


def test_eagle_loss_combines_weights():
    predicted = torch.randn(4, 8)
    features = torch.randn(4, 8)
    weight = torch.randn(16, 8)
    out = eagle_loss(predicted, features, None, weight, feature_loss_weight=2.0, logit_loss_weight=0.5)
    assert out["loss"].item() == pytest.approx(2.0 * out["feature_loss"].item() + 0.5 * out["logit_loss"].item())
    perfect = eagle_loss(features, features, None, weight, 1.0, 0.0)
    assert perfect["loss"].item() == 0.0 and perfect["hits"].all()


def test_medusa_loss_decay():
    weight = torch.randn(16, 8)
    hidden = [torch.randn(5, 8), torch.randn(3, 8), torch.zeros(0, 8)]
    labels = [torch.randint(0, 16, (5,)), torch.randint(0, 16, (3,)), torch.zeros(0, dtype=torch.long)]
    out = medusa_loss(hidden, [weight] * 3, labels, decay=0.8)
    expected = out["head_losses"][0] + 0.8 * out["head_losses"][1]
    assert out["loss"].item() == pytest.approx(expected.item(), rel=1e-6)
    assert out["head_losses"][2].item() == 0.0 and len(out["hits"][2]) == 0


def test_uniform_noise_range():
    x = torch.zeros(10000)
    noisy = add_uniform_noise(x, 0.2, torch.Generator().manual_seed(0))
    assert noisy.min() >= -0.1 and noisy.max() <= 0.1 and noisy.std() > 0.05
    assert add_uniform_noise(x, 0.0) is x


def test_top1_is_argmax_first_index_on_ties_in_each_dtype():
    from train.losses import top1

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(64, 300, generator=g).to(dtype)
        logits[:, 7] = logits[:, 200] = logits.amax(-1) + 1  # a tie at the top: the lower index wins
        logits[:5] = torch.randn(5, 300, generator=g).to(dtype)
        assert torch.equal(top1(logits), logits.argmax(-1))
        assert (top1(logits)[5:] == 7).all()
