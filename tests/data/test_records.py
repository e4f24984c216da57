import pytest

from data.records import RecordError, SkipCounter, normalise


def _sharegpt(*turns, record_id="abc"):
    return {"id": record_id, "conversations": [{"from": role, "value": text} for role, text in turns]}


def test_roles_are_normalised():
    turns = [("system", "s"), ("human", "a"), ("gpt", "b"), ("user", "c"), ("chatgpt", "d"), ("Human", "e"),
             ("bing", "f"), ("bard", "g"), ("assistant", "h")]
    record = normalise(_sharegpt(*turns), 0, SkipCounter(skip_bad_records=False))
    assert [m["role"] for m in record["messages"]] == [
        "system", "user", "assistant", "user", "assistant", "user", "assistant", "assistant", "assistant"]
    assert [m["content"] for m in record["messages"]] == list("sabcdefgh")


def test_system_kept_and_leading_assistant_turns_dropped():
    counter = SkipCounter(skip_bad_records=False)
    record = normalise(_sharegpt(("system", "be brief"), ("gpt", "stale"), ("bard", "stale2"), ("human", "q"),
                                 ("gpt", "a")), 0, counter)
    assert record == {"id": "abc", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"}]}
    assert counter.leading_assistant_turns_dropped == 2 and counter.kept == 1


def test_openai_messages_and_missing_id():
    counter = SkipCounter(skip_bad_records=False)
    record = normalise({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
                       7, counter)
    assert record["id"] == "row7" and record["messages"][1] == {"role": "assistant", "content": "a"}


BAD = [
    ("not_an_object", ["just a string"]),
    ("missing_conversations", [{"id": "m1", "text": "hello"}]),
    ("missing_conversations", [{"id": "m2", "conversations": "hello"}]),
    ("bad_turn", [{"id": "t1", "conversations": [{"from": "human"}]}]),
    ("bad_turn", [{"id": "t2", "conversations": [{"from": "human", "value": 3}]}]),
    ("bad_turn", [{"id": "t3", "conversations": ["hello"]}]),
    ("unknown_role", [{"id": "u1", "conversations": [{"from": "narrator", "value": "x"}]}]),
]


@pytest.mark.parametrize("reason, records", BAD)
def test_bad_records_counted_when_skipping(reason, records):
    counter = SkipCounter(skip_bad_records=True)
    assert [normalise(r, i, counter) for i, r in enumerate(records)] == [None]
    assert counter.as_dict()["skipped"] == {reason: 1}


@pytest.mark.parametrize("reason, records", BAD)
def test_bad_records_strict_error_names_record(reason, records):
    counter = SkipCounter(skip_bad_records=False)
    good = _sharegpt(("human", "q"), ("gpt", "a"), record_id="fine")
    normalise(good, 0, counter)
    with pytest.raises(RecordError) as info:
        normalise(records[0], 1, counter)
    assert info.value.reason == reason
    assert "record 1 " in str(info.value)
    if isinstance(records[0], dict):
        assert repr(records[0]["id"]) in str(info.value)


def test_empty_and_replyless_conversations_are_counted_not_errors():
    counter = SkipCounter(skip_bad_records=False)
    records = [_sharegpt(record_id="e1"), _sharegpt(("human", "  "), ("gpt", ""), record_id="e2"),
               _sharegpt(("human", "q"), record_id="n1"), _sharegpt(("gpt", "only"), record_id="n2")]
    assert [normalise(r, i, counter) for i, r in enumerate(records)] == [None] * 4
    assert counter.as_dict()["skipped"] == {"empty_conversation": 2, "no_assistant_reply": 2}
    assert counter.as_dict()["skipped_total"] == 4 and counter.kept == 0
