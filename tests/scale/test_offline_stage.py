"""The pipeline's entry points for offline mode and self-distillation (train/offline.py, train/selfdistill.py)."""
import json

import torch

from tests.helpers import ToyTokenizer
from tests.tiny import tiny_target
from tests.train.loop_fixtures import tiny_data, tiny_job
from train.objectives import OnlineFeatures
from train.offline import offline_source
from train.selfdistill import describe_regenerated, regenerate_data, regenerated_dtypes


def test_offline_source_builds_the_cache_once_and_serves_online_features(tmp_path):
    target, data = tiny_target(), tiny_data(train=6, held_out=2)
    job = tiny_job(tmp_path)
    job.data.feature_cache_dtype, job.data.feature_shard_records = "float32", 3
    source = offline_source(job, target, data)
    shards = sorted((tmp_path / "features").glob("shard-*"))
    assert len(shards) == 3 and (tmp_path / "features" / "index.json").is_file()
    rows = [data.train[0], data.train[5]]
    T = max(len(r["input_ids"]) for r in rows)
    batch = {"input_ids": torch.zeros(2, T, dtype=torch.long), "attention_mask": torch.zeros(2, T, dtype=torch.long),
             "ids": [r["id"] for r in rows]}
    for b, r in enumerate(rows):
        batch["input_ids"][b, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        batch["attention_mask"][b, :len(r["input_ids"])] = 1
    online = OnlineFeatures(target)(batch)
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(source(batch)[valid], online[valid], rtol=1e-5, atol=1e-5)
    stamp = shards[0].stat().st_mtime_ns
    offline_source(job, target, data)  # a second run finds every shard and rewrites none
    assert shards[0].stat().st_mtime_ns == stamp


def test_regenerate_stage_writes_a_sharegpt_jsonl_for_data_source(tmp_path):
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"id": f"x{i}", "conversations": [
        {"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "old"}]}) + "\n" for i in range(3)))
    target = tiny_target()
    target.tokenizer = ToyTokenizer()
    job = tiny_job(tmp_path / "run")
    job.data.source, job.data.cache_dir, job.data.max_records = str(source), str(tmp_path / "cache"), None
    job.data.regenerate.shard_size, job.data.regenerate.max_new_tokens = 2, 4
    out = regenerate_data(job, target)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert out == tmp_path / "run" / "regenerated" / "regenerated.jsonl"
    assert [r["id"] for r in lines] == ["x0", "x1", "x2"] and all(r["conversations"][1]["value"] != "old" for r in lines)
    made_in = regenerated_dtypes(job, target)
    assert made_in == {"float32": 2}  # three records, two a shard
    assert "computed in float32; self-distillation" in describe_regenerated(job, made_in)
    assert "(1 of 3 shards)" in describe_regenerated(job, {"float32": 2, "bfloat16": 1})
