"""Medusa static-tree drafter on a tiny target, and the static trees themselves."""
import pytest
import torch

from eval.acceptance import measure_rank_accuracies
from eval.runtime.drafters import DraftState
from eval.runtime.drafters.medusa import MedusaDrafter
from eval.runtime.generate import plain_generate, speculative_generate
from eval.runtime.medusa_trees import (MC_SIM_7B_63, build_tree_from_accuracies, choices_to_parents,
                                       expected_acceptance, normalize_choices, parse_choices)
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import SamplingConfig
from heads.medusa import MedusaConfig, MedusaHeads
from tests.tiny import tiny_target


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    target = tiny_target()
    lean = LeanLlama.from_hf(target.model, max_seq_len=256)
    heads = MedusaHeads(MedusaConfig.from_target(target, num_heads=4)).eval()
    with torch.no_grad():
        for k in range(4):
            heads.lm_head_weight(k).copy_(target.lm_head.weight + 0.05 * torch.randn_like(target.lm_head.weight))
            heads.head(k)[0].linear.weight.normal_(0.0, 0.05)
    shared = MedusaHeads(MedusaConfig.from_target(target, num_heads=4, share_lm_head=True)).eval()
    return lean, heads, shared


def prompts(count: int, length: int = 6):
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 128, (length,), generator=generator) for _ in range(count)]


def test_mc_sim_7b_63_is_a_valid_63_node_tree():
    choices = normalize_choices(MC_SIM_7B_63)
    assert len(choices) == 63 and max(len(p) for p in choices) == 4 and max(max(p) for p in choices) == 9
    parents = choices_to_parents(choices)
    for node, parent in enumerate(parents):
        assert parent < node
        assert parent == -1 or choices[parent] == choices[node][:-1]
    assert parse_choices("mc_sim_7b_63") == choices
    assert parse_choices("[[0], [0, 0], [1]]") == [(0,), (1,), (0, 0)]


def test_prefix_closure_is_enforced():
    with pytest.raises(ValueError, match="prefix"):
        normalize_choices([(0,), (1, 0)])


@pytest.mark.parametrize("head_type", ["own", "shared"])
@pytest.mark.parametrize("tree", ["mc_sim_7b_63", "[[0], [0, 0], [0, 0, 0], [1], [1, 0]]"])
def test_greedy_speculative_equals_plain(setup, head_type, tree):
    lean, heads, shared = setup
    drafter = MedusaDrafter(heads if head_type == "own" else shared, lean, parse_choices(tree))
    for prompt in prompts(3):
        plain = plain_generate(lean, prompt, 16)
        spec = speculative_generate(lean, drafter, prompt, 16)
        assert spec.tokens == plain.tokens
        assert set(spec.tree_sizes) == {len(drafter.choices)}


def test_typical_acceptance_runs_when_sampling(setup):
    lean, heads, _ = setup
    drafter = MedusaDrafter(heads, lean, MC_SIM_7B_63)
    result = speculative_generate(lean, drafter, prompts(1)[0], 12, SamplingConfig(temperature=0.7),
                                  generator=torch.Generator().manual_seed(0), verification="typical")
    assert len(result.tokens) == 12


def test_candidates_follow_head_rankings(setup):
    lean, heads, _ = setup
    drafter = MedusaDrafter(heads, lean, [(0,), (1,), (0, 0), (0, 2)])
    prompt = prompts(1)[0]
    out = lean(prompt, lean.new_cache(), hidden_layers=(-1,), logits="last")
    state = DraftState(torch.cat([prompt, torch.tensor([7])]), prompt.shape[0], out.hidden,
                       lean.config.num_layers, SamplingConfig())
    candidates = drafter.propose(state)
    logits = heads.logits(out.hidden[lean.config.num_layers][-1:][None])[:, 0, 0]  # (K, V)
    ranked = logits.argsort(dim=-1, descending=True)
    assert candidates.tokens.tolist() == [ranked[0, 0], ranked[0, 1], ranked[1, 0], ranked[1, 2]]
    assert candidates.parents.tolist() == [-1, -1, 0, 0]


def test_tree_from_accuracies_is_greedy_by_expected_acceptance():
    accuracies = [[0.6, 0.2, 0.1], [0.4, 0.2], [0.3]]
    tree = build_tree_from_accuracies(accuracies, 5)
    # Values: (0)=.6 (1)=.2 (2)=.1 (0,0)=.24 (0,1)=.12 (0,0,0)=.072 (1,0)=.08
    assert tree == [(0,), (1,), (2,), (0, 0), (0, 1)]
    assert build_tree_from_accuracies(accuracies, 2) == [(0,), (0, 0)]
    assert expected_acceptance(tree, accuracies) == pytest.approx(0.6 + 0.2 + 0.1 + 0.24 + 0.12)
    # Greedy is optimal here: no other 5-node prefix-closed tree scores higher.
    assert expected_acceptance(tree, accuracies) > expected_acceptance([(0,), (0, 0), (0, 0, 0), (1,), (0, 1)],
                                                                       accuracies)
    big = build_tree_from_accuracies([[0.5] + [0.05] * 9] * 4, 63)
    assert len(big) == 63 and normalize_choices(big) == big


def test_measured_rank_accuracies_are_distributions(setup):
    lean, heads, _ = setup
    drafter = MedusaDrafter(heads, lean, [(0,), (0, 0), (0, 0, 0)])
    sequences = [torch.cat([p, torch.tensor(plain_generate(lean, p, 12).tokens)]) for p in prompts(2)]
    accuracies = measure_rank_accuracies(drafter, sequences, [6, 6], top=5)
    assert len(accuracies) == 3 and all(len(row) == 5 for row in accuracies)
    assert all(0.0 <= sum(row) <= 1.0 + 1e-6 for row in accuracies)


def test_draft_vocab_subset(setup):
    lean, heads, shared = setup
    vocab = torch.arange(1, 128, 2)  # odd token ids only
    for which in (heads, shared):
        drafter = MedusaDrafter(which, lean, MC_SIM_7B_63, draft_vocab=vocab)
        for prompt in prompts(2):
            assert speculative_generate(lean, drafter, prompt, 12).tokens == plain_generate(lean, prompt, 12).tokens
        out = lean(prompts(1)[0], lean.new_cache(), hidden_layers=(-1,), logits="last")
        state = DraftState(torch.cat([prompts(1)[0], torch.tensor([7])]), 6, out.hidden, lean.config.num_layers,
                           SamplingConfig())
        assert all(t % 2 == 1 for t in drafter.propose(state).tokens.tolist())
    drafter = MedusaDrafter(heads, lean, [(0,), (0, 0)], draft_vocab=vocab)
    sequences = [torch.cat([p, torch.tensor(plain_generate(lean, p, 12).tokens)]) for p in prompts(2)]
    assert all(0.0 <= sum(row) <= 1.0 + 1e-6 for row in measure_rank_accuracies(drafter, sequences, [6, 6], top=5))


def test_float32_heads_draft_behind_a_bfloat16_target(setup):
    """runtime.dtype=auto may run the target in bf16 while the heads stay float32: the heads run in
    their dtype and the shared projection in the target's, and the output stays lossless."""
    _, _, shared = setup
    bf16 = LeanLlama.from_hf(tiny_target().model.to(torch.bfloat16), max_seq_len=256)
    drafter = MedusaDrafter(shared, bf16, [[0], [0, 0], [1]])
    logits = drafter.head_logits(torch.randn(3, bf16.config.hidden_size, dtype=torch.bfloat16))
    assert logits.shape[:2] == (2, 3) and logits.dtype == torch.float32
    prompt = prompts(1)[0]
    plain = plain_generate(bf16, prompt, 12).tokens
    assert speculative_generate(bf16, drafter, prompt, 12).tokens == plain
