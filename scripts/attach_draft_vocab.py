"""Give a head saved without a draft vocabulary the one its training job counts, in a new export folder.

    python scripts/attach_draft_vocab.py HEAD_DIR OUT_DIR [key=value ...]

Heads trained since the draft vocabulary became part of the head carry it (EAGLE-1/2 and Medusa: a
`draft_vocab` id list; EAGLE-3: d2t/t2d); one saved before drafts over the full vocabulary, which
costs its lm_head ~6x more per drafted token at the same acceptance. This script recounts the
vocabulary the way training counts it (train/loop.py): `heads.draft_vocab_size` ids, the most
frequent tokens at the loss positions of the training split of the job composed from the recipe the
head's manifest names (`training.recipe`) plus the given overrides (e.g. the data settings of the
command that trained it). The job's data stage runs: self-distilled replies are regenerated unless
their shards already exist under `data.regenerate.output_dir`.

The weights are unchanged. The new folder has the head's format and dtype, and its manifest keeps
the training, eval and runtime records, with a note saying where the vocabulary came from. OUT_DIR
must not exist (nothing is replaced).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def count_vocab(recipe: str, overrides: list[str]):
    """(sorted draft ids, the composed job, the loaded target) for `recipe` + `overrides`."""
    from data.pipeline import prepare_data
    from train.__main__ import compose_job
    from train.objectives import frequent_reply_tokens
    from train.pipeline import load_job_target, on_regenerated_data

    job = compose_job([f"+recipe={recipe}", *overrides])
    target = load_job_target(job)
    if job.data.regenerate.enabled:
        job = on_regenerated_data(job, target)[0]
    prepared = prepare_data(job.data, target.tokenizer)
    return frequent_reply_tokens(prepared.train, job.heads.draft_vocab_size, target.vocab_size), job, target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("head", type=Path, help="export folder or checkpoint of a head without a draft vocabulary")
    parser.add_argument("out", type=Path, help="new export folder (must not exist)")
    parser.add_argument("overrides", nargs="*", help="overrides added to the manifest's recipe (key=value)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from export import export_head, load_export
    from export.manifest import runtime_from_manifest
    from heads.vocab import draft_ids, set_draft_vocab

    if args.out.exists():
        raise SystemExit(f"{args.out} exists; give a new folder")
    head, config, manifest = load_export(args.head, None, dtype="float32")
    if draft_ids(head) is not None:
        raise SystemExit(f"{args.head}: the head already carries a {len(draft_ids(head))}-id draft vocabulary")
    recipe = (manifest.get("training") or {}).get("recipe")
    if not recipe:
        raise SystemExit(f"{args.head}: its manifest names no training recipe (training.recipe)")
    vocab, job, target = count_vocab(recipe, args.overrides)
    set_draft_vocab(head, vocab)
    note = (f"draft vocabulary ({len(vocab)} ids) attached after training by scripts/attach_draft_vocab.py: "
            f"counted at the loss positions of the training split of +recipe={recipe} "
            f"{' '.join(args.overrides)}".rstrip() + " (the replies regenerated again)")
    extra = {key: manifest[key] for key in ("training", "eval") if isinstance(manifest.get(key), dict)}
    extra["notes"] = [note]
    runtime = runtime_from_manifest(manifest.get("runtime"))
    if runtime is not None:
        extra["runtime"] = runtime
    out = export_head(head, config, manifest["format"], args.out, target, manifest["dtype"], extra)
    print(json.dumps({"out": str(out), "draft_vocab_size": len(vocab), "job_data": job.data.source}))


if __name__ == "__main__":
    main()
