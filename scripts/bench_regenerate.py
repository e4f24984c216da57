"""Self-distillation benchmark: new tokens per second of each regenerator on the same first-exchange
prompts of ShareGPT, in one run (variants interleaved, so rows of one run compare on a shared
machine):

  - `hf`: transformers' batched `generate` (left-padded static batches of --batch-size, prompts
    sorted by length, as data/regenerate.py sends them);
  - `lean`: the runtime's batched decoder over the lean forward with continuous batching (a finished
    reply's slot takes the next prompt at once), the regenerator `data.regenerate.generator=lean`
    uses.

Each in every dtype the machine offers (fp32; bf16 where asked or the CPU has bf16 instructions).
Greedy replies are compared between regenerators of one dtype (first differing token reported: on
a CPU both are the target's greedy replies up to float rounding).

    python scripts/bench_regenerate.py --prompts 48 --batch-size 48 --new-tokens 96 [--bf16] [--json F]
"""
from __future__ import annotations

import argparse
import json
import time


def first_prompts(target, count: int, max_length: int, new_tokens: int) -> list[list[int]]:
    """Prompt ids of the first exchanges of the first ShareGPT conversations that fit."""
    from data.config import DataConfig
    from data.sources import load_conversations
    from data.template import TemplateMismatch, prompt_ids

    conversations, _ = load_conversations(DataConfig())
    prompts = []
    for record in conversations:
        messages = record["messages"]
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if not first:
            continue
        try:
            ids = prompt_ids(target.tokenizer, messages[:first])
        except TemplateMismatch:
            continue
        if ids and len(ids) + new_tokens <= max_length:
            prompts.append(ids)
        if len(prompts) == count:
            break
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--bf16", action="store_true", help="measure bf16 even without bf16 instructions")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    from data.regenerate import hf_generate_fn
    from heads.dtypes import bf16_flags
    from heads.target import TargetConfig, load_target
    from train.pipeline import lean_generate_fn
    from train.selfdistill import eos_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    from eval.timing import cpu_info  # noqa: E402

    target = load_target(TargetConfig())
    prompts = first_prompts(target, args.prompts, args.max_length, args.new_tokens)
    prompts.sort(key=len)
    dtypes = [torch.float32] + ([torch.bfloat16] if args.bf16 or bf16_flags() else [])
    pad = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    rows, replies = [], {}
    for dtype in dtypes:
        target.model.to(dtype)
        makers = {"hf": lambda: hf_generate_fn(target.model, pad, eos_ids(target)),
                  "lean": lambda: lean_generate_fn(target, args.max_length + args.new_tokens, seed=0,
                                                   batch_size=args.batch_size)}
        for name, make in makers.items():
            generate = make()
            start = time.perf_counter()
            out = []
            if name == "hf":
                for i in range(0, len(prompts), args.batch_size):
                    out += generate(prompts[i:i + args.batch_size], args.new_tokens, 0.0)
            else:
                out = generate(prompts, args.new_tokens, 0.0)
            seconds = time.perf_counter() - start
            tokens = sum(len(r) for r in out)
            replies[(name, dtype)] = out
            rows.append({"generator": name, "dtype": str(dtype).removeprefix("torch."), "seconds": seconds,
                         "new_tokens": tokens, "tokens_per_s": tokens / seconds})
            print(f"{name:5s} {rows[-1]['dtype']:9s} {tokens:6d} tokens in {seconds:7.1f} s: "
                  f"{tokens / seconds:7.1f} tokens/s", flush=True)
    for dtype in dtypes:
        a, b = replies[("hf", dtype)], replies[("lean", dtype)]
        same = sum(x == y for x, y in zip(a, b))
        print(f"{str(dtype).removeprefix('torch.')}: {same} of {len(a)} greedy replies identical between hf and lean")
    base = {r["dtype"]: r["tokens_per_s"] for r in rows if r["generator"] == "hf"}
    for r in rows:
        r["vs_hf_same_dtype"] = r["tokens_per_s"] / base[r["dtype"]]
    summary = {"cpu": cpu_info()[0], "threads": torch.get_num_threads(), "prompts": len(prompts),
               "batch_size": args.batch_size, "new_tokens": args.new_tokens, "rows": rows}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
