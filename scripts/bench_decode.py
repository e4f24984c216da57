"""Decode benchmark: what a decode step and a verification cost on this machine, and what the
runtime makes of it. Prints in one run (variants interleaved; on a machine shared with other jobs
compare rows of one run, never across runs):

  1. read bandwidth (torch.sum over a large tensor; a copy too) and each dtype's weight-streaming
     floor for one decode step (bytes of the linear weights / read bandwidth);
  2. the dtype x path x N matrix: one forward over N new tokens after a 100-token prefix with every
     linear layer forced through one path, with the default rule, and with the paths chosen on this
     machine (ms, and ÷ the same variant's N=1);
  3. the chosen path per layer role and row count, and the dtype the runtime picks (a decode step
     plus one verification, as `runtime.dtype=auto` does);
  4. tokens/s of plain decoding, of the release head's EAGLE tree (heads/release/eagle_smollm2_135m,
     the CPU runtime's settings: tree size chosen at start, fallback gate) and of transformers'
     `generate`, all in the chosen dtype, on held-out prompts, greedy output checked.

    python scripts/bench_decode.py --threads 2 [--json bench.json] [--prompts 4] [--new-tokens 64]
    python scripts/bench_decode.py --tree-attention   # GPU: Triton kernel vs reference

With one thread, timings are the thread's CPU time (time taken by other jobs does not count); with
several, wall time. On a machine shared with other jobs, 2 OpenMP threads spinning at barriers
collapse (~10x slower steps); `--omp-wait passive` (OMP_WAIT_POLICY=PASSIVE, set before torch is
imported) avoids that at a small cost per parallel region on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

CURVE_SIZES = (1, 2, 4, 8, 16, 32, 64)


def cpu_name() -> str:
    from eval.timing import cpu_info

    return cpu_info()[0]


def bandwidth(megabytes: int = 1024, repeats: int = 5) -> dict:
    """Read bandwidth (sum) and copy bandwidth (read + write) over a tensor of `megabytes`, GB/s."""
    import torch

    from eval.runtime.linear_paths import timer

    clock = timer()
    x = torch.ones(megabytes * 2**20 // 4)
    y = torch.empty_like(x)
    best = {"sum": float("inf"), "copy": float("inf")}
    for _ in range(repeats):
        start = clock()
        x.sum()
        best["sum"] = min(best["sum"], clock() - start)
        start = clock()
        y.copy_(x)
        best["copy"] = min(best["copy"], clock() - start)
    nbytes = x.numel() * 4
    return {"read_gb_s": nbytes / best["sum"] / 1e9, "copy_gb_s": 2 * nbytes / best["copy"] / 1e9, "megabytes": megabytes}


def weight_bytes(lean) -> int:
    """Bytes one decode step streams: every linear weight once (one layout each)."""
    return sum(linear.weight_stored.numel() * linear.weight_stored.element_size()
               for linears in lean.linear_sites().values() for linear in linears)


def measure_matrix(built: dict, paths: list[str], prompt, sizes, repeats: int) -> dict:
    """Forward costs of every dtype x (forced path, default rule, chosen paths), interleaved."""
    from eval.runtime import linear_paths
    from eval.prepare import curve_variants, forward_costs, install, snapshot

    variants = curve_variants(built)
    for name, candidate in built.items():
        for path in paths:
            if linear_paths.available(path, candidate.lean.lm_head.weight_t):
                linear_paths.force_path(candidate.lean, path)
                variants[f"{name}/{path}"] = (candidate.lean, snapshot(candidate.lean))
        install(candidate.chosen or candidate.default)
    return forward_costs(variants, prompt, sizes, repeats)


def print_matrix(curves: dict, sizes) -> None:
    print(f"\nForward over N new tokens after a 100-token prefix, ms (÷ the same variant's N=1 below):")
    print(f"{'dtype/path':<20}" + "".join(f"{'N=' + str(n):>9}" for n in sizes))
    for name, row in curves.items():
        print(f"{name:<20}" + "".join(f"{1e3 * row[n]:>9.1f}" for n in sizes))
        print(f"{'':<20}" + "".join(f"{row[n] / row[1]:>9.2f}" for n in sizes))


def print_chosen(built: dict) -> None:
    for name, candidate in built.items():
        if not candidate.paths:
            continue
        report = candidate.paths
        sizes = report["sizes"]
        print(f"\nChosen paths, {name} (measured per layer role and N; {report['seconds']:.0f} s to measure):")
        print(f"{'layer':<14}" + "".join(f"{'N=' + str(n):>8}" for n in sizes))
        for site, plan in report["chosen"].items():
            print(f"{site:<14}" + "".join(f"{plan[n]:>8}" for n in sizes))
        matmul = report["matmul_ms"]
        print(f"{'matmuls, ms':<14}" + "".join(f"{matmul['chosen'][n]:>8.1f}" for n in sizes) + "  chosen")
        print(f"{'':<14}" + "".join(f"{matmul['default'][n]:>8.1f}" for n in sizes) + "  default rule")
        memory = report["memory_mb"]
        print(f"weight layouts held: {memory['held_after']:.0f} MB (one copy {memory['one_copy']:.0f} MB, budget "
              f"{memory['budget']:.0f} MB; memory shared with the transformers model not counted)")


def generate(target, runtime, prepared, prompts_count: int, new_tokens: int) -> dict:
    """Plain, the release head's EAGLE tree and transformers' generate through `eval.run.evaluate`."""
    from eval.__main__ import compose_eval, load_eval_head
    from eval.run import evaluate
    from eval.stage import eval_prompt_ids

    cfg = compose_eval(["head=release", f"runtime.num_prompts={prompts_count}"])
    head, head_config = load_eval_head("release", target)
    prompts = eval_prompt_ids(cfg.runtime, cfg.data, target.tokenizer, cfg.prompts_file)
    with tempfile.TemporaryDirectory() as out:
        report = evaluate(target, prompts, ["eagle_tree"], runtime, head=head, head_config=head_config, out_dir=out,
                          progress=False, prepared=prepared)
    plain, hf = report["baselines"]["plain"], report["baselines"]["transformers"]
    tree = report["drafters"][0]
    return {"prompts": len(prompts), "new_tokens": new_tokens,
            "plain_tokens_per_second": plain["tokens_per_second"],
            "transformers_tokens_per_second": hf["tokens_per_second"],
            "eagle_tree_tokens_per_second": tree["tokens_per_second"],
            "plain_vs_transformers": plain["tokens_per_second"] / hf["tokens_per_second"],
            "eagle_tree_vs_plain": tree["speedup_vs_plain"], "tau": tree["tau"],
            "speculated_fraction": tree["speculated_fraction"], "tree_total_tokens": tree["settings"]["total_tokens"],
            "greedy_identical": tree["greedy_identical"], "transformers_identical": hf.get("greedy_identical"),
            "verify_cost_in_plain_steps": tree.get("verify_cost_in_plain_steps")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--omp-wait", choices=["default", "passive", "active"], default="default",
                        help="OMP_WAIT_POLICY for this run (passive survives a shared machine)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto: fp32, and bf16 where the CPU has bf16 instructions (runtime.dtype)")
    parser.add_argument("--paths", default="gemv_t,linear,tall,rows,dnnl", help="paths forced in the matrix")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (minimum taken)")
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts for the tokens/s part (0: skip)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--tree-attention", action="store_true", help="GPU micro-benchmark of the Triton kernel")
    args = parser.parse_args()
    if args.omp_wait != "default":
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait.upper()
    import torch

    torch.set_num_threads(args.threads)
    if args.tree_attention:
        from eval.runtime.attention.triton_kernel import benchmark

        rows = benchmark()
        if args.json:
            json.dump(rows, open(args.json, "w"), indent=2)
        return

    from eval.__main__ import compose_eval
    from eval.runtime.linear_paths import clock_name
    from eval.prepare import build_candidates, curve_variants, finish, runtime_sizes
    from heads.target import TargetConfig, load_target

    start = time.perf_counter()
    runtime = compose_eval([f"runtime.max_new_tokens={args.new_tokens}", f"runtime.threads={args.threads}",
                            "runtime.drafters=[eagle_tree]", "runtime.tree_sweep=[]",
                            f"runtime.linear_paths_repeats={args.repeats}"]).runtime
    runtime.dtype = args.dtype
    target = load_target(TargetConfig(device="cpu"))
    clock = clock_name()
    print(f"CPU: {cpu_name()}; {args.threads} threads; {clock}; omp_wait={args.omp_wait}; torch {torch.__version__}. "
          "Figures are from this one run; the machine may be shared with other jobs.")
    memory = bandwidth()
    print(f"Read bandwidth {memory['read_gb_s']:.1f} GB/s (torch.sum over {memory['megabytes']} MB), "
          f"copy {memory['copy_gb_s']:.1f} GB/s (read + write)")

    sizes = sorted({*CURVE_SIZES, *runtime_sizes(runtime, ["eagle_tree"])})
    built, reason = build_candidates(target.model, runtime, sizes, max_seq_len=1024)
    prompt = torch.randint(0, 1000, (100,), generator=torch.Generator().manual_seed(0))
    curves = measure_matrix(built, [p for p in args.paths.split(",") if p], prompt, CURVE_SIZES, args.repeats)
    floors = {}
    for name, candidate in built.items():
        nbytes = weight_bytes(candidate.lean)
        floors[name] = {"weight_mb": nbytes / 1e6, "floor_ms": 1e3 * nbytes / (memory["read_gb_s"] * 1e9),
                        "step_ms": 1e3 * curves[f"{name}/{'chosen' if candidate.chosen else 'default'}"][1]}
    print_matrix(curves, CURVE_SIZES)
    print_chosen(built)
    print("\nWeight-streaming floor of a decode step (weights / read bandwidth) beside the measured step:")
    for name, floor in floors.items():
        print(f"  {name}: {floor['weight_mb']:.0f} MB -> floor {floor['floor_ms']:.1f} ms; measured step "
              f"{floor['step_ms']:.1f} ms ({floor['step_ms'] / floor['floor_ms']:.2f}x the floor)")
    decision_curves = {k: curves[k] for k in curve_variants(built)}
    lean, model, fields = finish(built, decision_curves, runtime, CURVE_SIZES, reason, time.perf_counter() - start)
    dtype = fields["dtype"]
    print(f"\nRuntime dtype: {dtype['chosen']} ({dtype['reason']})" + (
        f"; decode step + verification of {dtype['verify_size']} tokens: "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in dtype["decode_plus_verify_ms"].items())
        if dtype.get("decode_plus_verify_ms") else ""))
    results = {"cpu": cpu_name(), "threads": args.threads, "clock": clock, "bandwidth": memory, "floors": floors,
               "matrix_ms": {k: {n: 1e3 * t for n, t in row.items()} for k, row in curves.items()},
               "dtype": dtype, "paths": {name: c.paths for name, c in built.items()}}
    if args.prompts:
        del built
        results["generation"] = gen = generate(target, runtime, (lean, model, fields), args.prompts, args.new_tokens)
        print(f"\nTokens/s in {dtype['chosen']} on {gen['prompts']} held-out prompts, {args.new_tokens} new tokens, "
              "greedy (wall time):")
        print(f"  transformers generate {gen['transformers_tokens_per_second']:.1f}")
        print(f"  plain (lean)          {gen['plain_tokens_per_second']:.1f}  ({gen['plain_vs_transformers']:.2f}x generate)")
        print(f"  EAGLE tree (release)  {gen['eagle_tree_tokens_per_second']:.1f}  ({gen['eagle_tree_vs_plain']:.2f}x plain; "
              f"total_tokens {gen['tree_total_tokens']}, tau {gen['tau']:.2f}, speculated "
              f"{gen['speculated_fraction']:.0%}, greedy identical: {gen['greedy_identical']})")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2, default=str)


if __name__ == "__main__":
    main()
