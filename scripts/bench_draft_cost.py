"""What one speculative step's drafting costs for each head kind, in one run, on the same prompts
and the same lean target: the draft cost per step (propose + accept, ms), the verification beside it,
and that draft cost in EAGLE head forwards (the EAGLE-1/2 head drafting a chain of one token: one
head forward over the new token, and the accept step's refresh of the head over what was accepted).

    .venv/bin/python scripts/bench_draft_cost.py --head runs/kinds/eagle_smollm2_135m/export/native \
        --head runs/kinds/dflash_smollm2_135m/export/native [--prompts 4] [--tokens 48] [--threads 2] \
        [--head-dtype float32 --head-dtype runtime] [--tree-tokens 6 --tree-tokens 12] [--json FILE]

Each head runs its kind's chain drafter (`eagle_chain` at runtime.chain_depth, `peagle_chain`,
`dflash_chain`), `peagle_tree` and `medusa` where the head is of that kind, with the fallback gate
off so every step drafts; the EAGLE heads also run `eagle_chain` at depth 1, the unit the draft costs
are counted in. Prompts are the held-out prompts of the default data (as scripts/bench_engine.py
takes them); greedy output is checked against plain decoding. `--head-dtype runtime` runs
the heads in the target's dtype (`runtime.head_dtype`); given twice, both, each counted in the
EAGLE head forward of its own dtype. Prompt by prompt, plain decoding and
every drafter run in turn, so a drift in the machine's speed reaches all of them alike. Each time is
the median step (the mean beside it in --json). Rows of one run compare; on a machine
shared with another job no figure does (docs/performance.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TREE_TOKENS = 8  # default size of the EAGLE and P-EAGLE trees (root included); --tree-tokens adds sizes
KIND_DRAFTERS = ("eagle_chain", "eagle_tree", "peagle_chain", "peagle_tree", "dflash_chain", "medusa")


def unit_key(drafter: str) -> str:
    """The head-dtype part of a drafter label ("/bfloat16" in "peagle_tree/bfloat16"; "" for fp32
    heads): the key of the one-token EAGLE chain its draft cost is counted in."""
    return drafter[drafter.index("/"):] if "/" in drafter else ""


def _mean_ms(values: list[float]) -> float:
    return 1000.0 * sum(values) / max(len(values), 1)


def _median_ms(values: list[float]) -> float:
    return 1000.0 * statistics.median(values) if values else 0.0


def summarize(results, reference, plain_ms: float) -> dict:
    """One drafter's results over the prompts: per speculative step its draft and verify time (the
    median step, which a burst of another tenant's load on a shared host does not move; the mean
    beside it), τ, and whether the output equals plain greedy decoding."""
    draft = [t for r in results for t in r.draft_times]
    verify = [t for r in results for t in r.verify_times]
    accepted = [a for r in results for a in r.accepted]
    return {"steps": len(accepted), "tau": sum(a + 1 for a in accepted) / max(len(accepted), 1),
            "draft_ms_per_step": _median_ms(draft), "verify_ms_per_step": _median_ms(verify),
            "draft_ms_mean": _mean_ms(draft), "verify_ms_mean": _mean_ms(verify),
            "mean_tree_size": sum(s for r in results for s in r.tree_sizes) / max(len(accepted), 1),
            "greedy_identical": [r.tokens for r in results] == reference,
            # what the median step gives: τ tokens for one draft and one verification, against plain steps
            "speedup_est": (sum(a + 1 for a in accepted) / max(len(accepted), 1)) * plain_ms
            / max(_median_ms(draft) + _median_ms(verify), 1e-9)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", action="append", type=Path, required=True, help="head or export folder (repeat)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--linear-paths", default="auto",
                        help="runtime.linear_paths: auto (measured per role and row count, as the CPU eval runs; "
                             "the heads follow the target's), default, or a path name")
    parser.add_argument("--head-dtype", action="append", choices=["float32", "runtime"],
                        help="the heads' dtype: float32 (as trained), runtime (the target's); repeat to run both "
                             "(default float32)")
    parser.add_argument("--tree-tokens", action="append", type=int,
                        help=f"tree sizes (root included) for eagle_tree and peagle_tree; repeat (default {TREE_TOKENS})")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch

    from data.config import DataConfig
    from eval.config import RuntimeConfig
    from eval.prepare import dtype_name, head_in_dtype, prepare_target, runtime_sizes
    from eval.run import build_methods, summarize as eval_summary
    from eval.runtime.drafters.kinds import drafters_for
    from eval.runtime.generate import plain_generate, speculative_generate
    from eval.runtime.sampling import SamplingConfig
    from eval.stage import eval_prompt_ids, load_eval_head
    from eval.timing import cpu_hardware
    from heads.target import TargetConfig, load_target

    torch.set_num_threads(args.threads)
    runtime = RuntimeConfig(max_new_tokens=args.tokens, num_prompts=args.prompts, dtype=args.dtype,
                            linear_paths=args.linear_paths,
                            threads=args.threads, fallback=False, compare_transformers=False,
                            tree_total_tokens=TREE_TOKENS, tree_sweep=[], peagle_tree_tokens=TREE_TOKENS)
    target = load_target(TargetConfig(device="cpu"))
    prompts = [torch.tensor(p) for p in eval_prompt_ids(runtime, DataConfig(), target.tokenizer)]
    eos = [target.tokenizer.eos_token_id]
    sampling = SamplingConfig(0.0)
    max_len = max(len(p) for p in prompts) + args.tokens + 80
    lean, _, setup = prepare_target(target.model, runtime,
                                    sorted({*runtime_sizes(runtime, KIND_DRAFTERS), 16, *(args.tree_tokens or [])}),
                                    prompts[0], max_len)
    plain_generate(lean, prompts[0][:8], 4, sampling, eos)  # first-call overheads
    entries = []  # (folder, head type, label, drafter)
    for folder, head_dtype in [(f, d) for f in args.head for d in (args.head_dtype or ["float32"])]:
        head, _ = load_eval_head(folder, target)
        head = head.to(lean.output_device)
        if head_dtype == "runtime":
            head = head_in_dtype(head, lean.embedding.dtype)
        weights = next(head.parameters()).dtype
        suffix = "" if weights == torch.float32 else "/" + dtype_name(weights)
        names = [n for n in KIND_DRAFTERS if n in drafters_for(head)]
        sizes = args.tree_tokens or [TREE_TOKENS]
        runs = [(runtime, n, n) for n in names if not n.endswith("_tree")]
        runs += [(dataclasses.replace(runtime, tree_total_tokens=size, peagle_tree_tokens=size), n, f"{n}@{size}")
                 for n in names if n.endswith("_tree") for size in sizes]
        if "eagle_chain" in names:
            runs.append((dataclasses.replace(runtime, chain_depth=1), "eagle_chain", "eagle_chain@1"))
        for settings, name, label in runs:
            methods, _ = build_methods([name], settings, lean, head, prompts, eos)
            entries.append((folder, type(head).__name__, label + suffix, methods[-1].build()))
    # Prompt by prompt, plain decoding and then every drafter in turn: a host whose speed drifts
    # during the run moves every drafter's steps alike instead of the heads measured last.
    plain, results = [], [[] for _ in entries]
    for prompt in prompts:
        plain.append(plain_generate(lean, prompt, args.tokens, sampling, eos))
        for index, (_, _, _, drafter) in enumerate(entries):
            results[index].append(speculative_generate(lean, drafter, prompt, args.tokens, sampling, eos))
    reference = [r.tokens for r in plain]
    plain_ms = 1000.0 * statistics.median(r.decode_time / max(len(r.tokens) - 1, 1) for r in plain)  # median prompt
    plain_rate = eval_summary(plain, None)["tokens_per_second"]
    rows = []
    for (folder, head_type, label, drafter), done in zip(entries, results):
        row = {**summarize(done, reference, plain_ms),  # decode tokens/s against plain's, as the eval stage counts them
               "speedup": eval_summary(done, None)["tokens_per_second"] / plain_rate}
        rows.append({"head": str(folder), "head_type": head_type, "drafter": label, **row,
                     "followed_paths": getattr(drafter, "linear_paths", None)})
        print(f"{folder}  {label:14s} draft {row['draft_ms_per_step']:6.1f} ms  verify "
              f"{row['verify_ms_per_step']:6.1f} ms  tau {row['tau']:.2f}  {row['speedup']:.2f}x (est {row['speedup_est']:.2f}x)  tree {row['mean_tree_size']:.1f}  "
              f"greedy identical {row['greedy_identical']}", flush=True)
    # the unit: the EAGLE-1/2 head's one-token chain with the heads in the same dtype
    units = {unit_key(r["drafter"]): r["draft_ms_per_step"] for r in rows
             if r["drafter"].startswith("eagle_chain@1") and r["head_type"] == "EagleHead"}
    unit = units.get("")
    hardware, dtype = cpu_hardware(), setup.get("dtype", {}).get("chosen", args.dtype)
    lines = [f"Draft cost per speculative step, {len(prompts)} held-out prompts x {args.tokens} tokens, greedy, "
             f"{dtype}, linear paths {args.linear_paths}, {hardware}; median step of each drafter; plain decode step "
             f"{plain_ms:.1f} ms (median prompt).", "",
             "| head | drafter | draft ms/step | in EAGLE head forwards | verify ms/step | tree size | τ | vs plain "
             "(median step) | vs plain (tokens/s) | greedy identical |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        own = units.get(unit_key(row["drafter"]))
        forwards = "–" if own is None else f"{row['draft_ms_per_step'] / own:.2f}"
        lines.append(f"| {row['head_type']} | {row['drafter']} | {row['draft_ms_per_step']:.1f} | {forwards} | "
                     f"{row['verify_ms_per_step']:.1f} | {row['mean_tree_size']:.1f} | {row['tau']:.2f} | "
                     f"{row['speedup_est']:.2f}x | {row['speedup']:.2f}x | {row['greedy_identical']} |")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"hardware": hardware, "dtype": dtype, "linear_paths": args.linear_paths,
                                         "plain_ms_per_step": plain_ms,
                                         "eagle_head_forward_ms": unit,
                                         "eagle_head_forward_ms_by_head_dtype": units, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
