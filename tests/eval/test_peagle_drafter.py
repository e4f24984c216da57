"""P-EAGLE drafter on tiny targets: a random head and a warm one (the EAGLE-3 setup of
tests/tiny.py with a mask_hidden, so slot 0 agrees with the target most of the time). Checked:
greedy output identical to plain decoding, one head forward per proposal, slot outputs equal to the
head module's forward over the committed rows plus mask slots, a committed cache equal to a fresh
recompute, sampled drafts reporting their slot's distribution over target ids."""
import pytest
import torch

from eval.runtime.drafters import DraftState
from eval.runtime.drafters.peagle import LeanPeagleHead, PeagleDrafter
from eval.runtime.generate import plain_generate, speculative_generate
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import SamplingConfig, probabilities
from heads.eagle3 import Eagle3Head
from heads.peagle import PeagleConfig, PeagleHead
from heads.vocab import set_draft_vocab
from tests.tiny import tiny_eagle3_setup, tiny_target

NEW_TOKENS, K = 20, 4


def _random():
    torch.manual_seed(0)
    target = tiny_target()
    lean = LeanLlama.from_hf(target.model, max_seq_len=256)
    config = PeagleConfig.from_target(target, aux_layer_ids=[1, 0, 1], speculative_tokens=K, mask_token_id=5,
                                      draft_vocab_size=64)
    head = set_draft_vocab(PeagleHead(config), torch.arange(0, 128, 2)).eval()
    return target, lean, head


def _warm():
    target, lean, eagle3 = tiny_eagle3_setup()
    c = eagle3.config.to_dict()
    head = PeagleHead(PeagleConfig(**c, speculative_tokens=K))
    head.load_state_dict({**eagle3.state_dict(), "mask_hidden": head.mask_hidden.detach()})
    return target, lean, head.eval()


@pytest.fixture(scope="module", params=["random", "warm"])
def setup(request):
    return _random() if request.param == "random" else _warm()


def prompts(count: int, length: int = 7):
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (length,), generator=generator) for _ in range(count)]


def test_greedy_speculative_equals_plain(setup):
    target, lean, head = setup
    drafter = PeagleDrafter(head, lean)
    accepted = []
    for prompt in prompts(4):
        plain = plain_generate(lean, prompt, NEW_TOKENS)
        spec = speculative_generate(lean, drafter, prompt, NEW_TOKENS)
        assert spec.tokens == plain.tokens
        assert max(spec.tree_sizes) == K
        accepted.extend(spec.accepted)
    if head.config.mask_token_id == 0:  # the warm head: slot 0 is EAGLE-3's first draft
        assert max(accepted) >= 1


def _features(target, head, sequence):
    hidden = target.features(sequence[None], layers=head.config.aux_layer_ids).hidden
    return torch.cat([hidden[layer][0] for layer in head.config.aux_layer_ids], dim=-1)  # (T, n·Ht)


def _module_logits(target, head, sequence, features, slots):
    """The head module: committed rows 0..n-1 (n = len(sequence) - 1), then `slots` mask slots,
    one causal forward -> the last committed row's and the slots' logits (slots + 1, Vd)."""
    n = sequence.shape[0] - 1
    with torch.no_grad():
        embeds = target.embed_tokens(sequence[1:])
        slot_embeds, slot_hidden = head.slot_inputs(target.embed_tokens, slots, embeds.dtype)
        out, _ = head(torch.cat([embeds, slot_embeds])[None],
                      torch.cat([head.project(features[:n]), slot_hidden])[None], torch.arange(n + slots)[None])
        return head.logits(out[0, n - 1:])


def _state(target, sequence, features, sampling=SamplingConfig(), generator=None):
    n = sequence.shape[0] - 1
    return DraftState(sequence, n, {1: features[:n, :64], 0: features[:n, 64:128]}, target.num_layers, sampling,
                      generator=generator)


def test_one_forward_drafts_what_the_head_module_computes(monkeypatch):
    target, lean, head = _random()
    drafter = PeagleDrafter(head, lean)
    calls = []
    forward = LeanPeagleHead._forward
    monkeypatch.setattr(LeanPeagleHead, "_forward", lambda self, *args: calls.append(1) or forward(self, *args))
    sequence = prompts(1, 9)[0]
    features = _features(target, head, sequence)
    drafter.reset(sequence)
    candidates = drafter.propose(_state(target, sequence, features))
    assert len(calls) == 1 and candidates.tokens.shape == (K,) and candidates.parents.tolist() == [-1, 0, 1, 2]
    expected = head.to_target_ids(_module_logits(target, head, sequence, features, K - 1).argmax(-1))
    assert candidates.tokens.tolist() == expected.tolist()
    assert drafter.cache_length == 8  # the mask slots are drafted entries, not committed
    with torch.no_grad():
        _, (k, v) = head(target.embed_tokens(sequence[1:])[None], head.project(features[:8])[None],
                         torch.arange(8)[None], use_cache=True)
    torch.testing.assert_close(drafter.past[0], k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(drafter.past[1], v, atol=1e-5, rtol=1e-5)


def test_sampled_chain_reports_each_slots_distribution():
    target, lean, head = _random()
    drafter = PeagleDrafter(head, lean, depth=3)
    sequence = prompts(1, 6)[0]
    features = _features(target, head, sequence)
    sampling = SamplingConfig(temperature=0.8)
    drafter.reset(sequence)
    candidates = drafter.propose(_state(target, sequence, features, sampling, torch.Generator().manual_seed(0)))
    assert not candidates.deterministic and candidates.draft_probs.shape == (3, 128)
    probs = candidates.draft_probs
    assert probs[:, 1::2].sum() == 0  # zero outside the even draft vocabulary
    expected = probabilities(_module_logits(target, head, sequence, features, 2), sampling)  # (3, Vd)
    torch.testing.assert_close(probs[:, ::2], expected, atol=1e-5, rtol=1e-4)
    assert all(probs[i, t] > 0 for i, t in enumerate(candidates.tokens.tolist()))


def test_depth_and_head_checks():
    target, lean, head = _random()
    with pytest.raises(ValueError, match="depth must lie in"):
        PeagleDrafter(head, lean, depth=K + 1)
    with pytest.raises(ValueError, match="needs a PeagleHead"):
        PeagleDrafter(Eagle3Head(head.config), lean)
    assert PeagleDrafter.propose_many is None and PeagleDrafter(head, lean, depth=2).depth == 2
