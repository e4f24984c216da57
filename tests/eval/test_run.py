"""`evaluate` end to end on a tiny target: every drafter, both baselines, the files; the eval CLI
with an EAGLE-3 native checkpoint."""
import json

import pytest
import torch

import eval.__main__ as entry
from eval.config import RuntimeConfig
from eval.run import build_methods, evaluate
from eval.runtime.model import LeanLlama
from heads.eagle import EagleConfig, EagleHead, init_from_target
from heads.io import save_head
from heads.medusa import MedusaConfig, MedusaHeads
from tests.tiny import tiny_eagle3_setup, tiny_target

RUNTIME = RuntimeConfig(max_new_tokens=12, chain_depth=3, tree_top_k=2, tree_depth=3, tree_total_tokens=6,
                        tree_sweep=[4, 6, 8], medusa_choices="auto", threads=1)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def prompts(count: int = 3):
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, 128, (6,), generator=generator).tolist() for _ in range(count)]


def test_evaluate_eagle_end_to_end(target, tmp_path):
    head = init_from_target(EagleHead(EagleConfig.from_target(target)), target).eval()
    report = evaluate(target, prompts(), ["eagle_tree", "eagle_chain", "prompt_lookup", "self_speculation"],
                      RUNTIME, head=head, head_config=head.config, out_dir=tmp_path, progress=False)
    names = [row["name"] for row in report["drafters"]]
    assert names == ["eagle_tree", "eagle_tree@4", "eagle_tree@8", "eagle_chain", "prompt_lookup", "self_speculation"]
    for row in report["drafters"]:
        assert row["greedy_identical"] is True, row["name"]
        assert row["tau"] >= 1.0 and row["tokens_per_second"] > 0 and row["speedup_vs_transformers"] > 0
        assert row["prompts"] == 3 and row["lossy"] is False and row["verify_cost_in_plain_steps"] > 0
        assert row["break_even_tau"] > row["verify_cost_in_plain_steps"]
    assert report["baselines"]["transformers"]["tokens_per_second"] > 0
    assert report["recommended_runtime"]["total_tokens"] in (4, 6, 8)
    assert report["recommended_runtime"]["measured"] == ["total_tokens"]  # chosen from the sweep's timings
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["drafters"][0]["name"] == "eagle_tree"
    assert "bonus token INCLUDED" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "acceptance_per_depth.png").stat().st_size > 1000
    assert (tmp_path / "speedup_vs_tree_size.png").stat().st_size > 1000


def test_evaluate_medusa_with_auto_tree_and_lossy_typical(target, tmp_path):
    heads = MedusaHeads(MedusaConfig.from_target(target, num_heads=3, share_lm_head=True)).eval()
    runtime = RuntimeConfig(**{**RUNTIME.__dict__, "temperature": 0.7, "typical_acceptance": True,
                               "compare_transformers": False, "fallback": True})
    report = evaluate(target, prompts(2), ["medusa"], runtime, head=heads, head_config=heads.config,
                      out_dir=tmp_path, progress=False)
    (row,) = report["drafters"]
    assert row["lossy"] is True and "greedy_identical" not in row
    assert row["settings"]["fallback"] is True and 0.0 < row["speculated_fraction"] <= 1.0
    assert len(report["medusa"]["choices"]) in (4, 8, 16, 32, 64)
    assert set(report["medusa"]["expected_speedup_by_size"]) == {4, 8, 16, 32, 64}
    assert "typical (LOSSY)" in (tmp_path / "report.md").read_text()
    assert report["recommended_runtime"] == {"medusa_choices": report["medusa"]["choices"], "measured": ["medusa_choices"],
                                             "measured_on": report["measured_on"]}  # the tree was chosen by timing
    assert report["measured_on"]["device_type"] == "cpu" and report["measured_on"]["hardware"].startswith("CPU")


def test_head_drafters_are_skipped_without_a_head(target):
    lean = LeanLlama.from_hf(target.model, max_seq_len=64)
    methods, _ = build_methods(["eagle_tree", "medusa", "prompt_lookup"], RUNTIME, lean, head=None)
    assert [m.name for m in methods] == ["plain", "prompt_lookup"]
    with pytest.raises(ValueError, match="unknown drafter"):
        build_methods(["eagle_forest"], RUNTIME, lean)


def test_eval_entry_composes_into_dataclasses():
    from eval.__main__ import compose_eval

    cfg = compose_eval(["runtime.drafters=[prompt_lookup]", "runtime.threads=2", "head=some/dir"])
    assert cfg.runtime.drafters == ["prompt_lookup"] and cfg.runtime.threads == 2
    assert cfg.model.name_or_path.startswith("embedded:") and cfg.data.source.startswith("embedded:")
    assert cfg.head == "some/dir" and cfg.out == "runs/eval" and cfg.logger["kind"] == "none"
    with pytest.raises(Exception, match="tree_width"):
        compose_eval(["runtime.tree_width=3"])
    assert cfg.runtime.tree_total_tokens == "auto" and cfg.runtime.fallback is True  # the CPU runtime's defaults
    assert compose_eval(["runtime.tree_total_tokens=8"]).runtime.tree_total_tokens == 8


def test_eval_cli_runs_a_native_eagle3_checkpoint(tmp_path, monkeypatch):
    """`python -m eval head=DIR` with an EAGLE-3 native checkpoint: the EAGLE drafters run it with
    the head's own draft vocabulary, greedy output identical."""
    target, _, head = tiny_eagle3_setup(draft_vocab=torch.arange(0, 128, 2))
    folder = save_head(tmp_path / "eagle3_head", head, head.config)
    monkeypatch.setattr("heads.target.load_target", lambda config: target)
    monkeypatch.setattr("eval.stage.eval_prompt_ids", lambda *args: prompts(2))

    cfg = entry.compose_eval([f"head={folder}", f"out={tmp_path / 'report'}", "progress=false", "runtime.threads=1",
                              "runtime.max_new_tokens=8", "runtime.compare_transformers=false",
                              "runtime.tree_auto_sizes=[2,4]", "runtime.tree_sweep=[]"])
    assert cfg.runtime.drafters[:2] == ["eagle_tree", "eagle_chain"]
    report = entry.run(cfg)
    rows = {row["name"]: row for row in report["drafters"]}
    assert {"eagle_tree", "eagle_chain"} <= set(rows) and report["head"]["type"] == "Eagle3Config"
    for name in ("eagle_tree", "eagle_chain"):
        assert rows[name]["greedy_identical"] is True and rows[name]["settings"]["draft_vocab"] == 64
    lean = LeanLlama.from_hf(target.model, max_seq_len=64)
    methods, _ = build_methods(["eagle_chain", "medusa"], RUNTIME, lean, head=head)
    assert [m.name for m in methods] == ["plain", "eagle_chain"]
    assert methods[1].settings["draft_vocab"] == 64


def test_the_eval_door_picks_the_drafters_that_fit_the_head(target):
    """Both eval routes (`python -m eval`, the training pipeline) go through select_drafters."""
    from eval.stage import select_drafters

    wanted = ["eagle_tree", "medusa", "eagle_chain", "prompt_lookup"]
    eagle = EagleHead(EagleConfig.from_target(target))
    medusa = MedusaHeads(MedusaConfig.from_target(target, num_heads=2))
    eagle3 = tiny_eagle3_setup()[2]
    assert select_drafters(wanted, eagle) == ["eagle_tree", "eagle_chain", "prompt_lookup"]
    assert select_drafters(wanted, eagle3) == ["eagle_tree", "eagle_chain", "prompt_lookup"]
    assert select_drafters(wanted, medusa) == ["medusa", "prompt_lookup"]
    assert select_drafters(wanted, None) == ["prompt_lookup", "self_speculation"]
    assert select_drafters(["prompt_lookup"], None) == ["prompt_lookup"]  # nothing to replace
