"""The batch-size sweep and the speculation policy per batch size: the policy's choice and engine
terms from fixed figures; the runtime following it (plain steps where it says 0, output unchanged);
`evaluate` with runtime.batch_sizes on a tiny target (figures, crossover, plots, policy); the
policy in an export manifest."""
import json

import pytest
import torch

from eval.config import RuntimeConfig, check_runtime
from eval.policy import choose_policy
from eval.run import evaluate
from eval.runtime.batch_generate import BatchDecoder
from eval.runtime.drafters.eagle import EagleDrafter
from eval.runtime.drafters.policy import PolicyDrafter, SpeculationPolicy
from eval.runtime.generate import plain_generate
from eval.sweep import crossover, percentile
from heads.eagle import EagleConfig, EagleHead, init_from_target
from tests.tiny import tiny_eagle_setup, tiny_target


def test_policy_picks_the_best_size_per_batch_size_and_zero_past_the_crossover():
    plain = {1: 10.0, 2: 18.0, 4: 30.0, 8: 40.0}
    points = {1: {4: 14.0, 8: 16.0}, 2: {4: 22.0, 8: 21.0}, 4: {4: 30.2, 8: 25.0}, 8: {4: 35.0, 8: 30.0}}
    policy = choose_policy("eagle_tree", plain, points, {4: 2, 8: 3})
    assert [(r["min_batch"], r["max_batch"], r["size"]) for r in policy.ranges] == [(1, 1, 8), (2, 3, 4), (4, None, 0)]
    assert [policy.size_for(b) for b in (1, 2, 3, 4, 100)] == [8, 4, 4, 0, 0]  # 30.2 vs 30: within the margin
    terms = policy.engine_terms()
    assert terms["vllm"]["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 3, 2], [4, 1 << 20, 0]]
    assert terms["tensorrt_llm"]["draft_len_schedule"] == {"1": 3, "3": 2}  # larger batches: 0
    assert SpeculationPolicy.from_dict(policy.to_dict()).ranges == policy.ranges


def test_policy_that_pays_at_the_largest_batch_size_stops_past_twice_it():
    policy = choose_policy("eagle_chain", {1: 1.0, 4: 2.0}, {1: {3: 2.0}, 4: {3: 3.0}}, {3: 3})
    assert [(r["min_batch"], r["max_batch"], r["size"]) for r in policy.ranges] == [(1, 7, 3), (8, None, 0)]


def test_percentile_and_crossover():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([], 50) is None
    rows = [{"batch_size": 1, "best_speedup": 1.3}, {"batch_size": 2, "best_speedup": 1.1},
            {"batch_size": 4, "best_speedup": 0.9}]
    assert crossover(rows) == 4 and crossover(rows[:2]) is None


def test_runtime_follows_the_policy_and_output_is_unchanged():
    """Tree of 6 at batch sizes 1-2, plain steps from 3 on: requests join and leave, so the batch
    size (and with it the drafting) changes mid-sequence; greedy output equals plain decoding."""
    _, lean, head = tiny_eagle_setup()
    policy = SpeculationPolicy("eagle_tree", [{"min_batch": 1, "max_batch": 2, "size": 6, "draft_length": 3},
                                              {"min_batch": 3, "max_batch": None, "size": 0, "draft_length": 0}])
    build = lambda: PolicyDrafter(EagleDrafter(head, lean, depth=3, top_k=2, total_tokens=8), policy)  # noqa: E731
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=generator) for n in (4, 9, 6, 12)]
    budgets = [6, 20, 10, 14]
    decoder = BatchDecoder(lean, 3, drafter_factory=build, max_length=64)
    requests = [decoder.join(p, n) for p, n in zip(prompts[:3], budgets[:3])]
    while decoder.active:
        decoder.step()
        if len(requests) < 4 and decoder.free:
            requests.append(decoder.join(prompts[3], budgets[3]))
    for request, prompt, budget in zip(requests, prompts, budgets):
        assert request.result.tokens == plain_generate(lean, prompt, budget).tokens
        for size in request.result.tree_sizes:
            assert size in (0, 5)
    assert any(0 in r.result.tree_sizes for r in requests) and any(5 in r.result.tree_sizes for r in requests)


def test_evaluate_batch_sweep_end_to_end(tmp_path):
    target = tiny_target()
    head = init_from_target(EagleHead(EagleConfig.from_target(target)), target).eval()
    runtime = RuntimeConfig(max_new_tokens=8, tree_top_k=2, tree_depth=2, tree_total_tokens=4, tree_sweep=[3],
                            threads=1, batch_sizes=[1, 2, 4], compare_transformers=False)
    check_runtime(runtime)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (5, 8, 6)]
    report = evaluate(target, prompts, ["eagle_tree", "prompt_lookup"], runtime, head=head, head_config=head.config,
                      out_dir=tmp_path, progress=False)
    sweep = report["batch_sweep"]
    assert [row["batch_size"] for row in sweep["rows"]] == [1, 2, 4]
    for row in sweep["rows"]:
        assert list(row["methods"]) == ["plain", "eagle_tree", "eagle_tree@3", "prompt_lookup"]
        requests = {1: 3, 2: 4, 4: 4}[row["batch_size"]]  # 3 prompts in whole batches
        for name, figures in row["methods"].items():
            assert figures["greedy_identical"] is True, (row["batch_size"], name)
            assert figures["requests"] == requests and figures["tokens_per_second"] > 0
            assert figures["ttft_ms_p50"] <= figures["ttft_ms_p99"] <= figures["e2e_ms_p99"]
        assert row["methods"]["eagle_tree"]["draft_tokens_per_sequence"] == 3.0
        assert row["methods"]["eagle_tree"]["speedup_vs_plain"] > 0
    policy = report["speculation_policy"]
    assert policy["family"] in ("eagle_tree", "prompt_lookup")  # the faster at batch size 1 on this machine
    assert policy["ranges"][0]["min_batch"] == 1
    assert report["recommended_runtime"]["batch_policy"] == policy
    assert "batch_policy" in report["recommended_runtime"]["measured"]
    assert report["batch_one_check"]["ratio"] > 0
    assert json.loads((tmp_path / "report.json").read_text())["batch_sweep"]["batch_sizes"] == [1, 2, 4]
    assert "Crossover" in (tmp_path / "report.md").read_text()
    for name in ("speedup_vs_batch_size.png", "tpot_vs_batch_size.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_batch_sizes_are_checked():
    with pytest.raises(ValueError, match="runtime.batch_sizes"):
        check_runtime(RuntimeConfig(batch_sizes=[4, 2]))
    with pytest.raises(ValueError, match="runtime.batch_sizes"):
        check_runtime(RuntimeConfig(batch_sizes=[0, 2]))


def test_manifest_carries_the_policy_in_engine_terms():
    from export.manifest import recommended_runtime
    from heads.recommended import RecommendedRuntime
    from heads.eagle import EagleConfig

    policy = choose_policy("eagle_tree", {1: 1.0, 2: 2.0}, {1: {8: 1.5}, 2: {8: 1.9}}, {8: 3},
                           {"device_type": "cpu", "hardware": "CPU test, 2 threads"}).to_dict()
    config = EagleConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=128)
    runtime = recommended_runtime(config, RecommendedRuntime(total_tokens=8, measured=["total_tokens", "batch_policy"],
                                                             measured_on=policy["measured_on"], batch_policy=policy))
    assert runtime["vllm"]["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 1 << 20, 0]]
    assert runtime["tensorrt_llm"]["draft_len_schedule"] == {"1": 3}
    assert runtime["batch_policy"]["measured_on"]["hardware"] == "CPU test, 2 threads"
    assert "NOT GPU serving advice" in runtime["batch_policy"]["advice"]
