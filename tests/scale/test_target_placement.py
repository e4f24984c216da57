"""Where the target goes: split over a GPU group when one GPU cannot hold it (device_map and
max_memory reach from_pretrained), or loaded in parts when training reads a finished feature cache."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from heads.target import TargetConfig, load_target
from heads.target_parts import load_target_parts
from tests.tiny import tiny_model
from tests.train.loop_fixtures import tiny_data, tiny_job
from tests.helpers import pipeline_job
from train.__main__ import compose_job
from train.offline import offline_source, parts_only_layers
from train.pipeline import load_job_target
from train.placement import placed_target_config
from train.plan import target_span


class _Captured(Exception):
    pass


def _fake_gpus(monkeypatch, count: int, gigabytes: float) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(total_memory=gigabytes * 1e9))


def test_the_70b_target_is_split_over_this_ranks_group_of_four():
    job = compose_job(["+recipe=eagle_llama3_70b"])
    assert target_span(job) == 4
    placed = placed_target_config(job, local_rank=1, gpus_per_node=8, gpu_memory_gb=80)
    assert placed.device_map == "auto" and placed.max_memory == {g: "67GiB" for g in (4, 5, 6, 7)}  # 0.9 x 80 GB
    with pytest.raises(ValueError, match="-n 2"):  # 8 processes cannot each hold a copy of 4 GPUs
        placed_target_config(job, local_rank=2, gpus_per_node=8, gpu_memory_gb=80)
    # on GPUs of 192 GB the whole target fits one: replicated, config unchanged
    assert placed_target_config(job, local_rank=5, gpus_per_node=8, gpu_memory_gb=192) is job.model
    small = compose_job(["+recipe=eagle_llama3_8b"])
    assert placed_target_config(small, local_rank=3, gpus_per_node=8, gpu_memory_gb=80) is small.model
    explicit = compose_job(["+recipe=eagle_llama3_70b", "model.device_map=balanced"])
    assert placed_target_config(explicit, local_rank=0, gpus_per_node=8, gpu_memory_gb=80) is explicit.model
    assert placed_target_config(job) is job.model  # this machine: no GPU, nothing to split


def test_the_pipeline_hands_the_split_to_from_pretrained(monkeypatch):
    from transformers import AutoModelForCausalLM

    _fake_gpus(monkeypatch, 8, 80)
    monkeypatch.setenv("LOCAL_RANK", "1")
    seen = {}

    def fake(source, **kwargs):
        seen.update(kwargs, source=source)
        raise _Captured

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake)
    with pytest.raises(_Captured):
        load_job_target(compose_job(["+recipe=eagle_llama3_70b", "stages=[data,features]",
                                         "trainer.batch_size=4"]))  # 2 GB of activations: 4 GPUs per copy
    assert seen["source"] == "meta-llama/Meta-Llama-3-70B-Instruct" and seen["device_map"] == "auto"
    assert seen["max_memory"] == {4: "67GiB", 5: "67GiB", 6: "67GiB", 7: "67GiB"}


def test_a_replicated_target_loads_onto_its_ranks_gpu(monkeypatch):
    _fake_gpus(monkeypatch, 8, 80)
    monkeypatch.setenv("LOCAL_RANK", "3")
    placed = placed_target_config(compose_job(["+recipe=eagle_llama3_8b"]))
    assert placed.device == "cuda:3" and placed.device_map is None
    assert placed_target_config(compose_job(["+recipe=eagle_llama3_8b", "model.device=cuda:0"])).device == "cuda:0"


def test_only_a_finished_cache_without_target_stages_loads_parts(tmp_path):
    job = compose_job(job_overrides(tmp_path))
    assert parts_only_layers(job) is None  # no cache yet: the target writes it
    (tmp_path / "features").mkdir()
    (tmp_path / "features" / "index.json").write_text("{}")
    assert parts_only_layers(job) == [0]  # EAGLE: layer 0's shape (the decoder layer starts random)
    started = compose_job(job_overrides(tmp_path) + ["heads.eagle.init_layer=-1"])
    assert parts_only_layers(started) == [0, -1]  # ... and heads.eagle.init_layer's weights
    for change in (["data.mode=online"], ["stages=[data,train,eval]"], ["data.regenerate.enabled=true"]):
        assert parts_only_layers(compose_job(job_overrides(tmp_path) + change)) is None
    assert parts_only_layers(compose_job(job_overrides(tmp_path) + ["heads=medusa"])) == []


def job_overrides(tmp_path) -> list[str]:
    return ["data.mode=offline", "data.regenerate.enabled=false", f"trainer.output_dir={tmp_path}", "stages=[data,train]"]


def _loss_curve(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line["train/loss"] for line in lines if "train/loss" in line]


@pytest.mark.parametrize("kind,built_layers", [("eagle", 2), ("medusa", 0)])
def test_offline_training_from_target_parts_matches_the_whole_target(tmp_path, monkeypatch, kind, built_layers):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from train.loop import train_heads

    tiny_model(num_hidden_layers=4).save_pretrained(tmp_path / "tiny")
    config = TargetConfig(name_or_path=str(tmp_path / "tiny"), device="cpu")
    data = tiny_data(train=12, held_out=4)
    runs = {}
    for run in ("whole", "parts"):
        job = tiny_job(tmp_path / run, kind, max_steps=4, eval_every=4, save_every=4)
        job.data.mode, job.data.feature_cache_dtype = "offline", "float32"
        job.data.feature_cache_dir = str(tmp_path / "features")
        job.stages = ["data", "train"]
        runs[run] = job
    whole = load_target(config, tokenizer=object())
    source = offline_source(runs["whole"], whole, data)  # writes the cache
    train_heads(runs["whole"], whole, data, source=source)

    built, init = [], LlamaDecoderLayer.__init__
    monkeypatch.setattr(LlamaDecoderLayer, "__init__", lambda self, *a, **k: (built.append(1), init(self, *a, **k))[1])
    layers = parts_only_layers(runs["parts"])
    parts = load_target_parts(config, layers, tokenizer=object())
    assert len(built) == built_layers and parts.loaded_in_parts
    train_heads(runs["parts"], parts, data, source=offline_source(runs["parts"], parts, data))
    assert len(built) == built_layers  # nothing built the rest of the target later
    assert _loss_curve(tmp_path / "parts") == pytest.approx(_loss_curve(tmp_path / "whole"), rel=1e-6)


def test_a_cache_written_by_another_target_is_refused_on_every_rank(tmp_path, monkeypatch):
    tiny_model(seed=0).save_pretrained(tmp_path / "a")
    tiny_model(seed=1).save_pretrained(tmp_path / "b")
    job = tiny_job(tmp_path / "run", "medusa")
    job.data.mode, job.data.feature_cache_dtype = "offline", "float32"
    data = tiny_data(train=4, held_out=2)
    writer = load_target(TargetConfig(name_or_path=str(tmp_path / "a"), device="cpu"), tokenizer=object())
    offline_source(job, writer, data)
    other = load_target_parts(TargetConfig(name_or_path=str(tmp_path / "b"), device="cpu"), (), tokenizer=object())
    monkeypatch.setenv("RANK", "1")  # rank 0 also compares spec.json; the other ranks check the index
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="another target"):
        offline_source(job, other, data)


@pytest.mark.integration
def test_a_job_extracts_features_then_trains_from_target_parts(tmp_path, monkeypatch, tiny_chat_model):
    """stages=[data,features] with the whole target, then stages=[train] builds no decoder layer."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from train.pipeline import run_job

    common = ("heads=medusa", "data.mode=offline", "data.feature_cache_dtype=float32")
    run_job(pipeline_job(tiny_chat_model, tmp_path, "run", 2, *common, "stages=[data,features]", records="8"))
    assert (tmp_path / "run" / "features" / "index.json").is_file()
    built, init = [], LlamaDecoderLayer.__init__
    monkeypatch.setattr(LlamaDecoderLayer, "__init__", lambda self, *a, **k: (built.append(1), init(self, *a, **k))[1])
    summary = run_job(pipeline_job(tiny_chat_model, tmp_path, "run", 2, *common, "stages=[train]", records="8"))
    assert summary["train"]["steps"] == 2 and built == []


def test_a_shard_damaged_after_the_index_loads_the_whole_target_to_write_it_again(tmp_path, tiny_chat_model):
    """A finished cache whose shard was cut later: the rerun cannot train from target parts, whose
    forward cannot write the shard; it loads the whole target, rewrites the shard and trains."""
    from data.feature_cache import FeatureCache, shard_name
    from train.pipeline import run_job

    common = ("heads=medusa", "data.mode=offline", "data.feature_cache_dtype=float32", "data.feature_shard_records=8")
    run_job(pipeline_job(tiny_chat_model, tmp_path, "run", 1, *common, "stages=[data,features]"))
    shard = tmp_path / "run" / "features" / shard_name(1)
    whole = shard.read_bytes()
    shard.write_bytes(whole[:len(whole) // 2])
    job = pipeline_job(tiny_chat_model, tmp_path, "run", 1, *common, "stages=[data,features,train]")
    assert parts_only_layers(job) is None
    summary = run_job(job)
    assert summary["train"]["steps"] == 1 and shard.read_bytes() == whole
    assert len(FeatureCache(tmp_path / "run" / "features")) == 24
