"""Measure several heads in vLLM beside our runtime, on the same prompts, in one run.

    .venv/bin/python scripts/bench_engine.py [--head DIR ...] [--prompts 16] [--tokens 128] [--k 3]
        [--temperature 0] [--dtype float32] [--prompts-file FILE] [--out DIR] [--threads 2]

Default heads: the shipped release heads (heads/release/*). Each head's engine layout is handed to
vLLM as written (a release head's `speculators/` folder; an export of the head otherwise); our
chain runs at the same K, plain decoding (ours, vLLM's, transformers' `generate`) once for all.
Prints the markdown report (eval/engine_eval.py), with the first head's difference from each other
head in vLLM (mean length, first position) and its paired bootstrap standard error over the
prompts, and writes report.json / report.md to --out.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", action="append", type=Path, help="head folder (repeat); default: release heads")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts-file", default=None, help="JSONL of prompts (a `category` field adds rows)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-transformers", action="store_true", help="leave transformers' generate out")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "bench-engine")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch

    from data.config import DataConfig
    from eval.config import RuntimeConfig
    from eval.stage import eval_prompt_records, run_engine_comparison
    from heads.target import TargetConfig, load_target

    torch.set_num_threads(args.threads)
    heads = args.head or sorted(p for p in (REPO / "heads" / "release").iterdir() if (p / "specheads.json").is_file())
    runtime = RuntimeConfig(max_new_tokens=args.tokens, temperature=args.temperature, num_prompts=args.prompts,
                            dtype=args.dtype, threads=args.threads, prompts_file=args.prompts_file)
    target = load_target(TargetConfig(device="cpu"))
    prompts = eval_prompt_records(runtime, DataConfig(), target.tokenizer)
    run_engine_comparison(target, heads, prompts, runtime, args.out, args.k, transformers=not args.no_transformers)
    print((args.out / "report.md").read_text())


if __name__ == "__main__":
    main()
