"""EAGLE drafter on a tiny target with a tiny EAGLE head (random, and started from the target's
last layer so that some drafts are accepted): lossless greedy output, EAGLE-2 tree invariants, and
a draft KV cache that equals a fresh recompute after several steps."""
import pytest
import torch

from eval.drafters import DraftState
from eval.drafters.eagle import EagleDrafter, select_tree
from eval.generate import plain_generate, speculative_generate
from eval.model import LeanLlama
from eval.sampling import SamplingConfig
from heads.eagle import EagleConfig, EagleHead, init_from_target
from tests.tiny import tiny_target

NEW_TOKENS = 20


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    target = tiny_target()
    lean = LeanLlama.from_hf(target.model, max_seq_len=256)
    config = EagleConfig.from_target(target)
    random_head = EagleHead(config).eval()
    warm_head = init_from_target(EagleHead(config), target, layer=-1, fc="feature").eval()
    return lean, random_head, warm_head


def prompts(count: int, length: int = 7):
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (length,), generator=generator) for _ in range(count)]


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("which", ["random", "warm"])
def test_greedy_speculative_equals_plain(setup, mode, which):
    lean, random_head, warm_head = setup
    head = random_head if which == "random" else warm_head
    drafter = EagleDrafter(head, lean, mode=mode, depth=3, top_k=3, total_tokens=8)
    accepted = []
    for prompt in prompts(4):
        plain = plain_generate(lean, prompt, NEW_TOKENS)
        spec = speculative_generate(lean, drafter, prompt, NEW_TOKENS)
        assert spec.tokens == plain.tokens
        accepted.extend(spec.accepted)
        assert max(spec.tree_sizes) == (3 if mode == "chain" else 7)
    if which == "warm":
        assert max(accepted) >= 1  # the compaction path is exercised


def _state_after_prefill(lean, prompt):
    cache = lean.new_cache()
    out = lean(prompt, cache, hidden_layers=(-1,), logits="last")
    cache.commit()
    tokens = torch.cat([prompt, out.logits[-1].argmax()[None]])
    return DraftState(tokens, tokens.shape[0] - 1, out.hidden, lean.config.num_layers, SamplingConfig())


@pytest.mark.parametrize("top_k,depth,total", [(2, 3, 6), (3, 4, 10), (4, 3, 16), (2, 5, 40)])
def test_dynamic_tree_invariants(setup, top_k, depth, total):
    lean, _, warm_head = setup
    drafter = EagleDrafter(warm_head, lean, mode="tree", depth=depth, top_k=top_k, total_tokens=total)
    drafter.reset(prompts(1)[0])
    candidates = drafter.propose(_state_after_prefill(lean, prompts(1)[0]))
    available = top_k + (depth - 1) * top_k * top_k
    assert len(candidates) == min(total - 1, available)
    parents, scores = candidates.parents.tolist(), candidates.info["scores"]
    depths = []
    for i, parent in enumerate(parents):
        assert parent < i  # parents selected, topological order
        depths.append(1 if parent < 0 else depths[parent] + 1)
        if parent >= 0:
            assert scores[i] <= scores[parent] + 1e-6  # cumulative log-prob never rises along a path
    assert max(depths) <= depth
    for parent in set(parents):  # siblings carry distinct tokens (deterministic top-k drafts)
        siblings = [candidates.tokens[i].item() for i, p in enumerate(parents) if p == parent]
        assert len(siblings) == len(set(siblings))


def test_select_tree_keeps_best_nodes_and_remaps_parents():
    # Root children 0 (-0.1) and 1 (-2.0); node 2 child of 0 (-0.5); node 3 child of 2 (-0.6).
    candidates = select_tree([10, 11, 12, 13], [-1, -1, 0, 2], [-0.1, -2.0, -0.5, -0.6], [1, 1, 2, 3], 3)
    assert candidates.tokens.tolist() == [10, 12, 13]
    assert candidates.parents.tolist() == [-1, 0, 1]


def test_tree_depth_one_row_matches_chain_first_draft(setup):
    lean, _, warm_head = setup
    prompt = prompts(1)[0]
    tree = EagleDrafter(warm_head, lean, mode="tree", depth=2, top_k=3, total_tokens=4)
    chain = EagleDrafter(warm_head, lean, mode="chain", depth=2)
    tree.reset(prompt)
    chain.reset(prompt)
    tree_candidates = tree.propose(_state_after_prefill(lean, prompt))
    chain_candidates = chain.propose(_state_after_prefill(lean, prompt))
    # The best root child of the tree is the chain's first (argmax) draft.
    assert tree_candidates.tokens[0] == chain_candidates.tokens[0]


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_draft_cache_equals_fresh_recompute(setup, mode):
    lean, _, warm_head = setup
    prompt = prompts(1)[0]
    drafter = EagleDrafter(warm_head, lean, mode=mode, depth=3, top_k=3, total_tokens=8)
    result = speculative_generate(lean, drafter, prompt, 16)
    assert len(result.accepted) >= 3
    # The cache covers positions 0..T-3 of the T committed tokens seen by the last propose; rebuild
    # it from scratch with the target's features of the full sequence.
    sequence = torch.cat([prompt, torch.tensor(result.tokens)])
    length = drafter.cache_length
    features = lean(sequence[:length], lean.new_cache(), hidden_layers=(-1,), logits="none").hidden[
        lean.config.num_layers]  # (C, D)
    embeds = lean.embedding[sequence[1: length + 1]]
    fresh_out, (k, v) = warm_head(embeds[None], features[None], torch.arange(length)[None], use_cache=True)
    torch.testing.assert_close(drafter.past[0], k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(drafter.past[1], v, atol=1e-5, rtol=1e-4)
    # Same draft logits from the incremental cache as from the fresh one.
    state = DraftState(sequence[: length + 1], length, {lean.config.num_layers: features[-1:]},
                       lean.config.num_layers, SamplingConfig())
    drafter.runtime.truncate(length - 1)
    again = drafter.catch_up(state)
    torch.testing.assert_close(lean.lm_head(again[None]), lean.lm_head(fresh_out[0, -1:]), atol=1e-4, rtol=1e-4)


def test_sampled_chain_reports_draft_probabilities(setup):
    lean, _, warm_head = setup
    prompt = prompts(1)[0]
    drafter = EagleDrafter(warm_head, lean, mode="chain", depth=3)
    drafter.reset(prompt)
    state = _state_after_prefill(lean, prompt)
    state.sampling = SamplingConfig(temperature=0.8, top_k=20)
    state.generator = torch.Generator().manual_seed(0)
    candidates = drafter.propose(state)
    assert not candidates.deterministic and candidates.draft_probs.shape == (3, 128)
    for token, row in zip(candidates.tokens.tolist(), candidates.draft_probs):
        assert row[token] > 0 and abs(float(row.sum()) - 1.0) < 1e-5
        assert int((row > 0).sum()) <= 20
    result = speculative_generate(lean, drafter, prompt, 12, SamplingConfig(temperature=0.8),
                                  generator=torch.Generator().manual_seed(1))
    assert len(result.tokens) == 12


def test_draft_vocab_subset_stays_lossless_and_in_vocabulary(setup):
    lean, _, warm_head = setup
    vocab = torch.arange(0, 128, 2)  # even token ids only
    for mode in ("chain", "tree"):
        drafter = EagleDrafter(warm_head, lean, mode=mode, depth=3, top_k=3, total_tokens=8, draft_vocab=vocab)
        for prompt in prompts(2):
            drafter.reset(prompt)
            candidates = drafter.propose(_state_after_prefill(lean, prompt))
            assert all(t % 2 == 0 for t in candidates.tokens.tolist())
            assert speculative_generate(lean, drafter, prompt, NEW_TOKENS).tokens == plain_generate(
                lean, prompt, NEW_TOKENS).tokens
    drafter = EagleDrafter(warm_head, lean, mode="chain", depth=2, draft_vocab=vocab)
    prompt = prompts(1)[0]
    drafter.reset(prompt)
    state = _state_after_prefill(lean, prompt)
    state.sampling, state.generator = SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0)
    candidates = drafter.propose(state)
    assert candidates.draft_probs.shape == (2, 128) and float(candidates.draft_probs[:, 1::2].sum()) == 0.0


@torch.no_grad()
def test_tree_scores_equal_sequential_chain_log_probs(setup):
    """Each tree node's score equals the cumulative log-probability of its path computed one token
    at a time without a tree mask: checks the batched expansion's mask, positions and features."""
    lean, _, warm_head = setup
    prompt = prompts(1)[0]
    drafter = EagleDrafter(warm_head, lean, mode="tree", depth=4, top_k=3, total_tokens=20)
    drafter.reset(prompt)
    state = _state_after_prefill(lean, prompt)
    candidates = drafter.propose(state)
    committed, length = drafter.past, state.tokens.shape[0]
    root_feature = drafter.catch_up_output  # f̂_{T-1} of the last catch-up
    parents, tokens = candidates.parents.tolist(), candidates.tokens.tolist()
    for node, score in enumerate(candidates.info["scores"]):
        path = [node]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        feature, past, total = root_feature, committed, 0.0
        for i, step in enumerate(path):
            logp = torch.log_softmax(lean.lm_head(feature[None]).float(), dim=-1)[0]
            total += float(logp[tokens[step]])
            embed = lean.embedding[torch.tensor([[tokens[step]]])]
            out, past = warm_head(embed, feature[None, None], torch.tensor([[length - 1 + i]]), past_key_values=past,
                                  use_cache=True)
            feature = out[0, -1]
        # fp32 rounding of the lean runtime's packed weights compounds along a 4-deep path (~3e-4
        # here); a wrong mask, position or parent feature moves scores by far more. The runtime
        # itself is pinned to EagleHead in float64 by tests/eval/test_lean_head.py.
        assert abs(total - score) < 2e-3, (node, total, score)
