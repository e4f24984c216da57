"""Serving benchmark within the lean runtime (eval/serving.py; a measurement tool, not a server):
requests from held-out prompts arrive on a Poisson process at each of several rates, and static and
continuous batching serve the same arrival trace, each with plain decoding and with speculation
(the head's EAGLE tree at a fixed size, or following the speculation policy per batch size of a
batch-size sweep's report). Prints and optionally writes throughput, mean batch size, τ and
TTFT/TPOT/end-to-end percentiles per rate, scheduler and drafter, all measured in one run.

    python scripts/bench_serving.py --threads 2 --rates 0.5,1,2,4 --requests 16 --new-tokens 32
    python scripts/bench_serving.py --policy runs/eval/report.json --json serving.json

Idle time between arrivals is skipped, not slept (eval.serving.SkipClock). Greedy output of every
run is checked against the first one on the same trace.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", default="release", help="head folder or `release` (the shipped EAGLE head)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rates", default="0.5,1,2,4", help="arrival rates, requests per second")
    parser.add_argument("--requests", type=int, default=16, help="requests per rate")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts the requests cycle through")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--tree-size", type=int, default=None,
                        help="EAGLE tree total_tokens (default: the head's manifest, else 4)")
    parser.add_argument("--policy", help="an eval report.json with a speculation_policy to follow instead")
    parser.add_argument("--schedulers", default="static,continuous")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)

    import torch

    from eval.__main__ import compose_eval, load_eval_head, resolve_head
    from eval.runtime.drafters.eagle import EagleDrafter
    from eval.runtime.model import LeanLlama
    from eval.runtime.drafters.policy import PolicyDrafter, SpeculationPolicy
    from eval.serving import bench_serving, markdown
    from eval.stage import eval_prompt_ids
    from heads.eagle3 import Eagle3Head
    from heads.target import TargetConfig, load_target
    from heads.vocab import draft_ids

    torch.set_num_threads(args.threads)
    rates = [float(r) for r in args.rates.split(",") if r]
    cfg = compose_eval([f"head={args.head}", f"runtime.num_prompts={args.prompts}"])
    target = load_target(TargetConfig(device="cpu"))
    head, _ = load_eval_head(args.head, target)
    prompts = [torch.tensor(p) for p in eval_prompt_ids(cfg.runtime, cfg.data, target.tokenizer, cfg.prompts_file)]
    runtime = cfg.runtime
    manifest = resolve_head(args.head) / "specheads.json"
    tree = json.loads(manifest.read_text()).get("runtime", {}).get("tree", {}) if manifest.is_file() else {}
    size = args.tree_size or int(tree.get("total_tokens", 4))
    top_k, depth = int(tree.get("top_k", runtime.tree_top_k)), int(tree.get("depth", runtime.tree_depth))
    max_length = max(p.shape[0] for p in prompts) + args.new_tokens + max(size, 64) + 8
    lean = LeanLlama.from_hf(target.model.float(), max_seq_len=max_length)
    vocab = None if isinstance(head, Eagle3Head) else draft_ids(head)
    policy = None
    if args.policy:
        report = json.loads(open(args.policy).read())
        if not report.get("speculation_policy"):
            print(f"bench_serving: {args.policy} has no speculation_policy (run python -m eval runtime.batch_sizes=[...])",
                  file=sys.stderr)
            return 2
        policy = SpeculationPolicy.from_dict(report["speculation_policy"])

    def speculative():
        drafter = EagleDrafter(head, lean, mode="tree", depth=depth, top_k=top_k, total_tokens=size, draft_vocab=vocab)
        return drafter if policy is None else PolicyDrafter(drafter, policy)

    name = "eagle_tree (policy)" if policy else f"eagle_tree@{size}"
    eos = [target.tokenizer.eos_token_id] if target.tokenizer.eos_token_id is not None else []
    print(f"CPU {platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}; "
          f"{args.requests} requests per rate from {len(prompts)} held-out prompts, {args.new_tokens} new tokens, "
          f"max batch {args.max_batch}. One run; the machine may be shared with other jobs.", flush=True)
    start = time.perf_counter()
    rows = bench_serving(lean, prompts, rates, args.requests, args.new_tokens, args.max_batch,
                         {"plain": None, name: speculative}, args.schedulers.split(","), eos_token_ids=eos,
                         max_length=max_length, seed=args.seed, progress=lambda s: print(f"  {s}", flush=True))
    print(markdown(rows))
    print(f"({time.perf_counter() - start:.0f} s)")
    if not all(row.get("greedy_identical", True) for row in rows):
        print("GREEDY MISMATCH between runs of one trace: a bug in the runtime", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"threads": args.threads, "rates": rates, "max_batch": args.max_batch,
                       "policy": None if policy is None else policy.to_dict(), "rows": rows}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
