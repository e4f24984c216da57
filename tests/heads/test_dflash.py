"""DFlash block drafter: a written-out float64 reference, cached context K/V, layout keys."""
import math

import pytest
import torch

from heads.dflash import DflashConfig, DflashHead, block_tokens
from heads.io import build_head, load_head, save_head
from tests.tiny import tiny_target


def tiny_config(**overrides):
    values = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=128, target_hidden_size=64, aux_layer_ids=[0, 1], target_num_layers=2, num_layers=2,
                  block_size=4, rope_theta=10000.0)
    values.update(overrides)
    return DflashConfig(**values)


def random_head(config, dtype=torch.float64):
    head = DflashHead(config).to(dtype)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.2) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    return head


def reference(head, aux, context_positions, block_embeds, block_positions):
    """One sequence, written out: per layer and head, softmax(q·k/√hd) over [context; block], all visible."""
    c = head.config
    hd, groups = c.head_dim, c.num_attention_heads // c.num_key_value_heads

    def norm(x, w):
        return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)

    def rope(x, positions):  # x (S, n, hd)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        angle = positions[:, None].double() * inv  # (S, hd/2)
        cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]
        rotated = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
        return x * cos + rotated * sin

    context = norm(aux @ head.fc.weight.T, head.hidden_norm.weight)  # (C, D)
    x = block_embeds
    for layer in head.layers:
        a = layer.self_attn
        h = norm(x, layer.input_layernorm.weight)
        q = rope(norm((h @ a.q_proj.weight.T).view(-1, c.num_attention_heads, hd), a.q_norm.weight), block_positions)
        keys_in = torch.cat([context, h])
        k = norm((keys_in @ a.k_proj.weight.T).view(-1, c.num_key_value_heads, hd), a.k_norm.weight)
        k = rope(k, torch.cat([context_positions, block_positions]))
        v = (keys_in @ a.v_proj.weight.T).view(-1, c.num_key_value_heads, hd)
        heads = []
        for n in range(c.num_attention_heads):
            scores = q[:, n] @ k[:, n // groups].T / math.sqrt(hd)  # (N, C + N)
            heads.append(torch.softmax(scores, -1) @ v[:, n // groups])
        x = x + torch.cat(heads, -1) @ a.o_proj.weight.T
        g = norm(x, layer.post_attention_layernorm.weight)
        m = layer.mlp
        x = x + (torch.nn.functional.silu(g @ m.gate_proj.weight.T) * (g @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return x


def test_forward_matches_a_written_out_reference_in_float64():
    config = tiny_config()
    head = random_head(config)
    C, N = 7, config.block_size
    aux = torch.randn(C, 2 * 64, dtype=torch.float64)
    embeds = torch.randn(N, 64, dtype=torch.float64)
    context_positions, block_positions = torch.arange(C), torch.arange(C, C + N)
    kv = head.context_kv(head.project(aux[None]), context_positions[None])
    ours = head(embeds[None], block_positions[None], kv)[0]
    # rms_norm computes in float32 whatever the input (as transformers does)
    assert torch.allclose(ours, reference(head, aux, context_positions, embeds, block_positions), atol=1e-4)


def test_context_kv_of_a_longer_prefix_is_the_shorter_ones_extended():
    """The context's K/V of position s depend on c_s alone: a runtime may cache and extend them."""
    head = random_head(tiny_config())
    aux = torch.randn(1, 9, 128, dtype=torch.float64)
    positions = torch.arange(9)[None]
    whole = head.context_kv(head.project(aux), positions)
    first = head.context_kv(head.project(aux[:, :5]), positions[:, :5])
    rest = head.context_kv(head.project(aux[:, 5:]), positions[:, 5:])
    for (k, v), (k1, v1), (k2, v2) in zip(whole, first, rest):
        assert torch.allclose(k, torch.cat([k1, k2], 2)) and torch.allclose(v, torch.cat([v1, v2], 2))


def test_attention_within_the_block_runs_both_ways():
    head = random_head(tiny_config())
    kv = head.context_kv(head.project(torch.randn(1, 3, 128, dtype=torch.float64)), torch.arange(3)[None])
    embeds = torch.randn(1, 4, 64, dtype=torch.float64)
    changed = embeds.clone()
    changed[0, -1] += 1.0  # the last slot
    positions = torch.arange(3, 7)[None]
    assert not torch.allclose(head(embeds, positions, kv)[0, 0], head(changed, positions, kv)[0, 0])


def test_layers_are_independent_and_keys_follow_the_speculators_layout():
    config = tiny_config(num_layers=3)
    head = DflashHead(config)
    keys = set(head.state_dict())
    for layer in range(3):
        for part in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            assert f"layers.{layer}.self_attn.{part}.weight" in keys
        for part in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):
            assert f"layers.{layer}.{part}.weight" in keys
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= keys
    assert not any("embed" in key or "lm_head" in key for key in keys)
    one = sum(p.numel() for p in DflashHead(tiny_config(num_layers=1)).layers.parameters())
    assert sum(p.numel() for p in head.layers.parameters()) == 3 * one
    assert len({p.data_ptr() for p in head.layers.parameters()}) == len(list(head.layers.parameters()))


def test_block_tokens_put_the_anchor_first():
    assert block_tokens(torch.tensor([5, 9]), 3, 0).tolist() == [[5, 0, 0], [9, 0, 0]]


def test_config_from_target_and_checkpoint_round_trip(tmp_path):
    target = tiny_target()
    config = DflashConfig.from_target(target, aux_layer_ids=[0, 1], num_layers=2, block_size=8)
    assert (config.hidden_size, config.vocab_size, config.target_num_layers) == (64, 128, 2)
    head = build_head(config)
    save_head(tmp_path, head, config)
    loaded, loaded_config, meta = load_head(tmp_path, target)
    assert meta["type"] == "dflash" and loaded_config == config
    for key, value in head.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key])
    assert torch.equal(loaded.inv_freq, head.inv_freq)


@pytest.mark.parametrize("bad, message", [(dict(aux_layer_ids=[]), "empty"), (dict(aux_layer_ids=[2]), "must lie"),
                                          (dict(block_size=1), "block_size"), (dict(mask_token_id=128), "mask_token_id")])
def test_config_refuses_what_cannot_be_built(bad, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**bad)
