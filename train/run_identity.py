"""What a training run is: the data it reads, the target, the head it trains and the options that
change the weights (the tokenizer and chat template act through the rows' token ids and masks,
which the data hash covers). Every checkpoint records it, and a resume refuses a checkpoint of another run
instead of crediting new data (or another model) to old weights.

The identity is `{"id": hash, "fields": {dotted name: value}, "data": {"records", "tokens"}}`; the
fields are small values (hashes of the data and the target, head options, the data-order
settings), so a refusal names what changed. `data` is the size of the training rows, what an
export credits the head with; it is not compared (the rows' hash covers it). Not part of it: the
step budget (max_steps, max_minutes), the learning-rate schedule and the evaluation or saving
cadence; a resume may change those to train longer or otherwise.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

RUN_KEY = "run"  # the trainer_state.json entry that holds the identity


def data_fingerprint(rows) -> str:
    """Hash of the training rows in order: ids, input_ids and loss_mask (a datasets.Dataset is read
    as Arrow batches, ~0.2 s per million tokens; a list of dicts works too)."""
    digest = hashlib.sha256()
    if hasattr(rows, "with_format"):
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        for batch in rows.with_format("arrow").iter(batch_size=4096):  # pa.Table, selection applied
            digest.update("\n".join(map(str, batch.column("id").to_pylist())).encode() + b"\n")
            for name, kind in (("input_ids", pa.int32()), ("loss_mask", pa.int8())):
                for chunk in batch.column(name).chunks:
                    digest.update(np.asarray(chunk.value_lengths()).astype(np.int64).tobytes())
                    digest.update(np.asarray(pc.cast(chunk.flatten(), kind)).tobytes())
    else:
        for row in rows:
            digest.update(json.dumps([str(row["id"]), list(map(int, row["input_ids"])),
                                      list(map(int, row["loss_mask"]))]).encode())
    return digest.hexdigest()[:16]


def data_size(rows) -> dict:
    """{"records", "tokens"} of the training rows (a datasets.Dataset with a `length` column, or
    dicts with input_ids)."""
    if hasattr(rows, "column_names") and "length" in rows.column_names:
        tokens = sum(rows["length"])
    else:
        tokens = sum(len(row["input_ids"]) for row in rows)
    return {"records": len(rows), "tokens": int(tokens)}


def _head_options(heads) -> dict:
    """heads.* of the trained type, flattened (other types' options and eval-only settings left out)."""
    values = dataclasses.asdict(heads)
    fields = {}
    for key, value in values.items():
        if isinstance(value, dict):
            if key == heads.type:
                fields.update({f"heads.{key}.{name}": item for name, item in value.items() if name != "eval_steps"})
        else:
            fields[f"heads.{key}"] = value
    return fields


def run_identity(job, target, rows, world_size: int = 1) -> dict:
    """The identity of training `job` on `rows` (the training rows) against `target` in
    `world_size` processes (the global batch counts, not how it is split: a resume may change the
    process count)."""
    t = job.trainer
    fields = {
        "data.train_rows": data_fingerprint(rows),
        "model.fingerprint": target.fingerprint()["id"],
        **_head_options(job.heads),
        "trainer.seed": t.seed, "trainer.batch_size x processes": t.batch_size * world_size,
        "trainer.grad_accumulation": t.grad_accumulation,
        "trainer.init_from": t.init_from,
    }
    text = json.dumps(fields, sort_keys=True, default=str)
    return {"id": hashlib.sha256(text.encode()).hexdigest()[:16], "fields": fields, "data": data_size(rows)}


def identity_differences(saved: dict, current: dict) -> list[str]:
    """`field: checkpoint X vs this run Y` for every field that differs."""
    ours, theirs = current.get("fields", {}), saved.get("fields", {})
    return [f"{key}: checkpoint {theirs.get(key)!r} vs this run {ours.get(key)!r}"
            for key in sorted(set(ours) | set(theirs)) if ours.get(key) != theirs.get(key)]
