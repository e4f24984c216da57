"""DFlash drafter on tiny targets: greedy output identical to plain decoding, one block forward per
proposal equal to the head module's over the whole context, the cached context equal to a
recompute, sampled drafts reporting their slot's distribution, and speculative sampling that follows
the target's exact distribution (chi-square, as tests/eval/test_lossless_generate.py does for the
other drafters)."""
import itertools

import pytest
import torch

from eval.runtime.drafters import DraftState
from eval.runtime.drafters.dflash import DflashDrafter, dflash_chain
from eval.runtime.generate import plain_generate, speculative_generate
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import SamplingConfig, probabilities
from heads.dflash import DflashConfig, DflashHead, set_draft_vocab
from heads.eagle3 import Eagle3Config, Eagle3Head
from tests.helpers import chi_square_p_value, pooled_rare
from tests.tiny import tiny_model, tiny_target

NEW_TOKENS, B = 20, 5


def _randomized(head, scale=0.2):
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0.0, scale)
    return head.eval()


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    target = tiny_target()
    lean = LeanLlama.from_hf(target.model, max_seq_len=256)
    head = _randomized(DflashHead(DflashConfig.from_target(target, aux_layer_ids=[1, 0], num_layers=2,
                                                           block_size=B, mask_token_id=5)))
    return target, lean, head


def prompts(count: int, length: int = 7):
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (length,), generator=generator) for _ in range(count)]


@pytest.mark.parametrize("cache_context", [True, False])
def test_greedy_speculative_equals_plain(setup, cache_context):
    target, lean, head = setup
    drafter = DflashDrafter(head, lean, cache_context=cache_context)
    for prompt in prompts(3):
        plain = plain_generate(lean, prompt, NEW_TOKENS)
        spec = speculative_generate(lean, drafter, prompt, NEW_TOKENS)
        assert spec.tokens == plain.tokens and max(spec.tree_sizes) == B - 1


def test_greedy_speculative_equals_plain_over_a_draft_vocabulary(setup):
    target, lean, _ = setup
    torch.manual_seed(1)
    head = _randomized(DflashHead(DflashConfig.from_target(target, aux_layer_ids=[1, 0], num_layers=1, block_size=B,
                                                           mask_token_id=5, draft_vocab_size=40)))
    set_draft_vocab(head, torch.arange(3, 123, 3))
    drafter = DflashDrafter(head, lean)
    for prompt in prompts(2):
        spec = speculative_generate(lean, drafter, prompt, NEW_TOKENS)
        assert spec.tokens == plain_generate(lean, prompt, NEW_TOKENS).tokens
    drafter.reset(None)
    proposal = drafter.propose(_state(target, prompts(1, 6)[0], _features(target, head, prompts(1, 6)[0]), 0,
                                      SamplingConfig(), None))
    assert all(int(t) % 3 == 0 for t in proposal.tokens)  # drafts are target ids of the vocabulary


def test_an_oracle_head_is_accepted_whole():
    """A head whose every slot drafts the target's next token would be accepted in full: here the
    target repeats one token, and a head drafting that token everywhere gets B-1 per step."""
    target = tiny_target()
    lean = LeanLlama.from_hf(target.model, max_seq_len=256)
    head = DflashHead(DflashConfig.from_target(target, aux_layer_ids=[1], block_size=B))
    prompt = prompts(1)[0]
    plain = plain_generate(lean, prompt, 40).tokens
    drafter = DflashDrafter(head, lean)
    drafter.block_logits = lambda state: torch.nn.functional.one_hot(
        torch.tensor(plain[len(state.tokens) - len(prompt): len(state.tokens) - len(prompt) + B - 1]
                     + [0] * B)[: B - 1], 128).float()
    spec = speculative_generate(lean, drafter, prompt, 40)
    assert spec.tokens == plain and max(spec.accepted) == B - 1


def _features(target, head, sequence):
    hidden = target.features(sequence[None], layers=head.config.aux_layer_ids).hidden
    return {layer: hidden[layer][0] for layer in head.config.aux_layer_ids}


def _state(target, sequence, features, start, sampling=SamplingConfig(), generator=None):
    """The state after committing tokens[start : T-1]: their aux streams are the new features."""
    n = sequence.shape[0] - 1
    return DraftState(sequence, n, {layer: f[start:n] for layer, f in features.items()}, target.num_layers,
                      sampling, generator=generator)


def _module_logits(target, head, sequence, features, depth):
    n = sequence.shape[0] - 1
    with torch.no_grad():
        aux = torch.cat([features[layer][:n] for layer in head.config.aux_layer_ids], -1)
        kv = head.context_kv(head.project(aux[None]), torch.arange(n)[None])
        block = torch.tensor([[int(sequence[-1])] + [head.config.mask_token_id] * (B - 1)])
        out = head(target.embed_tokens(block), torch.arange(n, n + B)[None], kv)
        return head.logits(out[0, 1: depth + 1], target.lm_head.weight)


def test_cached_context_equals_the_module_over_the_whole_prefix_step_after_step(setup, monkeypatch):
    """The cached path (the lean block forward, which never calls the module) against the module
    path over the whole prefix, and against the module's forward written out here."""
    target, lean, head = setup
    sequence = prompts(1, 14)[0]
    features = _features(target, head, sequence)
    calls = []
    forward = DflashHead.forward
    monkeypatch.setattr(DflashHead, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    cached, fresh = DflashDrafter(head, lean), DflashDrafter(head, lean, cache_context=False)
    for drafter in (cached, fresh):
        drafter.reset(sequence)
    start = 0
    for end in (6, 7, 10, 14):  # commits of 6, 1, 3 and 4 tokens
        calls.clear()
        logits = cached.block_logits(_state(target, sequence[:end], features, start))
        assert not calls and cached.cache_length == end - 1
        torch.testing.assert_close(logits, fresh.block_logits(_state(target, sequence[:end], features, start)),
                                   atol=1e-5, rtol=1e-5)
        assert len(calls) == 1 and fresh.cache_length == end - 1
        torch.testing.assert_close(logits, _module_logits(target, head, sequence[:end], features, B - 1),
                                   atol=1e-4, rtol=1e-4)
        start = end - 1


@pytest.mark.parametrize("num_layers,depth", [(1, 1), (1, B - 1), (2, 2), (3, B - 1)])
def test_the_lean_block_is_the_module_block_in_float64(num_layers, depth):
    """Only the rows a proposal reads are computed (two distinct rows in the first layer, the depth
    slots in the last): the same logits as the module over the whole block, to float64 rounding."""
    torch.manual_seed(num_layers)
    target = tiny_target()
    lean = LeanLlama.from_hf(target.model, max_seq_len=256)
    head = _randomized(DflashHead(DflashConfig.from_target(target, aux_layer_ids=[1, 0], num_layers=num_layers,
                                                           block_size=B, mask_token_id=5)))
    for p in head.parameters():  # norms away from 1, so a norm applied to the wrong rows shows
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    head = head.double()
    target = target.double()
    lean = LeanLlama.from_hf(target.model, max_seq_len=256)
    sequence = prompts(1, 12)[0]
    features = _features(target, head, sequence)
    lean_drafter = DflashDrafter(head, lean, depth=depth)
    module_drafter = DflashDrafter(head, lean, depth=depth, cache_context=False)
    start = 0
    for end in (5, 9, 12):
        state = _state(target, sequence[:end], features, start)
        ours, reference = lean_drafter.block_logits(state), module_drafter.block_logits(state)
        assert ours.shape == (depth, 128)
        torch.testing.assert_close(ours, reference, atol=1e-10, rtol=1e-10)
        start = end - 1


def test_sampled_chain_reports_each_slots_distribution(setup):
    target, lean, head = setup
    drafter = DflashDrafter(head, lean, depth=3)
    sequence = prompts(1, 6)[0]
    features = _features(target, head, sequence)
    sampling = SamplingConfig(temperature=0.8)
    candidates = drafter.propose(_state(target, sequence, features, 0, sampling, torch.Generator().manual_seed(0)))
    assert not candidates.deterministic and candidates.draft_probs.shape == (3, 128)
    assert candidates.parents.tolist() == [-1, 0, 1]
    expected = probabilities(_module_logits(target, head, sequence, features, 3), sampling)
    torch.testing.assert_close(candidates.draft_probs, expected, atol=1e-5, rtol=1e-4)


def test_depth_and_head_checks(setup):
    target, lean, head = setup
    with pytest.raises(ValueError, match="depth must lie in"):
        DflashDrafter(head, lean, depth=B)
    with pytest.raises(ValueError, match="needs a DflashHead"):
        DflashDrafter(Eagle3Head(Eagle3Config.from_target(target, aux_layer_ids=[0, 1])), lean)
    assert dflash_chain(head, lean, 50).depth == B - 1 and dflash_chain(head, lean, 2).depth == 2


VOCAB, LENGTH, SAMPLES = 4, 3, 1500


def _peaked_lean() -> LeanLlama:
    """A tiny target over VOCAB tokens with peaked, non-degenerate next-token distributions."""
    model = tiny_model(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                       num_key_value_heads=1, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.6)
    return LeanLlama.from_hf(model, max_seq_len=32)


def _exact(lean, prompt) -> dict:
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        logits = lean(torch.cat([prompt, torch.tensor(seq[:-1], dtype=torch.long)]), lean.new_cache()).logits
        probs = torch.softmax(logits[-LENGTH:], -1)
        out[seq] = float(torch.prod(torch.stack([probs[i, t] for i, t in enumerate(seq)])))
    return out


@pytest.mark.parametrize("greedy_drafts,draft_vocab", [(False, None), (False, [1, 2]),
                                                        pytest.param(True, None, marks=pytest.mark.slow)])
def test_speculative_sampling_matches_exact_distribution(greedy_drafts, draft_vocab):
    """Also over a draft vocabulary of 2 of the 4 ids: tokens 0 and 3 are never drafted, and the
    target's whole distribution must still come out."""
    lean = _peaked_lean()
    config = DflashConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=8, vocab_size=VOCAB, target_hidden_size=16, aux_layer_ids=[0, 1],
                          target_num_layers=2, block_size=3, mask_token_id=3,
                          draft_vocab_size=len(draft_vocab or []))
    head = _randomized(DflashHead(config), 0.6)
    if draft_vocab:
        set_draft_vocab(head, torch.tensor(draft_vocab))
    drafter = DflashDrafter(head, lean, greedy_drafts=greedy_drafts)
    prompt, generator, counts = torch.tensor([1, 3, 2]), torch.Generator().manual_seed(0), {}
    for _ in range(SAMPLES):
        tokens = tuple(speculative_generate(lean, drafter, prompt, LENGTH, SamplingConfig(temperature=1.0),
                                            generator=generator).tokens)
        counts[tokens] = counts.get(tokens, 0) + 1
    assert chi_square_p_value(*pooled_rare(counts, _exact(lean, prompt), SAMPLES), SAMPLES) > 1e-3
