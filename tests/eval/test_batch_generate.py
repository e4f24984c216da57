"""Batched decoding on tiny models: each sequence of a greedy batch decodes to exactly its batch-1
output (plain, EAGLE tree and chain for EAGLE-1/2 and EAGLE-3 heads, Medusa, prompt lookup, stub
trees of ragged sizes), with ragged prompt lengths and EOS at different steps; finished sequences
leave the batch and new ones join between steps; EAGLE drafts a batch in batched head forwards and
proposes what it proposes one sequence at a time; sampling at batch > 1 follows the target's exact
distribution (chi-square; plain, a stub tree, and (slow) a batched EAGLE-3 sampled chain), and a
broken sampler fails the same test."""
import pytest
import torch

from eval.runtime.batch_generate import BatchDecoder, batch_generate, time_per_output_token
from eval.runtime.batch_model import BatchKVCache, batch_forward
from eval.runtime.drafters.eagle import EagleDrafter
from eval.runtime.drafters.medusa import MedusaDrafter
from eval.runtime.drafters.prompt_lookup import PromptLookupDrafter
from eval.runtime.generate import plain_generate, speculative_generate
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import SamplingConfig
from tests.eval.test_lossless_generate import LENGTH, SAMPLES, SAMPLING, TreeStub, _peaked_lean, exact
from tests.helpers import OracleDrafter, chi_square_p_value
from tests.tiny import tiny_eagle3_setup, tiny_eagle_setup, tiny_model

VOCAB, NEW_TOKENS = 128, 20


@pytest.fixture(scope="module")
def lean():
    torch.manual_seed(0)
    return LeanLlama.from_hf(tiny_model(num_hidden_layers=3), max_seq_len=256)


def ragged_prompts(lengths=(3, 9, 5, 14, 7)):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=generator) for n in lengths]


def test_batch_forward_matches_batch_one_forward(lean):
    """Ragged cache lengths, a tree per sequence and padding rows: logits and the cache entries
    equal those of each sequence's own forward."""
    prompts = ragged_prompts((4, 11, 7))
    cache = BatchKVCache(lean, 3, 64)
    singles = []
    for slot, prompt in enumerate(prompts):
        lean(prompt, cache.caches[slot])
        cache.caches[slot].commit()
        single = lean.new_cache(64)
        lean(prompt, single)
        single.commit()
        singles.append(single)
    parents = [[-1, 0, 0, 1], [-1, 0, 1], [-1]]
    trees = [torch.zeros(4, 4, dtype=torch.bool) for _ in parents]
    for tree, tree_parents in zip(trees, parents):
        for i, p in enumerate(tree_parents):
            tree[i, i] = True
            while p >= 0:
                tree[i, p] = True
                p = tree_parents[p]
    depths = [[0, 1, 1, 2], [0, 1, 2, 0], [0, 0, 0, 0]]
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0], [12, 0, 0, 0]])
    for b, n in enumerate((4, 3, 1)):
        trees[b][n:] = torch.eye(4, dtype=torch.bool)[n:]
    positions = torch.tensor([[p.shape[0] + d for d in ds] for p, ds in zip(prompts, depths)])
    out = batch_forward(lean, tokens, cache, positions, torch.stack(trees), hidden_layers=(-1,))
    for b, n in enumerate((4, 3, 1)):
        alone = lean(tokens[b, :n], singles[b], positions[b, :n], trees[b][:n, :n], hidden_layers=(-1,))
        torch.testing.assert_close(out.logits[b, :n], alone.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.hidden[lean.config.num_layers][b, :n], alone.hidden[lean.config.num_layers],
                                   atol=1e-4, rtol=1e-4)
        cache.caches[b].compact([0, n - 1])
        singles[b].compact([0, n - 1])
        length = singles[b].length
        assert cache.caches[b].length == length
        torch.testing.assert_close(cache.k[:, b, :, :length], singles[b].k[:, :, :length], atol=1e-5, rtol=1e-5)


def test_plain_batch_equals_batch_one_with_eos_at_different_steps(lean):
    prompts = ragged_prompts()
    alone = [plain_generate(lean, p, NEW_TOKENS).tokens for p in prompts]
    eos = alone[1][4]  # ends sequence 1 early; others end where (if) they meet it
    expected = [plain_generate(lean, p, NEW_TOKENS, eos_token_ids=[eos]).tokens for p in prompts]
    assert len({len(tokens) for tokens in expected}) > 1
    results = batch_generate(lean, prompts, NEW_TOKENS, eos_token_ids=[eos], max_length=64)
    assert [r.tokens for r in results] == expected
    for result in results:
        assert 0 < result.prefill_time <= result.total_time
        assert len(result.tokens) == 1 or time_per_output_token(result) > 0


def _eagle_factory(setup, mode):
    target, eagle_lean, head = setup

    def build():
        return EagleDrafter(head, eagle_lean, mode=mode, depth=3, top_k=3, total_tokens=8)
    return eagle_lean, build


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_greedy_eagle_batch_equals_batch_one(kind, mode):
    setup = tiny_eagle_setup() if kind == "eagle" else tiny_eagle3_setup()
    model, build = _eagle_factory(setup, mode)
    prompts = ragged_prompts()
    alone = [plain_generate(model, p, NEW_TOKENS).tokens for p in prompts]
    eos = alone[2][6]
    expected = [speculative_generate(model, build(), p, NEW_TOKENS, eos_token_ids=[eos]).tokens for p in prompts]
    assert expected == [plain_generate(model, p, NEW_TOKENS, eos_token_ids=[eos]).tokens for p in prompts]
    results = batch_generate(model, prompts, NEW_TOKENS, eos_token_ids=[eos], drafter_factory=build, max_length=80)
    assert [r.tokens for r in results] == expected
    assert sum(sum(r.accepted) for r in results) > 0  # some drafts were accepted: the paths were exercised


def test_greedy_medusa_and_prompt_lookup_batches_equal_batch_one(lean):
    from heads.medusa import MedusaConfig, MedusaHeads

    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(num_heads=3, num_layers=1, hidden_size=64, vocab_size=VOCAB,
                                     share_lm_head=True)).eval()
    choices = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    repetitive = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6])
    prompts = ragged_prompts()[:3] + [repetitive]
    expected = [plain_generate(lean, p, NEW_TOKENS).tokens for p in prompts]
    for build in (lambda: MedusaDrafter(heads, lean, choices), lambda: PromptLookupDrafter(num_draft=4)):
        runs = [batch_generate(lean, prompts, NEW_TOKENS, max_length=64, decoder=BatchDecoder(
            lean, len(prompts), drafter_factory=build, max_length=64, batched_drafting=batched)) for batched in (True, False)]
        assert [r.tokens for r in runs[0]] == expected
        assert [r.accepted for r in runs[0]] == [r.accepted for r in runs[1]]  # Medusa: batched heads, same trees


def test_ragged_stub_trees_and_acceptance(lean):
    """Oracle drafters with different right/wrong counts per sequence: trees of different sizes in
    one forward (padding), ragged acceptance, every sequence equal to its batch-1 output."""
    prompts = ragged_prompts()
    expected = [plain_generate(lean, p, NEW_TOKENS).tokens for p in prompts]
    settings = iter([(0, 3, False), (4, 0, False), (2, 2, True), (0, 0, False), (3, 1, True)])
    drafters = [OracleDrafter(e + [0] * 8, p.shape[0], *s) for e, p, s in zip(expected, prompts, settings)]
    pool = iter(drafters)
    results = batch_generate(lean, prompts, NEW_TOKENS, drafter_factory=lambda: next(pool), max_length=64)
    assert [r.tokens for r in results] == expected
    assert results[1].accepted[0] == 4 and results[0].accepted[0] == 0 and results[3].tree_sizes[0] == 0


def test_continuous_batching_join_and_leave(lean):
    """Requests join between steps into the slots finished ones left; each equals batch-1."""
    prompts = ragged_prompts((3, 9, 5, 14, 7, 4, 6))
    budgets = [5, 12, 3, 20, 8, 6, 10]
    expected = [plain_generate(lean, p, n).tokens for p, n in zip(prompts, budgets)]
    decoder = BatchDecoder(lean, 3, max_length=64)
    waiting, results = list(range(len(prompts))), {}
    while waiting or decoder.active:
        while waiting and decoder.free:
            index = waiting.pop(0)
            request = decoder.join(prompts[index], budgets[index], key=index)
            results[index] = request
        decoder.step()
        assert len(decoder.active) <= 3
    assert [results[i].result.tokens for i in range(len(prompts))] == expected


class BrokenTree(TreeStub):
    """The tree stub claiming its deterministic drafts were sampled from a uniform distribution:
    verification then accepts them too often, and the output distribution is wrong."""

    def propose(self, state):
        candidates = super().propose(state)
        candidates.deterministic = False
        candidates.draft_probs = torch.full((len(candidates), 4), 0.25)
        return candidates


def _batched_counts(lean, build, prompt, batch=25) -> dict:
    counts = {}
    decoder = BatchDecoder(lean, batch, SAMPLING, drafter_factory=build, max_length=24)
    for round_ in range(SAMPLES // batch):
        generators = [torch.Generator().manual_seed(round_ * batch + i) for i in range(batch)]
        results = batch_generate(lean, [prompt] * batch, LENGTH, SAMPLING, generators=generators, decoder=decoder)
        for result in results:
            counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
    return counts


@pytest.mark.parametrize("drafter", ["plain", "tree"])
def test_batched_sampling_matches_exact_distribution(drafter):
    lean = _peaked_lean()
    prompt = torch.tensor([1, 3, 2])
    counts = _batched_counts(lean, None if drafter == "plain" else TreeStub, prompt)
    assert chi_square_p_value(counts, exact(lean, prompt), SAMPLES) > 1e-3


def test_batched_broken_sampler_fails_the_test():
    lean = _peaked_lean()
    prompt = torch.tensor([1, 3, 2])
    counts = _batched_counts(lean, BrokenTree, prompt)
    assert chi_square_p_value(counts, exact(lean, prompt), SAMPLES) < 1e-3


def test_sampled_batch_draws_what_batch_one_draws(lean):
    """One generator per sequence: the random draws of a sequence do not depend on its batch."""
    prompts = ragged_prompts()[:3]
    sampling = SamplingConfig(temperature=1.0)
    alone = [plain_generate(lean, p, NEW_TOKENS, sampling, generator=torch.Generator().manual_seed(i)).tokens
             for i, p in enumerate(prompts)]
    generators = [torch.Generator().manual_seed(i) for i in range(3)]
    results = batch_generate(lean, prompts, NEW_TOKENS, sampling, generators=generators, max_length=64)
    assert [r.tokens for r in results] == alone


def _eagle31_setup():
    """tiny_eagle3_setup's target and lean forward with a random EAGLE-3 head that sets the
    EAGLE-3.1 options (its norms away from ones): norm(out) is fed back in the batched forward too."""
    from heads.eagle3 import Eagle3Config, Eagle3Head

    target, lean, _ = tiny_eagle3_setup()
    torch.manual_seed(1)
    head = Eagle3Head(Eagle3Config.from_target(target, aux_layer_ids=[0, 1], norm_before_fc=True, norm_output=True))
    with torch.no_grad():
        for name, weight in head.named_parameters():
            if "norm" in name:
                weight.normal_(1.0, 0.3)
    return target, lean, head.eval()


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3.1"])
@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_batched_eagle_drafting_drafts_what_each_sequence_drafts(kind, mode):
    """EAGLE drafts the batch in batched head forwards: the same trees (sizes, acceptance) as
    drafting one sequence at a time, and the same output."""
    setup = {"eagle": tiny_eagle_setup, "eagle3": tiny_eagle3_setup, "eagle3.1": _eagle31_setup}[kind]()
    model, build = _eagle_factory(setup, mode)
    prompts = ragged_prompts()
    runs = []
    for batched in (True, False):
        decoder = BatchDecoder(model, len(prompts), drafter_factory=build, max_length=80, batched_drafting=batched)
        runs.append(batch_generate(model, prompts, NEW_TOKENS, decoder=decoder))
    assert [r.tokens for r in runs[0]] == [r.tokens for r in runs[1]]
    assert [r.accepted for r in runs[0]] == [r.accepted for r in runs[1]]
    assert [r.tree_sizes for r in runs[0]] == [r.tree_sizes for r in runs[1]]


@pytest.mark.slow
def test_batched_eagle_chain_sampling_matches_exact_distribution():
    from tests.eval.test_lossless_generate import _drafter

    lean = _peaked_lean()
    prompt = torch.tensor([1, 3, 2])
    counts = _batched_counts(lean, lambda: _drafter("eagle3_sampled_chain", lean), prompt)
    assert chi_square_p_value(counts, exact(lean, prompt), SAMPLES) > 1e-3
