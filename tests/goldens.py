"""Golden learning curves: a short, step-based run of each CPU recipe on a fixed slice of
self-distilled data, recorded in tests/assets/goldens/ and rerun by tests/train/test_goldens.py.

    python -m tests.goldens slice                  # rebuild tests/assets/goldens/selfdistill_slice.jsonl
    python -m tests.goldens record [RECIPE ...]    # run, write tests/assets/goldens/<recipe>.json
    python -m tests.goldens check [RECIPE ...]     # rerun, print the differences from the goldens
    python -m tests.goldens spread [RECIPE ...]    # rerun under VARIANTS, record the deviations in the golden

A run is the recipe as `python -m train +recipe=NAME` composes it (learning rate, schedule,
batch, head settings, loss vocabulary, feature memory), with only what makes it short and
step-based replaced (`overrides`): the slice as data, RECIPES[name] steps, no wall-clock
budget, one evaluation at the end, no W&B. The target is the embedded SmolLM2. The torch thread
count is the caller's (tests: 2 where the machine has 2 cores, tests/conftest.py; `--threads` here).

Adding a recipe: one line in RECIPES, then `python -m tests.goldens record NAME` (and `spread NAME`
to note how far it moves across thread counts and vector ISAs). Regenerate a
golden only on purpose, in the commit that changes the recipe, saying why in its message.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parent / "assets" / "goldens"
SLICE = ASSETS / "selfdistill_slice.jsonl"
SLICE_TRAIN, SLICE_HELD_OUT = 16, 8  # conversations on each side of the recipes' hash split

# recipe -> optimizer steps of its golden run (each ~20-60 s on one thread of a 2-core CPU).
RECIPES = {
    "eagle_smollm2_135m": 30,
    "eagle3_smollm2_135m": 20,
    "medusa_smollm2_135m": 10,  # a step projects 4 heads through the whole 49,152-token lm_head: ~5 s
    "peagle_smollm2_135m": 10,
    "dflash_smollm2_135m": 8,  # a step drafts 16-token blocks from every anchor: ~4 s
}
# CPU recipes without a golden yet, and why (tests/train/test_goldens.py lets no other one pass).
PENDING: dict[str, str] = {}

# What a rerun may differ by. Origin: each golden's "spread" (`spread NAME`), measured on an AMD
# EPYC (AVX-512), torch 2.13: the same run repeated is bit-identical; 2 threads instead of 1 moved
# the EAGLE loss by at most 1.3e-7 relative, AVX2 kernels instead of AVX-512 ones by 1.6e-6, and
# no held-out top-1 moved (one flipped position is 0.001 of the EAGLE golden's 1025). The limits
# sit ~600x above that, so CPUs and BLAS builds pass, while any change to the recipe's settings
# or its numerics (learning rate, schedule, loss, data order) fails: the EAGLE default's learning
# rate x0.5 moves its loss by up to 0.21 relative (step 3; held-out top-1 by 0.008), x100 by 1e5.
LOSS_RTOL = 1e-3  # per step, relative to the golden loss
TOP1_ATOL = 0.01  # held-out top-1 per draft step / head, absolute


def slice_digest(path: Path = SLICE) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def overrides(recipe: str, run_dir: Path, steps: int) -> list[str]:
    """The recipe's own settings, made short and step-based over the slice."""
    return [f"+recipe={recipe}", f"data.source={SLICE}", "data.format=jsonl", "data.regenerate.enabled=false",
            "data.max_records=null", f"data.cache_dir={run_dir / 'data_cache'}", f"trainer.output_dir={run_dir}",
            f"trainer.max_steps={steps}", "trainer.max_minutes=null", "trainer.schedule_clock=steps",
            f"trainer.eval_every={steps}", f"trainer.save_every={steps}", "trainer.eval_at_start=false",
            "trainer.log_every=1", "trainer.resume=never", "trainer.num_threads=null", "logger=none", "stages=[data,train]"]


def run_recipe(recipe: str, target, run_dir: Path, steps: int | None = None) -> dict:
    """Train the recipe's head for its golden step count; returns its curve: the training loss
    at every step and the held-out top-1 per draft step (EAGLE) or head (Medusa) at the end."""
    from data.pipeline import prepare_data
    from train.__main__ import compose_job
    from train.loop import train_heads

    steps = steps or RECIPES[recipe]
    job = compose_job(overrides(recipe, Path(run_dir), steps))
    prepared = prepare_data(job.data, target.tokenizer, run_dir)
    started = time.time()
    result = train_heads(job, target, prepared)
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    losses = [line["train/loss"] for line in lines if "train/loss" in line]
    held_out = result.final_eval
    top1_keys = sorted((k for k in held_out if k.startswith("eval/top1_")),
                       key=lambda k: int(re.search(r"(\d+)$", k).group(1)))  # step0..stepN / head0..headK
    top1 = [held_out[key] for key in top1_keys]
    return {"loss": losses, "held_out_top1": top1, "held_out_positions": int(held_out["eval/positions"]),
            "train_records": len(prepared.train), "held_out_records": len(prepared.eval),
            "seconds": round(time.time() - started, 1)}


def differences(golden: dict, fresh: dict, loss_rtol: float = LOSS_RTOL, top1_atol: float = TOP1_ATOL) -> list[str]:
    """What in `fresh` lies outside the tolerance around `golden` (empty: it matches)."""
    problems = []
    for key in ("train_records", "held_out_records", "held_out_positions"):
        if golden[key] != fresh[key]:
            problems.append(f"{key}: {fresh[key]} (golden {golden[key]}): other data than the golden's")
    if len(fresh["loss"]) != len(golden["loss"]):
        problems.append(f"{len(fresh['loss'])} logged losses, golden {len(golden['loss'])}")
    for step, (new, old) in enumerate(zip(fresh["loss"], golden["loss"]), start=1):
        if not abs(new - old) <= loss_rtol * abs(old):
            problems.append(f"loss at step {step}: {new:.5g}, golden {old:.5g} "
                            f"(relative difference {abs(new - old) / abs(old):.3g} > {loss_rtol})")
    if len(fresh["held_out_top1"]) != len(golden["held_out_top1"]):
        problems.append(f"{len(fresh['held_out_top1'])} held-out top-1 figures, golden {len(golden['held_out_top1'])}")
    for index, (new, old) in enumerate(zip(fresh["held_out_top1"], golden["held_out_top1"])):
        if not abs(new - old) <= top1_atol:
            problems.append(f"held-out top-1 [{index}]: {new:.4f}, golden {old:.4f} (|difference| > {top1_atol})")
    return problems


def deviation(golden: dict, fresh: dict) -> dict:
    """The largest per-step relative loss difference and held-out top-1 difference of `fresh`."""
    return {"loss_relative": max(abs(a - b) / abs(b) for a, b in zip(fresh["loss"], golden["loss"])),
            "top1_absolute": max(abs(a - b) for a, b in zip(fresh["held_out_top1"], golden["held_out_top1"]))}


# The variants `spread` reruns a golden under: another thread count, and AVX2 kernels in place of
# AVX-512 ones (what a CI machine without AVX-512 runs).
VARIANTS = {
    "2 threads": (["--threads", "2"], {}),
    "AVX2 kernels": (["--threads", "1"], {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                                          "ONEDNN_MAX_CPU_ISA": "AVX2"}),
}


def measure_spread(recipe: str) -> dict:
    """Rerun `recipe` in a fresh process per VARIANTS entry; the deviation of each from its golden."""
    import subprocess
    import sys

    golden, out = load_golden(recipe), {}
    for name, (arguments, env) in VARIANTS.items():
        done = subprocess.run([sys.executable, "-m", "tests.goldens", "check", recipe, *arguments],
                              env={**os.environ, **env}, capture_output=True, text=True, check=True)
        fresh = json.loads(done.stdout.strip().splitlines()[-1])
        out[name] = {key: float(f"{value:.3g}") for key, value in deviation(golden, fresh).items()}
    return out


def golden_path(recipe: str) -> Path:
    return ASSETS / f"{recipe}.json"


def load_golden(recipe: str) -> dict:
    return json.loads(golden_path(recipe).read_text())


def _write_json(path: Path, values: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(values, indent=1) + "\n")
    tmp.replace(path)


def make_slice(target, path: Path = SLICE, train: int = SLICE_TRAIN, held_out: int = SLICE_HELD_OUT) -> Path:
    """The first `train` training-side and `held_out` held-out conversations of the embedded
    ShareGPT (the recipes' hash split) whose first prompt fits, their first exchange regenerated by
    the target with the default job's settings (greedy, conf/data/sharegpt_selfdistill.yaml)."""
    import dataclasses

    from data.regenerate import hf_generate_fn, merge_shards, regenerate
    from data.sources import load_conversations
    from data.split import is_eval
    from data.template import prompt_ids
    from train.__main__ import compose_job
    from train.selfdistill import eos_ids, target_identity

    job = compose_job([])
    data = job.data
    config = dataclasses.replace(data.regenerate, shard_size=train + held_out)
    conversations, _ = load_conversations(data)
    wanted, picked = {False: train, True: held_out}, []
    for index in range(len(conversations)):
        record = conversations[index]
        side = is_eval(record["id"], data.eval_fraction, data.split_seed)
        if sum(is_eval(r["id"], data.eval_fraction, data.split_seed) == side for r in picked) >= wanted[side]:
            if len(picked) == train + held_out:
                break
            continue
        messages = record["messages"]
        first_reply = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        if len(prompt_ids(target.tokenizer, messages[:first_reply])) + config.max_new_tokens > data.max_length:
            continue
        picked.append(record)
    pad = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    with tempfile.TemporaryDirectory() as scratch:
        regenerate(picked, target.tokenizer, hf_generate_fn(target.model, pad, eos_ids(target)), scratch, config,
                   max_prompt_tokens=data.max_length, seed=job.trainer.seed, target_identity=target_identity(target))
        merged = merge_shards(scratch, len(picked), config.shard_size)
        kept = merged.read_text().splitlines()
        if len(kept) != len(picked):
            raise RuntimeError(f"regeneration kept {len(kept)} of {len(picked)} conversations")
        tmp = path.with_suffix(".jsonl.tmp")
        shutil.copyfile(merged, tmp)
        tmp.replace(path)
    return path


def cpu_name() -> str:
    from eval.timing import cpu_info

    return cpu_info()[0]


def _load_target():
    from heads.target import TargetConfig, load_target

    return load_target(TargetConfig(device="cpu"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["slice", "record", "check", "spread"])
    parser.add_argument("recipes", nargs="*", help=f"default: all of {sorted(RECIPES)}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the tests use 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = None if args.command == "spread" else _load_target()
    if args.command == "slice":
        print(f"wrote {make_slice(target)} (sha256 {slice_digest()})")
        return
    for recipe in args.recipes or sorted(RECIPES):
        if args.command == "spread":
            golden = load_golden(recipe)
            golden["spread"] = measure_spread(recipe)
            _write_json(golden_path(recipe), golden)
            print(f"{recipe}: {golden['spread']}")
            continue
        with tempfile.TemporaryDirectory() as run_dir:
            fresh = run_recipe(recipe, target, Path(run_dir))
        if args.command == "check":
            problems = differences(load_golden(recipe), fresh)
            print(f"{recipe} ({fresh['seconds']} s, {args.threads} threads): "
                  + ("matches its golden" if not problems else "\n  " + "\n  ".join(problems)))
            print(json.dumps(fresh))  # the last line: what `spread` reads
            continue
        _write_json(golden_path(recipe), {
            "recipe": recipe, "steps": RECIPES[recipe],
            "command": f"python -m tests.goldens record {recipe}",
            "settings": overrides(recipe, Path("<tmp>"), RECIPES[recipe]),
            "slice_sha256": slice_digest(), "threads": args.threads,
            "recorded_on": f"{cpu_name()}, torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()} kernels",
            **fresh})
        print(f"{recipe}: {fresh['seconds']} s, final loss {fresh['loss'][-1]:.4f}, "
              f"held-out top-1 {[round(a, 4) for a in fresh['held_out_top1']]} -> {golden_path(recipe)}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
