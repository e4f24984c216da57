import pytest
import torch
import torch.nn.functional as F
from torch import nn

from heads.eagle import EagleConfig, EagleHead
from heads.medusa import MedusaConfig, MedusaHeads
from train.heldout import (OPENING_TOKENS, acceptance_estimate, chain_walk, eagle_eval_counts, eagle_greedy_grid,
                           eagle_unroll, held_out_figures, medusa_eval_counts, opening_mask, walk_row)
from train.losses import eagle_position_mask, shift_left
from train.objectives import FrozenParts, OnlineFeatures
from tests.tiny import tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _batch(T=12, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (B, T), generator=g)
    loss_mask = torch.ones(B, T, dtype=torch.long)
    loss_mask[:, :3] = 0
    return {"input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.long), "loss_mask": loss_mask}


def test_acceptance_estimate_by_hand():
    assert acceptance_estimate([0.5, 0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert acceptance_estimate([1.0, 1.0, 0.0, 1.0]) == 3.0
    assert acceptance_estimate([0.8, 0.5], depth=1) == pytest.approx(1.8)
    assert acceptance_estimate([]) == 1.0


class OracleHead(nn.Module):
    """Returns the target's true feature for position t+1+j (j read from the position ids)."""

    def __init__(self, features, sign=1.0):
        super().__init__()
        self.features, self.sign = features, sign

    def forward(self, embeds, inputs, position_ids, attention_mask=None, past_key_values=None, use_cache=False):
        j = int(position_ids[0, 0])
        n = inputs.shape[1]
        out = torch.zeros_like(inputs)
        out[:, : n - j] = self.features[:, 1 + j:]
        return self.sign * out, (torch.zeros(1), torch.zeros(1))


def test_eagle_counts_with_perfect_and_wrong_heads(target):
    batch = _batch()
    features = OnlineFeatures(target)(batch)
    parts = FrozenParts.from_target(target)
    counts = eagle_eval_counts(OracleHead(features), parts, batch, features, steps=3)
    metrics = held_out_figures(counts, "step")
    assert [metrics[f"eval/top1_step{j}"] for j in range(3)] == [1.0, 1.0, 1.0]
    assert metrics["eval/acceptance_length"] == 4.0
    # chain t at step j counts iff x_{t+2+j} is an assistant token (index 3..11): t in [max(0, 1-j), 9-j]
    assert counts[:, 2].tolist() == [18.0, 18.0, 16.0]
    wrong = held_out_figures(eagle_eval_counts(OracleHead(features, -1.0), parts, batch, features, 3), "step")
    assert wrong["eval/top1_step0"] == 0.0 and wrong["eval/acceptance_length"] == 1.0
    # The walk: chains 1..9 count; chain 1 predicts the reply's first token (the prefill's), so the
    # perfect head's steps sit at t = 2 and 6 (3 drafts each), the wrong head's at every t in 2..9.
    assert metrics["eval/chain_steps"] == 4.0 and metrics["eval/chain_acceptance_length"] == 4.0
    assert wrong["eval/chain_steps"] == 16.0 and wrong["eval/chain_acceptance_length"] == 1.0


def test_walk_row_by_hand():
    counted = torch.tensor([0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    hits = torch.zeros(3, 12, dtype=torch.bool)
    hits[0, 1] = True  # chain 1 predicts the reply's first token (the prefill's): never drafted
    hits[0, 2] = hits[1, 2] = True  # t=2 accepts 2 (its third draft misses) -> t=5
    hits[0, 5] = hits[1, 5] = hits[2, 5] = True  # t=5: the third draft lies past the run -> 2, t=8
    hits[0, 9] = True  # t=8 opens the next run: skipped; t=9 accepts 1 -> t=11, a miss
    assert walk_row(hits, counted) == [2, 2, 1, 0]
    assert walk_row(hits[:1], counted) == [1, 0, 1, 1, 0]
    counts = chain_walk(torch.stack([hits, hits], 1), torch.stack([counted, counted]))
    assert counts.tolist() == [[6.0, 8.0], [4.0, 8.0], [0.0, 8.0]]


def test_opening_mask_keeps_each_replys_first_tokens():
    counted = torch.tensor([[0, 1, 1, 1, 1, 0, 0, 1, 1, 0, 1],
                            [1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    assert opening_mask(counted, 2).int().tolist() == [[0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 1],
                                                       [1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0]]
    assert torch.equal(opening_mask(counted, 100), counted)


def test_the_opening_walk_stops_at_the_openings_end():
    """The walk over each reply's first 3 tokens: a draft past them is not accepted (a run of 3
    new tokens ends there), and the second reply's opening is walked too."""
    counted = torch.tensor([0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    hits = torch.zeros(3, 12, dtype=torch.bool)
    hits[0, 2] = hits[1, 2] = hits[2, 2] = True  # t=2 would accept 3 in the whole reply; 2 in its opening
    hits[0, 9] = True  # t=9 accepts 1, then its second draft misses
    both = chain_walk(torch.stack([hits, hits], 1), torch.stack([counted, counted]), opening=3)
    assert both[:, :2].tolist() == chain_walk(torch.stack([hits, hits], 1), torch.stack([counted, counted])).tolist()
    assert both[:, 2:].tolist() == [[4.0, 4.0], [2.0, 4.0], [0.0, 4.0]]
    figures = held_out_figures(torch.cat([torch.ones(3, 3), both], 1), "step")
    assert figures["eval/opening_chain_acceptance_length"] == 2.5 and figures["eval/opening_tokens"] == OPENING_TOKENS


def test_the_walk_is_the_runtime_chains_acceptance(target):
    """Replayed on the target's own greedy reply, the walk accepts at every step what the runtime's
    greedy chain of the same depth accepts there (every step whose drafts lie inside the reply)."""
    from eval.runtime.drafters.eagle import EagleDrafter
    from eval.runtime.generate import speculative_generate
    from eval.runtime.model import LeanLlama
    from heads.eagle import init_from_target

    torch.manual_seed(0)
    lean = LeanLlama.from_hf(target.model, max_seq_len=128)
    head = init_from_target(EagleHead(EagleConfig.from_target(target)), target, layer=-1, fc="feature").eval()
    depth, total = 3, 0
    for seed in range(4):
        prompt = torch.randint(3, 128, (6,), generator=torch.Generator().manual_seed(seed))
        result = speculative_generate(lean, EagleDrafter(head, lean, mode="chain", depth=depth), prompt, 40)
        ids = torch.cat([prompt, torch.tensor(result.tokens)])[None]
        loss_mask = torch.zeros_like(ids)
        loss_mask[:, prompt.shape[0]:] = 1
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
        walks: list = []
        eagle_eval_counts(head, FrozenParts.from_target(target), batch, OnlineFeatures(target)(batch), depth,
                          walks=walks)
        committed, inside = 1, 0  # the prefill's token; steps whose depth drafts all lie in the reply
        for accepted in result.accepted:
            if committed + depth > len(result.tokens):
                break
            committed, inside = committed + accepted + 1, inside + 1
        assert walks[0][:inside] == result.accepted[:inside], seed
        total += sum(result.accepted[:inside])
    assert total > 0  # some drafts were accepted, so the comparison saw more than misses


def test_unroll_matches_sequential_decoding(target):
    """The all-chains mask gives what a KV-cached draft loop gives for one chain."""
    head = EagleHead(EagleConfig.from_target(target)).eval()
    parts = FrozenParts.from_target(target)
    batch = _batch(T=10, B=1)
    ids, features = batch["input_ids"], OnlineFeatures(target)(batch)
    steps = 3
    unrolled = eagle_unroll(head, parts, ids, features, steps)
    for t in (0, 3, 5):
        pos = torch.arange(t + 1)[None]
        out, kv = head(parts.embed(ids[:, 1:t + 2]), features[:, : t + 1], pos, use_cache=True)
        feature = out[:, -1:]
        torch.testing.assert_close(feature[0, 0], unrolled[0][0, t], atol=1e-5, rtol=1e-4)
        for j in range(1, steps):
            out, kv = head(parts.embed(ids[:, t + 1 + j: t + 2 + j]), feature, torch.tensor([[t + j]]),
                           past_key_values=kv, use_cache=True)
            feature = out
            torch.testing.assert_close(feature[0, 0], unrolled[j][0, t], atol=1e-5, rtol=1e-4)


def test_medusa_counts_shapes(target):
    batch = _batch()
    features = OnlineFeatures(target)(batch)
    heads = MedusaHeads(MedusaConfig.from_target(target, num_heads=3))
    counts = medusa_eval_counts(heads, FrozenParts.from_target(target), batch, features)
    assert counts.shape == (3, 7)
    assert counts[:, 2].tolist() == [18.0, 18.0, 16.0]
    assert (counts[:, 0] <= counts[:, 1]).all()


def test_cached_truths_give_the_same_counts(target):
    batch = _batch()
    features = OnlineFeatures(target)(batch)
    parts = FrozenParts.from_target(target)
    head = EagleHead(EagleConfig.from_target(target)).eval()
    truths: list = []
    first = eagle_eval_counts(head, parts, batch, features, 3, truths)
    assert len(truths) == 1  # the target's greedy tokens at step 0's positions serve every step
    torch.testing.assert_close(eagle_eval_counts(head, parts, batch, features, 3, truths), first)
    torch.testing.assert_close(eagle_eval_counts(head, parts, batch, features, 3), first)


def test_eagle_counts_score_each_step_against_the_target_token_it_drafts(target):
    """Step j's truth is argmax lm_head(f_{t+1+j}) wherever chain t counts at step j, as a projection
    of that step's own features gives it."""
    batch = _batch()
    features = OnlineFeatures(target)(batch)
    parts = FrozenParts.from_target(target)
    base = eagle_position_mask(batch["loss_mask"], batch["attention_mask"])
    grid = eagle_greedy_grid(parts, features, base)
    for j in range(4):
        valid = shift_left(base, j)
        assert valid.any()
        own = F.linear(shift_left(features[:, 1:], j)[valid], parts.lm_head_weight).argmax(-1)
        assert torch.equal(shift_left(grid, j)[valid], own), j


def test_held_out_chains_draft_what_the_runtime_chain_drafts():
    """The training-time evaluation (eagle_unroll) and the runtime's EAGLE chain drafter compute the
    same chain: fed the drafter's own chain tokens as data tokens, every unrolled step's argmax is
    the drafter's next token (so the held-out figures measure the drafter that will run)."""
    from eval.runtime.drafters import DraftState
    from eval.runtime.drafters.eagle import EagleDrafter
    from eval.runtime.model import LeanLlama
    from eval.runtime.sampling import SamplingConfig
    from heads.eagle import EagleConfig, EagleHead, init_from_target
    from train.heldout import eagle_unroll
    from train.objectives import FrozenParts
    from tests.tiny import tiny_target

    torch.manual_seed(0)
    target = tiny_target()
    lean = LeanLlama.from_hf(target.model, max_seq_len=64)
    head = init_from_target(EagleHead(EagleConfig.from_target(target)), target, layer=-1, fc="feature").eval()
    prompt = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(5))
    L = lean.config.num_layers
    features = lean(prompt[:-1], lean.new_cache(), hidden_layers=(-1,), logits="none").hidden[L]  # f_0..f_{T-2}
    drafter = EagleDrafter(head, lean, mode="chain", depth=4)
    drafter.reset(prompt)
    chain = drafter.propose(DraftState(prompt, prompt.shape[0] - 1, {L: features}, L, SamplingConfig())).tokens
    sequence = torch.cat([prompt, torch.as_tensor(chain[:-1])])  # data tokens = the drafter's own chain
    truth = torch.cat([features, features.new_zeros(len(chain), features.shape[1])])[None]  # only f_{<=T-2} read
    parts = FrozenParts.from_target(target)
    outputs = eagle_unroll(head, parts, sequence[None], truth[:, : sequence.shape[0]], len(chain))
    root = prompt.shape[0] - 2  # chain t = T-2: reads x_{T-1} (the root) and f_{T-2}
    unrolled = [int((outputs[j][0, root] @ parts.lm_head_weight.T).argmax()) for j in range(len(chain))]
    assert unrolled == list(chain)
