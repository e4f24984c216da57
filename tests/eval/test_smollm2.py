"""The runtime on the real embedded SmolLM2-135M (fp32): logit parity with transformers, and greedy
speculative decoding (prompt lookup, self-speculation) equal to plain greedy decoding."""
import pytest
import torch

from eval.runtime.drafters.draft_model import DynamicGamma, self_speculation_drafter
from eval.runtime.drafters.prompt_lookup import PromptLookupDrafter
from eval.runtime.generate import plain_generate, speculative_generate
from eval.runtime.model import LeanLlama
from eval.runtime.tree import build_tree

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "List three colours: red, green,",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def lean(smollm2):
    return LeanLlama.from_hf(smollm2.model, max_seq_len=256)


@pytest.mark.integration
def test_logits_match_transformers(smollm2, lean):
    ids = smollm2.tokenizer(PROMPTS[0], return_tensors="pt").input_ids[0]
    with torch.no_grad():
        expected = smollm2.model(ids[None]).logits[0]
    cache = lean.new_cache()
    prefill = lean(ids[:-3], cache).logits
    cache.commit()
    tree = build_tree([-1, 0, 1])  # the last 3 tokens as a (chain-shaped) tree with an explicit mask
    tail = lean(ids[-3:], cache, positions=cache.length + tree.depths, tree_mask=tree.mask).logits
    torch.testing.assert_close(torch.cat([prefill, tail]), expected, atol=2e-3, rtol=1e-3)


@pytest.mark.integration
def test_greedy_speculative_equals_plain(smollm2, lean):
    eos = [smollm2.tokenizer.eos_token_id]
    for text in PROMPTS:
        prompt = smollm2.tokenizer(text, return_tensors="pt").input_ids[0]
        plain = plain_generate(lean, prompt, NEW_TOKENS, eos_token_ids=eos).tokens
        lookup = speculative_generate(lean, PromptLookupDrafter(num_draft=4), prompt, NEW_TOKENS, eos_token_ids=eos)
        assert lookup.tokens == plain
        drafter = self_speculation_drafter(lean, 10, DynamicGamma(max_gamma=3, adaptive=False))
        self_spec = speculative_generate(lean, drafter, prompt, NEW_TOKENS, eos_token_ids=eos)
        assert self_spec.tokens == plain
        assert self_spec.tree_sizes and all(size == 3 for size in self_spec.tree_sizes)
