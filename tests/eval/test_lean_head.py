"""The lean drafting runtime of the EAGLE head equals `EagleHead`'s own forward: committed
catch-up (causal, over a growing cache), chain drafts and tree-masked drafts, with q/k norm, biases
and GQA; float64 so that any difference beyond rounding is a bug, plus fp32 (the packed weights)."""
import pytest
import torch

from eval.drafters.lean_head import LeanEagleHead
from heads.eagle import EagleConfig, EagleHead


def _head(dtype, **options) -> EagleHead:
    config = EagleConfig(hidden_size=48, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=12, vocab_size=64, **options)
    torch.manual_seed(0)
    head = EagleHead(config).to(dtype).eval()
    with torch.no_grad():
        for p in head.parameters():  # norms and biases away from their trivial init
            p.add_(0.1 * torch.randn_like(p))
    return head


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("options", [{}, {"qk_norm": True, "qkv_bias": True, "fc_bias": True}])
@torch.no_grad()
def test_lean_head_matches_eagle_head(dtype, tol, options):
    head = _head(dtype, **options)
    lean = LeanEagleHead(head, capacity=8)  # small: the buffers must grow
    g = torch.Generator().manual_seed(1)
    e, f = torch.randn(20, 48, generator=g, dtype=dtype), torch.randn(20, 48, generator=g, dtype=dtype)
    # Committed positions in three catch-ups of different sizes equal one causal forward.
    full, (k, v) = head(e[None, :13], f[None, :13], torch.arange(13)[None], use_cache=True)
    outs = [lean.commit(e[a:b], f[a:b]) for a, b in ((0, 6), (6, 7), (7, 13))]
    torch.testing.assert_close(torch.cat(outs), full[0], atol=tol, rtol=tol)
    torch.testing.assert_close(lean.committed_kv[0], k, atol=tol, rtol=tol)
    torch.testing.assert_close(lean.committed_kv[1], v, atol=tol, rtol=tol)
    # A two-level tree: 3 nodes at one position, then 2 children that see one parent each.
    mask1 = torch.zeros(3, 16, dtype=torch.bool)
    mask1[:, :13] = True
    mask1[torch.arange(3), 13 + torch.arange(3)] = True
    level1 = lean.draft(e[13:16], f[13:16], torch.full((3,), 13), mask1)
    ref1, (k1, v1) = head(e[None, 13:16], f[None, 13:16], torch.full((1, 3), 13), attention_mask=mask1[None, None],
                          past_key_values=(k, v), use_cache=True)
    torch.testing.assert_close(level1, ref1[0], atol=tol, rtol=tol)
    mask2 = torch.zeros(2, 18, dtype=torch.bool)
    mask2[:, :13] = True
    mask2[0, 15], mask2[1, 13] = True, True
    mask2[0, 16], mask2[1, 17] = True, True
    level2 = lean.draft(e[16:18], f[16:18], torch.full((2,), 14), mask2)
    ref2, _ = head(e[None, 16:18], f[None, 16:18], torch.full((1, 2), 14), attention_mask=mask2[None, None],
                   past_key_values=(k1, v1), use_cache=True)
    torch.testing.assert_close(level2, ref2[0], atol=tol, rtol=tol)
    # mask None: all earlier entries plus causal among the new ones (a chain step).
    chain = lean.draft(e[18:20], f[18:20], torch.tensor([15, 16]))
    causal = torch.ones(2, 20, dtype=torch.bool).tril_(18)
    ref_chain, _ = head(e[None, 18:20], f[None, 18:20], torch.tensor([[15, 16]]), attention_mask=causal[None, None],
                        past_key_values=(torch.cat([k1, lean.k[None, :, 16:18]], 2), torch.cat([v1, lean.v[None, :, 16:18]], 2)),
                        use_cache=True)
    torch.testing.assert_close(chain, ref_chain[0], atol=tol, rtol=tol)
    # The next catch-up drops the drafted entries and continues the committed cache.
    after = lean.commit(e[13:15], f[13:15])
    ref3, _ = head(e[None, 13:15], f[None, 13:15], torch.arange(13, 15)[None], past_key_values=(k, v), use_cache=True)
    torch.testing.assert_close(after, ref3[0], atol=tol, rtol=tol)
    assert lean.length == 15 and lean.drafted == 0
    lean.truncate(10)
    with pytest.raises(ValueError, match="truncate"):
        lean.truncate(11)
