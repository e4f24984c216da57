"""The real embedded ShareGPT V3 file (truncated mid-record) with SmolLM2's template."""
import pytest

from data.config import DataConfig
from data.pipeline import prepare_data
from data.sources import TruncatedJSONError, embedded_sharegpt_path, load_conversations, parse_json_array

pytestmark = pytest.mark.integration

COMPLETE_RECORDS = 17_671


def test_strict_mode_says_where_the_file_breaks():
    with pytest.raises(TruncatedJSONError) as info:  # ~3.5 s on a quiet 2-core machine
        parse_json_array(str(embedded_sharegpt_path()), salvage=False)
    message = str(info.value)
    assert "byte 125509550" in message and "line 604540" in message and f"record {COMPLETE_RECORDS} " in message
    assert f"keep the {COMPLETE_RECORDS} complete records" in message


def test_salvage_and_smollm2_template(smollm2_tokenizer):
    conversations, stats = load_conversations(DataConfig())  # cached after the first parse
    assert stats["truncated"] and stats["complete_records"] == COMPLETE_RECORDS
    assert stats["kept"] + stats["skipped_total"] == COMPLETE_RECORDS == len(conversations) + stats["skipped_total"]
    config = DataConfig(max_records=12, max_eval_records=4, max_length=1024)
    data = prepare_data(config, smollm2_tokenizer)
    assert data.stats["load"]["complete_records"] == COMPLETE_RECORDS
    assert len(data.train) + data.stats["train"]["skipped"].get("no_assistant_tokens", 0) == 12
    by_id = {row["id"]: row["messages"] for row in conversations.select(range(200))}
    for row in data.train:
        ids, mask = row["input_ids"], row["loss_mask"]
        assert len(ids) <= 1024 and sum(mask) == row["assistant_tokens"] > 0
        replies = "".join(m["content"] + "<|im_end|>" for m in by_id[row["id"]] if m["role"] == "assistant")
        runs, current = [], []
        for token, flag in zip(ids, mask):
            if flag:
                current.append(token)
            elif current:
                runs.append(current)
                current = []
        for run in runs:  # each run is one reply (or a truncated reply's head) ending its turn
            text = smollm2_tokenizer.decode(run)
            assert text in replies and (text.endswith("<|im_end|>") or run is runs[-1])
