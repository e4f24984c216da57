"""A layer-split target in the lean runtime: a fake device map over CPU devices drives the boundary
code (activations moved once per boundary per forward), the weights are the transformers model's own
(no clone: storage identity), and greedy output matches the unsplit model's token for token."""
import copy

import pytest
import torch

import eval.runtime.placement as placement
from eval.config import RuntimeConfig
from eval.prepare import prepare_target
from eval.run import evaluate
from eval.runtime import linear_paths
from eval.runtime.generate import plain_generate
from eval.runtime.kv_cache import KVCache
from eval.runtime.model import LeanLlama
from heads.eagle import EagleConfig, EagleHead, init_from_target
from tests.tiny import tiny_model, tiny_target

# Four layers over three "devices" (all the CPU): boundaries before layer 1, before layer 3 and before the head.
DEVICE_MAP = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1,
              "model.layers.2": 1, "model.layers.3": 2, "model.norm": 3, "lm_head": 3}
ON_CPU = {key: "cpu" for key in range(4)}
BOUNDARIES = 3


def _split(hf, **options) -> LeanLlama:
    return LeanLlama.from_hf(hf, max_seq_len=128, device_map=DEVICE_MAP, devices=ON_CPU, **options)


@pytest.fixture
def moves(monkeypatch):
    """Every boundary crossing: (tensors moved, destination)."""
    seen = []
    original = placement.move

    def counting(tensors, device):
        seen.append((len(tensors), torch.device(device)))
        return original(tensors, device)

    monkeypatch.setattr(placement, "move", counting)
    return seen


def _storages(module) -> dict[int, int]:
    """{storage pointer: bytes} of every parameter and buffer."""
    tensors = [*module.parameters(), *module.buffers()]
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def test_split_forward_moves_at_each_boundary_and_matches_the_unsplit_model(moves):
    hf = tiny_model(num_hidden_layers=4)
    whole = LeanLlama.from_hf(copy.deepcopy(hf), max_seq_len=128)
    split = _split(hf)
    assert split.is_split and not whole.is_split and not split.config.weight_copies
    assert [(s.start, s.end, s.cross) for s in split.stages] == [(0, 1, False), (1, 3, True), (3, 4, True)]
    assert split.head_stage.cross and split.output_device == torch.device("cpu")

    ids = torch.randint(0, 128, (11,))
    cache = split.new_cache()
    out = split(ids, cache, hidden_layers=(0, 2, -1))
    assert len(moves) == BOUNDARIES and [n for n, _ in moves] == [5, 5, 1]  # x, cos, sin, mask, bits; then x
    reference = whole(ids, whole.new_cache(), hidden_layers=(0, 2, -1))
    torch.testing.assert_close(out.logits, reference.logits, atol=2e-5, rtol=1e-4)
    for layer in (0, 2, 4):
        torch.testing.assert_close(out.hidden[layer], reference.hidden[layer], atol=2e-5, rtol=1e-4)

    moves.clear()
    prompt = torch.randint(3, 128, (7,))
    tokens = plain_generate(split, prompt, 24).tokens
    assert tokens == plain_generate(whole, prompt, 24).tokens
    forwards = 1 + 24 - 1  # prefill, then one decode step per token after the first
    assert len(moves) == BOUNDARIES * forwards


def test_split_eval_gives_plain_greedy_tokens_with_an_eagle_head(tmp_path, moves):
    """The whole eval door on a split target: paths and dtype chosen in place, EAGLE tree and chain,
    self-speculation over the first layers, all greedy-identical to plain decoding."""
    target = tiny_target(num_hidden_layers=4)
    target.model.hf_device_map = {name: f"cpu:{key}" for name, key in DEVICE_MAP.items()}  # keys differ, all CPU
    before = _storages(target.model)
    head = init_from_target(EagleHead(EagleConfig.from_target(target)), target).eval()
    runtime = RuntimeConfig(max_new_tokens=10, chain_depth=3, tree_top_k=2, tree_depth=3, tree_total_tokens=6,
                            tree_sweep=[], threads=1, dtype="auto", linear_paths="auto", linear_paths_repeats=1,
                            compare_transformers=True, fallback=False)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (6,), generator=generator).tolist() for _ in range(2)]
    report = evaluate(target, prompts, ["eagle_tree", "eagle_chain", "self_speculation"], runtime, head=head,
                      head_config=head.config, out_dir=tmp_path, progress=False)
    for row in report["drafters"]:
        assert row["greedy_identical"] is True, row["name"]
    assert report["baselines"]["transformers"]["greedy_identical"] is True  # the fused views compute as before
    assert "split across devices" in report["weights"] and report["dtype"]["chosen"] == "float32"
    assert report["placement"]["boundaries"] == BOUNDARIES
    assert [(s["layers"], s["key"]) for s in report["placement"]["stages"]] == [
        ([0, 1], "cpu:0"), ([1, 3], "cpu:1"), ([3, 4], "cpu:2"), ("head", "cpu:3")]
    assert f"Target split across devices ({BOUNDARIES} boundaries): layer 0 on cpu:0 (cpu), layers 1-2 on cpu:1" in (tmp_path / "report.md").read_text()
    chosen = report["linear_paths"]["by_dtype"]["float32"]["chosen"]
    assert {path for plan in chosen.values() for path in plan.values()} <= {"linear", "tall"}
    assert moves and sum(_storages(target.model).values()) == sum(before.values())  # fused in place, not doubled


@pytest.mark.parametrize("family", ["llama", "qwen2_bias"])
def test_no_weight_is_cloned(family):
    """Without copies every tensor the lean forward holds (rotary tables aside) is storage of the
    transformers model, whose memory stays what it was: the fused q|k|v and gate|up replace the parts."""
    if family == "llama":
        hf = tiny_model()
    else:
        from tests.eval.test_model import _family_model

        hf = _family_model("qwen2_bias")
    ids = torch.randint(0, hf.config.vocab_size, (1, 9))
    with torch.no_grad():
        expected = hf(ids).logits
    before = _storages(hf)
    lean = LeanLlama.from_hf(hf, max_seq_len=64, weight_copies=False)
    after = _storages(hf)
    assert sum(after.values()) == sum(before.values())
    held = {t.untyped_storage().data_ptr() for t in lean.parameters()}
    held |= {layout.untyped_storage().data_ptr() for site in lean.linear_sites().values() for linear in site
             for layout in linear.layouts.values()}
    assert held <= set(after), "the lean forward holds a weight the transformers model does not"
    attention = hf.model.layers[0].self_attn
    fused = lean.blocks[0].attention.qkv_proj.weight_stored
    assert attention.q_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    if attention.q_proj.bias is not None:
        assert attention.k_proj.bias.untyped_storage().data_ptr() == \
            lean.blocks[0].attention.qkv_proj.bias.untyped_storage().data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, expected)  # the model computes as before, on the views
    again = LeanLlama.from_hf(hf, max_seq_len=64, weight_copies=False)  # already fused: reused as it is
    assert _storages(hf) == after
    assert again.blocks[1].mlp.gate_up_proj.weight_stored.data_ptr() == \
        lean.blocks[1].mlp.gate_up_proj.weight_stored.data_ptr()
    cache = lean.new_cache()
    torch.testing.assert_close(lean(ids[0], cache).logits, expected[0], atol=2e-5, rtol=1e-4)


def test_the_weight_copies_rule():
    cpu, gpu = torch.device("cpu"), torch.device("cuda:0")
    assert placement.weight_copies_allowed([cpu] * 3, ["cpu"] * 3, 10, available_bytes=100)[0]
    refused = {
        "on cuda": placement.weight_copies_allowed([cpu, gpu, gpu], ["cpu", "0", "0"], 10, available_bytes=100),
        "split across devices": placement.weight_copies_allowed([cpu] * 3, [0, 1, 1], 10, available_bytes=100),
        "memory available": placement.weight_copies_allowed([cpu] * 3, ["cpu"] * 3, 60, available_bytes=100),
    }
    for why, (allowed, note) in refused.items():
        assert not allowed and why in note


def test_without_copies_only_in_place_paths_run():
    lean = LeanLlama.from_hf(tiny_model(), max_seq_len=64, weight_copies=False)
    report = linear_paths.select_paths(lean, [1, 2, 4], repeats=1)
    assert {path for plan in report["chosen"].values() for path in plan.values()} <= {"linear", "tall"}
    assert report["memory_mb"]["held_after"] == 0.0
    with pytest.raises(ValueError, match="would copy the weights"):
        linear_paths.force_path(lean, "gemv_t")


def test_other_dtype_than_a_split_targets_is_refused():
    hf = tiny_model(num_hidden_layers=4)
    hf.hf_device_map = {name: f"cpu:{key}" for name, key in DEVICE_MAP.items()}
    with pytest.raises(ValueError, match="runtime.dtype=bfloat16"):
        prepare_target(hf, RuntimeConfig(dtype="bfloat16"), [1, 2], torch.arange(3, 9), 64)


def test_kv_cache_lives_with_each_layer():
    cache = KVCache(num_layers=3, num_kv_heads=1, head_dim=2, max_length=8, device=["cpu", "cpu", "meta"])
    assert len(cache.buffers) == 2 and cache.k[1].device.type == "cpu" and cache.v[2].device.type == "meta"
    cache.reserve(2)
    cache.write(0, torch.ones(1, 2, 2), -torch.ones(1, 2, 2))
    cache.compact([1])
    assert cache.length == 1 and cache.k[0][0, 0].tolist() == [1.0, 1.0]


def test_offloaded_or_misplaced_layers_are_named():
    hf = tiny_model()
    with pytest.raises(ValueError, match="model.layers.1 lies on cpu, the device map says cuda:1"):
        LeanLlama.from_hf(hf, device_map={"model": 0, "model.layers.1": 1, "lm_head": 0}, devices={0: "cpu"})
    hf.model.layers[1].to("meta")
    with pytest.raises(ValueError, match="model.layers.1 is offloaded"):
        LeanLlama.from_hf(hf)
