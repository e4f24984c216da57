"""scripts/kinds_table.py: the head-kinds table comes from the files bench_kinds.sh's runs wrote (job
summaries, vLLM reports, the draft-cost run), and only its marked block of a markdown file is rewritten."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from kinds_table import BEGIN, END, main, norms_table, table  # noqa: E402


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _kind(out: Path, recipe: str, top1: float, rows: list[dict]) -> None:
    _write(out / recipe / "job_summary.json", {
        "recipe": recipe, "hardware": "CPU Test (AMX), 2 threads",
        "train": {"steps": 120, "stopped": "max_minutes", "hardware": "CPU Test (AMX), 2 threads",
                  "final_eval": {"eval/top1_step0": top1, "eval/acceptance_length": 1.4}},
        "eval": {"dtype": {"chosen": "bfloat16"}, "drafters": rows}})


@pytest.fixture
def out(tmp_path: Path) -> Path:
    out = tmp_path / "kinds"
    _kind(out, "eagle_smollm2_135m", 0.31, [
        {"name": "eagle_tree", "tau": 1.6, "speedup_vs_plain": 1.2, "draft_ms_per_step": 9.0},
        {"name": "eagle_tree@32", "sweep": True, "tau": 3.0, "speedup_vs_plain": 5.0},  # a sweep point is no method
        {"name": "prompt_lookup", "tau": 1.1, "speedup_vs_plain": 1.4}])  # not the head's drafter
    _kind(out, "dflash_smollm2_135m", 0.22, [{"name": "dflash_chain", "tau": 2.1, "speedup_vs_plain": 1.5,
                                              "draft_ms_per_step": 4.0}])
    heads = [{"head": str(out / "eagle_smollm2_135m" / "export" / "native"),
              "rows": {"engine": {"accepted_per_position": [0.41, 0.2, 0.1], "mean_acceptance_length": 1.71}},
              "speed": {"engine_speculative": {"speedup_vs_plain": 1.07}}, "agreement": {}}]
    _write(out / "engine_k3" / "report.json", {"k": 3, "engine_version": "0.x", "heads": heads})
    _write(out / "draft_cost.json", {"eagle_head_forward_ms": 5.0, "rows": [
        {"head": str(out / "dflash_smollm2_135m" / "export" / "native"), "drafter": "dflash_chain",
         "draft_ms_per_step": 6.0, "tau": 1.5, "speedup_est": 1.4},
        {"head": str(out / "dflash_smollm2_135m" / "export" / "native"), "drafter": "eagle_chain@1",
         "draft_ms_per_step": 1.0, "tau": 1.1, "speedup_est": 9.9}]})
    return out


def test_rows_come_from_the_runs(out: Path):
    body, notes = table(out)
    lines = {line.split(" | ")[0].lstrip("| "): line for line in body.splitlines()[2:]}
    assert "`eagle_tree` 1.60" in lines["EAGLE-1/2"] and "1.20x" in lines["EAGLE-1/2"]
    assert "K=3: 0.410, 1.71" in lines["EAGLE-1/2"] and "1.07x" in lines["EAGLE-1/2"]
    assert "| 9.0 |" in lines["EAGLE-1/2"]  # the eval stage's draft cost when no draft-cost run measured it
    assert "6.0 (1.20)" in lines["DFlash"]  # 6 ms = 1.2 EAGLE head forwards of 5 ms
    # the one-run figures replace the eval stage's; the one-token chain is the unit, never the pick
    assert "`dflash_chain` 1.50" in lines["DFlash"] and "1.40x" in lines["DFlash"] and "9.90x" not in lines["DFlash"]
    assert "not run" in lines["EAGLE-3"] and "not run" in lines["P-EAGLE"]
    assert "CPU Test (AMX), 2 threads" in notes[0] and "bfloat16" in notes[0]


def test_write_rewrites_only_the_block(out: Path, tmp_path: Path, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n{BEGIN}\nSTALE-ROW\n{END}\ntail\n")
    monkeypatch.setattr(sys, "argv", ["kinds_table.py", str(out), "--write", str(readme)])
    main()
    text = readme.read_text()
    assert text.startswith(f"# title\n{BEGIN}\n") and text.endswith(f"{END}\ntail\n")
    assert "STALE-ROW" not in text and "EAGLE-1/2" in text
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="kinds:begin"):
        main()


def test_norms_table_reads_each_option_run(tmp_path: Path):
    out = tmp_path / "kinds"
    _kind(out, "eagle3_smollm2_135m", 0.25, [])
    _write(out / "eagle3_fc_norm" / "job_summary.json", {"train": {"steps": 90, "stopped": "max_minutes", "final_eval": {
        "eval/top1_step0": 0.27, "eval/top1_step1": 0.2, "eval/top1_step2": 0.15, "eval/top1_step3": 0.1,
        "eval/acceptance_length": 1.33}}})
    lines = {line.split(" | ")[0].lstrip("| "): line for line in norms_table(out).splitlines()[2:]}
    assert "0.250 / – / – / –" in lines["as trained above"] and "| 1.400 |" in lines["as trained above"]
    assert "90 (max_minutes) | 0.270 / 0.200 / 0.150 / 0.100 | 1.330" in lines["`fc_norm`"]
    assert "not run" in lines["`norm_before_fc`"] and "not run" in lines["`norm_output`"]


def test_a_draft_cost_run_with_heads_in_two_dtypes_counts_each_in_its_own_unit(out: Path, tmp_path: Path):
    """bench_draft_cost.py --head-dtype float32 --head-dtype runtime: a "/bfloat16" row is counted in
    the bf16 heads' one-token chain, and may be the kind's pick."""
    dflash = str(out / "dflash_smollm2_135m" / "export" / "native")
    cost = tmp_path / "bf16.json"
    _write(cost, {"eagle_head_forward_ms": 5.0, "eagle_head_forward_ms_by_head_dtype": {"": 5.0, "/bfloat16": 4.0},
                  "dtype": "bfloat16", "linear_paths": "auto", "rows": [
        {"head": dflash, "drafter": "dflash_chain", "draft_ms_per_step": 6.0, "tau": 1.5, "speedup_est": 1.4},
        {"head": dflash, "drafter": "dflash_chain/bfloat16", "draft_ms_per_step": 6.0, "tau": 1.5, "speedup_est": 1.6},
        {"head": dflash, "drafter": "eagle_chain@1/bfloat16", "draft_ms_per_step": 1.0, "speedup_est": 9.9}]})
    body, notes = table(out, cost)
    line = next(line for line in body.splitlines() if line.startswith("| DFlash"))
    assert "`dflash_chain/bfloat16` 1.50" in line and "6.0 (1.50)" in line and "1.60x" in line
    assert "linear paths auto" in notes[0]
