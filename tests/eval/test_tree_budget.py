"""EAGLE tree size from the measured verification-cost curve: the choice rule on hand-made curves,
teacher-forced acceptance that matches the runtime's first step, and `tree_total_tokens: auto` with
the fallback gate through `evaluate`, for EAGLE-1/2 and EAGLE-3 heads (the latter over a draft
vocabulary of 96 of the 128 ids)."""
import pytest
import torch

from eval.acceptance import greedy_accepted, measure_tree_acceptance, walk_acceptance
from eval.calibrate import choose_tree_budget, monotone_costs, verify_costs
from eval.config import RuntimeConfig
from eval.run import evaluate
from eval.runtime.drafters import Candidates
from eval.runtime.drafters.eagle import EagleDrafter
from eval.runtime.generate import plain_generate, speculative_generate
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


def test_choose_tree_budget_follows_the_cost_curve():
    accepted = {2: 0.5, 4: 1.0, 8: 1.4, 16: 1.7}
    no_draft = {n: 0.0 for n in accepted}
    steep = {1: 1.0, 2: 1.8, 4: 2.0, 8: 2.4, 16: 3.4}  # this CPU: multi-row forwards cost ~2x
    flat = {1: 1.0, 2: 1.0, 4: 1.01, 8: 1.02, 16: 1.05}  # a GPU: verification is nearly free
    best, values = choose_tree_budget(steep, accepted, no_draft)
    assert best == 4 and values[4] == pytest.approx(2.0 / 2.0) and values[16] == pytest.approx(2.7 / 3.4)
    assert choose_tree_budget(flat, accepted, no_draft)[0] == 16
    assert choose_tree_budget(flat, accepted, {2: 0.0, 4: 0.1, 8: 0.3, 16: 0.6})[0] == 8  # drafting has a price
    assert choose_tree_budget({1: 1.0, 2: 2.0, 4: 2.0}, {2: 1.0, 4: 1.0}, {2: 0.0, 4: 0.0})[0] == 2  # ties: smaller


def test_greedy_accepted_walks_the_matching_path():
    tree = Candidates(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, -1, 1, 1, 3]))  # 5 | 6 -> (7 | 8 -> 9)
    assert greedy_accepted(tree, [6, 8, 9, 1]) == 3
    assert greedy_accepted(tree, [6, 7, 9]) == 2
    assert greedy_accepted(tree, [4]) == 0 and greedy_accepted(tree, []) == 0


def test_teacher_forced_acceptance_matches_the_runtime(each_kind):
    """At every root the runtime visits, the teacher-forced tree of each budget accepts exactly as
    many drafts as the runtime's step with that total_tokens did."""
    _, lean, head = each_kind
    budgets, levels, new_tokens = [2, 3, 5, 8], 3, 16
    seen_accepts = 0
    for prompt in prompts(2):
        full = torch.cat([prompt, torch.tensor(plain_generate(lean, prompt, new_tokens).tokens)])
        forced = {}  # root index -> {budget: accepted drafts}
        for budget in budgets:
            drafter = EagleDrafter(head, lean, mode="tree", depth=levels, top_k=3, total_tokens=budget)
            root = prompt.shape[0]
            for accepted in speculative_generate(lean, drafter, prompt, new_tokens).accepted:
                if root + 1 + levels > full.shape[0]:
                    break
                if root not in forced:  # one position: the sequence ends `levels` tokens after the root
                    calibration = EagleDrafter(head, lean, mode="tree", depth=levels, top_k=3, total_tokens=max(budgets))
                    measured = measure_tree_acceptance(calibration, [full[: root + 1 + levels]], [root], budgets)
                    assert measured["positions"] == 1 and measured["levels"] == levels
                    forced[root] = measured["accepted"]
                    assert all(forced[root][a] <= forced[root][b] for a, b in zip(budgets, budgets[1:]))  # nested
                assert forced[root][budget] == accepted, (root, budget, forced[root], accepted)
                seen_accepts += accepted
                root += accepted + 1
    assert seen_accepts > 0  # the warm head gets drafts accepted: the comparison is not all zeros


def test_walk_takes_the_steps_a_greedy_run_takes():
    # roots at positions 0 (2 accepted: 3 tokens), 3 (1 accepted), 5 (3 accepted), then past the end
    assert walk_acceptance([2, 0, 0, 1, 0, 3, 0]) == [2, 1, 3]
    assert walk_acceptance([0, 0, 0]) == [0, 0, 0] and walk_acceptance([]) == []


def test_calibration_expects_the_tau_the_runtime_gets(each_kind):
    """The calibration's expected acceptance per step is the runtime's, step for step: the walk over
    teacher-forced positions takes the runtime's steps. The mean over every position (the old
    estimate) is higher than what the runtime got for some budget: easy stretches take few steps."""
    _, lean, head = each_kind
    budgets, levels, new_tokens = [2, 3, 5, 8], 3, 24
    overstated = 0
    for prompt in prompts(3):
        full = torch.cat([prompt, torch.tensor(plain_generate(lean, prompt, new_tokens).tokens)])
        calibration = EagleDrafter(head, lean, mode="tree", depth=levels, top_k=3, total_tokens=max(budgets))
        measured = measure_tree_acceptance(calibration, [full], [prompt.shape[0]], budgets)
        for budget in budgets:
            drafter = EagleDrafter(head, lean, mode="tree", depth=levels, top_k=3, total_tokens=budget)
            root, steps = prompt.shape[0], []
            for accepted in speculative_generate(lean, drafter, prompt, new_tokens).accepted:
                if root >= full.shape[0] - levels:  # past the last position calibration drafts at
                    break
                steps.append(accepted)
                root += accepted + 1
            assert measured["steps"][budget] == len(steps) > 0
            assert measured["accepted"][budget] == pytest.approx(sum(steps) / len(steps))
            overstated += measured["accepted_per_position"][budget] > measured["accepted"][budget] + 1e-9
    assert overstated > 0


def test_evaluate_with_auto_tree_size_and_fallback(each_kind, tmp_path):
    target, _, head = each_kind
    runtime = RuntimeConfig(max_new_tokens=12, tree_top_k=2, tree_depth=3, tree_total_tokens="auto",
                            tree_auto_sizes=[2, 4, 8, 32], tree_sweep=[4], fallback=True, fallback_probe_every=4,
                            compare_transformers=False, threads=1)
    report = evaluate(target, [p.tolist() for p in prompts(2)], ["eagle_tree", "prompt_lookup"], runtime, head=head,
                      head_config=head.config, out_dir=tmp_path, progress=False)
    budget = report["eagle_tree_budget"]
    # top_k 2, depth 3 drafts at most 2 + 2 * 4 = 10 nodes: a 32-token budget is no different tree.
    assert budget["chosen"] in (2, 4, 8) and set(budget["tokens_per_plain_step_by_size"]) == {2, 4, 8}
    assert set(budget["verify_seconds_by_tokens"]) == {1, 2, 4, 8} and budget["positions"] > 0
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
    assert f"| {budget['chosen']} (chosen) |" in text and "verification-cost curve" in text
    with pytest.raises(ValueError, match="tree_total_tokens"):
        evaluate(target, [prompts(1)[0].tolist()], ["eagle_tree"], RuntimeConfig(tree_total_tokens="big"), head=head,
                 out_dir=tmp_path, progress=False)


def test_verification_costs_never_fall_with_more_tokens(setup):
    # a noisy cheap reading at 8 tokens (seen on the shared CPU) must not make 8 look cheaper than 2
    assert monotone_costs({1: 1.0, 2: 1.32, 4: 1.39, 8: 1.24, 3: 1.38}) == {1: 1.0, 2: 1.32, 3: 1.38, 4: 1.39, 8: 1.39}
    choice, _ = choose_tree_budget(monotone_costs({1: 1.0, 2: 1.3, 8: 1.1}), {2: 0.35, 8: 0.45}, {2: 0.1, 8: 0.3})
    assert choice == 2  # with the raw readings 8 would win: 1.45 / 1.4 > 1.35 / 1.4
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
    assert bars == [("calibration: greedy continuations", False), ("calibration: tree acceptance per size", False)]
