"""Generation invariants on a tiny model: greedy speculative output equals plain greedy output
token for token, whatever the drafter proposes (never / always / partly right, chain or tree), in
fp32 and in bf16, with the default linear paths and with one path forced for every row count."""
import pytest
import torch

from eval.runtime import linear_paths
from eval.runtime.drafters import Drafter
from eval.runtime.drafters.draft_model import DynamicGamma, self_speculation_drafter
from eval.runtime.drafters.prompt_lookup import PromptLookupDrafter, lookup
from eval.runtime.generate import plain_generate, speculative_generate
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import SamplingConfig
from tests.helpers import OracleDrafter
from tests.tiny import tiny_model

VOCAB, NEW_TOKENS = 128, 24


@pytest.fixture(scope="module", params=[("float32", None), ("float32", "tall"), ("bfloat16", None),
                                        ("bfloat16", "dnnl")], ids=lambda p: "-".join(filter(None, p)))
def lean(request):
    """The lean forward in each dtype the runtime may choose, with the default rule and with a
    forced path for every row count: speculative output must equal plain output within each."""
    dtype, path = request.param
    torch.manual_seed(0)
    model = LeanLlama.from_hf(tiny_model(num_hidden_layers=3).to(getattr(torch, dtype)), max_seq_len=256)
    if path is not None:
        if not linear_paths.available(path, model.lm_head.weight_t):
            pytest.skip(f"{path} is not available for {dtype} on this machine")
        linear_paths.force_path(model, path)
    return model


def prompts(count: int, length: int = 6):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (length,), generator=generator) for _ in range(count)]


@pytest.mark.parametrize("right,wrong,decoys", [(0, 3, False), (4, 0, False), (2, 2, False), (3, 1, True), (0, 0, False)])
def test_greedy_speculative_equals_plain_for_stub_drafters(lean, right, wrong, decoys):
    for prompt in prompts(4):
        plain = plain_generate(lean, prompt, NEW_TOKENS).tokens
        drafter = OracleDrafter(plain + [0] * 8, prompt.shape[0], right, wrong, decoys)
        assert isinstance(drafter, Drafter)
        result = speculative_generate(lean, drafter, prompt, NEW_TOKENS)
        assert result.tokens == plain
        expected_accept = right if right + wrong else 0
        assert all(a == expected_accept for a in result.accepted[:-2])
        assert sum(a + 1 for a in result.accepted) >= len(plain) - 1


def test_always_accept_needs_fewer_target_steps(lean):
    prompt = prompts(1)[0]
    plain = plain_generate(lean, prompt, NEW_TOKENS).tokens
    result = speculative_generate(lean, OracleDrafter(plain + [0] * 8, prompt.shape[0], 4, 0), prompt, NEW_TOKENS)
    assert len(result.accepted) <= (NEW_TOKENS - 1 + 4) // 5
    assert result.acceptance_length > 4.0


def test_greedy_prompt_lookup_and_self_speculation_equal_plain(lean):
    repetitive = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6])
    for prompt in prompts(3) + [repetitive]:
        plain = plain_generate(lean, prompt, NEW_TOKENS).tokens
        assert speculative_generate(lean, PromptLookupDrafter(num_draft=4), prompt, NEW_TOKENS).tokens == plain
        for adaptive in (True, False):
            drafter = self_speculation_drafter(lean, 2, DynamicGamma(max_gamma=3, adaptive=adaptive))
            result = speculative_generate(lean, drafter, prompt, NEW_TOKENS)
            assert result.tokens == plain
    full_depth = self_speculation_drafter(lean, 3, DynamicGamma(max_gamma=3, adaptive=False))
    result = speculative_generate(lean, full_depth, prompts(1)[0], NEW_TOKENS)
    assert all(a == 3 for a in result.accepted[:-1])  # a draft identical to the target is always right


def test_eos_and_max_new_tokens(lean):
    prompt = prompts(1)[0]
    plain = plain_generate(lean, prompt, NEW_TOKENS).tokens
    eos = plain[5]
    cut = plain[: plain.index(eos) + 1]
    assert plain_generate(lean, prompt, NEW_TOKENS, eos_token_ids=[eos]).tokens == cut
    drafter = OracleDrafter(plain + [0] * 8, prompt.shape[0], 4, 0)
    assert speculative_generate(lean, drafter, prompt, NEW_TOKENS, eos_token_ids=[eos]).tokens == cut
    assert len(speculative_generate(lean, drafter, prompt, 3).tokens) == 3


def test_sampled_generation_runs_with_sampled_and_deterministic_drafts(lean):
    sampling = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9)
    prompt = prompts(1)[0]
    for drafter in (self_speculation_drafter(lean, 2, DynamicGamma(max_gamma=3, adaptive=False)),
                    PromptLookupDrafter()):
        generator = torch.Generator().manual_seed(0)
        result = speculative_generate(lean, drafter, prompt, NEW_TOKENS, sampling, generator=generator)
        assert len(result.tokens) == NEW_TOKENS and all(0 <= t < VOCAB for t in result.tokens)
    typical = speculative_generate(lean, PromptLookupDrafter(), prompt, NEW_TOKENS, sampling, verification="typical")
    assert len(typical.tokens) == NEW_TOKENS
    a = plain_generate(lean, prompt, NEW_TOKENS, sampling, generator=torch.Generator().manual_seed(3)).tokens
    b = plain_generate(lean, prompt, NEW_TOKENS, sampling, generator=torch.Generator().manual_seed(3)).tokens
    assert a == b


def test_dynamic_gamma_switches_off_when_drafts_fail_and_probes():
    controller = DynamicGamma(max_gamma=6, draft_cost=0.05, probe_every=4, initial_alpha=0.8)
    assert controller.gamma() > 0
    for _ in range(30):
        controller.update(0, 3)
    gammas = [controller.gamma() for _ in range(8)]
    assert gammas.count(0) == 6 and gammas.count(1) == 2  # off, probing every 4th step
    for _ in range(30):
        controller.update(6, 6)
    assert controller.gamma() == 6


def test_prompt_lookup_finds_most_recent_longest_match():
    tokens = torch.tensor([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3])
    assert lookup(tokens, 3, 3, 1).tolist() == [4, 5, 1]
    assert lookup(torch.tensor([1, 2, 3]), 3, 3, 1).tolist() == []
    assert lookup(torch.tensor([7, 8, 9, 7]), 2, 3, 1).tolist() == [8, 9]
