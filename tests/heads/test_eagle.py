import copy

import pytest
import torch
from torch import nn

from heads.eagle import EagleConfig, EagleHead, init_from_target, rope_inv_freq
from tests.tiny import tiny_target

D, I, NH, NKV, HD, V = 64, 128, 4, 2, 16, 128


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def expected_keys(fc_bias=False, qkv_bias=False, qk_norm=False):
    keys = {"fc.weight", "layers.0.post_attention_layernorm.weight"}
    keys |= {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"}
    keys |= {f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    if fc_bias:
        keys.add("fc.bias")
    if qkv_bias:
        keys |= {f"layers.0.self_attn.{p}_proj.bias" for p in "qkv"}
    if qk_norm:
        keys |= {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"}
    return keys


def test_config_from_target(target):
    config = EagleConfig.from_target(target)
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (D, I, V)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (NH, NKV, HD)
    assert config.rope_scaling is None and config.rope_theta == 10000.0
    assert config.target_fingerprint["id"] == target.fingerprint()["id"]
    assert EagleConfig.from_target(target, fc_bias=True).fc_bias


@pytest.mark.parametrize("options", [{}, {"fc_bias": True, "qkv_bias": True, "qk_norm": True}])
def test_keys_shapes_and_parameter_count(target, options):
    head = EagleHead(EagleConfig.from_target(target, **options))
    state = head.state_dict()
    assert set(state) == expected_keys(**options)
    assert state["fc.weight"].shape == (D, 2 * D)
    assert state["layers.0.self_attn.q_proj.weight"].shape == (NH * HD, D)
    assert state["layers.0.self_attn.k_proj.weight"].shape == (NKV * HD, D)
    assert state["layers.0.self_attn.o_proj.weight"].shape == (D, NH * HD)
    assert state["layers.0.mlp.down_proj.weight"].shape == (D, I)
    count = 2 * D * D + D * NH * HD * 2 + 2 * D * NKV * HD + 3 * D * I + D
    if options:
        count += D + NH * HD + 2 * NKV * HD + 2 * HD
    assert sum(p.numel() for p in head.parameters()) == count


def _inputs(B=2, T=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(B, T, D, generator=g)
    feat = torch.randn(B, T, D, generator=g)
    pos = torch.arange(T).expand(B, T)
    return emb, feat, pos


def test_causal_equals_explicit_mask(target):
    head = EagleHead(EagleConfig.from_target(target)).eval()
    emb, feat, pos = _inputs()
    T = emb.shape[1]
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(2, 1, T, T)
    out_causal, _ = head(emb, feat, pos)
    out_mask, _ = head(emb, feat, pos, attention_mask=mask)
    torch.testing.assert_close(out_causal, out_mask)
    # Causality: changing the last input leaves earlier outputs alone.
    feat2 = feat.clone()
    feat2[:, -1] += 1.0
    out2, _ = head(emb, feat2, pos)
    torch.testing.assert_close(out2[:, :-1], out_causal[:, :-1])
    assert not torch.allclose(out2[:, -1], out_causal[:, -1])


def test_kv_cache_incremental_equals_full(target):
    head = EagleHead(EagleConfig.from_target(target)).eval()
    emb, feat, pos = _inputs()
    full, kv_full = head(emb, feat, pos, use_cache=True)
    assert kv_full[0].shape == (2, NKV, 7, HD)
    out, kv = head(emb[:, :3], feat[:, :3], pos[:, :3], use_cache=True)  # prefill 3, then 2 + 1 + 1
    pieces = [out]
    for start, stop in ((3, 5), (5, 6), (6, 7)):
        out, kv = head(emb[:, start:stop], feat[:, start:stop], pos[:, start:stop], past_key_values=kv, use_cache=True)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv[0], kv_full[0], atol=1e-5, rtol=1e-5)
    assert head(emb, feat, pos)[1] is None


def test_layer_matches_transformers_layer_without_input_norm(target):
    """Our decoder layer == the target's layer with its input norm removed (RoPE + GQA parity)."""
    head = init_from_target(EagleHead(EagleConfig.from_target(target)), target, layer=-1, fc="random").eval()
    reference = copy.deepcopy(target.decoder_layers[-1])
    reference.input_layernorm = nn.Identity()
    x = torch.randn(2, 7, D)
    pos = torch.arange(7).expand(2, 7)
    rotary = target.model.model.rotary_emb
    ref = reference(x, attention_mask=None, position_ids=pos, position_embeddings=rotary(x, pos))
    ref = ref[0] if isinstance(ref, tuple) else ref
    ours, _ = head.layers[0](x, *head.rope(pos, x.dtype), None, None)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)


def test_init_fc_passes_feature(target):
    head = init_from_target(EagleHead(EagleConfig.from_target(target)), target, layer=None, fc="feature")
    emb, feat, _ = _inputs()
    torch.testing.assert_close(head.fc(torch.cat([emb, feat], -1)), feat)
    with pytest.raises(ValueError, match="init_fc"):
        init_from_target(head, target, layer=None, fc="zeros")


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
    config = EagleConfig(hidden_size=D, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV,
                         head_dim=HD, vocab_size=V, rope_theta=500000.0, rope_scaling=scaling,
                         max_position_embeddings=1024)
    ours, _ = rope_inv_freq(config)
    reference = LlamaRotaryEmbedding(LlamaConfig(
        hidden_size=D, num_attention_heads=NH, head_dim=HD, max_position_embeddings=1024,
        rope_parameters={**scaling, "rope_theta": 500000.0}))
    torch.testing.assert_close(ours, reference.inv_freq)
    plain, _ = rope_inv_freq(EagleConfig(**{**config.__dict__, "rope_scaling": None}))
    assert not torch.allclose(ours, plain)


@pytest.mark.parametrize("bias", [False, True])
def test_ridge_fit_recovers_a_linear_map(target, bias):
    from heads.eagle import set_fc_by_ridge

    head = init_from_target(EagleHead(EagleConfig.from_target(target, fc_bias=bias)), target, -1, fc="ridge")
    assert head.layers[0].self_attn.o_proj.weight.abs().sum() == 0  # the head starts as the fit
    true_w, true_b = torch.randn(D, 2 * D), torch.randn(D) if bias else torch.zeros(D)
    x = torch.randn(500, 2 * D, dtype=torch.float64)
    y = x @ true_w.double().T + true_b.double()
    x1 = torch.cat([x, torch.ones(500, 1, dtype=torch.float64)], -1)
    set_fc_by_ridge(head, x1.T @ x1, x1.T @ y, 500, penalty=0.0)
    torch.testing.assert_close(head.fc.weight, true_w, atol=1e-4, rtol=1e-4)
    if bias:
        torch.testing.assert_close(head.fc.bias, true_b, atol=1e-4, rtol=1e-4)
    emb, feat, pos = _inputs()
    torch.testing.assert_close(head(emb, feat, pos)[0], head.fc(torch.cat([emb, feat], -1)))
