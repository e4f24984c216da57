"""Eval writes only into a folder that holds nothing but what an earlier eval wrote: a user's
report.md kept in `out` is refused, before any model loads, unless the user passes overwrite=true."""
from __future__ import annotations

import json

import pytest

import eval.__main__ as entry
from eval.config import RuntimeConfig
from eval.engine_eval import measure_engine
from eval.out_folder import RECORD_NAME, OutFolderError, check_out_folder, claim
from eval.report import write_report
from tests.helpers import pipeline_job, report


def _no_target(config):
    raise AssertionError("the target must not load when the output folder is refused")


def _user_folder(path):
    path.mkdir()
    (path / "report.md").write_text("my notes")
    (path / "report.json").write_text('{"mine": true}')
    return path


def test_eval_refuses_a_folder_with_a_users_report_before_the_target_loads(tmp_path, monkeypatch, capsys):
    out = _user_folder(tmp_path / "mine")
    monkeypatch.setattr("heads.target.load_target", _no_target)
    assert entry.cli([f"out={out}", "progress=false"]) == 2
    assert "holds files eval did not write (report.json, report.md)" in capsys.readouterr().err
    assert (out / "report.md").read_text() == "my notes" and not (out / RECORD_NAME).exists()
    (tmp_path / "file").write_text("x")
    assert entry.cli([f"out={tmp_path / 'file'}", "progress=false"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_every_writer_refuses_to_replace_a_users_report(tmp_path):
    out = _user_folder(tmp_path / "mine")
    with pytest.raises(OutFolderError, match="holds report.json, report.md, which eval did not write"):
        write_report(report(), out)
    with pytest.raises(OutFolderError, match="which eval did not write"):  # before it loads the head
        measure_engine(None, [tmp_path / "head"], [], RuntimeConfig(), out)
    assert (out / "report.md").read_text() == "my notes" and json.loads((out / "report.json").read_text())["mine"]


def test_eval_writes_again_where_it_wrote_and_overwrite_hands_a_folder_over(tmp_path):
    out = tmp_path / "eval"
    write_report(report(), out)
    check_out_folder(out)  # only eval's files (and its record) there
    write_report(report(), out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutFolderError, match=r"\(notes.txt\)"):
        check_out_folder(out)
    mine = _user_folder(tmp_path / "mine")
    check_out_folder(mine, overwrite=True)  # the user asked: eval may replace what is there
    write_report(report(), mine)
    assert json.loads((mine / "report.json").read_text())["drafters"]
    check_out_folder(mine)  # recorded as eval's now: a later eval needs no overwrite
    claim(mine, ["report.md"])


def test_a_job_refuses_a_users_file_in_its_eval_folder_before_the_target_loads(tiny_chat_model, tmp_path,
                                                                                monkeypatch):
    from train.pipeline import run_job

    (tmp_path / "run").mkdir()
    _user_folder(tmp_path / "run" / "eval")
    monkeypatch.setattr("train.pipeline.load_job_target", _no_target)
    job = pipeline_job(tiny_chat_model, tmp_path, "run", 1, "stages=[eval]")
    with pytest.raises(OutFolderError, match=r"holds files eval did not write.*move them out of it"):
        run_job(job)
    assert (tmp_path / "run" / "eval" / "report.md").read_text() == "my notes"
    # An eval stage from before eval kept its own record: the job summary names what it wrote.
    files = {"json": str(tmp_path / "run" / "eval" / "report.json"), "markdown": "run/eval/report.md"}
    (tmp_path / "run" / "job_summary.json").write_text(json.dumps({"eval": {"files": files}}))
    with pytest.raises(AssertionError, match="must not load"):  # past the check: the target would load now
        run_job(job)
    check_out_folder(tmp_path / "run" / "eval")
