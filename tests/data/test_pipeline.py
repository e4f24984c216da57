import json
from pathlib import Path

import pytest

from data.config import DataConfig
from data.pipeline import apply_overflow, prepare_data
from data.prompts import eval_prompts, load_prompt_file
from data.split import base_id
from data.template import Tokenized, tokenize_with_mask

pytestmark = pytest.mark.integration  # SmolLM2's real tokenizer (from the target cache)


def _write(tmp_path, n=30, long_reply_words=0):
    records = []
    for i in range(n):
        for piece in range(2):  # ShareGPT-style pieces of one conversation
            records.append({"id": f"c{i}_{piece}", "conversations": [
                {"from": "human", "value": f"Question {i}.{piece}?"}, {"from": "gpt", "value": f"Answer {i}.{piece}."}]})
    if long_reply_words:
        records.append({"id": "long", "conversations": [
            {"from": "human", "value": "Count."}, {"from": "gpt", "value": " ".join(["word"] * long_reply_words)}]})
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records))
    return path


def _config(tmp_path, path, **overrides):
    values = dict(source=str(path), cache_dir=str(tmp_path / "cache"), eval_fraction=0.3,
                  max_eval_records=None, max_records=None, max_length=256)
    values.update(overrides)
    return DataConfig(**values)


def test_rows_split_and_stats(tmp_path, smollm2_tokenizer):
    path = _write(tmp_path)
    data = prepare_data(_config(tmp_path, path), smollm2_tokenizer, run_dir=tmp_path / "run")
    train_bases = {base_id(i) for i in data.train["id"]}
    eval_bases = {base_id(i) for i in data.eval["id"]}
    assert train_bases and eval_bases and not train_bases & eval_bases  # abc_0 / abc_1 never leak
    assert len(data.train) + len(data.eval) == 60
    row = data.train[0]
    assert len(row["input_ids"]) == len(row["loss_mask"]) == row["length"]
    ids, mask, _ = tokenize_with_mask(smollm2_tokenizer, [{"role": "user", "content": "Question 0.0?"},
                                                       {"role": "assistant", "content": "Answer 0.0."}])
    by_id = {r["id"]: r for r in list(data.train) + list(data.eval)}
    assert by_id["c0_0"]["input_ids"] == ids and by_id["c0_0"]["loss_mask"] == mask
    stats = json.loads((tmp_path / "run" / "data_stats.json").read_text())
    assert stats == data.stats
    assert stats["train"]["tokens"] == sum(len(r) for r in data.train["input_ids"])
    assert stats["train"]["assistant_tokens"] == sum(sum(m) for m in data.train["loss_mask"])
    assert stats["load"]["kept"] == 60 and stats["train"]["records"] == len(data.train)


def test_caps_apply_after_the_split(tmp_path, smollm2_tokenizer):
    path = _write(tmp_path)
    full = prepare_data(_config(tmp_path, path), smollm2_tokenizer)
    capped = prepare_data(_config(tmp_path, path, max_records=3, max_eval_records=2), smollm2_tokenizer)
    assert list(capped.train["id"]) == list(full.train["id"])[:3]
    assert list(capped.eval["id"]) == list(full.eval["id"])[:2]


def test_overflow_modes(tmp_path, smollm2_tokenizer):
    path = _write(tmp_path, n=3, long_reply_words=150)
    results = {mode: prepare_data(_config(tmp_path, path, overflow=mode, max_length=64, eval_fraction=0.5),
                                  smollm2_tokenizer) for mode in ("truncate", "drop", "split")}

    def rows(data):
        return {r["id"]: r for r in list(data.train) + list(data.eval)}

    truncated = rows(results["truncate"])
    assert truncated["long"]["length"] == 64 and truncated["long"]["truncated"]
    assert sum(results["truncate"].stats[side]["truncated"] for side in ("train", "eval")) == 1
    assert "long" not in rows(results["drop"])
    assert sum(results["drop"].stats[s]["skipped"].get("overflow_dropped", 0) for s in ("train", "eval")) == 1
    pieces = {k: v for k, v in rows(results["split"]).items() if base_id(k) == "long"}
    assert len(pieces) >= 3 and all(v["length"] <= 64 for v in pieces.values())
    assert sorted(pieces) == [f"long_{k}" for k in range(len(pieces))]
    side = [k in results["split"].train["id"] for k in pieces]
    assert all(side) or not any(side)
    joined = [t for k in sorted(pieces, key=lambda k: int(k.split("_")[1])) for t in pieces[k]["input_ids"]]
    assert joined == tokenize_with_mask(smollm2_tokenizer, [{"role": "user", "content": "Count."}, {
        "role": "assistant", "content": " ".join(["word"] * 150)}])[0][:len(joined)]


def test_apply_overflow_counts_pieces_without_reply_tokens():
    ids, mask = list(range(10)), [0] * 6 + [1] * 4
    tokens = Tokenized(ids, mask, 10)
    assert [p[-1] for p in apply_overflow("a_1", tokens, 4, "split")] == ["no_assistant_tokens", "ok", "ok"]
    assert [p[0] for p in apply_overflow("a_1", tokens, 4, "split")] == ["a_1_0", "a_1_1", "a_1_2"]
    assert apply_overflow("a", tokens, 4, "truncate")[0][-1] == "no_assistant_tokens"
    assert apply_overflow("a", tokens, 4, "drop") == [("a", [], [], False, "overflow_dropped")]
    assert apply_overflow("a", tokens, 10, "drop") == [("a", ids, mask, False, "ok")]
    with pytest.raises(ValueError, match="data.overflow"):
        apply_overflow("a", tokens, 4, "wrap")


def test_nothing_left_is_an_error(tmp_path, smollm2_tokenizer):
    path = _write(tmp_path, n=2)
    with pytest.raises(ValueError, match="no training records"):
        prepare_data(_config(tmp_path, path, max_length=8, eval_fraction=0.01), smollm2_tokenizer)


def test_eval_prompts_come_from_the_held_out_side(tmp_path, smollm2_tokenizer):
    path = _write(tmp_path)
    config = _config(tmp_path, path)
    data = prepare_data(config, smollm2_tokenizer)
    prompts = eval_prompts(config, smollm2_tokenizer, n=5, max_prompt_tokens=512)
    assert len(prompts) == 5
    assert {base_id(p["id"]) for p in prompts} <= {base_id(i) for i in data.eval["id"]}
    first = prompts[0]
    i, piece = first["id"][1:].split("_")
    assert first["reference"] == f"Answer {i}.{piece}." and first["messages"][-1]["role"] == "user"
    assert smollm2_tokenizer.decode(first["prompt_ids"]).endswith(f"Question {i}.{piece}?<|im_end|>\n<|im_start|>assistant\n")
    assert eval_prompts(config, smollm2_tokenizer, n=5, max_prompt_tokens=10) == []


def test_load_prompt_file(tmp_path, smollm2_tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join([json.dumps({"prompt": "Hi there"}), "", json.dumps({"id": "m", "messages": [
        {"role": "user", "content": "Hello"}, {"role": "gpt", "content": "Hey"}]})]) + "\n")
    prompts = load_prompt_file(path, smollm2_tokenizer)
    assert [p["id"] for p in prompts] == ["line1", "m"]
    assert prompts[0]["reference"] is None and prompts[1]["reference"] == "Hey"
    assert smollm2_tokenizer.decode(prompts[1]["prompt_ids"]).endswith("Hello<|im_end|>\n<|im_start|>assistant\n")
    path.write_text(json.dumps({"messages": [{"role": "narrator", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="line 1"):
        load_prompt_file(path, smollm2_tokenizer)


def test_a_prompts_file_may_give_each_prompt_a_category(tmp_path, smollm2_tokenizer):
    shipped = Path(__file__).resolve().parents[1] / "assets" / "prompts_by_category.jsonl"
    prompts = load_prompt_file(shipped, smollm2_tokenizer)
    assert {p["category"] for p in prompts} == {"code", "math", "writing"} and len(prompts) == 12
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "Hi"}) + "\n" + json.dumps({"prompt": "Hi", "category": 3}) + "\n")
    with pytest.raises(ValueError, match=r"line 2: 'category' must be a string"):
        load_prompt_file(path, smollm2_tokenizer)
    path.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    assert load_prompt_file(path, smollm2_tokenizer)[0]["category"] is None


def test_template_refusals_are_counted_or_name_the_record(tmp_path, smollm2_tokenizer):
    import copy

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}{% if 'refuse' in m['content'] %}{{ raise_exception('no') }}"
                               "{% endif %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    records = [{"id": f"ok{i}", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
               for i in range(6)]
    records.append({"id": "x1", "messages": [{"role": "user", "content": "please refuse"},
                                             {"role": "assistant", "content": "a"}]})
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    config = _config(tmp_path, path, eval_fraction=0.01)
    data = prepare_data(config, tokenizer)
    assert len(data.train) == 6 and data.stats["train"]["skipped"] == {"template_mismatch": 1}
    with pytest.raises(ValueError, match="id='x1'.*refused"):
        prepare_data(_config(tmp_path, path, eval_fraction=0.01, skip_bad_records=False), tokenizer)
