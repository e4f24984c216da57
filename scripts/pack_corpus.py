"""Pack a corpus recipe's regenerated shards for the repository, so a fresh machine reuses them
(`data.regenerate.reuse_from`) instead of regenerating (~45 minutes on a bf16 CPU, ~75 on AVX2).

    python scripts/pack_corpus.py                       # the EAGLE-3 corpus recipe, its shards so far
    python scripts/pack_corpus.py --dtype bfloat16 --recipe eagle3_smollm2_135m_corpus \\
        --into data/corpora/sharegpt_first_exchange
    python scripts/pack_corpus.py --records 8192        # a corpus larger than the recipe asks for

Each complete shard of the recipe's output folder whose key is the one the recipe computes for the
embedded target in --dtype is gzipped (no timestamp, so the same shard packs to the same bytes)
beside its key; a shard with another key is refused. `corpus.json` names what the corpus was
made from: the target's fingerprint, the dtype, the sampling settings, the records per shard.
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="eagle3_smollm2_135m_corpus")
    parser.add_argument("--dtype", default="bfloat16", help="what the target computed the replies in")
    parser.add_argument("--records", type=int, default=None,
                        help="the records the corpus covers (default: the recipe's data.max_records); a job asking "
                             "for fewer copies the shards it needs")
    parser.add_argument("--into", default=str(ROOT / "data" / "corpora" / "sharegpt_first_exchange"))
    args = parser.parse_args()

    from eval.timing import cpu_info
    from heads.dtypes import bf16_flags
    from heads.target import TargetConfig, load_target
    from train.__main__ import compose_job
    from train.selfdistill import shard_keys, target_identity

    overrides = [f"+recipe={args.recipe}"] + ([f"data.max_records={args.records}"] if args.records else [])
    job = compose_job(overrides)
    source, into = Path(job.data.regenerate.output_dir), Path(args.into)
    target = load_target(TargetConfig(device="cpu"))
    keys = shard_keys(job, target, args.dtype)
    into.mkdir(parents=True, exist_ok=True)
    shards = []
    for name, key in keys.items():
        shard = source / name
        if not shard.is_file():
            print(f"{shard}: not made yet; the corpus stops before it")
            break
        found = (source / f"{name}.key").read_text(encoding="utf-8").strip()
        if found != key:
            sys.exit(f"{shard}.key: {found} is not the key the recipe computes for {args.dtype} replies ({key})")
        raw = shard.read_bytes()
        tmp = into / f".{name}.gz.tmp-{os.getpid()}"
        with open(tmp, "wb") as handle, gzip.GzipFile(fileobj=handle, mode="wb", mtime=0, filename="") as packed:
            packed.write(raw)
        (into / f"{name}.key").write_text(key + "\n", encoding="utf-8")
        os.replace(tmp, into / f"{name}.gz")
        shards.append({"name": name, "conversations": raw.count(b"\n"), "sha256": hashlib.sha256(raw).hexdigest()})
    config = job.data.regenerate
    manifest = {
        "recipe": args.recipe, "source": job.data.source, "records": min(len(shards) * config.shard_size, job.data.max_records or len(shards) * config.shard_size),
        "shard_size": config.shard_size, "target": target_identity(target), "dtype": args.dtype,
        "settings": {"temperature": config.temperature, "max_new_tokens": config.max_new_tokens,
                     "max_turns": config.max_turns, "max_prompt_tokens": job.data.max_length},
        "made_on": f"{cpu_info()[0]} (bf16 instructions: {', '.join(bf16_flags()) or 'none'})", "packed": datetime.date.today().isoformat(), "shards": shards}
    tmp = into / f".corpus.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, into / "corpus.json")
    kept = sum(s["conversations"] for s in shards)
    print(f"packed {len(shards)} shards ({kept} conversations) into {into}")


if __name__ == "__main__":
    main()
