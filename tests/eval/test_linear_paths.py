"""Per-row-count linear paths: every path gives the reference logits (fp32 to round-off, bf16 to
its own round-off), a wrong kernel is caught and never chosen, the choice honours the memory budget
and favours one row, and a layer always keeps a plain layout for `weight_t`."""
import copy

import pytest
import torch

from eval.runtime import linear_paths
from eval.runtime.linear_paths import PATHS, Path, choose_plan, parity_error, select_paths, table
from eval.runtime.model import LeanLlama, Linear
from eval.runtime.tree import build_tree
from tests.eval.test_model import _family_model
from tests.helpers import tree_paths
from tests.tiny import tiny_model

CHUNKS = (slice(0, 9), slice(9, 10), slice(10, 12), slice(12, 16), slice(16, 21))  # prefill, 1, 2, 4, 5 rows


def _logits_in_chunks(lean, ids):
    cache, pieces = lean.new_cache(), []
    for chunk in CHUNKS:
        pieces.append(lean(ids[chunk], cache).logits.float())
        cache.commit()
    return torch.cat(pieces)


def _available(lean, path):
    return linear_paths.available(path, lean.lm_head.weight_t)


@pytest.mark.parametrize("family", ["llama_gqa", "qwen2_bias"])
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_path_gives_the_reference_logits(family, fuse, path):
    hf = _family_model(family)
    lean = LeanLlama.from_hf(hf, max_seq_len=64, fuse_projections=fuse)
    if not _available(lean, path):
        pytest.skip(f"{path} is not available on this machine")
    ids = torch.randint(0, hf.config.vocab_size, (21,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    linear_paths.force_path(lean, path)
    torch.testing.assert_close(_logits_in_chunks(lean, ids), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_path_in_bf16_matches_the_default_rule_to_bf16_round_off(path):
    hf = copy.deepcopy(tiny_model()).to(torch.bfloat16)
    reference = LeanLlama.from_hf(hf, max_seq_len=64)
    lean = LeanLlama.from_hf(hf, max_seq_len=64)
    if not _available(lean, path):
        pytest.skip(f"{path} is not available for bf16 on this machine")
    ids = torch.randint(0, 128, (21,), generator=torch.Generator().manual_seed(0))
    linear_paths.force_path(lean, path)
    expected = _logits_in_chunks(reference, ids)
    scale = expected.abs().max()
    assert (_logits_in_chunks(lean, ids) - expected).abs().max() <= 0.03 * scale


def test_tree_forward_with_a_chosen_plan_equals_each_path_as_a_chain():
    lean = LeanLlama.from_hf(tiny_model(), max_seq_len=64)
    select_paths(lean, [2, 4, 8], repeats=1)
    prefix, parents = torch.randint(0, 128, (7,)), [-1, 0, 0, 1, 1, 2, 3, 5]
    tree, tokens = build_tree(parents), torch.randint(0, 128, (8,))
    cache = lean.new_cache()
    lean(prefix, cache)
    cache.commit()
    tree_logits = lean(tokens, cache, positions=cache.length + tree.depths, tree_mask=tree.mask).logits
    cache.compact([])
    for path in tree_paths(tree.parents.tolist()):
        chain_logits = lean(tokens[path], cache).logits
        cache.compact([])
        torch.testing.assert_close(tree_logits[path], chain_logits, atol=1e-5, rtol=1e-5)


def test_parity_error_passes_round_off_and_fails_a_wrong_product():
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 96, generator=generator), torch.randn(64, 96, generator=generator)
    assert parity_error(x @ w.t(), x, w) <= 1.0
    wrong = x @ w.t()
    wrong[2, 5] += 1e-3 * wrong.abs().max()
    assert parity_error(wrong, x, w) > 1.0
    bias = torch.randn(64, generator=generator)
    assert parity_error(torch.addmm(bias, x, w.t()), x, w, bias) <= 1.0


def test_a_broken_candidate_is_measured_out_and_never_chosen(monkeypatch):
    # "broken" runs fastest (it skips most of the product) but is off by far more than round-off
    broken = Path("broken", "t", lambda w, bias: (lambda x: x[:, :1] * w[:1]))
    monkeypatch.setitem(PATHS, "broken", broken)
    hf = tiny_model()
    lean = LeanLlama.from_hf(hf, max_seq_len=64)
    report = select_paths(lean, [2, 4], candidates=("gemv_t", "broken", "dnnl"), repeats=1)
    assert all(errors["broken"] > 1.0 for errors in report["parity_error"].values())
    assert all("broken" not in names for names in report["candidates"].values())
    assert all("broken" not in plan.values() for plan in report["chosen"].values())
    ids = torch.randint(0, 128, (21,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(_logits_in_chunks(lean, ids), hf(ids[None]).logits[0], atol=2e-5, rtol=1e-4)


def _times(**paths):
    """{path: {n: seconds}} from path=(t1, t2, t8)."""
    return {p: dict(zip((1, 2, 8), values)) for p, values in paths.items()}


def test_choose_plan_takes_the_fastest_per_row_count_within_the_budget():
    times = {"a": _times(gemv_t=(1.0, 2.0, 8.0), tall=(2.0, 1.1, 6.0), dnnl=(1.5, 1.5, 2.0)),
             "b": _times(gemv_t=(1.0, 2.0, 8.0), tall=(2.0, 1.1, 6.0), dnnl=(1.5, 1.5, 2.0))}
    sizes = {"a": {"t": 100, "rm": 100, "dnnl": 100}, "b": {"t": 100, "rm": 0, "dnnl": 100}}  # b's rm is shared
    free = choose_plan(times, sizes, budget_bytes=1000)
    assert free["a"].plan == free["b"].plan == {1: "gemv_t", 2: "tall", 8: "dnnl"}
    tight = choose_plan(times, sizes, budget_bytes=400)  # a may hold two layouts, b's rm is free
    assert tight["b"].plan == {1: "gemv_t", 2: "tall", 8: "dnnl"}
    assert len(tight["a"].layouts) == 2 and tight["a"].plan[1] == "gemv_t"  # one row keeps its fastest path
    assert tight["a"].beyond == tight["a"].plan[8]


def test_a_layer_keeps_a_plain_layout_and_shares_the_source():
    weight = torch.randn(48, 32)
    linear = Linear(weight, pack=True, share=True)
    assert linear.layout_bytes("rm") == 0 and linear.layout_bytes("t") == 48 * 32 * 4
    if not linear_paths.can_pack(weight):
        pytest.skip("oneDNN packing unavailable")
    linear.use({1: "dnnl"})
    assert set(linear.layouts) == {"dnnl", "rm"} and linear.layouts["rm"].data_ptr() == weight.data_ptr()
    torch.testing.assert_close(linear.weight_t, weight.t())
    x = torch.randn(3, 32)
    torch.testing.assert_close(linear(x), x @ weight.t(), atol=1e-5, rtol=1e-5)
    linear.use(None)  # back to the default rule on what is held
    torch.testing.assert_close(linear(x[:1]), x[:1] @ weight.t(), atol=1e-5, rtol=1e-5)


def test_table_uses_the_nearest_measured_size_and_row_limits():
    names = table({1: "gemv_t", 2: "rows", 8: "dnnl"}, beyond="tall")
    assert names[0] == names[1] == "gemv_t" and names[2] == names[4] == "rows"
    assert names[5] == names[8] == names[6] == "dnnl"  # rows stops at ROWS_MAX: the next size's path
    assert names[9] == names[linear_paths.MAX_ROWS] == "tall"
    assert table({1: "gemv_t", 4: "rows"})[5] == "gemv_t"  # rows never runs past its limit


def _forced(lean, path):
    linear_paths.force_path(lean, path)
    return lean


@pytest.mark.parametrize("vocab", [None, torch.arange(0, 128, 2)])
def test_draft_heads_follow_the_targets_measured_paths(vocab):
    """A drafter's linear layers take the paths installed on the target's same roles (fc: down_proj's),
    and draft what the default rule drafts; a target in another dtype leaves them on the default rule."""
    from eval.runtime.drafters.dflash import DflashDrafter
    from eval.runtime.drafters.eagle import EagleDrafter
    from eval.runtime.drafters.medusa import MedusaDrafter
    from heads.dflash import DflashConfig, DflashHead
    from heads.medusa import MedusaConfig, MedusaHeads
    from tests.eval.test_eagle_drafter import _proposal
    from tests.tiny import tiny_eagle3_setup

    target, lean, head = tiny_eagle3_setup(draft_vocab=vocab)
    default = EagleDrafter(head, lean, mode="tree", depth=3, top_k=3, total_tokens=8)
    assert default.linear_paths == {}  # nothing measured on the target: the default rule
    tall = _forced(LeanLlama.from_hf(target.model, max_seq_len=256), "tall")
    drafter = EagleDrafter(head, tall, mode="tree", depth=3, top_k=3, total_tokens=8)
    assert drafter.linear_paths == {"fc": "down_proj", "qkv_proj": "qkv_proj", "o_proj": "o_proj",
                                    "gate_up_proj": "gate_up_proj", "down_proj": "down_proj", "lm_head": "lm_head"}
    for site, linears in drafter.runtime.linear_sites().items():
        assert [linear.plan for linear in linears] == [{1: "tall"}], site
    prompt = torch.randint(0, target.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    ours, _ = _proposal(drafter, tall, prompt)
    reference, _ = _proposal(default, lean, prompt)
    assert torch.equal(ours.tokens, reference.tokens) and torch.equal(ours.parents, reference.parents)

    medusa = MedusaHeads(MedusaConfig.from_target(target, num_heads=2, share_lm_head=False))
    followed = MedusaDrafter(medusa, tall, [[0], [0, 0]], vocab)
    assert followed.linear_paths == {"lm_head": "lm_head"} and followed.projections[0].plan == {1: "tall"}
    x = torch.randn(3, lean.config.hidden_size)
    torch.testing.assert_close(followed.head_logits(x), MedusaDrafter(medusa, lean, [[0], [0, 0]], vocab).head_logits(x))

    dflash = DflashHead(DflashConfig.from_target(target, aux_layer_ids=[0, 1], block_size=4,
                                                 draft_vocab_size=target.vocab_size if vocab is None else vocab.numel()))
    if vocab is not None:
        assert DflashDrafter(dflash, tall).lm_head.plan == {1: "tall"}

    bf16 = _forced(LeanLlama.from_hf(copy.deepcopy(target.model).to(torch.bfloat16), max_seq_len=256), "tall")
    kept = EagleDrafter(head, bf16, mode="chain", depth=2)  # an fp32 head behind a bf16 target
    assert kept.linear_paths == {} and all(linear.plan is None for linears in kept.runtime.linear_sites().values()
                                           for linear in linears)
