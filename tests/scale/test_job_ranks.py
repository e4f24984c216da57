"""A whole job (data -> train -> eval -> export) on a layer-split target under a 2-process gloo
launch: eval and export run once, on rank 0, while rank 1 waits; both ranks exit 0; the eval ran
the split forward (its report records the devices); and the export is byte for byte what one
process exports from the same run folder."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = str(Path(__file__).with_name("job_worker.py"))
ROOT = str(Path(__file__).resolve().parents[2])
STAGES = ("runtime.drafters=[eagle_tree]", "runtime.tree_total_tokens=4", "runtime.tree_sweep=[]", "runtime.num_prompts=1",
          "runtime.max_new_tokens=4", "runtime.compare_transformers=false")


def _launch(nproc: int, args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TORCH_EXTENSIONS_DIR": str(tmp / "ext")}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    launcher = [sys.executable, WORKER] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", WORKER]
    return subprocess.run(launcher + args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _without_created(raw: bytes) -> dict:
    manifest = json.loads(raw)
    manifest.pop("created_utc")
    return manifest


@pytest.mark.slow  # 40 s on an idle 2-core machine, 2 min loaded; the default run has test_main_process_stage_*
@pytest.mark.integration
def test_a_split_target_job_runs_eval_and_export_once_on_rank_zero(tiny_chat_model, tmp_path):
    common = ["--split", str(tiny_chat_model), str(tmp_path), "run", *STAGES]
    two = _launch(2, common, tmp_path)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]  # torchrun: every rank exited 0
    assert "rank 1 waits for rank 0's eval and export" in two.stderr
    assert two.stdout.count("== ") == 1  # one final summary: rank 0's
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "eval").iterdir() if "report" in p.name) == ["report.json", "report.md"]
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["placement"]["split"] and report["placement"]["boundaries"] == 2, report["placement"]
    assert [s["key"] for s in report["placement"]["stages"]] == ["cpu:0", "cpu:1", "cpu:2"]
    assert "split across devices" in report["weights"]
    assert all(row["greedy_identical"] for row in report["drafters"])
    assert "Target split across devices (2 boundaries)" in (run / "eval" / "report.md").read_text()
    export = run / "export"
    assert sorted(p.name for p in export.iterdir()) == ["eagle", "eagle_vllm", "native"]  # no leftovers
    summary = json.loads((run / "job_summary.json").read_text())
    assert set(summary) >= {"data", "train", "eval", "export"}
    runtime = json.loads((export / "eagle" / "specheads.json").read_text())["runtime"]
    assert runtime["tree"]["total_tokens"] == 4 and runtime["sources"]["total_tokens"] == "configured"

    # One process, the same run folder: the export of the same head and figures, elsewhere.
    one = _launch(1, [*common, "stages=[export]", f"export.out={tmp_path / 'one'}"], tmp_path)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    by_two, by_one = _files(export), _files(tmp_path / "one")
    assert sorted(by_two) == sorted(by_one)
    for name, raw in by_two.items():
        if name.endswith("specheads.json"):  # the creation time is the one field that may differ
            assert _without_created(raw) == _without_created(by_one[name]), name
        else:
            assert raw == by_one[name], name
    assert not (tmp_path / "ext").exists(), "a DeepSpeed op was JIT-compiled"


def test_main_process_stages_run_once_and_every_rank_gets_the_result_or_the_failure(tmp_path):
    """Two ranks started as torchrun starts them (without its launcher: seconds, not tens)."""
    from train.distributed import _free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    ranks = [subprocess.Popen([sys.executable, str(Path(__file__).with_name("main_only_worker.py")), str(tmp_path)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    for rank in ranks:
        output = rank.communicate(timeout=120)[0]
        assert rank.returncode == 0, output[-2000:]
    got = {(mode, r): json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for mode in ("ok", "fail")
           for r in (0, 1)}
    assert got[("ok", 0)] == got[("ok", 1)] == {"result": {"value": 42}}
    assert sorted(p.name for p in tmp_path.glob("*-ran-by-*")) == ["fail-ran-by-rank0", "ok-ran-by-rank0"]
    assert got[("fail", 0)] == {"raised": "bad head"}
    assert got[("fail", 1)] == {"failed": "rank 0 failed in its test stage: ValueError: bad head"}
