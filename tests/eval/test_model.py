"""Parity of the lean forward with transformers on tiny configs of each supported family."""
import pytest
import torch

from eval.runtime.model import LeanLlama
from eval.runtime.tree import build_tree
from tests.helpers import tree_paths
from tests.tiny import tiny_model

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def _family_model(family: str):
    import transformers

    torch.manual_seed(0)
    if family == "llama_gqa":
        return tiny_model()
    if family == "llama_tied_mha":
        return tiny_model(tie_word_embeddings=True, num_key_value_heads=4)
    config_class, model_class, extra = {
        "qwen2_bias": ("Qwen2Config", "Qwen2ForCausalLM", {}),
        "qwen3_qk_norm": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
        "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    }[family]
    config = getattr(transformers, config_class)(**COMMON, **extra)
    config._attn_implementation = "sdpa"
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15) if p.dim() == 2 else p.add_(0.1 * torch.randn_like(p))
    return model


FAMILIES = ["llama_gqa", "llama_tied_mha", "qwen2_bias", "qwen3_qk_norm", "mistral"]


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_in_chunks(family, fuse):
    hf = _family_model(family)
    lean = LeanLlama.from_hf(hf, max_seq_len=64, fuse_projections=fuse)
    ids = torch.randint(0, hf.config.vocab_size, (21,))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
        hidden_expected = hf(ids[None], output_hidden_states=True).hidden_states
    cache = lean.new_cache()
    pieces = []
    for chunk in (ids[:9], ids[9:10], ids[10:14], ids[14:]):  # prefill, decode step, chains
        pieces.append(lean(chunk, cache).logits)
        cache.commit()
    torch.testing.assert_close(torch.cat(pieces), expected, atol=2e-5, rtol=1e-4)
    cache.truncate(0)
    out = lean(ids, cache, hidden_layers=(0, 1, -1), logits="last")
    torch.testing.assert_close(out.logits, expected[-1:], atol=2e-5, rtol=1e-4)
    for layer in (0, 1, hf.config.num_hidden_layers):
        torch.testing.assert_close(out.hidden[layer], hidden_expected[layer][0], atol=2e-5, rtol=1e-4)


def test_qkv_bias_and_qk_norm_are_loaded():
    qwen2 = LeanLlama.from_hf(_family_model("qwen2_bias"), fuse_projections=False)
    assert qwen2.blocks[0].attention.q_proj.bias is not None and qwen2.blocks[0].attention.q_norm is None
    fused = LeanLlama.from_hf(_family_model("qwen2_bias"), fuse_projections=True).blocks[0].attention
    assert fused.qkv_proj.bias.shape == (64 + 2 * 32,) and not hasattr(fused, "q_proj")
    qwen3 = LeanLlama.from_hf(_family_model("qwen3_qk_norm"))
    assert qwen3.blocks[0].attention.q_norm is not None and qwen3.config.head_dim == 32


def test_tree_forward_equals_each_path_run_as_a_chain():
    lean = LeanLlama.from_hf(tiny_model(), max_seq_len=64)
    prefix = torch.randint(0, 128, (7,))
    parents = [-1, 0, 0, 1, 1, 2, 3, 5]
    tree = build_tree(parents)
    tokens = torch.randint(0, 128, (len(parents),))
    cache = lean.new_cache()
    lean(prefix, cache)
    cache.commit()
    tree_logits = lean(tokens, cache, positions=cache.length + tree.depths, tree_mask=tree.mask).logits
    cache.compact([])
    for path in tree_paths(tree.parents.tolist()):
        chain_logits = lean(tokens[path], cache).logits
        cache.compact([])
        torch.testing.assert_close(tree_logits[path], chain_logits, atol=1e-5, rtol=1e-5)


def test_truncated_copy_shares_weights_and_matches_a_shallow_model():
    hf = tiny_model()
    lean = LeanLlama.from_hf(hf, max_seq_len=32)
    draft = lean.truncated(1)
    assert draft.blocks[0] is lean.blocks[0] and draft.lm_head is lean.lm_head and len(draft.blocks) == 1
    hf.model.layers = hf.model.layers[:1]
    hf.config.num_hidden_layers = 1
    ids = torch.randint(0, 128, (5,))
    cache = draft.new_cache()
    with torch.no_grad():
        torch.testing.assert_close(draft(ids, cache).logits, hf(ids[None]).logits[0], atol=2e-5, rtol=1e-4)
