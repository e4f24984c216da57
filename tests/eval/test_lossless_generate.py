"""End to end through `speculative_generate`: with temperature 1 the first tokens of speculative
sampling follow the target's exact distribution (enumerated on a 4-token vocabulary), for sampled
chain drafts from a truncated draft model, for a deterministic tree stub, for an EAGLE-3 head
drafting over 3 of the 4 tokens (sampled chain and EAGLE-2 tree, ids mapped through d2t), for a
P-EAGLE head's sampled chain and its top-k tree from one pass (the same draft vocabulary), and for
the tree stub behind the fallback gate switching between plain and speculative steps mid-sequence.
Chi-square at 0.001, with the sequences expected fewer than 5 times pooled into one cell; an
EAGLE-3 drafter that reports its draft distribution without the d2t map fails the same test, and
so does the P-EAGLE tree under a broken sampler that forgets a rejected sibling. The verification
rule itself is tested more thoroughly (and against a broken sampler, also with a draft vocabulary)
in test_verify.py; this checks the plumbing (draft_probs alignment, tree order, cache compaction)."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from eval.runtime.drafters import Candidates
from eval.runtime.drafters.adaptive import FallbackDrafter, SpeculationGate
from eval.runtime.drafters.draft_model import DynamicGamma, self_speculation_drafter
from eval.runtime.drafters.eagle import EagleDrafter
from eval.runtime.drafters.peagle import PeagleDrafter, PeagleTreeDrafter
from eval.runtime.generate import speculative_generate
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import SamplingConfig
from heads.eagle3 import Eagle3Config, Eagle3Head, set_draft_vocab
from heads.peagle import PeagleConfig, PeagleHead
from tests.helpers import broken_verify, chi_square_p_value, pooled_rare
from tests.tiny import tiny_model

VOCAB, LENGTH, SAMPLES = 4, 3, 1500
SAMPLING = SamplingConfig(temperature=1.0)


class TreeStub:
    """Deterministic tree: two children of the root (tokens 0, 1), each with one child (token 2)."""

    feature_layers = ()

    def reset(self, prompt):
        pass

    def propose(self, state):
        return Candidates(torch.tensor([0, 2, 1, 2]), torch.tensor([-1, 0, -1, 2]))

    def accept(self, state, accepted):
        pass


def exact(lean, prompt) -> dict:
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        cache = lean.new_cache()
        logits = lean(torch.cat([prompt, torch.tensor(seq[:-1], dtype=torch.long)]), cache).logits
        probs = torch.softmax(logits[-LENGTH:], -1)
        out[seq] = float(torch.prod(torch.stack([probs[i, t] for i, t in enumerate(seq)])))
    return out


def _peaked_lean() -> LeanLlama:
    """A tiny target over VOCAB tokens with peaked, non-degenerate next-token distributions."""
    model = tiny_model(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                       num_key_value_heads=1, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.6)
    return LeanLlama.from_hf(model, max_seq_len=32)


def _eagle3_head() -> Eagle3Head:
    """A random EAGLE-3 head for `_peaked_lean` drafting over target ids 0, 2, 3 (Vd = 3 < V = 4)."""
    config = Eagle3Config(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=8, vocab_size=VOCAB, draft_vocab_size=3, target_hidden_size=16,
                          aux_layer_ids=[0, 1], target_num_layers=2)
    head = set_draft_vocab(Eagle3Head(config), torch.tensor([0, 2, 3]))
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:  # peaked draft distributions that differ from the target's
                p.normal_(0.0, 0.6)
    return head.eval()


def _peagle_head() -> PeagleHead:
    """`_eagle3_head`'s weights with a mask_hidden: 2 tokens per pass over target ids 0, 2, 3."""
    eagle3 = _eagle3_head()
    head = PeagleHead(PeagleConfig(**eagle3.config.to_dict(), speculative_tokens=2, mask_token_id=3))
    with torch.no_grad():
        head.mask_hidden.normal_(0.0, 1.0)
    head.load_state_dict({**eagle3.state_dict(), "mask_hidden": head.mask_hidden.detach()})
    return head.eval()


def _drafter(name: str, lean: LeanLlama):
    if name == "peagle_sampled_chain":
        return PeagleDrafter(_peagle_head(), lean)
    if name == "peagle_tree":  # 3 of the 2 slots' top-3 paths: siblings at the root every step
        return PeagleTreeDrafter(_peagle_head(), lean, total_tokens=4)
    if name == "sampled_chain":
        return self_speculation_drafter(lean, 1, DynamicGamma(max_gamma=2, adaptive=False))
    if name == "deterministic_tree":
        return TreeStub()
    mode = "chain" if "chain" in name else "tree"
    drafter = EagleDrafter(_eagle3_head(), lean, mode=mode, depth=2, top_k=2, total_tokens=5,
                           greedy_drafts=name.startswith("eagle3_argmax"))
    if name.endswith("unmapped"):  # the Vd probabilities put at target ids 0..Vd-1: ignores d2t
        drafter._full_distribution = lambda q: F.pad(q, (0, VOCAB - q.shape[0]))
    return drafter


def _p_value(counts: dict, lean, prompt) -> float:
    return chi_square_p_value(*pooled_rare(counts, exact(lean, prompt), SAMPLES), SAMPLES)


def _sample_counts(lean, drafter_name: str, prompt) -> dict:
    generator = torch.Generator().manual_seed(0)
    counts = {}
    drafter = _drafter(drafter_name, lean)
    for _ in range(SAMPLES):
        if drafter_name == "sampled_chain":
            drafter = _drafter(drafter_name, lean)
        tokens = tuple(speculative_generate(lean, drafter, prompt, LENGTH, SAMPLING, generator=generator).tokens)
        counts[tokens] = counts.get(tokens, 0) + 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("drafter_name", ["sampled_chain", "deterministic_tree", "eagle3_sampled_chain", "eagle3_tree",
                                          "eagle3_argmax_chain", "peagle_sampled_chain", "peagle_tree"])
def test_speculative_sampling_matches_exact_distribution(drafter_name):
    lean = _peaked_lean()
    prompt = torch.tensor([1, 3, 2])
    counts = _sample_counts(lean, drafter_name, prompt)
    assert _p_value(counts, lean, prompt) > 1e-3


@pytest.mark.slow
def test_eagle3_draft_distribution_without_the_id_map_is_caught():
    lean = _peaked_lean()
    prompt = torch.tensor([1, 3, 2])
    counts = _sample_counts(lean, "eagle3_sampled_chain_unmapped", prompt)
    assert _p_value(counts, lean, prompt) < 1e-3


@pytest.mark.slow
def test_peagle_tree_under_a_broken_sampler_is_caught(monkeypatch):
    """The tree's root has several deterministic children: a sampler that forgets the rejected ones
    (the target's distribution left whole, not with their tokens zeroed) drifts from the target."""
    import eval.runtime.generate

    monkeypatch.setattr(eval.runtime.generate, "verify_sampled", broken_verify)
    lean = _peaked_lean()
    prompt = torch.tensor([1, 3, 2])
    counts = _sample_counts(lean, "peagle_tree", prompt)
    assert _p_value(counts, lean, prompt) < 1e-3


class Clock:
    """Fake time: every reading advances 1 s; drafting adds `draft_cost` more (set by the drafter)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now


class CostlyTree(TreeStub):
    def __init__(self, clock, draft_cost):
        self.clock, self.draft_cost = clock, draft_cost

    def propose(self, state):
        self.clock.now += self.draft_cost
        return super().propose(state)


@pytest.mark.slow
def test_fallback_switching_mid_sequence_keeps_the_exact_distribution():
    """One gate shared by every sample, so each step's choice (tree or plain step) depends on the
    random acceptance history: sampling must still follow the target exactly."""
    lean = _peaked_lean()
    prompt = torch.tensor([1, 3, 2])
    clock = Clock()
    # A speculative step costs 1 + 0.7 plain steps: it pays while recent steps commit > 1.7 tokens.
    drafter = FallbackDrafter(CostlyTree(clock, 0.7), SpeculationGate(plain_seconds=1.0, probe_every=2, decay=0.5),
                              clock)
    generator = torch.Generator().manual_seed(0)
    counts, mixed = {}, 0
    for _ in range(SAMPLES):
        result = speculative_generate(lean, drafter, prompt, LENGTH, SAMPLING, generator=generator)
        tokens = tuple(result.tokens)
        counts[tokens] = counts.get(tokens, 0) + 1
        mixed += 0 in result.tree_sizes and max(result.tree_sizes) > 0
    assert mixed > SAMPLES // 10  # many sequences switched between plain and speculative steps
    assert _p_value(counts, lean, prompt) > 1e-3
