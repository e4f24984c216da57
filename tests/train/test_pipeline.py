"""The whole job end to end on a tiny random target that uses SmolLM2's tokenizer and chat
template: data -> train -> eval -> export, then the exported folder validates."""
from __future__ import annotations

import json

import pytest

from train.__main__ import compose_job
from train.pipeline import run_job


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    from transformers import AutoTokenizer

    from heads.target import TargetConfig, resolve_source
    from tests.tiny import tiny_model

    folder = tmp_path_factory.mktemp("tiny_chat")
    tokenizer = AutoTokenizer.from_pretrained(resolve_source(TargetConfig())[0])
    model = tiny_model(vocab_size=len(tokenizer), tie_word_embeddings=True, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rows = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Count from {i}."},
        {"from": "gpt", "value": " ".join(str(j) for j in range(i, i + 12))}]} for i in range(24)]
    (folder / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return folder


ARCH_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "vocab_size")


def tiny_job(model_dir, tmp_path, run: str, steps: int, *extra: str, records: str = "null"):
    """A job on the tiny chat model: its architecture read from the folder, a few training steps."""
    return compose_job([
        f"model.name_or_path={model_dir}", *(f"model.arch.{key}=null" for key in ARCH_KEYS),
        f"data.source={model_dir / 'data.jsonl'}", f"data.max_records={records}", "data.eval_fraction=0.25",
        "data.regenerate.enabled=false",  # the default job's self-distillation: on where a test asks
        f"data.cache_dir={tmp_path / 'cache'}", f"trainer.output_dir={tmp_path / run}",
        f"trainer.max_steps={steps}", f"trainer.eval_every={steps}", f"trainer.save_every={steps}",
        "trainer.eval_batches=1", "trainer.max_minutes=null", "logger=none", *extra])


@pytest.mark.integration
def test_job_runs_every_stage(tiny_chat_model, tmp_path):
    job = tiny_job(tiny_chat_model, tmp_path, "run", 2, "runtime.drafters=[eagle_chain,prompt_lookup]",
                   "runtime.tree_sweep=[]", "runtime.num_prompts=1", "runtime.max_new_tokens=6",
                   "runtime.compare_transformers=false")
    summary = run_job(job)
    assert summary["train"]["steps"] == 2
    assert {row["name"] for row in summary["eval"]["drafters"]} == {"eagle_chain", "prompt_lookup"}
    assert set(summary["export"]) == {"native", "eagle", "eagle_vllm"}
    run = tmp_path / "run"
    assert (run / "metrics.jsonl").is_file() and (run / "eval" / "report.json").is_file()

    from export.validate import validate_export

    for folder in summary["export"].values():
        validate_export(folder)
    # Re-running only the later stages picks up the trained head from the run folder.
    again = run_job(tiny_job(tiny_chat_model, tmp_path, "run", 2, "stages=[export]", f"export.out={tmp_path / 'x'}"))
    assert set(again["export"]) == {"native", "eagle", "eagle_vllm"}
    manifest = json.loads((tmp_path / "x" / "native" / "specheads.json").read_text())
    assert manifest["training"]["steps"] == 2  # figures of the run that trained the head
    assert manifest["training"]["held_out"] == summary["train"]["final_eval"]
    assert manifest["training"]["hardware"] == summary["train"]["hardware"] and manifest["training"]["data_source"]
    kept = json.loads((run / "job_summary.json").read_text())
    assert kept["train"] == summary["train"] and kept["export"] == again["export"]
    # Training can start from an engine-layout export (bf16 weights read back into a head).
    resumed = run_job(tiny_job(tiny_chat_model, tmp_path, "again", 1,
                               f"trainer.init_from={summary['export']['eagle']}", "stages=[data,train]"))
    assert resumed["train"]["steps"] == 1


@pytest.mark.integration
@pytest.mark.parametrize("batch_size", [1, 4])  # 1: the lean runtime; 4: transformers' batched generate
def test_self_distilled_offline_job(tiny_chat_model, tmp_path, batch_size):
    """regenerate -> data on the regenerated set -> offline feature cache -> train."""
    job = tiny_job(tiny_chat_model, tmp_path, "run", 2, "data.regenerate.enabled=true",
                   f"data.regenerate.batch_size={batch_size}",
                   "data.regenerate.max_new_tokens=5", "data.regenerate.shard_size=4", "data.mode=offline",
                   "data.feature_cache_dtype=float32", "stages=[data,train]", records="8")
    summary = run_job(job)
    regenerated = (tmp_path / "run" / "regenerated" / "regenerated.jsonl").read_text().splitlines()
    assert len(regenerated) == 8
    assert summary["train"]["steps"] == 2
    assert any((tmp_path / "run").rglob("*.safetensors"))
