"""EAGLE drafter on tiny targets, for both head kinds: EAGLE-1/2 (`EagleHead`) and EAGLE-3
(`Eagle3Head`, aux streams, its own lm_head and draft vocabulary). Each kind comes as a random head
and a warm one that the target accepts (EAGLE-1/2 from the target's last layer; EAGLE-3 from
`tiny_eagle3_setup`, which agrees most of the time). Checked: lossless greedy output, EAGLE-2 tree
invariants, a draft KV cache that equals a fresh recompute from the target's own features, tree
scores equal to the head module's sequential log-probabilities (also for EAGLE-3 heads with the
EAGLE-3.1 options), the draft vocabulary, and lossless output behind a bf16 target."""
import copy
from dataclasses import dataclass

import pytest
import torch

from eval.prepare import head_in_dtype
from eval.runtime import linear_paths
from eval.runtime.drafters import DraftState
from eval.runtime.drafters.eagle import EagleDrafter
from eval.runtime.drafters.eagle_tree import select_tree
from eval.runtime.generate import plain_generate, speculative_generate
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import SamplingConfig
from heads.eagle import EagleConfig, EagleHead, init_from_target
from heads.eagle3 import Eagle3Config, Eagle3Head, init_from_target as init_from_target3
from tests.tiny import tiny_eagle3_setup, tiny_target

NEW_TOKENS = 20
EVEN = torch.arange(0, 128, 2)  # a draft vocabulary of half the target's ids


@dataclass
class Pair:
    """A head with the target (and its lean forward) it drafts for."""

    target: object
    lean: LeanLlama
    head: torch.nn.Module

    @property
    def eagle3(self) -> bool:
        return isinstance(self.head, Eagle3Head)

    def features(self, sequence: torch.Tensor) -> torch.Tensor:
        """(T, F) what the head reads at each position, from transformers' forward (as training does)."""
        layers = self.head.config.aux_layer_ids if self.eagle3 else [-1]
        hidden = self.target.features(sequence[None], layers=layers).hidden
        return torch.cat([hidden[layer % (self.target.num_layers + 1)][0] for layer in layers], dim=-1)

    def module(self, embeds, hidden, positions, past=None, committed=True):
        """The head module's own forward; committed positions take features, drafts their parent's
        output (EAGLE-3: as the head feeds it back, normed under norm_output)."""
        if self.eagle3:
            hidden = self.head.project(hidden) if committed else self.head.feedback(hidden)
        return self.head(embeds, hidden, positions, past_key_values=past, use_cache=True)

    def log_probs(self, out: torch.Tensor) -> torch.Tensor:
        """(D,) output -> (V,) draft log-probabilities over target ids (-inf outside the draft vocabulary)."""
        if not self.eagle3:
            return torch.log_softmax(self.lean.lm_head(out[None]).float(), dim=-1)[0]
        full = torch.full((self.head.config.vocab_size,), float("-inf"))
        full[self.head.draft_ids()] = torch.log_softmax(self.head.logits(out).float(), dim=-1)
        return full


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def kind(request):
    """{"random": Pair, "warm": Pair} of one head kind."""
    torch.manual_seed(0)
    target = tiny_target()
    lean = LeanLlama.from_hf(target.model, max_seq_len=256)
    if request.param == "eagle":
        config = EagleConfig.from_target(target)
        warm = init_from_target(EagleHead(config), target, layer=-1, fc="feature").eval()
        return {"random": Pair(target, lean, EagleHead(config).eval()), "warm": Pair(target, lean, warm)}
    # Three streams, out of order and repeated: the concatenation order is the head's.
    random = Eagle3Head(Eagle3Config.from_target(target, aux_layer_ids=[1, 0, 1])).eval()
    return {"random": Pair(target, lean, random), "warm": Pair(*tiny_eagle3_setup())}


def prompts(count: int, length: int = 7):
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (length,), generator=generator) for _ in range(count)]


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("which", ["random", "warm"])
def test_greedy_speculative_equals_plain(kind, mode, which):
    pair = kind[which]
    drafter = EagleDrafter(pair.head, pair.lean, mode=mode, depth=3, top_k=3, total_tokens=8)
    accepted = []
    for prompt in prompts(4):
        plain = plain_generate(pair.lean, prompt, NEW_TOKENS)
        spec = speculative_generate(pair.lean, drafter, prompt, NEW_TOKENS)
        assert spec.tokens == plain.tokens
        accepted.extend(spec.accepted)
        assert max(spec.tree_sizes) == (3 if mode == "chain" else 7)
    if which == "warm":
        assert max(accepted) >= 1  # the compaction path is exercised
    if which == "warm" and pair.eagle3:  # the EAGLE-3 setup agrees most of the time
        assert sum(accepted) / len(accepted) > 0.7


@pytest.mark.parametrize("head_dtype", ["float32", "runtime"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_speculative_equals_plain_in_bf16(kind, mode, head_dtype):
    """A bf16 target with its paths installed, the head in fp32 (its own paths) or in bf16
    (`runtime.head_dtype=runtime`: the target's paths)."""
    pair = kind["warm"]
    bf16 = LeanLlama.from_hf(copy.deepcopy(pair.target.model).to(torch.bfloat16), max_seq_len=256)
    linear_paths.force_path(bf16, "linear")
    head = pair.head if head_dtype == "float32" else head_in_dtype(pair.head, torch.bfloat16)
    drafter = EagleDrafter(head, bf16, mode=mode, depth=3, top_k=3, total_tokens=8)
    assert bool(drafter.linear_paths) == (head_dtype == "runtime")
    for prompt in prompts(4):
        plain = plain_generate(bf16, prompt, NEW_TOKENS).tokens
        assert speculative_generate(bf16, drafter, prompt, NEW_TOKENS).tokens == plain


def _state_after_prefill(drafter, lean, prompt):
    cache = lean.new_cache()
    out = lean(prompt, cache, hidden_layers=drafter.feature_layers, logits="last")
    cache.commit()
    tokens = torch.cat([prompt, out.logits[-1].argmax()[None]])
    return DraftState(tokens, tokens.shape[0] - 1, out.hidden, lean.config.num_layers, SamplingConfig())


def _proposal(drafter, lean, prompt, **sampling):
    drafter.reset(prompt)
    state = _state_after_prefill(drafter, lean, prompt)
    if sampling:
        state.sampling, state.generator = SamplingConfig(**sampling), torch.Generator().manual_seed(0)
    return drafter.propose(state), state


@pytest.mark.parametrize("top_k,depth,total", [(2, 3, 6), (3, 4, 10), (4, 3, 16), (2, 5, 40)])
def test_dynamic_tree_invariants(kind, top_k, depth, total):
    pair = kind["warm"]
    drafter = EagleDrafter(pair.head, pair.lean, mode="tree", depth=depth, top_k=top_k, total_tokens=total)
    candidates, _ = _proposal(drafter, pair.lean, prompts(1)[0])
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


def test_tree_depth_one_row_matches_chain_first_draft(kind):
    pair = kind["warm"]
    prompt = prompts(1)[0]
    tree, _ = _proposal(EagleDrafter(pair.head, pair.lean, mode="tree", depth=2, top_k=3, total_tokens=4),
                        pair.lean, prompt)
    chain, _ = _proposal(EagleDrafter(pair.head, pair.lean, mode="chain", depth=2), pair.lean, prompt)
    # The best root child of the tree is the chain's first (argmax) draft.
    assert tree.tokens[0] == chain.tokens[0]


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("which", ["random", "warm"])
def test_draft_cache_equals_fresh_recompute(kind, mode, which):
    """After a generation, the head's committed cache equals the head module run once over the
    sequence with features from transformers' forward: the lean target handed the drafter the
    right layers (EAGLE-3: the streams entering aux_layer_ids, in the head's order) for the right
    tokens, through every compaction."""
    pair = kind[which]
    prompt = prompts(1)[0]
    drafter = EagleDrafter(pair.head, pair.lean, mode=mode, depth=3, top_k=3, total_tokens=8)
    result = speculative_generate(pair.lean, drafter, prompt, 16)
    assert len(result.accepted) >= 3
    # The cache covers positions 0..T-3 of the T committed tokens seen by the last propose.
    sequence = torch.cat([prompt, torch.tensor(result.tokens)])
    length = drafter.cache_length
    features = pair.features(sequence[:length])  # (C, F)
    embeds = pair.lean.embedding[sequence[1: length + 1]]
    fresh_out, (k, v) = pair.module(embeds[None], features[None], torch.arange(length)[None])
    torch.testing.assert_close(drafter.past[0], k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(drafter.past[1], v, atol=1e-5, rtol=1e-4)
    # Same draft scores from the incremental cache as from the fresh one.
    num_layers = pair.lean.config.num_layers
    hidden = pair.lean(sequence[:length], pair.lean.new_cache(), hidden_layers=drafter.feature_layers,
                       logits="none").hidden
    state = DraftState(sequence[: length + 1], length, {layer: h[-1:] for layer, h in hidden.items()}, num_layers,
                       SamplingConfig())
    drafter.runtime.truncate(length - 1)
    again = drafter.catch_up(state)
    torch.testing.assert_close(pair.log_probs(again), pair.log_probs(fresh_out[0, -1]), atol=1e-4, rtol=1e-4)


def test_sampled_chain_reports_draft_probabilities(kind):
    pair = kind["warm"]
    prompt = prompts(1)[0]
    drafter = EagleDrafter(pair.head, pair.lean, mode="chain", depth=3)
    candidates, _ = _proposal(drafter, pair.lean, prompt, temperature=0.8, top_k=20)
    assert not candidates.deterministic and candidates.draft_probs.shape == (3, 128)
    for token, row in zip(candidates.tokens.tolist(), candidates.draft_probs):
        assert row[token] > 0 and abs(float(row.sum()) - 1.0) < 1e-5
        assert int((row > 0).sum()) <= 20
    result = speculative_generate(pair.lean, drafter, prompt, 12, SamplingConfig(temperature=0.8),
                                  generator=torch.Generator().manual_seed(1))
    assert len(result.tokens) == 12


def test_eagle1_draft_vocab_subset_stays_lossless_and_in_vocabulary(kind):
    pair = kind["warm"]
    if pair.eagle3:
        with pytest.raises(ValueError, match="own vocabulary"):
            EagleDrafter(pair.head, pair.lean, draft_vocab=EVEN)
        return
    for mode in ("chain", "tree"):
        drafter = EagleDrafter(pair.head, pair.lean, mode=mode, depth=3, top_k=3, total_tokens=8, draft_vocab=EVEN)
        for prompt in prompts(2):
            candidates, _ = _proposal(drafter, pair.lean, prompt)
            assert all(t % 2 == 0 for t in candidates.tokens.tolist())
            assert speculative_generate(pair.lean, drafter, prompt, NEW_TOKENS).tokens == plain_generate(
                pair.lean, prompt, NEW_TOKENS).tokens
    drafter = EagleDrafter(pair.head, pair.lean, mode="chain", depth=2, draft_vocab=EVEN)
    candidates, _ = _proposal(drafter, pair.lean, prompts(1)[0], temperature=1.0)
    assert candidates.draft_probs.shape == (2, 128) and float(candidates.draft_probs[:, 1::2].sum()) == 0.0


@torch.no_grad()
def test_tree_scores_equal_sequential_chain_log_probs(kind):
    """Each tree node's score equals the cumulative log-probability of its path computed one token
    at a time by the head module without a tree mask: checks the batched expansion's mask,
    positions, fed-back outputs and the draft-to-target id map."""
    _check_tree_scores(kind["warm"])


EAGLE31 = [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_output": True},
           {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True}]


@pytest.fixture(scope="module", params=EAGLE31, ids=lambda o: "+".join(o))
def eagle31(request):
    """A random EAGLE-3 head with EAGLE-3.1 options, its norms away from ones, over half the vocabulary."""
    torch.manual_seed(0)
    target = tiny_target()
    config = Eagle3Config.from_target(target, draft_vocab_size=EVEN.numel(), aux_layer_ids=[1, 0, 1],
                                      **request.param)
    head = init_from_target3(Eagle3Head(config), target, EVEN).eval()
    with torch.no_grad():
        for name, weight in head.named_parameters():
            if "norm" in name:
                weight.normal_(1.0, 0.3)
    return Pair(target, LeanLlama.from_hf(target.model, max_seq_len=256), head)


@torch.no_grad()
def test_eagle31_drafter_scores_equal_the_head_module(eagle31):
    """The drafter's tree scores and chain logits are the head module's (fc's input norms at
    catch-up, norm(out) fed back under norm_output), and drafting stays lossless."""
    _check_tree_scores(eagle31)
    drafter = EagleDrafter(eagle31.head, eagle31.lean, mode="chain", depth=3)
    prompt = prompts(1)[0]
    candidates, state = _proposal(drafter, eagle31.lean, prompt)
    output, past, length = drafter.catch_up_output, drafter.past, state.tokens.shape[0]
    for i, token in enumerate(candidates.tokens.tolist()):
        assert token == int(torch.argmax(eagle31.log_probs(output)))  # greedy chain: the module's argmax
        embed = eagle31.lean.embedding[torch.tensor([[token]])]
        out, past = eagle31.module(embed, output[None, None], torch.tensor([[length - 1 + i]]), past, committed=False)
        output = out[0, -1]
    assert speculative_generate(eagle31.lean, drafter, prompt, 12).tokens == plain_generate(eagle31.lean, prompt, 12).tokens


def _check_tree_scores(pair):
    drafter = EagleDrafter(pair.head, pair.lean, mode="tree", depth=4, top_k=3, total_tokens=20)
    candidates, state = _proposal(drafter, pair.lean, prompts(1)[0])
    committed, length = drafter.past, state.tokens.shape[0]
    root_output = drafter.catch_up_output  # the head's output at position T-2 of the last catch-up
    parents, tokens = candidates.parents.tolist(), candidates.tokens.tolist()
    for node, score in enumerate(candidates.info["scores"]):
        path = [node]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        output, past, total = root_output, committed, 0.0
        for i, step in enumerate(path):
            total += float(pair.log_probs(output)[tokens[step]])
            embed = pair.lean.embedding[torch.tensor([[tokens[step]]])]
            out, past = pair.module(embed, output[None, None], torch.tensor([[length - 1 + i]]), past, committed=False)
            output = out[0, -1]
        # fp32 rounding of the lean runtime's packed weights compounds along a 4-deep path (~3e-4
        # here); a wrong mask, position or parent output moves scores by far more. The runtime
        # itself is pinned to the heads in float64 by tests/eval/test_lean_head.py.
        assert abs(total - score) < 2e-3, (node, total, score)


def test_eagle3_drafts_in_its_vocabulary_through_d2t():
    """A draft vocabulary of the even ids: every draft is an even target id, chosen by the head's
    logits over Vd columns mapped by d2t; greedy output stays the target's and drafts still land."""
    target, lean, head = tiny_eagle3_setup(draft_vocab=EVEN)
    assert head.config.draft_vocab_size == 64 and int(head.d2t[5]) == 5  # draft id 5 is target id 10
    accepted = []
    for mode in ("chain", "tree"):
        drafter = EagleDrafter(head, lean, mode=mode, depth=3, top_k=3, total_tokens=8)
        assert torch.equal(drafter.vocab, EVEN)
        for prompt in prompts(3):
            candidates, state = _proposal(drafter, lean, prompt)
            assert all(t % 2 == 0 for t in candidates.tokens.tolist())
            first = int(head.to_target_ids(head.logits(drafter.catch_up_output).argmax()))
            assert candidates.tokens[0] == first
            spec = speculative_generate(lean, drafter, prompt, NEW_TOKENS)
            assert spec.tokens == plain_generate(lean, prompt, NEW_TOKENS).tokens
            accepted += spec.accepted
    assert sum(accepted) > 0
    sampled, _ = _proposal(EagleDrafter(head, lean, mode="chain", depth=2), lean, prompts(1)[0], temperature=1.0)
    assert sampled.draft_probs.shape == (2, 128) and float(sampled.draft_probs[:, 1::2].sum()) == 0.0
    torch.testing.assert_close(sampled.draft_probs.sum(-1), torch.ones(2))


def test_head_in_dtype_casts_a_copy_of_the_parameters_only(kind):
    head = kind["warm"].head
    cast = head_in_dtype(head, torch.bfloat16)
    assert {p.dtype for p in cast.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in head.parameters()} == {torch.float32}  # the head itself unchanged
    assert cast.inv_freq.dtype == torch.float32 and torch.equal(cast.inv_freq, head.inv_freq)
    assert head_in_dtype(head, torch.float32) is head
