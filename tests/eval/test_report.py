"""Report writing from a hand-made report dict: files, table content, W&B logging with a stub."""
import json
import sys
import types

from eval.report import log_to_wandb, markdown_table, write_report
from tests.helpers import report, report_row as _row


def test_markdown_table_lists_every_method_with_ratios():
    text = markdown_table(report())
    assert "| eagle_tree | lossless | total_tokens=16 | 2.60 |" in text
    assert "| 40.0 | 1.20 | 1.35 | 60.00 |" in text  # verify ms, verify in plain steps, break-even tau, tokens/s
    assert "| plain (lean forward) |" in text and "| transformers generate |" in text
    assert "typical (LOSSY)" in text and "bonus token INCLUDED" in text
    assert "| 2.00 | 6.00 | yes |" in text  # eagle_tree: 60/30 vs plain, 60/10 vs transformers
    assert "MISMATCH" not in text


def test_mismatch_is_loud():
    bad = report(drafters=[_row("eagle_chain", identical=False)])
    assert "**GREEDY MISMATCH against plain decoding: eagle_chain**" in markdown_table(bad)


def test_write_report_files(tmp_path):
    paths = write_report(report(), tmp_path / "out")
    assert json.loads(paths["json"].read_text())["drafters"][0]["tau"] == 2.6
    for kind in ("acceptance_plot", "speedup_plot"):
        assert paths[kind].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # One tree size (or none): no curve of one dot, and no earlier run's plot left beside the new report.
    for drafters in ([_row("eagle_tree", 16)], [_row("eagle_chain")]):
        paths = write_report(report(drafters=drafters), tmp_path / "out")
        assert "speedup_plot" not in paths and not (tmp_path / "out" / "speedup_vs_tree_size.png").exists()
        assert paths["acceptance_plot"].is_file()


def test_acceptance_per_depth_counts_speculative_steps_only():
    from eval.runtime.generate import GenerationResult
    from eval.run import summarize

    # Four steps: two speculative (3 then 1 accepted of 4 drafted), two plain steps of the gate.
    result = GenerationResult(tokens=list(range(8)), prefill_time=0.1, total_time=1.0, accepted=[3, 0, 1, 0],
                              tree_sizes=[4, 0, 4, 0], draft_times=[0.0] * 4, verify_times=[0.1] * 4)
    summary = summarize([result], None)
    assert summary["speculated_fraction"] == 0.5 and summary["tau_when_speculating"] == 3.0
    assert summary["acceptance_per_depth"] == [1.0, 0.5, 0.5, 0.0]  # not [0.5, 0.25, 0.25, 0.0]
    assert summary["tau"] == 2.0
    never = GenerationResult(tokens=[1, 2], accepted=[0, 0], tree_sizes=[0, 0], draft_times=[0.0] * 2,
                             verify_times=[0.1] * 2, total_time=1.0)
    assert summarize([never], None)["acceptance_per_depth"] == []


def test_depth_table_shows_the_speculated_fraction():
    row = {**_row("eagle_tree", 16), "speculated_fraction": 0.06}
    assert "| eagle_tree | 0.06 | 0.80 | 0.50 | 0.20 |" in markdown_table(report(drafters=[row]))


def test_wandb_logging_only_with_an_active_run(tmp_path, monkeypatch):
    logged = []
    stub = types.SimpleNamespace(run=None, log=logged.append, Image=lambda path: ("image", path),
                                 Table=lambda columns: types.SimpleNamespace(rows=[], add_data=lambda *r: None))
    monkeypatch.setitem(sys.modules, "wandb", stub)
    paths = write_report(report(), tmp_path)
    assert logged == []
    stub.run = object()
    assert log_to_wandb(report(), paths)
    assert logged[0]["eval/eagle_tree/tau"] == 2.6 and logged[0]["eval/plain_tokens_per_second"] == 30.0


def test_tree_budget_and_speculated_fraction_in_the_table():
    row = {**_row("eagle_tree", 4, tau=1.9, tps=40.0), "speculated_fraction": 0.25}
    budget = {"chosen": 4, "calibration_prompts": 2, "plain_step_seconds": 0.030,
              "step_seconds_by_size": {2: 0.048, 4: 0.054}, "step_cost_in_plain_steps": {2: 1.6, 4: 1.8},
              "expected_tau_by_size": {2: 1.5, 4: 2.1}, "expected_speedup_by_size": {2: 0.94, 4: 1.17}}
    text = markdown_table(report(drafters=[row], eagle_tree_budget=budget, peagle_tree_budget={**budget, "chosen": 2},
                                 medusa={"choices": [[0]]}))
    assert "| eagle_tree | lossless | total_tokens=4 | 1.90 | 0.25 |" in text
    assert "| 4 (chosen) | 1.80 | 2.10 | 1.17x |" in text and "| 2 | 1.60 | 1.50 | 0.94x |" in text
    assert "plain decode steps of 30.0 ms" in text and "P-EAGLE tree size chosen" in text
    assert "| 2 (chosen) | 1.60 | 1.50 | 0.94x |" in text and "Medusa tree" not in text  # a named tree: none timed
    assert "chosen" not in markdown_table(report(drafters=[row]))
