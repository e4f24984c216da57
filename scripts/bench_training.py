"""Training-throughput benchmark: tokens/s of the frozen target's forward alone vs full training
steps (target forward + head + loss + backward + AdamW) for each head type, on the same batches.

    python scripts/bench_training.py                 # embedded SmolLM2 + ShareGPT, fp32 CPU
    python scripts/bench_training.py --tiny          # tiny random model, seconds (smoke test)

Variants run interleaved round by round (target, eagle, medusa, target, ...) so a shared machine's
load drifts over all of them alike; the ratio training / target-forward is the heads' overhead.
`--bf16` adds the target's forward and an EAGLE step with the frozen target in bf16 (the feature
pass the dtype rule picks on a CPU with bf16 instructions; the head keeps fp32 weights), so the
feature pass's speed in each dtype compares within one run. `--head-bf16` adds EAGLE-3 training
steps on features computed once (by the bf16 target, as memoised after a first epoch) with the
head's matmuls in fp32 and under bf16 autocast (fp32 master weights; `trainer.mixed_precision`'s
choice on a CPU whose target computes in bf16), the step cost once the feature pass is paid.
Not a timed test: absolute numbers depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.runtime.clock import device_clock  # noqa: E402
from heads.config import EagleOptions, MedusaOptions  # noqa: E402
from heads.eagle import EagleConfig, init_from_target as init_eagle  # noqa: E402
from heads.io import build_head  # noqa: E402
from heads.medusa import MedusaConfig, init_from_target as init_medusa  # noqa: E402
from train.objectives import FrozenParts, OnlineFeatures, eagle_step, medusa_step  # noqa: E402


def load(args):
    from data.collate import collate

    if args.tiny:
        from tests.tiny import tiny_target

        target = tiny_target()
        g = torch.Generator().manual_seed(0)
        rows = [{"input_ids": torch.randint(3, 128, (args.length,), generator=g).tolist(),
                 "loss_mask": [0] * 8 + [1] * (args.length - 8)} for _ in range(args.batches * args.batch_size)]
    else:
        from data.config import DataConfig
        from data.pipeline import prepare_data
        from heads.target import TargetConfig, load_target

        target = load_target(TargetConfig(device="cpu"))
        data = prepare_data(DataConfig(max_records=args.batches * args.batch_size * 4, max_eval_records=1,
                                       max_length=args.length), target.tokenizer)
        rows = sorted(data.train, key=lambda row: -row["length"])[: args.batches * args.batch_size]
    batches = [collate(rows[i:i + args.batch_size], 0) for i in range(0, len(rows), args.batch_size)]
    return target, batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random model instead of SmolLM2")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--length", type=int, default=512, help="max tokens per row")
    parser.add_argument("--batches", type=int, default=3, help="distinct batches per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--bf16", action="store_true", help="add the bf16 feature pass (forward and EAGLE step)")
    parser.add_argument("--head-bf16", action="store_true",
                        help="add EAGLE-3 steps on precomputed features, fp32 and bf16-autocast matmuls")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, batches = load(args)
    source, parts = OnlineFeatures(target), FrozenParts.from_target(target)
    eagle = init_eagle(build_head(EagleConfig.from_target(target)), target)
    medusa = init_medusa(build_head(MedusaConfig.from_target(target)), target)
    variants = {
        "target forward": None,
        "eagle train step": (eagle, eagle_step, EagleOptions()),
        "medusa train step": (medusa, medusa_step, MedusaOptions()),
    }
    sources = dict.fromkeys(variants, source)
    if args.bf16:
        import copy

        low = copy.deepcopy(target)
        low.model.to(torch.bfloat16)
        bf16_source = OnlineFeatures(low, dtype=torch.float32)  # the head reads fp32 features, as in training
        bf16_eagle = init_eagle(build_head(EagleConfig.from_target(target)), target)
        variants.update({"target forward bf16": None, "eagle step bf16": (bf16_eagle, eagle_step, EagleOptions())})
        sources.update({"target forward bf16": bf16_source, "eagle step bf16": bf16_source})
    autocast = dict.fromkeys(variants, False)
    if args.head_bf16:
        import copy

        from heads.config import Eagle3Options
        from train.kinds import Eagle3Kind
        from train.objectives import frequent_reply_tokens

        kind = Eagle3Kind(Eagle3Options(aux_layer_ids=[0, 1, 1] if args.tiny else None))  # the tiny target: 2 layers
        low = copy.deepcopy(target)
        low.model.to(torch.bfloat16)
        online = OnlineFeatures(low, kind.feature_layers(target.num_layers), dtype=torch.float32)
        computed = {id(batch): online(batch) for batch in batches}  # paid once, as after a first epoch
        vocab = frequent_reply_tokens([{"input_ids": b["input_ids"][i].tolist(), "loss_mask": b["loss_mask"][i].tolist()}
                                       for b in batches for i in range(b["input_ids"].shape[0])], 8192, target.vocab_size)
        eagle3_step = lambda head, parts_, batch, features, options, chunk: kind.step(  # noqa: E731
            head, parts_, batch, features, chunk)
        for name, low_matmuls in (("eagle3 step", False), ("eagle3 step bf16 autocast", True)):
            torch.manual_seed(0)
            variants[name] = (kind.build(target, vocab)[0], eagle3_step, None)
            sources[name] = lambda batch: computed[id(batch)]
            autocast[name] = low_matmuls
    optimizers = {name: torch.optim.AdamW(v[0].parameters(), lr=1e-4) for name, v in variants.items() if v}
    clock = device_clock(target.device)  # CUDA: synchronised readings
    seconds = dict.fromkeys(variants, 0.0)
    tokens = dict.fromkeys(variants, 0)
    for round_index in range(args.rounds + 1):  # round 0 warms up and is not counted
        for name, variant in variants.items():
            started = clock()
            for batch in batches:
                features = sources[name](batch)
                if variant is not None:
                    head, step, options = variant
                    with torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=autocast[name]):
                        loss = step(head, parts, batch, features, options, args.chunk_size)["loss"]
                    loss.backward()
                    optimizers[name].step()
                    optimizers[name].zero_grad(set_to_none=True)
                if round_index:
                    tokens[name] += int(batch["attention_mask"].sum())
            if round_index:
                seconds[name] += clock() - started
    print(f"threads={torch.get_num_threads()} batch_size={args.batch_size} length<={args.length} "
          f"batches={len(batches)} rounds={args.rounds} (shared machines: compare within one run)")
    base = tokens["target forward"] / seconds["target forward"]
    for name in variants:
        rate = tokens[name] / seconds[name]
        print(f"{name:>19}: {rate:8.1f} tokens/s   cost vs target forward {base / rate:5.2f}x")


if __name__ == "__main__":
    main()
