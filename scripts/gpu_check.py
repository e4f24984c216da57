"""One GPU check of everything that only runs on CUDA, with a JSON summary (scripts/gpu_check.sh).

    bash scripts/gpu_check.sh [--out runs/gpu_check.json] [--budget 450]

Steps, each in its own process under its own deadline (a hung step cannot eat the others' time;
the JSON is rewritten after every step, so a killed run still leaves what finished):
  gpu_tests             every `pytest -m gpu` test (counts and the names of failures)
  tree_attention        the Triton tree-attention kernel vs SDPA with a dense tree mask, bf16:
                        max |difference| and microseconds per call, tree 16/32/64 x context 512/2k/8k
  head_train_8b_shape   one bf16 EAGLE training step on a random Llama-3-8B-shaped target with 2
                        full-width layers: tokens/s and peak memory
  deepspeed_zero2_nccl  the training loop under DeepSpeed ZeRO-2, NCCL, one process on one GPU
  eval_release          `python -m eval head=release` on the GPU (CUDA-synchronised timing): tau,
                        speedup vs plain decoding and vs transformers' generate
Without CUDA every step is recorded as "skipped: no CUDA" and the JSON is still written.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MARK = "GPU_CHECK_RESULT "
# Seconds each step may take (sum 420: with start-up the whole check stays under 8 minutes).
BUDGETS = {"gpu_tests": 90, "tree_attention": 60, "head_train_8b_shape": 60, "deepspeed_zero2_nccl": 90,
           "eval_release": 120}
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)


def step_gpu_tests(work: Path) -> dict:
    import xml.etree.ElementTree as ET

    report = work / "gpu_tests.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                          f"--junitxml={report}"], cwd=ROOT, capture_output=True, text=True)
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    return {"ok": run.returncode == 0, **counts, "failed": failed, "tail": run.stdout[-1500:]}


def step_tree_attention(work: Path) -> dict:
    from eval.runtime.attention.triton_kernel import benchmark

    rows = benchmark(tree_sizes=(16, 32, 64), contexts=(512, 2048, 8192))
    worst = max(row["max_abs_diff"] for row in rows)
    return {"ok": worst < 5e-2, "max_abs_diff": worst, "rows": rows}  # bf16 outputs: ~1e-2 is rounding


def step_head_train_8b_shape(work: Path) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from data.collate import collate
    from eval.runtime.clock import device_clock
    from heads.config import EagleOptions
    from heads.eagle import EagleConfig, init_from_target
    from heads.io import build_head
    from heads.target import TargetConfig, load_target
    from train.objectives import FrozenParts, OnlineFeatures, eagle_step

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **LLAMA3_8B)).to(torch.bfloat16)
    target = load_target(TargetConfig(name_or_path="llama3-8b-shape-2-layers", device="cuda", dtype="bfloat16"),
                         model=model, tokenizer=None)
    head = init_from_target(build_head(EagleConfig.from_target(target)), target).cuda()
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4)
    batch_size, length = 4, 1024
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, LLAMA3_8B["vocab_size"], (length,), generator=g).tolist(),
             "loss_mask": [0] * 16 + [1] * (length - 16)} for _ in range(batch_size)]
    batch = {k: v.cuda() for k, v in collate(rows, 0).items()}
    source, parts = OnlineFeatures(target), FrozenParts.from_target(target)
    clock, seconds, steps = device_clock("cuda"), 0.0, 3
    torch.cuda.reset_peak_memory_stats()
    for step in range(steps + 1):  # step 0 warms up (allocator, kernels) and is not timed
        start = clock()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = eagle_step(head, parts, batch, source(batch), EagleOptions(), 1024)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:
            seconds += clock() - start
    return {"ok": bool(torch.isfinite(loss)), "tokens_per_second": steps * batch_size * length / seconds,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30, "batch": [batch_size, length],
            "loss": float(loss), "target": "random Llama-3-8B shape, 2 layers, bf16"}


def step_deepspeed_zero2_nccl(work: Path) -> dict:
    run_dir = work / "zero2"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": str(work / "ext")}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                          str(ROOT / "tests" / "scale" / "loop_worker.py"), "--runs",
                          json.dumps([{"dir": str(run_dir), "deepspeed": 2}])],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    metrics = run_dir / "metrics.jsonl"
    losses = [json.loads(line).get("train/loss") for line in metrics.read_text().splitlines()] \
        if metrics.is_file() else []
    losses = [x for x in losses if x is not None]
    return {"ok": run.returncode == 0 and bool(losses), "losses": losses, "backend": "nccl",
            "tail": (run.stdout + run.stderr)[-1500:]}


def step_eval_release(work: Path) -> dict:
    out = work / "eval"
    run = subprocess.run([sys.executable, "-m", "eval", "head=release", "runtime.drafters=[eagle_tree,eagle_chain]",
                          "runtime.num_prompts=4", "runtime.max_new_tokens=64", f"out={out}"],
                         cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0 or not (out / "report.json").is_file():
        return {"ok": False, "tail": (run.stdout + run.stderr)[-1500:]}
    report = json.loads((out / "report.json").read_text())
    rows = {row["name"]: {key: row.get(key) for key in ("tau", "tokens_per_second", "speedup_vs_plain",
                                                        "speedup_vs_transformers", "greedy_identical",
                                                        "greedy_identical_up_to_ties", "greedy_divergences")}
            for row in report["drafters"]}
    # bf16 on a GPU may leave plain decoding at rounding near-ties (eval.divergence); anything else fails
    return {"ok": all(row["greedy_identical"] is not False or row["greedy_identical_up_to_ties"]
                      for row in rows.values()),
            "measured_on": report.get("measured_on"), "drafters": rows,
            "recommended_runtime": report.get("recommended_runtime")}


STEPS = {name[len("step_"):]: fn for name, fn in globals().items() if name.startswith("step_")}


def _write(path: Path, summary: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    tmp.replace(path)


def _run_step(name: str, budget: float, work: Path) -> dict:
    started = time.time()
    try:
        run = subprocess.run([sys.executable, __file__, "--step", name, "--work", str(work)], cwd=ROOT,
                             capture_output=True, text=True, timeout=budget)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {budget:.0f} s", "seconds": round(time.time() - started, 1)}
    lines = [line for line in run.stdout.splitlines() if line.startswith(MARK)]
    if run.returncode != 0 or not lines:
        return {"status": "error", "seconds": round(time.time() - started, 1),
                "tail": (run.stdout + run.stderr)[-2000:]}
    result = json.loads(lines[-1][len(MARK):])
    return {"status": "passed" if result.pop("ok") else "failed", "seconds": round(time.time() - started, 1),
            **result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/gpu_check.json")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all steps together")
    parser.add_argument("--step", choices=sorted(STEPS), help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:  # one step, in its own process
        print(MARK + json.dumps(STEPS[args.step](Path(args.work)), default=str), flush=True)
        return 0
    import torch

    cuda = torch.cuda.is_available()
    out, deadline = Path(args.out), time.time() + args.budget
    summary = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
               "cuda": cuda, "device": torch.cuda.get_device_name() if cuda else None, "steps": {}}
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work:
        for name in BUDGETS:
            left = deadline - time.time()
            if not cuda:
                result = {"status": "skipped: no CUDA"}
            elif left < 10:
                result = {"status": "skipped: out of time"}
            else:
                result = _run_step(name, min(BUDGETS[name], left), Path(work))
            summary["steps"][name] = result
            print(f"{name:<22} {result['status']}", flush=True)
            _write(out, summary)
    summary["passed"] = cuda and all(step["status"] == "passed" for step in summary["steps"].values())
    _write(out, summary)
    print(f"summary: {out}")
    return 0 if summary["passed"] or not cuda else 1


if __name__ == "__main__":
    sys.exit(main())
