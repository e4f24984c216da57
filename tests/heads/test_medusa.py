import pytest
import torch
import torch.nn.functional as F

from heads.medusa import MedusaConfig, MedusaHeads, init_from_target
from tests.tiny import tiny_target

D, V = 64, 128


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize("K,L,share", [(4, 1, False), (3, 2, False), (2, 3, True)])
def test_keys_and_parameter_count(target, K, L, share):
    heads = MedusaHeads(MedusaConfig.from_target(target, num_heads=K, num_layers=L, share_lm_head=share))
    keys = set(heads.state_dict())
    expected = {f"{h}.{l}.linear.{p}" for h in range(K) for l in range(L) for p in ("weight", "bias")}
    if not share:
        expected |= {f"{h}.{L}.weight" for h in range(K)}
    assert keys == expected
    # L independent blocks per head: a shared block would count once.
    assert sum(p.numel() for p in heads.parameters()) == K * (L * (D * D + D) + (0 if share else V * D))
    assert heads.state_dict()["0.0.linear.weight"].abs().sum() == 0  # zero-initialised


def test_layers_are_independent(target):
    heads = MedusaHeads(MedusaConfig.from_target(target, num_heads=1, num_layers=2))
    with torch.no_grad():
        heads.head(0)[0].linear.weight.fill_(1.0)
    assert heads.head(0)[1].linear.weight.abs().sum() == 0


def test_shapes_and_init_from_target(target):
    heads = init_from_target(MedusaHeads(MedusaConfig.from_target(target, num_heads=3)), target)
    for k in range(3):
        torch.testing.assert_close(heads.lm_head_weight(k), target.lm_head.weight)
    x = torch.randn(2, 5, D)
    assert heads.hidden(x).shape == (3, 2, 5, D)
    logits = heads.logits(x)
    assert logits.shape == (3, 2, 5, V)
    with torch.no_grad():
        for k in range(3):
            heads.head(k)[0].linear.bias.fill_(-50.0)  # SiLU(-50) ~ 0: each head is the identity
    torch.testing.assert_close(heads.logits(x)[1], target.lm_head(x), atol=1e-4, rtol=1e-4)


def test_shared_lm_head_uses_given_weight(target):
    heads = MedusaHeads(MedusaConfig.from_target(target, num_heads=2, share_lm_head=True))
    x = torch.randn(1, 4, D)
    weight = target.lm_head.weight
    logits = heads.logits(x, weight)
    torch.testing.assert_close(logits[0], F.linear(heads.hidden(x)[0], weight))
    with pytest.raises(ValueError, match="share_lm_head"):
        heads.logits(x)
