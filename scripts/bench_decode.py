"""Decode benchmark for the lean forward (the baseline speedups are measured against).

Prints, in one run with the variants interleaved (the machine may be shared: compare within a run):
  1. plain greedy decoding ms/token and tokens/s for the lean forward (unfused and fused
     projections) vs transformers `generate`, with the generated tokens checked identical;
  2. the verification-cost curve: one forward over N = 1, 2, 4, ..., 64 new tokens (a random tree)
     relative to N = 1, which is what tree sizes are chosen from.

    python scripts/bench_decode.py --threads 2 [--json bench.json]
    python scripts/bench_decode.py --tree-attention   # GPU: Triton kernel vs reference

On a machine shared with other jobs, 2 OpenMP threads spinning at barriers collapse (~10x slower
steps); `--omp-wait passive` (OMP_WAIT_POLICY=PASSIVE, set before torch is imported) avoids that
at a small cost per parallel region on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

PROMPTS = [
    "The history of the Roman Empire can be summarised as follows:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here are five tips for staying productive while working from home:\n1.",
]
CURVE_SIZES = (1, 2, 4, 8, 16, 32, 64)


def _random_tree(n: int, generator):
    import torch

    from eval.tree import build_tree

    parents = [-1] + [int(torch.randint(max(0, i - 3), i, (1,), generator=generator)) for i in range(1, n)]
    return build_tree(parents)


def bench_plain(target, models: dict, prompts, new_tokens: int, reps: int) -> dict:
    from eval.generate import plain_generate
    from eval.timing import device_clock, module_device

    hf = target.model
    clock = device_clock(module_device(hf))  # CUDA: synchronised readings
    hf.generation_config.pad_token_id = hf.generation_config.pad_token_id or target.tokenizer.eos_token_id
    eos = hf.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    times = {name: [] for name in ["transformers", *models]}
    tokens_out = {name: [] for name in times}
    decode_ms = {name: [] for name in models}
    for _ in range(reps):
        for ids in prompts:
            for name in times:  # interleaved: every variant sees the same machine load
                start = clock()
                if name == "transformers":
                    out = hf.generate(ids[None], max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[0]:].tolist()
                else:
                    result = plain_generate(models[name], ids, new_tokens, eos_token_ids=eos)
                    out = result.tokens
                    decode_ms[name].append(1e3 * result.decode_time / max(len(out) - 1, 1))
                times[name].append((clock() - start, len(out)))
                tokens_out[name].append(out)
    report = {}
    for name, runs in times.items():
        tokens_per_second = sum(n for _, n in runs) / sum(t for t, _ in runs)
        report[name] = {"tokens_per_second": tokens_per_second,
                        "identical_to_transformers": tokens_out[name] == tokens_out["transformers"]}
        if name in decode_ms:
            report[name]["decode_ms_per_token_median"] = statistics.median(decode_ms[name])
    for name in models:
        report[name]["speedup_vs_transformers"] = report[name]["tokens_per_second"] / report["transformers"]["tokens_per_second"]
    return report


def bench_curve(models: dict, context_ids, reps: int) -> dict:
    import torch

    from eval.timing import device_clock, module_device

    generator = torch.Generator().manual_seed(0)
    trees = {n: _random_tree(n, generator) for n in CURVE_SIZES}
    caches = {}
    for name, model in models.items():
        caches[name] = model.new_cache(context_ids.shape[0] + max(CURVE_SIZES) + 1)
        model(context_ids, caches[name], logits="none")
        caches[name].commit()
    best = {name: {n: float("inf") for n in CURVE_SIZES} for name in models}
    tokens = torch.randint(0, 1000, (max(CURVE_SIZES),), generator=generator)
    for _ in range(reps):
        for n in CURVE_SIZES:
            for name, model in models.items():
                tree, cache = trees[n], caches[name]
                clock = device_clock(module_device(model))
                start = clock()
                model(tokens[:n], cache, positions=cache.length + tree.depths,
                      tree_mask=None if n == 1 else tree.mask, tree_bits=tree.bits)
                best[name][n] = min(best[name][n], clock() - start)
                cache.compact([])
    return {name: {n: {"ms": 1e3 * t, "relative": t / row[1]} for n, t in row.items()} for name, row in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=2, help="passes over the prompts for plain decoding")
    parser.add_argument("--curve-reps", type=int, default=5)
    parser.add_argument("--variants", default="lean,lean_unfused,lean_unpacked",
                        help="comma list: lean (fused q|k|v and gate|up, packed multi-row weights: the "
                             "default), lean_unfused, lean_unpacked, lean_unfused_unpacked")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--tree-attention", action="store_true", help="GPU micro-benchmark of the Triton kernel")
    parser.add_argument("--omp-wait", choices=["default", "passive", "active"], default="default",
                        help="OMP_WAIT_POLICY for this run (passive survives a shared machine)")
    args = parser.parse_args()
    if args.omp_wait != "default":
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait.upper()
    import torch

    torch.set_num_threads(args.threads)
    if args.tree_attention:
        from eval.attention.triton_kernel import benchmark

        rows = benchmark()
        if args.json:
            json.dump(rows, open(args.json, "w"), indent=2)
        return

    from eval.model import LeanLlama
    from heads.target import TargetConfig, load_target

    target = load_target(TargetConfig(device="cpu"))
    models = {name: LeanLlama.from_hf(target.model, max_seq_len=1024, fuse_projections="unfused" not in name,
                                      pack_multi_row="unpacked" not in name)
              for name in args.variants.split(",")}
    prompts = [target.tokenizer(p, return_tensors="pt").input_ids[0] for p in PROMPTS]
    with torch.inference_mode():
        plain = bench_plain(target, models, prompts, args.new_tokens, args.reps)
        curve = bench_curve(models, torch.cat(prompts * 4), args.curve_reps)
    print(f"threads={args.threads}  omp_wait={args.omp_wait}  new_tokens={args.new_tokens}  prompts={len(prompts)} x {args.reps}  "
          f"(fp32; the machine may be shared: compare rows of one run)")
    print(f"{'variant':<14}{'tokens/s':>10}{'ms/token':>10}{'x transformers':>16}{'identical':>11}")
    for name, row in plain.items():
        print(f"{name:<14}{row['tokens_per_second']:>10.1f}{row.get('decode_ms_per_token_median', float('nan')):>10.1f}"
              f"{row.get('speedup_vs_transformers', 1.0):>16.2f}{str(row['identical_to_transformers']):>11}")
    print("verification cost: forward over N new tokens (tree mask) / one decode step")
    print(f"{'variant':<14}" + "".join(f"{'N=' + str(n):>9}" for n in CURVE_SIZES))
    for name, row in curve.items():
        print(f"{name:<14}" + "".join(f"{row[n]['relative']:>9.2f}" for n in CURVE_SIZES))
        print(f"{'  ms':<14}" + "".join(f"{row[n]['ms']:>9.1f}" for n in CURVE_SIZES))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"threads": args.threads, "omp_wait": args.omp_wait, "plain": plain, "verify_curve": curve}, handle, indent=2)


if __name__ == "__main__":
    main()
