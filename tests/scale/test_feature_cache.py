"""Offline feature cache: shards, atomic resume, disk refusal, reader, and online == offline training."""
import json
import os

import pytest
import torch

from data.feature_cache import (
    CacheSpaceError, FeatureCache, check_disk, estimate_cache_bytes, shard_name, write_feature_cache, write_index,
)
from tests.tiny import tiny_target
from tests.train.loop_fixtures import tiny_data, tiny_job, tiny_rows


def _rows(n=10, seed=0):
    return list(tiny_rows(n, seed))


def test_estimate_is_tokens_times_hidden_times_layers_times_bytes():
    assert estimate_cache_bytes(1000, 64, 2, "bfloat16") == 1000 * (64 * 2 * 2 + 5)
    assert estimate_cache_bytes(1000, 64, 1, "float32") == 1000 * (64 * 4 + 5)


def test_disk_refusal_names_the_sizes(tmp_path):
    with pytest.raises(CacheSpaceError, match="GB free"):
        check_disk(tmp_path / "not" / "yet", 10**18)
    check_disk(tmp_path, 1)


def test_cache_round_trip_matches_the_target(tmp_path):
    target, rows = tiny_target(), _rows(10)
    write_feature_cache(tmp_path, target, rows, layers=(1, -1), dtype="float32", shard_records=4,
                        batch_size=3, progress=False)
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == [shard_name(i) for i in range(3)]
    write_index(tmp_path)
    cache = FeatureCache(tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    assert len(cache) == 10 and index["num_tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert index["layers"] == [1, -1] and index["dtype"] == "float32"
    row = rows[7]
    record = cache.by_id(row["id"])
    ids = torch.tensor([row["input_ids"]])
    expected = target.features(ids, layers=(1, -1))
    assert record["input_ids"].tolist() == row["input_ids"] and record["loss_mask"].tolist() == row["loss_mask"]
    torch.testing.assert_close(record["hidden"][-1], expected.hidden[target.num_layers][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(record["hidden"][1], expected.hidden[1][0], rtol=1e-5, atol=1e-5)
    assert set(record) == {"id", "input_ids", "loss_mask", "hidden"}


def test_progress_counts_records_per_batch(tmp_path, monkeypatch):
    import tqdm.auto

    bars = []

    class Bar:
        def __init__(self, total, **options):
            self.total, self.updates = total, []
            bars.append(self)

        def update(self, n):
            self.updates.append(n)

        def close(self):
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    write_feature_cache(tmp_path, tiny_target(), _rows(10), dtype="float32", shard_records=4, batch_size=3)
    (bar,) = bars
    assert bar.total == 10 and bar.updates == [3, 1, 3, 1, 2]  # shards of 4, 4, 2 records in batches of 3


def test_a_truncated_shard_is_not_counted_as_done(tmp_path, caplog):
    import logging

    target, rows = tiny_target(), _rows(6)
    kwargs = dict(dtype="float32", shard_records=2, progress=False)
    write_feature_cache(tmp_path, target, rows, **kwargs)
    shard = tmp_path / shard_name(1)
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) - 100])  # a copy or a disk that lost the tail
    with pytest.raises(ValueError, match=rf"{shard_name(1)}: \d+ bytes, its header describes \d+"):
        write_index(tmp_path)
    with caplog.at_level(logging.WARNING):
        again = write_feature_cache(tmp_path, target, rows, **kwargs)
    assert again["written"] == [1] and f"{shard}: " in caplog.text
    assert shard.read_bytes() == whole
    write_index(tmp_path)
    shard.write_bytes(whole[:5])  # cut after the index was written
    with pytest.raises(ValueError, match=rf"{shard_name(1)}: 5, index.json recorded {len(whole)} bytes"):
        FeatureCache(tmp_path)


def test_bf16_cache_is_half_the_size(tmp_path):
    target, rows = tiny_target(), _rows(6)
    for dtype in ("bfloat16", "float32"):
        write_feature_cache(tmp_path / dtype, target, rows, dtype=dtype, shard_records=8, progress=False)
    size = lambda d: os.path.getsize(tmp_path / d / shard_name(0))  # noqa: E731
    assert size("bfloat16") < 0.6 * size("float32")
    assert FeatureCache(write_index(tmp_path / "bfloat16"))[0]["hidden"][-1].dtype == torch.bfloat16


def test_ranks_write_disjoint_shards_and_a_rerun_resumes_at_the_missing_one(tmp_path):
    target, rows = tiny_target(), _rows(10)
    kwargs = dict(dtype="float32", shard_records=2, progress=False)
    first = write_feature_cache(tmp_path, target, rows, rank=0, world_size=2, **kwargs)
    second = write_feature_cache(tmp_path, target, rows, rank=1, world_size=2, **kwargs)
    assert first["written"] == [0, 2, 4] and second["written"] == [1, 3]
    before = (tmp_path / shard_name(1)).stat().st_mtime_ns
    (tmp_path / shard_name(3)).unlink()  # an interrupted run: shard 3 never renamed into place
    (tmp_path / f".{shard_name(3)}.tmp-999").write_bytes(b"partial")
    with pytest.raises(FileNotFoundError, match=shard_name(3)):
        write_index(tmp_path)
    again = write_feature_cache(tmp_path, target, rows, rank=1, world_size=2, **kwargs)
    assert again["written"] == [3] and again["skipped"] == [1]
    assert (tmp_path / shard_name(1)).stat().st_mtime_ns == before
    assert len(FeatureCache(write_index(tmp_path))) == 10


def test_a_different_spec_is_refused(tmp_path):
    target, rows = tiny_target(), _rows(4)
    write_feature_cache(tmp_path, target, rows, dtype="float32", progress=False)
    with pytest.raises(ValueError, match="dtype"):
        write_feature_cache(tmp_path, target, rows, dtype="bfloat16", progress=False)


def test_unfinished_cache_cannot_be_read(tmp_path):
    with pytest.raises(FileNotFoundError, match="index.json"):
        FeatureCache(tmp_path)


def _loss_curve(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line["train/loss"] for line in lines if "train/loss" in line]


@pytest.mark.parametrize("kind,dtype,rel", [("eagle", "float32", 1e-4), ("medusa", "float32", 1e-4),
                                            ("eagle", "bfloat16", 5e-3), ("eagle3", "float32", 1e-4)])
def test_offline_training_matches_online(tmp_path, kind, dtype, rel):
    """float32 cache: equal up to batch-shape rounding (~1e-6); bf16 cache: measured 2.6e-4.
    EAGLE-3's cache holds its aux layers and the final state."""
    from train.kinds import head_kind
    from train.loop import train_heads
    from train.offline import OfflineFeatures

    target, data = tiny_target(), tiny_data(train=16, held_out=4)
    online = tiny_job(tmp_path / "online", kind, max_steps=4, eval_every=4, save_every=4)
    offline = tiny_job(tmp_path / "offline", kind, max_steps=4, eval_every=4, save_every=4)
    layers = head_kind(online.heads).feature_layers(target.num_layers)
    cache_dir = tmp_path / "features"
    write_feature_cache(cache_dir, target, list(data.train) + list(data.eval), layers=layers, dtype=dtype,
                        shard_records=8, batch_size=5, progress=False)
    source = OfflineFeatures(FeatureCache(write_index(cache_dir)), layers)
    train_heads(online, target, data)
    train_heads(offline, target, data, source=source)
    assert _loss_curve(tmp_path / "offline") == pytest.approx(_loss_curve(tmp_path / "online"), rel=rel)


def test_offline_source_refuses_a_stale_cache(tmp_path):
    from train.offline import OfflineFeatures

    target, rows = tiny_target(), _rows(2)
    write_feature_cache(tmp_path, target, rows, dtype="float32", progress=False)
    source = OfflineFeatures(FeatureCache(write_index(tmp_path)))
    ids = torch.tensor([rows[0]["input_ids"]]) + 1
    with pytest.raises(ValueError, match="other tokens"):
        source({"input_ids": ids, "ids": [rows[0]["id"]]})


def test_an_aux_layer_cache_serves_what_the_target_gives_online(tmp_path):
    """EAGLE-3 reads several streams plus the final state, concatenated in the order asked for; a
    stream asked for twice (small targets' default ids repeat) is stored once and served twice."""
    from train.objectives import MemoizedFeatures, OnlineFeatures
    from train.offline import OfflineFeatures

    target, rows = tiny_target(num_hidden_layers=4), _rows(5)
    layers = [2, 0, 3, 2, -1]
    write_feature_cache(tmp_path, target, rows, layers=layers, dtype="float32", shard_records=2, progress=False)
    cache = FeatureCache(write_index(tmp_path))
    assert cache.layers == [2, 0, 3, -1]
    picked = [rows[3], rows[1]]
    T = max(len(r["input_ids"]) for r in picked)
    batch = {"input_ids": torch.zeros(2, T, dtype=torch.long), "attention_mask": torch.zeros(2, T, dtype=torch.long),
             "ids": [r["id"] for r in picked]}
    for b, r in enumerate(picked):
        batch["input_ids"][b, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        batch["attention_mask"][b, :len(r["input_ids"])] = 1
    online = OnlineFeatures(target, layers)(batch)
    offline = OfflineFeatures(cache, layers)(batch)
    assert online.shape == offline.shape == (2, T, 5 * 64)
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(offline[valid], online[valid], rtol=1e-5, atol=1e-5)
    single = target.features(batch["input_ids"][:1], layers=(0,)).hidden[0]
    torch.testing.assert_close(offline[0, :len(picked[0]["input_ids"]), 64:128],
                               single[0, :len(picked[0]["input_ids"])], rtol=1e-5, atol=1e-5)
    memo = MemoizedFeatures(OfflineFeatures(cache, layers), max_megabytes=1)
    memo(batch)
    torch.testing.assert_close(memo(batch)[valid], offline[valid])  # the second call is served from memory
    assert set(memo.rows) == set(batch["ids"])
    with pytest.raises(ValueError, match=r"not \[1\]"):
        OfflineFeatures(cache, [1, -1])
    with pytest.raises(ValueError, match="layers"):  # a cache of other layers is refused, not mixed
        write_feature_cache(tmp_path, target, rows, layers=[-1], dtype="float32", shard_records=2, progress=False)


def test_a_cache_recorded_with_the_old_zero_top_k_field_still_resumes(tmp_path):
    target, rows = tiny_target(), _rows(6)
    write_feature_cache(tmp_path, target, rows, dtype="float32", shard_records=4, progress=False)
    spec = json.loads((tmp_path / "spec.json").read_text())
    (tmp_path / "spec.json").write_text(json.dumps({**spec, "top_k": 0}))
    done = write_feature_cache(tmp_path, target, rows, dtype="float32", shard_records=4, progress=False)
    assert done["written"] == [] and len(done["skipped"]) == 2
    (tmp_path / "spec.json").write_text(json.dumps({**spec, "top_k": 3}))
    with pytest.raises(ValueError, match="different spec"):
        write_feature_cache(tmp_path, target, rows, dtype="float32", shard_records=4, progress=False)
