import pytest
import torch

from heads.eagle3 import Eagle3Config, Eagle3Head, init_from_target
from heads.io import build_head, head_type, load_head, save_head
from heads.peagle import PeagleConfig, PeagleHead, slot_attention_mask
from heads.vocab import draft_ids, set_draft_vocab
from tests.tiny import tiny_target

D, V, L = 64, 128, 4


@pytest.fixture(scope="module")
def target():
    return tiny_target(num_hidden_layers=L)


def test_config_checks_and_type(target):
    config = PeagleConfig.from_target(target, draft_vocab_size=40, mask_token_id=5, speculative_tokens=6)
    assert (config.mask_token_id, config.speculative_tokens, config.aux_layer_ids) == (5, 6, [2, 2, 1])
    assert head_type(config) == "peagle" and head_type(Eagle3Config.from_target(target)) == "eagle3"
    assert isinstance(build_head(config), PeagleHead)
    with pytest.raises(ValueError, match="mask_token_id"):
        PeagleConfig.from_target(target, mask_token_id=V)
    with pytest.raises(ValueError, match="speculative_tokens"):
        PeagleConfig.from_target(target, speculative_tokens=0)


def test_keys_are_eagle3_plus_mask_hidden(target):
    aux = [0, 1, 3]
    eagle3 = Eagle3Head(Eagle3Config.from_target(target, draft_vocab_size=40, aux_layer_ids=aux))
    head = PeagleHead(PeagleConfig.from_target(target, draft_vocab_size=40, aux_layer_ids=aux))
    ours, theirs = head.state_dict(), eagle3.state_dict()
    assert set(ours) - set(theirs) == {"mask_hidden"} and set(theirs) <= set(ours)
    assert {k: v.shape for k, v in ours.items() if k != "mask_hidden"} == {k: v.shape for k, v in theirs.items()}
    assert tuple(ours["mask_hidden"].shape) == (1, 1, len(aux) * D)
    count = sum(p.numel() for p in eagle3.parameters()) + len(aux) * D
    assert sum(p.numel() for p in head.parameters()) == count  # no embedding of its own: the target's


def test_mask_slots_read_the_mask_token_and_projected_mask_hidden(target):
    head = PeagleHead(PeagleConfig.from_target(target, mask_token_id=7))
    embeds, hidden = head.slot_inputs(lambda ids: target.embed_tokens(ids), 3, torch.float32)
    torch.testing.assert_close(embeds, target.embed_tokens.weight[[7, 7, 7]])
    torch.testing.assert_close(hidden, head.fc(head.mask_hidden[0]).expand(3, -1))
    hidden.sum().backward()
    assert head.mask_hidden.grad.abs().sum() > 0


def test_round_trip_and_vocabulary(tmp_path, target):
    ids = torch.tensor([0, 3, 5, 9, 40, 127])
    config = PeagleConfig.from_target(target, draft_vocab_size=6, speculative_tokens=3)
    head = init_from_target(PeagleHead(config), target, ids)
    assert torch.equal(draft_ids(head), ids)
    set_draft_vocab(head, ids)
    save_head(tmp_path, head, config)
    loaded, loaded_config, meta = load_head(tmp_path, target)
    assert meta["type"] == "peagle" and loaded_config == config and isinstance(loaded, PeagleHead)
    for key, value in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)
    x, pos = torch.randn(1, 4, D), torch.arange(4)[None]
    torch.testing.assert_close(loaded(x, x, pos)[0], head(x, x, pos)[0])


def _reference_rule(anchor, depth):
    """speculators' P-EAGLE mask over all rows (depth 0 included), one document, no window."""
    R = anchor.shape[0]
    allowed = torch.zeros(R, R, dtype=torch.bool)
    for q in range(R):
        for k in range(R):
            allowed[q, k] = bool((depth[k] == 0 and anchor[q] >= anchor[k])
                                 or (anchor[q] == anchor[k] and depth[q] >= depth[k]))
    return allowed


def test_slot_mask_is_the_reference_rule():
    n = 6  # the example of speculators' docstring: depth 1 at [0, 1, 3, 4], 2 at [0, 3], 3 at [0]
    anchors = torch.tensor([0, 1, 3, 4, 0, 3, 0])
    depths = torch.tensor([1, 1, 1, 1, 2, 2, 3])
    full = _reference_rule(torch.cat([torch.arange(n), anchors]), torch.cat([torch.zeros(n, dtype=torch.long), depths]))
    ours = slot_attention_mask(anchors[None], depths[None], n)[0, 0]
    assert torch.equal(ours, full[n:])
    assert torch.equal(full[:n, :n], torch.ones(n, n, dtype=torch.bool).tril())  # depth 0 rows: causal
    assert not full[:n, n:].any()  # and blind to the mask rows
    padded = slot_attention_mask(torch.tensor([[2, -1, -1]]), torch.tensor([[1, 1, 1]]), 4)[0, 0]
    assert padded[0].tolist() == [True, True, True, False, True, False, False]
    assert padded[1:, :4].sum() == 0 and padded[1:].any(-1).all()  # padding rows see padding rows only
