"""EAGLE tree size from greedy runs of each size on the machine: the choice rule, the τ and step time
of those runs against the runtime's own, and `tree_total_tokens: auto` with the fallback gate
through `evaluate`, for EAGLE-1/2 and EAGLE-3 heads (the latter over a draft vocabulary of 96 of
the 128 ids)."""
import pytest
import torch

import eval.calibrate
from eval.calibrate import (CALIBRATION_PROMPTS, choose_size, eagle_tree_budget, measure_sizes, monotone_costs,
                            verify_costs)
from eval.config import RuntimeConfig
from eval.run import evaluate
from eval.runtime.drafters.eagle import EagleDrafter
from eval.runtime.generate import speculative_generate
from heads.eagle3 import Eagle3Head
from tests.tiny import tiny_eagle3_setup, tiny_eagle_setup


@pytest.fixture(scope="module")
def setup():
    return tiny_eagle_setup()


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def each_kind(request):
    """(target, lean, warm head) of each EAGLE head kind."""
    if request.param == "eagle":
        return tiny_eagle_setup()
    return tiny_eagle3_setup(draft_vocab=torch.arange(128)[torch.arange(128) % 4 != 3])


def prompts(count: int, length: int = 7):
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, 128, (length,), generator=generator) for _ in range(count)]


def test_the_fastest_size_is_chosen_and_the_smaller_on_a_tie():
    assert choose_size({2: 1.10, 4: 1.31, 8: 1.27}) == 4
    assert choose_size({2: 1.2, 4: 1.2}) == 2  # same speed, less work
    assert choose_size({2: 0.0, 4: 0.0}) == 2  # nothing timed (inf step): the smallest


def test_sizes_are_timed_as_the_runtime_runs_them(each_kind):
    """Calibration's τ per size is what a greedy run with that size commits (the same runs), its
    step time is the runs' whole step past the first (draft, verify and bookkeeping), and its
    speedup is τ x plain step / step."""
    _, lean, head = each_kind
    budgets, new_tokens = [2, 3, 5, 8], 16
    build = {n: (lambda n=n: EagleDrafter(head, lean, mode="tree", depth=3, top_k=3, total_tokens=n)) for n in budgets}
    calibration = prompts(5)
    measured = measure_sizes(lean, build, calibration, new_tokens, [])
    assert measured["calibration_prompts"] == CALIBRATION_PROMPTS == 4  # the first four prompts only
    for n in budgets:
        runs = [speculative_generate(lean, build[n](), p, new_tokens) for p in calibration[:4]]
        assert measured["steps"][n] == sum(len(r.accepted) for r in runs)
        assert measured["tau"][n] == pytest.approx(sum(a + 1 for r in runs for a in r.accepted) / measured["steps"][n])
        assert measured["speedup"][n] == pytest.approx(
            measured["tau"][n] * measured["plain_step_seconds"] / measured["step_seconds"][n])
    assert measured["tau"][8] > 1.0  # the warm head gets drafts accepted: the comparison is not all ones
    steps = [measured["step_seconds"][n] for n in budgets]
    assert steps == sorted(steps) and all(0 < s < 1 for s in steps) and 0 < measured["plain_step_seconds"] < 1


def test_a_size_that_times_faster_is_chosen(setup, monkeypatch):
    """The choice follows the timed step, not a cost model: a drafter made slow at one size loses
    there however many tokens it commits."""
    import time

    _, lean, head = setup

    class Slow(EagleDrafter):
        def propose(self, state):
            time.sleep(0.05)
            return super().propose(state)

    runtime = RuntimeConfig(max_new_tokens=10, tree_top_k=2, tree_depth=3, tree_auto_sizes=[2, 6])
    monkeypatch.setattr(eval.calibrate, "EagleDrafter",
                        lambda *a, total_tokens, **k: (Slow if total_tokens == 6 else EagleDrafter)(
                            *a, total_tokens=total_tokens, **k))
    chosen, budget = eagle_tree_budget(head, lean, runtime, prompts(2), [], None)
    assert chosen == 2 and budget["step_cost_in_plain_steps"][6] > budget["step_cost_in_plain_steps"][2] + 1
    assert budget["expected_tau_by_size"][6] >= budget["expected_tau_by_size"][2]  # it lost on time alone


def test_evaluate_with_auto_tree_size_and_fallback(each_kind, tmp_path):
    target, _, head = each_kind
    runtime = RuntimeConfig(max_new_tokens=12, tree_top_k=2, tree_depth=3, tree_total_tokens="auto",
                            tree_auto_sizes=[2, 4, 8, 32], tree_sweep=[4], fallback=True, fallback_probe_every=4,
                            compare_transformers=False, threads=1)
    report = evaluate(target, [p.tolist() for p in prompts(2)], ["eagle_tree", "prompt_lookup"], runtime, head=head,
                      head_config=head.config, out_dir=tmp_path, progress=False)
    budget = report["eagle_tree_budget"]
    # top_k 2, depth 3 drafts at most 2 + 2 * 4 = 10 nodes: a 32-token budget is no different tree.
    assert budget["chosen"] in (2, 4, 8) and set(budget["expected_speedup_by_size"]) == {2, 4, 8}
    assert set(budget["step_seconds_by_size"]) == {2, 4, 8} and budget["calibration_prompts"] == 2
    rows = {row["name"]: row for row in report["drafters"]}
    tree = rows["eagle_tree"]
    assert tree["settings"]["total_tokens"] == budget["chosen"] and tree["settings"]["fallback"] is True
    if isinstance(head, Eagle3Head):  # its own vocabulary, reported; the head named in the report
        assert tree["settings"]["draft_vocab"] == 96 and report["head"]["type"] == "Eagle3Config"
        assert report["head"]["aux_layer_ids"] == [0, 1] and tree["tau_when_speculating"] > 1.2
    assert report["recommended_runtime"]["total_tokens"] in (budget["chosen"], 4)
    for row in rows.values():
        assert row["greedy_identical"] is True and 0.0 <= row["speculated_fraction"] <= 1.0
    assert rows.get("eagle_tree@4", {"settings": {"fallback": False}})["settings"]["fallback"] is False
    text = (tmp_path / "report.md").read_text()
    assert f"| {budget['chosen']} (chosen) |" in text and "timing greedy runs of each size" in text
    with pytest.raises(ValueError, match="tree_total_tokens"):
        evaluate(target, [prompts(1)[0].tolist()], ["eagle_tree"], RuntimeConfig(tree_total_tokens="big"), head=head,
                 out_dir=tmp_path, progress=False)


def test_verification_costs_never_fall_with_more_tokens(setup):
    # a noisy cheap reading at 8 tokens (seen on the shared CPU) must not make 8 look cheaper than 2
    assert monotone_costs({1: 1.0, 2: 1.32, 4: 1.39, 8: 1.24, 3: 1.38}) == {1: 1.0, 2: 1.32, 3: 1.38, 4: 1.39, 8: 1.39}
    _, lean, _ = setup
    costs = verify_costs(lean, torch.arange(3, 10), (1, 2, 4), repeats=2)
    assert list(costs) == [1, 2, 4] and costs[1] <= costs[2] <= costs[4]


def test_calibration_shows_progress_per_prompt(setup, monkeypatch):
    import tqdm.auto

    from eval.calibrate import eagle_tree_budget

    bars = []
    monkeypatch.setattr(tqdm.auto, "tqdm", lambda items, desc, disable, **options: bars.append((desc, disable)) or items)
    target, lean, head = setup
    runtime = RuntimeConfig(max_new_tokens=6, tree_top_k=2, tree_depth=2, tree_auto_sizes=[2, 4])
    eagle_tree_budget(head, lean, runtime, prompts(2), [], None, progress=True)
    assert bars == [("calibration: eagle tree sizes", False)]


def test_medusa_calibration_decodes_each_prompt_plainly_once(setup, monkeypatch):
    """The Medusa tree's calibration needs the prompts' greedy continuations; the same plain runs are
    its timed baseline, so plain decoding runs once per calibration prompt. A count of runs that
    does not match the prompts is refused."""
    from eval.runtime.generate import plain_generate
    from heads.medusa import MedusaConfig, MedusaHeads

    target, lean, _ = setup
    heads = MedusaHeads(MedusaConfig.from_target(target, num_heads=2, share_lm_head=True)).eval()
    runs = []
    monkeypatch.setattr(eval.calibrate, "plain_generate", lambda *a, **k: runs.append(1) or plain_generate(*a, **k))
    runtime = RuntimeConfig(max_new_tokens=6, medusa_choices="auto")
    choices, report = eval.calibrate.medusa_choices(heads, lean, runtime, prompts(5), [], None)
    assert len(runs) == CALIBRATION_PROMPTS and report["calibration_prompts"] == CALIBRATION_PROMPTS
    assert report["plain_step_seconds"] > 0 and len(choices) == report["chosen"]
    with pytest.raises(ValueError, match="plain_runs holds 1 runs for 4"):
        measure_sizes(lean, {2: lambda: None}, prompts(5), 6, [], plain_runs=runs[:1])
