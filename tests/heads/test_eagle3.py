import pytest
import torch
from torch import nn

from heads.eagle3 import (
    Eagle3Config, Eagle3Head, default_aux_layer_ids, init_from_target, set_draft_vocab, vocab_maps,
)
from tests.tiny import tiny_target

D, I, NH, NKV, HD, V, L = 64, 128, 4, 2, 16, 128, 6


@pytest.fixture(scope="module")
def target():
    return tiny_target(num_hidden_layers=L)


def test_config_from_target(target):
    config = Eagle3Config.from_target(target, draft_vocab_size=32)
    assert config.aux_layer_ids == [2, 3, 3] == default_aux_layer_ids(L)
    assert (config.hidden_size, config.target_hidden_size, config.draft_vocab_size, config.vocab_size) == (D, D, 32, V)
    assert config.target_fingerprint["id"] == target.fingerprint()["id"]
    assert Eagle3Config.from_target(target).draft_vocab_size == V
    assert Eagle3Config.from_target(target, draft_vocab_size=10**6).draft_vocab_size == V
    assert default_aux_layer_ids(30) == [2, 15, 27]  # SmolLM2-135M, FORMATS.md
    with pytest.raises(ValueError, match="aux_layer_ids"):
        Eagle3Config.from_target(target, aux_layer_ids=[1, L])
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config.from_target(target, draft_vocab_size=-1)


@pytest.mark.parametrize("aux", [[1, 3, 4], [2], [0, 1, 2, 3, 4]])
def test_keys_shapes_and_parameter_count(target, aux):
    Vd = 40
    head = Eagle3Head(Eagle3Config.from_target(target, draft_vocab_size=Vd, aux_layer_ids=aux))
    state = head.state_dict()
    n = len(aux)
    shapes = {
        "fc.weight": (D, n * D),
        "midlayer.self_attn.q_proj.weight": (NH * HD, 2 * D),
        "midlayer.self_attn.k_proj.weight": (NKV * HD, 2 * D),
        "midlayer.self_attn.v_proj.weight": (NKV * HD, 2 * D),
        "midlayer.self_attn.o_proj.weight": (D, NH * HD),
        "midlayer.mlp.gate_proj.weight": (I, D),
        "midlayer.mlp.up_proj.weight": (I, D),
        "midlayer.mlp.down_proj.weight": (D, I),
        "midlayer.input_layernorm.weight": (D,),
        "midlayer.hidden_norm.weight": (D,),
        "midlayer.post_attention_layernorm.weight": (D,),
        "norm.weight": (D,),
        "lm_head.weight": (Vd, D),
        "d2t": (Vd,),
        "t2d": (V,),
    }
    assert {k: tuple(v.shape) for k, v in state.items()} == shapes
    assert state["d2t"].dtype == torch.long and state["t2d"].dtype == torch.bool
    count = n * D * D + 2 * D * (NH * HD + 2 * NKV * HD) + NH * HD * D + 3 * D * I + 4 * D + Vd * D
    assert sum(p.numel() for p in head.parameters()) == count


def test_vocab_maps_round_trip(target):
    ids = torch.tensor([0, 3, 4, 9, 100, 127])
    d2t, t2d = vocab_maps(ids, V)
    assert torch.equal(torch.arange(6) + d2t, ids)
    assert int(t2d.sum()) == 6 and torch.equal(t2d.nonzero().squeeze(1), ids)
    head = Eagle3Head(Eagle3Config.from_target(target, draft_vocab_size=6))
    init_from_target(head, target, ids)
    assert torch.equal(head.draft_ids(), ids)
    assert torch.equal(head.to_target_ids(torch.tensor([[5, 0], [2, 3]])), torch.tensor([[127, 0], [4, 9]]))
    torch.testing.assert_close(head.lm_head.weight, target.lm_head.weight[ids])
    with pytest.raises(ValueError, match="ascending"):
        vocab_maps(torch.tensor([3, 1]), V)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        set_draft_vocab(head, torch.arange(5))


def _reference_layer(head: Eagle3Head):
    """transformers' Llama pieces wired as EAGLE-3's layer, q/k/v widened to 2D, weights from `head`."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

    c = head.config
    config = LlamaConfig(hidden_size=D, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV,
                         head_dim=HD, rms_norm_eps=c.rms_norm_eps, max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    attention = LlamaAttention(config, layer_idx=0)
    for name in "qkv":
        setattr(attention, f"{name}_proj", nn.Linear(2 * D, getattr(attention, f"{name}_proj").out_features,
                                                      bias=False))
    parts = nn.ModuleDict({"self_attn": attention, "mlp": LlamaMLP(config),
                           **{n: LlamaRMSNorm(D, c.rms_norm_eps)
                              for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}})
    parts.double().load_state_dict(head.midlayer.state_dict())  # float64 before loading: no fp32 round trip
    return parts, config


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_layer_matches_transformers_in_float64(target, norm_before_residual):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(target, draft_vocab_size=50,
                                               norm_before_residual=norm_before_residual)).double().eval()
    for p in head.parameters():  # non-trivial norms too
        p.data.normal_(0.0, 0.2).add_(0.5)
    ref, config = _reference_layer(head)
    B, T = 2, 7
    embeds, hidden = torch.randn(B, T, D, dtype=torch.float64), torch.randn(B, T, D, dtype=torch.float64)
    pos = torch.arange(T).expand(B, T) + 3
    cos, sin = LlamaRotaryEmbedding(config)(hidden, pos)
    ours = head.rope(pos, torch.float64)
    torch.testing.assert_close(ours[0][:, 0], cos, atol=1e-6, rtol=0)  # both take fp32 angles
    cos, sin = ours[0][:, 0], ours[1][:, 0]  # the same angles below, so the layer is compared exactly
    normed = ref["hidden_norm"](hidden)
    x = torch.cat([ref["input_layernorm"](embeds), normed], -1)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T)
    attn = ref["self_attn"](x, position_embeddings=(cos, sin), attention_mask=causal)[0]
    resid = (normed if norm_before_residual else hidden) + attn
    expected = resid + ref["mlp"](ref["post_attention_layernorm"](resid))
    out, _ = head(embeds, hidden, pos)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
    assert head.logits(out).shape == (B, T, 50)


def test_kv_cache_incremental_equals_full(target):
    head = Eagle3Head(Eagle3Config.from_target(target, draft_vocab_size=50)).eval()
    B, T = 2, 7
    emb, hid = torch.randn(B, T, D), torch.randn(B, T, D)
    pos = torch.arange(T).expand(B, T)
    full, kv_full = head(emb, hid, pos, use_cache=True)
    out, kv = head(emb[:, :3], hid[:, :3], pos[:, :3], use_cache=True)
    pieces = [out]
    for start, stop in ((3, 5), (5, 7)):
        out, kv = head(emb[:, start:stop], hid[:, start:stop], pos[:, start:stop], past_key_values=kv,
                       use_cache=True)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv[0], kv_full[0], atol=1e-5, rtol=1e-5)


def test_project_reads_aux_streams_in_order(target):
    head = Eagle3Head(Eagle3Config.from_target(target, aux_layer_ids=[1, 2, 4]))
    feats = target.features(torch.randint(0, V, (1, 5)), layers=(1, 2, 4))
    aux = torch.cat([feats.hidden[i] for i in (1, 2, 4)], -1)  # (1, 5, 3D)
    assert head.project(aux).shape == (1, 5, D)


def test_native_checkpoint_round_trip(target, tmp_path):
    from heads.io import load_head, save_head

    ids = torch.arange(0, V, 3)
    config = Eagle3Config.from_target(target, draft_vocab_size=ids.numel(), aux_layer_ids=[1, 2, 4])
    head = init_from_target(Eagle3Head(config), target, ids)
    save_head(tmp_path / "h", head, config)
    loaded, loaded_config, meta = load_head(tmp_path / "h", target)
    assert meta["type"] == "eagle3" and loaded_config == config
    assert torch.equal(loaded.draft_ids(), ids)
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    B, T = 1, 4
    emb, hid, pos = torch.randn(B, T, D), torch.randn(B, T, D), torch.arange(T)[None]
    torch.testing.assert_close(loaded(emb, hid, pos)[0], head(emb, hid, pos)[0])


def _rms(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("option, keys", [("norm_before_fc", {"input_norm.weight": (3 * D,)}),
                                          ("fc_norm", {f"fc_norm.{i}.weight": (D,) for i in range(3)})])
def test_fc_input_norms_keys_and_math(target, option, keys):
    """speculators' names and shapes; fc reads the normalised streams, written out by hand."""
    plain = Eagle3Head(Eagle3Config.from_target(target, aux_layer_ids=[1, 2, 4]))
    head = Eagle3Head(Eagle3Config.from_target(target, aux_layer_ids=[1, 2, 4], **{option: True})).double()
    extra = {k: tuple(v.shape) for k, v in head.state_dict().items() if k not in plain.state_dict()}
    assert extra == keys
    assert sum(p.numel() for p in head.parameters()) - sum(p.numel() for p in plain.parameters()) == 3 * D
    with torch.no_grad():
        for key in keys:
            head.get_parameter(key).normal_(1.0, 0.3)
    aux = torch.randn(2, 5, 3 * D, dtype=torch.float64) * torch.tensor([0.5, 4.0, 30.0]).double().repeat_interleave(D)
    eps = head.config.rms_norm_eps
    if option == "norm_before_fc":
        expected = _rms(aux, head.input_norm.weight, eps)
    else:
        expected = torch.cat([_rms(s, norm.weight, eps) for s, norm in zip(aux.split(D, -1), head.fc_norm)], -1)
    # rms_norm normalises in float32 whatever the input's dtype, as the target's norms do.
    torch.testing.assert_close(head.fc_inputs(aux), expected, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(head.project(aux), expected @ head.fc.weight.T, atol=1e-5, rtol=1e-6)


def test_fc_norm_options_are_exclusive(target):
    with pytest.raises(ValueError, match="norm_before_fc and fc_norm are exclusive"):
        Eagle3Config.from_target(target, norm_before_fc=True, fc_norm=True)


def test_defaults_keep_the_plain_head(target):
    """Off by default: same keys, fc reads aux as is, the output goes back pre-norm."""
    config = Eagle3Config.from_target(target)
    assert (config.norm_before_fc, config.fc_norm, config.norm_output) == (False, False, False)
    head = Eagle3Head(config)
    aux, out = torch.randn(1, 3, 3 * D), torch.randn(1, 3, D)
    assert head.fc_inputs(aux) is aux and head.feedback(out) is out
    on = Eagle3Head(Eagle3Config.from_target(target, norm_output=True))
    torch.testing.assert_close(on.feedback(out), on.norm(out))
    assert set(on.state_dict()) == set(head.state_dict())


@pytest.mark.parametrize("options", [{"norm_before_fc": True, "norm_output": True}, {"fc_norm": True}])
def test_native_checkpoint_round_trip_with_options(target, tmp_path, options):
    from heads.io import load_head, save_head

    config = Eagle3Config.from_target(target, draft_vocab_size=40, aux_layer_ids=[1, 2, 4], **options)
    head = Eagle3Head(config)
    with torch.no_grad():
        for name, value in head.named_parameters():
            if "norm" in name and not name.startswith("midlayer"):
                value.normal_(1.0, 0.3)
    save_head(tmp_path / "h", head, config)
    loaded, loaded_config, _ = load_head(tmp_path / "h", target)
    assert loaded_config == config
    assert set(loaded.state_dict()) == set(head.state_dict())
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
