"""scripts/results_table.py: the recipe table comes from each recipe's last run folder, and only the
marked block of a markdown file is rewritten."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from results_table import BEGIN, END, last_runs, render, replace_block  # noqa: E402


def _job(folder: Path, recipe: str, top1: float, tau: float, when: float, with_eval: bool = True) -> Path:
    """A run folder as train.pipeline.run_job leaves it."""
    folder.mkdir(parents=True)
    held_out = {"eval/positions": 100.0, "eval/top1_step1": 0.2, "eval/top1_step0": top1,
                "eval/acceptance_length": 1.0 + top1}
    summary = {"recipe": recipe, "hardware": "CPU x86_64, 2 threads", "wall_seconds": 600.0,
               "train": {"steps": 300, "stopped": "max_steps", "final_eval": held_out, "hardware": "CPU x86_64, 2 threads"}}
    if with_eval:
        summary["eval"] = {"drafters": [
            {"name": "eagle_tree", "sweep": False, "tau": tau, "speedup_vs_plain": 1.1},
            {"name": "eagle_tree@8", "sweep": True, "tau": 9.0, "speedup_vs_plain": 9.0},  # sweeps are not the method
            {"name": "prompt_lookup", "sweep": False, "tau": 1.1, "speedup_vs_plain": 1.05}]}
    path = folder / "job_summary.json"
    path.write_text(json.dumps(summary))
    os.utime(path, (when, when))
    return folder


def test_each_recipe_shows_its_last_run(tmp_path):
    _job(tmp_path / "old_eagle", "eagle_smollm2_135m", 0.30, 1.2, when=1_000)
    _job(tmp_path / "new_eagle", "eagle_smollm2_135m", 0.35, 1.4, when=2_000)
    _job(tmp_path / "nested" / "medusa", "medusa_smollm2_135m", 0.26, 1.3, when=1_500, with_eval=False)
    (tmp_path / "no_run_here").mkdir()
    rows = last_runs([tmp_path])
    assert [row["recipe"] for row in rows] == ["eagle_smollm2_135m", "medusa_smollm2_135m"]
    assert rows[0]["run"].endswith("new_eagle") and rows[0]["top1"] == 0.35  # step 0, not step 1
    assert rows[0]["method"] == rows[0]["head_method"] == {"name": "eagle_tree", "tau": 1.4, "vs_plain": 1.1}
    table = render(rows, ["eagle3_smollm2_135m", "eagle_smollm2_135m"])
    assert "| eagle_smollm2_135m | 300 (max_steps) | 0.350 | 1.350 | eagle_tree: 1.40, 1.10x | 10.0 |" in table
    assert "| medusa_smollm2_135m | 300 (max_steps) | 0.260 | 1.260 | – |" in table
    assert "CPU x86_64, 2 threads (1970-01-01) |" in table  # the day the run's summary was written
    assert "| eagle3_smollm2_135m | not yet measured | – | – | – | – | – | – |" in table


def test_the_heads_own_drafter_is_shown_when_another_was_faster(tmp_path):
    folder = _job(tmp_path / "run", "eagle_smollm2_135m", 0.3, 1.3, when=1_000)
    summary = json.loads((folder / "job_summary.json").read_text())
    summary["eval"]["drafters"][2]["speedup_vs_plain"] = 1.2  # prompt lookup beats the head
    (folder / "job_summary.json").write_text(json.dumps(summary))
    assert "| prompt_lookup: 1.10, 1.20x (eagle_tree: 1.30, 1.10x) |" in render(last_runs([tmp_path]))


def test_job_minutes_are_the_training_jobs_not_a_later_stage_runs(tmp_path):
    folder = _job(tmp_path / "run", "eagle_smollm2_135m", 0.3, 1.3, when=1_000)
    summary = json.loads((folder / "job_summary.json").read_text())
    # the job trained and evaluated in 12 minutes; an eval-only run took 48 s afterwards
    summary.update({"job_seconds": 720.0, "wall_seconds": 48.0, "stages": ["eval"]})
    (folder / "job_summary.json").write_text(json.dumps(summary))
    assert "| eagle_tree: 1.30, 1.10x | 12.0 |" in render(last_runs([tmp_path]))
    # a summary that records its stages but no training run's time shows none
    del summary["job_seconds"]
    (folder / "job_summary.json").write_text(json.dumps(summary))
    assert "| eagle_tree: 1.30, 1.10x | – |" in render(last_runs([tmp_path]))


def test_only_the_marked_block_is_rewritten(tmp_path):
    text = f"# Title\n\nbefore\n{BEGIN}\n| stale | table |\n{END}\nafter\n"
    new = replace_block(text, "| fresh |\n")
    assert new == f"# Title\n\nbefore\n{BEGIN}\n| fresh |\n{END}\nafter\n"
    assert replace_block(new, "| fresh |") == new  # idempotent
    for broken in (text.replace(END, ""), text + BEGIN + "\n", f"{END}\n{BEGIN}\n"):
        with pytest.raises(SystemExit, match="README.md: needs one line"):
            replace_block(broken, "x", "README.md")


def test_the_script_rewrites_a_file(tmp_path):
    _job(tmp_path / "runs" / "eagle", "eagle_smollm2_135m", 0.33, 1.3, when=1_000)
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{BEGIN}\nold\n{END}\noutro\n")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "results_table.py"), "--runs",
                           str(tmp_path / "runs"), "--write", str(doc)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = doc.read_text().splitlines()
    assert lines[:2] == ["intro", BEGIN] and lines[-2:] == [END, "outro"] and "old" not in lines
    assert any(line.startswith("| eagle_smollm2_135m | 300 (max_steps) | 0.330 |") for line in lines)
    missing = subprocess.run([sys.executable, str(ROOT / "scripts" / "results_table.py"), "--runs",
                              str(tmp_path / "empty"), "--releases", "none"], capture_output=True, text=True)
    assert missing.returncode != 0 and "no run folders" in missing.stderr


def test_a_release_head_stands_for_its_recipe_until_a_newer_run(tmp_path):
    releases = tmp_path / "release" / "eagle3_head"
    releases.mkdir(parents=True)
    manifest = {"created_utc": "2026-12-01T05:00:08Z", "training": {
        "recipe": "eagle3_smollm2_135m_long", "steps": 638, "hardware": "CPU x86_64, 2 threads",
        "held_out": {"eval/top1_step0": 0.305, "eval/acceptance_length": 1.393}},
        "eval": {"hardware": "AMD EPYC, 2 threads", "eagle_tree": {"tau": 1.07, "speedup_vs_plain": 1.02},
                 "prompt_lookup": {"tau": 1.15, "speedup_vs_plain": 1.13}}}
    (releases / "specheads.json").write_text(json.dumps(manifest))
    rows = last_runs([tmp_path / "runs"], tmp_path / "release")
    assert len(rows) == 1 and rows[0]["recipe"] == "eagle3_smollm2_135m_long"
    line = render(rows).splitlines()[-1]
    assert line.startswith("| eagle3_smollm2_135m_long | 638 (release head) | 0.305 | 1.393 | "
                           "prompt_lookup: 1.15, 1.13x (eagle_tree: 1.07, 1.02x) | – | AMD EPYC, 2 threads (2026-12-01) |")
    newer = 1_900_000_000  # 2030: a run folder of the recipe written after the head replaces its row
    _job(tmp_path / "runs" / "rerun", "eagle3_smollm2_135m_long", 0.4, 1.6, when=newer)
    rows = last_runs([tmp_path / "runs"], tmp_path / "release")
    assert rows[0]["run"].endswith("rerun") and rows[0]["top1"] == 0.4
