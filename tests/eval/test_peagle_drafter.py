"""P-EAGLE drafters on tiny targets: a random head and a warm one (the EAGLE-3 setup of
tests/tiny.py with a mask_hidden, so slot 0 agrees with the target most of the time). Checked:
greedy output identical to plain decoding (chain and tree), one head forward per proposal, slot
outputs equal to the head module's forward over the committed rows plus mask slots, a committed
cache equal to a fresh recompute (after one proposal and after a generation), sampled drafts
reporting their slot's distribution over target ids; the tree: the most probable paths by hand,
its first path the chain's drafts, deterministic drafts at a temperature."""
import pytest
import torch

from eval.runtime.drafters import DraftState
from eval.runtime.drafters.peagle import LeanPeagleHead, PeagleDrafter, PeagleTreeDrafter, slot_tree
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


def test_slot_tree_keeps_the_most_probable_paths():
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.4, 0.1, 0.5], [0.05, 0.05, 0.9]])  # (depth 3, Vd 3)
    # Path products: (0,) .6, (1,) .3, (0, 0) .3, (0, 0, 0) .27, (0, 1) .24, then (0, 1, 0) .216.
    candidates = slot_tree(probs, 5)
    assert candidates.parents.tolist() == [-1, -1, 0, 0, 2]  # (0,), (1,), (0, 0), (0, 1), (0, 0, 0)
    assert candidates.tokens.tolist() == [1, 2, 2, 0, 2]  # each node's rank in its slot, as a column
    assert candidates.deterministic
    assert slot_tree(probs, 1).tokens.tolist() == [1]
    assert len(slot_tree(probs, 100)) == 3 + 9 + 27  # every path when the budget exceeds them


def _first_path(candidates) -> list[int]:
    """Tokens along the first child of each node from the root (the all-top-1 path of a slot tree)."""
    parents, path, node = candidates.parents.tolist(), [], -1
    while node in parents:
        node = parents.index(node)
        path.append(int(candidates.tokens[node]))
    return path


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tree_first_path_is_the_chain_and_branches_within_the_budget(temperature):
    target, lean, head = _random()
    with torch.no_grad():  # a confident head, so its tree reaches past the first slot
        head.lm_head.weight.mul_(10.0)
    chain, tree = PeagleDrafter(head, lean, greedy_drafts=True), PeagleTreeDrafter(head, lean, total_tokens=8)
    sampling = SamplingConfig(temperature=temperature)
    depths = []
    for sequence in prompts(3, 9):
        features = _features(target, head, sequence)
        chain.reset(sequence)
        tree.reset(sequence)
        drafts = chain.propose(_state(target, sequence, features, sampling)).tokens.tolist()
        candidates = tree.propose(_state(target, sequence, features, sampling))
        assert candidates.deterministic and len(candidates) == 7
        path = _first_path(candidates)
        assert 1 <= len(path) <= K and path == drafts[:len(path)]
        depths.append(len(path))
        parents = candidates.parents.tolist()
        assert len(set(parents)) < len(parents)  # 7 nodes over 4 slots: some node has siblings
        assert all(int(t) % 2 == 0 for t in candidates.tokens)  # target ids of the even draft vocabulary
        assert tree.cache_length == chain.cache_length == 8  # the same committed rows, the slots dropped
    assert max(depths) == K


@pytest.mark.parametrize("total", [2, 3, 4])
def test_a_small_tree_drafts_only_the_slots_it_can_reach(total):
    """A tree of total - 1 nodes cannot reach past depth total - 1: its drafter runs that many slots
    and proposes the tree that the K slots' logits give."""
    target, lean, head = _random()
    with torch.no_grad():  # a confident head, so trees reach past the first slot
        head.lm_head.weight.mul_(10.0)
    small, full = PeagleTreeDrafter(head, lean, total_tokens=total), PeagleTreeDrafter(head, lean, total_tokens=total)
    full.depth = K  # as before the cap: every slot drafted
    assert small.depth == total - 1
    sampling = SamplingConfig()
    for sequence in prompts(3, 9):
        features = _features(target, head, sequence)
        small.reset(sequence)
        full.reset(sequence)
        state = _state(target, sequence, features, sampling)
        assert small.slot_logits(state).shape[0] == total - 1
        small.reset(sequence)
        mine, theirs = small.propose(state), full.propose(_state(target, sequence, features, sampling))
        assert mine.tokens.tolist() == theirs.tokens.tolist() and mine.parents.tolist() == theirs.parents.tolist()
        assert small.cache_length == full.cache_length


def test_tree_greedy_speculative_equals_plain(setup):
    target, lean, head = setup
    drafter = PeagleTreeDrafter(head, lean, total_tokens=8)
    accepted = []
    for prompt in prompts(4):
        plain = plain_generate(lean, prompt, NEW_TOKENS)
        spec = speculative_generate(lean, drafter, prompt, NEW_TOKENS)
        assert spec.tokens == plain.tokens
        assert max(spec.tree_sizes) == 7
        accepted.extend(spec.accepted)
    if head.config.mask_token_id == 0:  # the warm head: slot 0 is EAGLE-3's first draft
        assert max(accepted) >= 1


@pytest.mark.parametrize("tree", [False, True])
def test_committed_cache_after_a_generation_equals_a_fresh_recompute(tree):
    target, lean, head = _random()
    drafter = PeagleTreeDrafter(head, lean, total_tokens=6) if tree else PeagleDrafter(head, lean)
    prompt = prompts(1, 9)[0]
    result = speculative_generate(lean, drafter, prompt, NEW_TOKENS, SamplingConfig(temperature=0.8),
                                  generator=torch.Generator().manual_seed(0))
    assert len(result.tree_sizes) > 3
    sequence = torch.cat([prompt, torch.tensor(result.tokens)])
    n = drafter.cache_length  # the positions the last proposal committed: 0..n-1
    assert prompt.shape[0] - 1 < n < sequence.shape[0]
    features = _features(target, head, sequence[: n + 1])
    with torch.no_grad():
        _, (k, v) = head(target.embed_tokens(sequence[1: n + 1])[None], head.project(features[:n])[None],
                         torch.arange(n)[None], use_cache=True)
    torch.testing.assert_close(drafter.past[0], k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drafter.past[1], v, atol=1e-4, rtol=1e-4)


def test_tree_checks():
    target, lean, head = _random()
    with pytest.raises(ValueError, match="total_tokens"):
        PeagleTreeDrafter(head, lean, total_tokens=1)
    with pytest.raises(ValueError, match="depth must lie in"):
        PeagleTreeDrafter(head, lean, depth=K + 1)
    assert PeagleTreeDrafter.propose_many is None and PeagleTreeDrafter(head, lean, 4, depth=2).depth == 2


def test_eval_measures_the_tree_at_its_setting():
    from eval.config import RuntimeConfig, check_runtime
    from eval.run import build_methods

    target, lean, head = _random()
    runtime = RuntimeConfig(drafters=["peagle_tree", "peagle_chain"], chain_depth=3, peagle_tree_tokens=6)
    check_runtime(runtime)
    methods, _ = build_methods(runtime.drafters, runtime, lean, head=head)
    assert [m.name for m in methods] == ["plain", "peagle_tree", "peagle_chain"]
    tree, chain = methods[1].build(), methods[2].build()
    assert isinstance(tree, PeagleTreeDrafter) and (tree.total_tokens, tree.depth) == (6, 3)
    assert type(chain) is PeagleDrafter and chain.depth == 3
    assert methods[1].settings["total_tokens"] == 6 and methods[1].settings["depth"] == 3
    with pytest.raises(ValueError, match="peagle_tree_tokens"):
        check_runtime(RuntimeConfig(peagle_tree_tokens=1))


def test_eval_chooses_the_tree_size_by_timing_runs():
    """peagle_tree_tokens "auto": the size of tree_auto_sizes whose greedy runs go fastest, from
    the same calibration as the EAGLE tree, reported beside its τ and step cost per size."""
    from eval.config import RuntimeConfig, check_runtime
    from eval.run import build_methods

    target, lean, head = _random()
    runtime = RuntimeConfig(drafters=["peagle_tree"], chain_depth=3, peagle_tree_tokens="auto",
                            tree_auto_sizes=[2, 4, 6], max_new_tokens=8)
    check_runtime(runtime)
    prompts = [torch.randint(3, 100, (6,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    methods, extra = build_methods(runtime.drafters, runtime, lean, head=head, prompts=prompts)
    budget = extra["peagle_tree_budget"]
    assert set(budget["expected_speedup_by_size"]) == {2, 4, 6} and budget["calibration_prompts"] == 2
    assert budget["chosen"] == max(budget["expected_speedup_by_size"],
                                   key=lambda n: (budget["expected_speedup_by_size"][n], -n))
    tree = methods[1].build()
    assert tree.total_tokens == budget["chosen"] and methods[1].settings["total_tokens_auto"] is True
    with pytest.raises(ValueError, match="peagle_tree_tokens"):
        check_runtime(RuntimeConfig(peagle_tree_tokens="big"))


def test_the_chosen_tree_size_reaches_the_manifest():
    """A P-EAGLE head's report recommends the tree size its auto calibration chose (labelled
    measured, with the hardware), and the export manifest carries it with vLLM's K unchanged; a
    fixed size is recommended as configured."""
    from eval.config import RuntimeConfig
    from eval.recommend import recommended_runtime as from_rows
    from export.manifest import recommended_runtime as section

    _, _, head = _random()
    where = {"device_type": "cpu", "hardware": "CPU test, 2 threads"}
    runtime = RuntimeConfig(drafters=["peagle_tree", "peagle_chain"], chain_depth=3)
    rows = [{"name": "plain", "tokens_per_second": 10.0, "settings": {}},
            {"name": "peagle_tree", "tokens_per_second": 14.0,
             "settings": {"total_tokens_auto": True, "total_tokens": 6, "depth": 3}},
            {"name": "peagle_chain", "tokens_per_second": 15.0, "settings": {"depth": 3}}]
    record = from_rows(rows, runtime, {}, where)
    manifest = section(head.config, record)
    assert manifest["tree"]["total_tokens"] == 6 and manifest["tree"]["depth"] == 3
    assert manifest["sources"]["total_tokens"] == "measured" and manifest["measured_on"] == where
    assert manifest["sources"]["top_k"] == "default (not measured)"  # P-EAGLE trees have no top_k
    assert manifest["vllm"]["num_speculative_tokens"] == head.config.speculative_tokens
    rows[1]["settings"] = {"total_tokens": 8, "depth": 3}  # peagle_tree_tokens=8: configured, not timed
    fixed = section(head.config, from_rows(rows, runtime, {}, where))
    assert fixed["tree"]["total_tokens"] == 8 and fixed["source"] == "configured" and fixed["measured_on"] is None
