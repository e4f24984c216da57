"""Bad data sources get a message naming the file (and the line or byte), or a counted skip."""
from __future__ import annotations

import codecs
import json
import logging

import pytest

from data.config import DataConfig
from data.records import RecordError
from data.sources import load_conversations, resolve_source


def _record(i, text="answer"):
    return {"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                             {"from": "gpt", "value": f"{text} {i}"}]}


def _load(tmp_path, path, **options):
    return load_conversations(DataConfig(source=str(path), cache_dir=str(tmp_path / "cache"), **options))


@pytest.mark.parametrize("content, skipped", [
    ("", "nothing, the source is empty"),
    ("\n\n", "nothing, the source is empty"),
    ('{"id": 1}\n{"id": 2}\n', "{'missing_conversations': 2}"),
])
def test_no_usable_records_names_the_file_and_the_counts(tmp_path, content, skipped):
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"no usable records in {path} \(kept 0; skipped: {skipped}\)"):
        _load(tmp_path, path)


def test_an_object_wrapping_the_records_is_named(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"data": [_record(0), _record(1)]}, indent=2))
    with pytest.raises(ValueError, match=r"no usable records in .*one JSON object with keys \['data'\]"):
        _load(tmp_path, path)


@pytest.mark.parametrize("name, lines", [("data.json", False), ("data.jsonl", True)])
def test_a_utf8_byte_order_mark_is_accepted(tmp_path, name, lines):
    path = tmp_path / name
    records = [_record(0), _record(1)]
    text = "".join(json.dumps(r) + "\n" for r in records) if lines else json.dumps(records)
    path.write_bytes(codecs.BOM_UTF8 + text.encode())
    dataset, stats = _load(tmp_path, path)
    assert list(dataset["id"]) == ["r0", "r1"] and stats["skipped_total"] == 0


def test_a_jsonl_file_holding_an_array_is_read_as_one(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps([_record(0), _record(1)], indent=2))
    assert resolve_source(DataConfig(source=str(path)))[0] == "json"
    dataset, _ = _load(tmp_path, path)
    assert list(dataset["id"]) == ["r0", "r1"]


def _latin1_jsonl(tmp_path):
    path = tmp_path / "data.jsonl"
    good = (json.dumps(_record(0)) + "\n").encode()
    bad = json.dumps(_record(1, "caf\u00e9"), ensure_ascii=False).encode("latin-1") + b"\n"
    path.write_bytes(good + bad + (json.dumps(_record(2)) + "\n").encode())
    return path, len(good) + bad.index(b"\xe9")


def test_jsonl_bytes_that_are_not_utf8_are_counted_or_named(tmp_path):
    path, offset = _latin1_jsonl(tmp_path)
    dataset, stats = _load(tmp_path, path)
    assert list(dataset["id"]) == ["r0", "r2"] and stats["skipped"] == {"not_utf8": 1}
    with pytest.raises(RecordError, match=rf"{path} line 2: bytes that are not UTF-8 at byte {offset}"):
        _load(tmp_path, path, skip_bad_records=False)


def test_json_array_bytes_that_are_not_utf8_are_counted_or_named(tmp_path):
    path = tmp_path / "data.json"
    head = codecs.BOM_UTF8 + b"[" + json.dumps(_record(0)).encode() + b", "
    bad = json.dumps(_record(1, "na\u00efve"), ensure_ascii=False).encode("latin-1")
    path.write_bytes(head + bad + b", " + json.dumps(_record(2)).encode() + b"]")
    dataset, stats = _load(tmp_path, path)
    assert list(dataset["id"]) == ["r0", "r2"] and stats["skipped"] == {"not_utf8": 1}
    offset = len(head) + bad.index(b"\xef")
    with pytest.raises(RecordError, match=rf"{path}: bytes that are not UTF-8 at byte {offset}"):
        _load(tmp_path, path, skip_bad_records=False)


def test_more_than_half_skipped_is_a_warning(tmp_path, caplog):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(_record(0)) + "\n" + "{broken\n" * 2)
    with caplog.at_level(logging.WARNING):
        _load(tmp_path, path)
    assert "more than half of the records" in caplog.text and str(path) in caplog.text
    caplog.clear()
    path.write_text(json.dumps(_record(0)) + "\n" + json.dumps(_record(1)) + "\n{broken\n")
    with caplog.at_level(logging.WARNING):
        _load(tmp_path, path)
    assert "more than half" not in caplog.text


@pytest.mark.parametrize("source", ["data/sharegpt_clean", "./typo", "runs/a/b", "missing.jsonl", "~/nothing/here",
                                    "plainname"])
def test_a_missing_local_looking_source_never_goes_to_the_hub(tmp_path, monkeypatch, source):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()  # `data/...` names a local folder: a typo, not an org on the hub
    with pytest.raises(FileNotFoundError, match=r"data\.source=.*no such local file or folder"):
        resolve_source(DataConfig(source=source))


def test_hub_ids_are_org_slash_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_source(DataConfig(source="someone/some-dataset")) == ("hub", "someone/some-dataset")
    (tmp_path / "someone" / "some-dataset").mkdir(parents=True)
    assert resolve_source(DataConfig(source="someone/some-dataset"))[0] == "disk"  # a local folder wins


def test_the_model_follows_the_same_rule(tmp_path, monkeypatch):
    from heads.target import TargetConfig, resolve_source as resolve_model

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for name in ("models/llama-typo", "./llama", "plain"):
        with pytest.raises(FileNotFoundError, match=r"model\.name_or_path=.*no such local file or folder"):
            resolve_model(TargetConfig(name_or_path=name))
    assert resolve_model(TargetConfig(name_or_path="meta-llama/Llama-3.1-8B"))[0] == "meta-llama/Llama-3.1-8B"


def test_prompts_file_that_is_a_folder_or_not_utf8(tmp_path):
    from data.prompts import load_prompt_file

    with pytest.raises(FileNotFoundError, match="a folder, not a JSONL file"):
        load_prompt_file(tmp_path, tokenizer=None)
    path = tmp_path / "prompts.jsonl"
    raw = b'{"prompt": "hi"}\n{"prompt": "caf\xe9"}\n'
    path.write_bytes(raw)
    offset = raw.index(b"\xe9")
    with pytest.raises(ValueError, match=rf"{path} line 2: bytes that are not UTF-8 at byte {offset}"):
        load_prompt_file(path, tokenizer=None)
    path.write_text("\n")
    with pytest.raises(ValueError, match="no prompts in it"):
        load_prompt_file(path, tokenizer=None)


@pytest.mark.parametrize("name, lines", [("data.jsonl", True), ("data.json", False)])
def test_a_lone_surrogate_escape_is_counted_or_named(tmp_path, name, lines):
    """`\\ud800` is valid JSON, but the string it makes is not text: Arrow and every tokenizer refuse it."""
    path = tmp_path / name
    records = [_record(0), _record(1, "broken \ud800 half"), _record(2)]
    dumped = [json.dumps(r) for r in records]  # ensure_ascii writes the lone half as the escape
    assert "\\ud800" in dumped[1]
    path.write_text("\n".join(dumped) + "\n" if lines else "[" + ", ".join(dumped) + "]")
    dataset, stats = _load(tmp_path, path)
    assert list(dataset["id"]) == ["r0", "r2"] and stats["skipped"] == {"lone_surrogate": 1}
    where = rf"{path} line 2" if lines else rf"{path}: the record at byte {1 + len(dumped[0]) + 2}"
    with pytest.raises(RecordError, match=rf"\[lone_surrogate\]: {where}.*a lone surrogate escape"):
        _load(tmp_path, path, skip_bad_records=False)


def test_a_lone_surrogate_in_a_prompts_file_names_the_line(tmp_path):
    from data.prompts import load_prompt_file

    path = tmp_path / "prompts.jsonl"
    path.write_text("\n" + json.dumps({"prompt": "half \udc00 pair"}) + "\n")
    with pytest.raises(ValueError, match=rf"{path} line 2: a lone surrogate escape"):
        load_prompt_file(path, tokenizer=None)


def test_a_fifo_is_refused_as_data_and_as_a_prompts_file(tmp_path):
    import os

    from data.prompts import load_prompt_file

    fifo = tmp_path / "data.json"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    with pytest.raises(ValueError, match=rf"{fifo} is not a regular file or folder \(a FIFO"):
        resolve_source(DataConfig(source=str(fifo), format="json"))
    with pytest.raises(FileNotFoundError, match=r"not a regular file \(a FIFO"):
        load_prompt_file(fifo, tokenizer=None)
