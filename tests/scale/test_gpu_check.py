"""scripts/gpu_check.sh without CUDA: every step says so and the JSON summary is still written."""
import json
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what a machine without CUDA does")
def test_the_gpu_check_dry_runs_without_cuda(tmp_path):
    out = tmp_path / "check.json"
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads(out.read_text())
    assert summary["cuda"] is False and summary["passed"] is False
    assert list(summary["steps"]) == ["gpu_tests", "tree_attention", "head_train_8b_shape",
                                      "deepspeed_zero2_nccl", "eval_release"]
    assert {step["status"] for step in summary["steps"].values()} == {"skipped: no CUDA"}
