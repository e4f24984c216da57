"""The lean drafting runtime of the EAGLE heads equals their own forward (`EagleHead`, `Eagle3Head`):
committed catch-up (causal, over a growing cache), chain drafts and tree-masked drafts, with q/k
norm, biases, GQA and (EAGLE-3) norm_before_residual and the EAGLE-3.1 options (fc's input norms,
norm(out) fed back), the draft logits and vocabulary; float64 so
that any difference beyond rounding is a bug, plus fp32 (the packed weights)."""
import pytest
import torch

from eval.runtime.drafters.lean_head import LeanEagleHead
from eval.runtime.model import Linear
from heads.eagle import EagleConfig, EagleHead
from heads.eagle3 import Eagle3Config, Eagle3Head, set_draft_vocab

SIZES = dict(hidden_size=48, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
             vocab_size=64)
AUX = [0, 2, 3]  # three target streams of width 40


def _head(dtype, kind, **options):
    torch.manual_seed(0)
    if kind == "eagle3":
        config = Eagle3Config(**SIZES, draft_vocab_size=24, target_hidden_size=40, aux_layer_ids=AUX, **options)
        head = set_draft_vocab(Eagle3Head(config), torch.arange(64)[torch.randperm(64)[:24]].sort().values)
    else:
        head = EagleHead(EagleConfig(**SIZES, **options))
    head = head.to(dtype).eval()
    with torch.no_grad():
        for p in head.parameters():  # norms and biases away from their trivial init
            p.add_(0.1 * torch.randn_like(p))
    return head


CASES = [("eagle", {}), ("eagle", {"qk_norm": True, "qkv_bias": True, "fc_bias": True}),
         ("eagle3", {}), ("eagle3", {"qk_norm": True, "qkv_bias": True, "norm_before_residual": True}),
         ("eagle3", {"norm_before_fc": True, "norm_output": True}),
         ("eagle3", {"fc_norm": True, "norm_output": True, "norm_before_residual": True}), ("eagle3", {"fc_norm": True})]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("kind,options", CASES)
@torch.no_grad()
def test_lean_head_matches_the_head(dtype, tol, kind, options):
    head = _head(dtype, kind, **options)
    lean = LeanEagleHead(head, capacity=8)  # small: the buffers must grow
    g = torch.Generator().manual_seed(1)
    e, f = torch.randn(20, 48, generator=g, dtype=dtype), torch.randn(20, 48, generator=g, dtype=dtype)
    # Committed positions take the target's features: f_t (EAGLE-1/2) or three aux streams (EAGLE-3,
    # projected by fc). Drafted entries below take their parents' outputs of width D, which the
    # head feeds back as they are (EAGLE-3 under norm_output: normed).
    committed = torch.randn(15, 120, generator=g, dtype=dtype) if kind == "eagle3" else f[:15]
    project = head.project if kind == "eagle3" else (lambda features: features)
    fed = head.feedback if kind == "eagle3" else (lambda out: out)
    # Committed positions in three catch-ups of different sizes equal one causal forward.
    full, (k, v) = head(e[None, :13], project(committed[None, :13]), torch.arange(13)[None], use_cache=True)
    outs = [lean.commit(e[a:b], committed[a:b]) for a, b in ((0, 6), (6, 7), (7, 13))]
    torch.testing.assert_close(torch.cat(outs), full[0], atol=tol, rtol=tol)
    torch.testing.assert_close(lean.committed_kv[0], k, atol=tol, rtol=tol)
    torch.testing.assert_close(lean.committed_kv[1], v, atol=tol, rtol=tol)
    # A two-level tree: 3 nodes at one position, then 2 children that see one parent each.
    mask1 = torch.zeros(3, 16, dtype=torch.bool)
    mask1[:, :13] = True
    mask1[torch.arange(3), 13 + torch.arange(3)] = True
    level1 = lean.draft(e[13:16], f[13:16], torch.full((3,), 13), mask1)
    ref1, (k1, v1) = head(e[None, 13:16], fed(f[None, 13:16]), torch.full((1, 3), 13), attention_mask=mask1[None, None],
                          past_key_values=(k, v), use_cache=True)
    torch.testing.assert_close(level1, ref1[0], atol=tol, rtol=tol)
    mask2 = torch.zeros(2, 18, dtype=torch.bool)
    mask2[:, :13] = True
    mask2[0, 15], mask2[1, 13] = True, True
    mask2[0, 16], mask2[1, 17] = True, True
    level2 = lean.draft(e[16:18], f[16:18], torch.full((2,), 14), mask2)
    ref2, _ = head(e[None, 16:18], fed(f[None, 16:18]), torch.full((1, 2), 14), attention_mask=mask2[None, None],
                   past_key_values=(k1, v1), use_cache=True)
    torch.testing.assert_close(level2, ref2[0], atol=tol, rtol=tol)
    # mask None: all earlier entries plus causal among the new ones (a chain step).
    chain = lean.draft(e[18:20], f[18:20], torch.tensor([15, 16]))
    causal = torch.ones(2, 20, dtype=torch.bool).tril_(18)
    ref_chain, _ = head(e[None, 18:20], fed(f[None, 18:20]), torch.tensor([[15, 16]]), attention_mask=causal[None, None],
                        past_key_values=(torch.cat([k1, lean.k[None, :, 16:18]], 2), torch.cat([v1, lean.v[None, :, 16:18]], 2)),
                        use_cache=True)
    torch.testing.assert_close(chain, ref_chain[0], atol=tol, rtol=tol)
    # The next catch-up drops the drafted entries and continues the committed cache.
    after = lean.commit(e[13:15], committed[13:15])
    ref3, _ = head(e[None, 13:15], project(committed[None, 13:15]), torch.arange(13, 15)[None], past_key_values=(k, v),
                   use_cache=True)
    torch.testing.assert_close(after, ref3[0], atol=tol, rtol=tol)
    assert lean.length == 15 and lean.drafted == 0
    lean.truncate(10)
    with pytest.raises(ValueError, match="truncate"):
        lean.truncate(11)
    if kind == "eagle3":  # its own norm and lm_head over Vd columns, which are the head's draft ids
        torch.testing.assert_close(lean.logits(after), head.logits(ref3[0]).float(), atol=tol, rtol=tol)
        assert lean.logits(after).shape == (2, 24) and torch.equal(lean.vocab, head.draft_ids())
        assert torch.equal(head.to_target_ids(torch.arange(24)), lean.vocab)
        assert lean.feature_layers == tuple(AUX)
    else:
        assert lean.vocab is None and lean.feature_layers == (-1,)
        with pytest.raises(RuntimeError, match="lm_head"):
            lean.logits(after)


@torch.no_grad()
def test_eagle1_logits_through_the_target_lm_head_and_a_draft_vocab():
    head = _head(torch.float32, "eagle")
    lm_head = Linear(torch.randn(64, 48))
    vocab = torch.tensor([1, 5, 9, 40])
    out = torch.randn(3, 48)
    full = LeanEagleHead(head, lm_head=lm_head).logits(out)
    torch.testing.assert_close(full, out @ lm_head.weight_t)
    lean = LeanEagleHead(head, lm_head=lm_head, draft_vocab=vocab)
    torch.testing.assert_close(lean.logits(out), full[:, vocab])
    assert torch.equal(lean.vocab, vocab)


def test_an_eagle3_head_keeps_its_own_vocabulary():
    head = _head(torch.float32, "eagle3")
    with pytest.raises(ValueError, match="own vocabulary"):
        LeanEagleHead(head, draft_vocab=torch.arange(10))
    full = Eagle3Head(Eagle3Config(**SIZES, draft_vocab_size=64, target_hidden_size=40, aux_layer_ids=AUX))
    assert LeanEagleHead(full).vocab is None  # Vd = V: draft ids are target ids
