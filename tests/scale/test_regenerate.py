"""Self-distillation: turn-by-turn regeneration with a tiny model, shards, resume after a crash."""
import dataclasses
import json

import pytest

from data.config import RegenerateConfig
from data.records import SkipCounter, normalise
from data.regenerate import hf_generate_fn, merge_shards, regenerate, shard_dtypes, shard_name
from tests.helpers import ToyTokenizer
from tests.tiny import tiny_model


def _records(n):
    return [{"id": f"c{i}", "messages": [
        {"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "old reply"},
        {"role": "user", "content": "more"}, {"role": "assistant", "content": "old again"}]} for i in range(n)]


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


class Counting:
    def __init__(self, generate, fail_after=None):
        self.generate, self.calls, self.fail_after = generate, 0, fail_after

    def __call__(self, prompts, max_new_tokens, temperature):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("simulated interruption")
        self.calls += 1
        return self.generate(prompts, max_new_tokens, temperature)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_interrupted_regeneration_resumes_to_the_same_output(tmp_path, temperature):
    config = RegenerateConfig(enabled=True, temperature=temperature, max_new_tokens=5, batch_size=2, shard_size=2)
    generate = hf_generate_fn(tiny_model(), pad_id=0, eos_ids=[2])
    records, tokenizer = _records(5), ToyTokenizer()

    full = regenerate(records, tokenizer, Counting(generate), tmp_path / "full", config, progress=False)
    assert full["written"] == [0, 1, 2]
    reference = _read(merge_shards(tmp_path / "full", len(records), config.shard_size))

    crashing = Counting(generate, fail_after=5)  # 2 turns per batch: dies inside the third shard
    with pytest.raises(KeyboardInterrupt):
        regenerate(records, tokenizer, crashing, tmp_path / "resumed", config, progress=False)
    assert sorted(p.name for p in (tmp_path / "resumed").glob("regenerated-*.jsonl")) == [shard_name(0), shard_name(1)]
    assert shard_name(2, 1, 2) == "regenerated-00002-first1.jsonl"  # the last shard holds 1 record of 2
    with pytest.raises(FileNotFoundError, match=shard_name(2, 1, 2)):
        merge_shards(tmp_path / "resumed", len(records), config.shard_size)
    resumed = Counting(generate)
    again = regenerate(records, tokenizer, resumed, tmp_path / "resumed", config, progress=False)
    assert again == {"written": [2], "skipped": [0, 1]} and resumed.calls == 2
    assert _read(merge_shards(tmp_path / "resumed", len(records), config.shard_size)) == reference

    assert [r["id"] for r in reference] == [r["id"] for r in records]
    counter = SkipCounter(skip_bad_records=False)  # what data.source=<regenerated.jsonl> will read
    assert all(normalise(r, i, counter) is not None for i, r in enumerate(reference))
    first = reference[0]["conversations"]
    assert [t["from"] for t in first] == ["human", "gpt", "human", "gpt"]
    assert first[0]["value"] == "hi 0" and first[1]["value"] not in ("old reply", "")


def test_ranks_split_shards_and_long_prompts_cut_the_conversation(tmp_path):
    config = RegenerateConfig(enabled=True, max_new_tokens=4, batch_size=4, shard_size=1)
    generate = hf_generate_fn(tiny_model(), pad_id=0, eos_ids=[2])
    records = _records(3)
    r0 = regenerate(records, ToyTokenizer(), generate, tmp_path, config, rank=0, world_size=2, progress=False)
    r1 = regenerate(records, ToyTokenizer(), generate, tmp_path, config, rank=1, world_size=2,
                    max_prompt_tokens=20, progress=False)
    assert r0["written"] == [0, 2] and r1["written"] == [1]
    cut = _read(tmp_path / shard_name(1))[0]["conversations"]
    assert [t["from"] for t in cut] == ["human", "gpt"]  # the second turn's prompt exceeds 20 tokens
    assert len(_read(merge_shards(tmp_path, 3, 1))) == 3


def test_batches_sorted_by_prompt_length_keep_each_reply_with_its_conversation(tmp_path):
    """Prompts are batched by length; every reply must still land in the conversation that asked."""
    tokenizer = ToyTokenizer()
    records = [{"id": f"c{i}", "messages": [{"role": "user", "content": "x" * (9 - i)},
                                            {"role": "assistant", "content": "old"}]} for i in range(6)]
    batches = []

    def echo_length(prompts, max_new_tokens, temperature):  # the reply spells its prompt's length
        batches.append([len(p) for p in prompts])
        return [[3 + len(p)] for p in prompts]

    config = RegenerateConfig(batch_size=4, shard_size=8, max_new_tokens=2)
    regenerate(records, tokenizer, echo_length, tmp_path, config, progress=False)
    assert batches[0] == sorted(batches[0]) and max(batches[0]) <= min(batches[1])
    for record, written in zip(records, _read(tmp_path / shard_name(0, 6, 8))):
        prompt = tokenizer(tokenizer.apply_chat_template(record["messages"][:1], add_generation_prompt=True))
        assert written["id"] == record["id"]
        assert written["conversations"][1]["value"] == tokenizer.decode([3 + len(prompt["input_ids"])])


def test_max_turns_keeps_the_first_exchanges_only(tmp_path):
    calls = []

    def generate(prompts, max_new_tokens, temperature):
        calls.append(len(prompts))
        return [[3 + 1] for _ in prompts]

    config = RegenerateConfig(batch_size=8, shard_size=8, max_new_tokens=2, max_turns=1)
    regenerate(_records(3), ToyTokenizer(), generate, tmp_path, config, progress=False)
    rows = _read(tmp_path / shard_name(0, 3, 8))
    assert calls == [3]  # one round: the second turns are never generated
    assert [[m["from"] for m in r["conversations"]] for r in rows] == [["human", "gpt"]] * 3


def test_a_shard_from_other_records_or_settings_is_written_again(tmp_path):
    """Raising max_records turns the old last shard into a partial one (its records are a prefix
    of the new shard's): it must be regenerated, not reused; so must shards made with other
    settings. A shard without a key (written before keys existed, by an unknown target and
    settings) is written again too."""
    config = RegenerateConfig(enabled=True, max_new_tokens=4, batch_size=2, shard_size=2)
    generate = hf_generate_fn(tiny_model(), pad_id=0, eos_ids=[2])
    tokenizer, out = ToyTokenizer(), tmp_path / "regen"
    assert regenerate(_records(3), tokenizer, generate, out, config, progress=False)["written"] == [0, 1]
    grown = regenerate(_records(4), tokenizer, Counting(generate), out, config, progress=False)
    assert grown["written"] == [1]  # shard 1 held c2 only; now c2 and c3
    assert [r["id"] for r in _read(merge_shards(out, 4, 2))] == ["c0", "c1", "c2", "c3"]
    counting = Counting(generate)
    assert regenerate(_records(4), tokenizer, counting, out, config, progress=False)["written"] == []
    assert counting.calls == 0
    longer = RegenerateConfig(enabled=True, max_new_tokens=6, batch_size=2, shard_size=2)
    assert regenerate(_records(4), tokenizer, generate, out, longer, progress=False)["written"] == [0, 1]
    assert regenerate(_records(4), tokenizer, generate, out, longer, progress=False)["written"] == []
    (out / (shard_name(0) + ".key")).unlink()
    assert regenerate(_records(4), tokenizer, generate, out, longer, progress=False)["written"] == [0]


def test_a_shard_written_by_another_target_is_written_again(tmp_path):
    config = RegenerateConfig(enabled=True, max_new_tokens=4, batch_size=2, shard_size=2)
    generate = hf_generate_fn(tiny_model(), pad_id=0, eos_ids=[2])
    tokenizer, out = ToyTokenizer(), tmp_path / "regen"
    first = {"fingerprint": "aaaa", "tokenizer": "t1"}
    assert regenerate(_records(4), tokenizer, generate, out, config, progress=False,
                      target_identity=first)["written"] == [0, 1]
    counting = Counting(generate)
    assert regenerate(_records(4), tokenizer, counting, out, config, progress=False,
                      target_identity=dict(first))["written"] == []
    other = {"fingerprint": "bbbb", "tokenizer": "t1"}
    assert regenerate(_records(4), tokenizer, generate, out, config, progress=False,
                      target_identity=other)["written"] == [0, 1]
    retokenized = {"fingerprint": "bbbb", "tokenizer": "t2"}
    assert regenerate(_records(4), tokenizer, generate, out, config, progress=False,
                      target_identity=retokenized)["written"] == [0, 1]


def _lean_target():
    from heads.target import FrozenTarget

    tokenizer = ToyTokenizer()
    tokenizer.eos_token_id = 2
    return FrozenTarget(tiny_model(), tokenizer, name="tiny")


def test_continuous_batching_regenerator_gives_the_one_at_a_time_replies():
    """The lean regenerator with continuous batching (slots refilled as replies finish) writes the
    greedy replies of one-prompt-at-a-time decoding and of transformers' generate."""
    from train.pipeline import lean_generate_fn

    target = _lean_target()
    prompts = [[3 + (7 * i + j) % 90 for j in range(4 + 3 * i)] for i in range(7)]
    continuous = lean_generate_fn(target, max_seq_len=64, batch_size=3)
    single = lean_generate_fn(target, max_seq_len=64, batch_size=1)
    assert getattr(continuous, "batches_itself", False) and not getattr(single, "batches_itself", False)
    replies = continuous(prompts, 9, 0.0)
    assert replies == single(prompts, 9, 0.0)
    hf = hf_generate_fn(target.model, pad_id=0, eos_ids=[2])
    assert replies == [hf([p], 9, 0.0)[0] for p in prompts]
    assert all(1 <= len(r) <= 9 for r in replies)


def test_a_generator_that_batches_itself_gets_each_round_whole(tmp_path):
    seen = []

    def generate(prompts, max_new_tokens, temperature):
        seen.append(len(prompts))
        return [[5, 6, 2] for _ in prompts]

    generate.batches_itself = True
    config = RegenerateConfig(enabled=True, max_new_tokens=4, batch_size=2, shard_size=5)
    regenerate(_records(5), ToyTokenizer(), generate, tmp_path, config, progress=False)
    assert seen == [5, 5]  # two assistant turns per conversation: two rounds, not slices of batch_size


def test_the_seed_keys_sampled_shards_only():
    from data.regenerate import shard_key

    records = _records(2)
    greedy, sampled = RegenerateConfig(enabled=True), RegenerateConfig(enabled=True, temperature=0.7)
    assert shard_key(records, greedy, 2048, 0) == shard_key(records, greedy, 2048, 1)
    assert shard_key(records, sampled, 2048, 0) != shard_key(records, sampled, 2048, 1)


def test_shards_written_in_another_dtype_are_written_again(tmp_path):
    from data.regenerate import shard_key

    records, config = _records(2), RegenerateConfig(enabled=True)
    assert shard_key(records, config, 2048, 0) == shard_key(records, config, 2048, 0, dtype="float32")
    assert shard_key(records, config, 2048, 0, dtype="bfloat16") != shard_key(records, config, 2048, 0)
    small = RegenerateConfig(enabled=True, max_new_tokens=3, batch_size=2, shard_size=2)
    generate = Counting(hf_generate_fn(tiny_model(), pad_id=0, eos_ids=[2]))
    regenerate(records, ToyTokenizer(), generate, tmp_path, small, progress=False)
    again = regenerate(records, ToyTokenizer(), generate, tmp_path, small, progress=False, dtype="bfloat16")
    assert again["written"] == [0]


def test_a_job_asking_for_fewer_records_leaves_a_larger_jobs_complete_shard_alone(tmp_path):
    config = RegenerateConfig(enabled=True, max_new_tokens=4, batch_size=2, shard_size=2)
    generate = hf_generate_fn(tiny_model(), pad_id=0, eos_ids=[2])
    tokenizer, out = ToyTokenizer(), tmp_path / "corpus"
    assert regenerate(_records(4), tokenizer, generate, out, config, progress=False)["written"] == [0, 1]
    complete = (out / shard_name(1)).read_bytes(), (out / (shard_name(1) + ".key")).read_bytes()
    smaller = regenerate(_records(3), tokenizer, Counting(generate), out, config, progress=False)
    assert smaller["written"] == [1]  # c2 alone, under its own name
    assert ((out / shard_name(1)).read_bytes(), (out / (shard_name(1) + ".key")).read_bytes()) == complete
    assert [r["id"] for r in _read(merge_shards(out, 3, 2))] == ["c0", "c1", "c2"]
    assert [r["id"] for r in _read(merge_shards(out, 4, 2))] == ["c0", "c1", "c2", "c3"]
    counting = Counting(generate)  # both jobs' shards are now there: nothing to write for either
    assert regenerate(_records(3), tokenizer, counting, out, config, progress=False)["written"] == []
    assert regenerate(_records(4), tokenizer, counting, out, config, progress=False)["written"] == []
    assert counting.calls == 0


def _pack(folder, into):
    """A shipped copy of `folder`'s shards: each gzipped beside its key."""
    import gzip
    import shutil

    into.mkdir()
    for shard in folder.glob("regenerated-*.jsonl"):
        with open(shard, "rb") as read, gzip.open(into / f"{shard.name}.gz", "wb") as write:
            shutil.copyfileobj(read, write)
        shutil.copy(f"{shard}.key", into / f"{shard.name}.key")
    return into


def test_shards_made_elsewhere_are_copied_in_where_their_keys_match(tmp_path):
    config = RegenerateConfig(enabled=True, max_new_tokens=4, batch_size=2, shard_size=2)
    generate = hf_generate_fn(tiny_model(), pad_id=0, eos_ids=[2])
    records, tokenizer = _records(4), ToyTokenizer()
    regenerate(records, tokenizer, generate, tmp_path / "made", config, progress=False)
    shipped = _pack(tmp_path / "made", tmp_path / "shipped")
    reference = _read(merge_shards(tmp_path / "made", 4, 2))

    reusing = dataclasses.replace(config, reuse_from=str(shipped))
    never = Counting(generate, fail_after=0)  # any generation raises
    done = regenerate(records, tokenizer, never, tmp_path / "job", reusing, progress=False)
    assert done == {"written": [], "skipped": [0, 1]}
    assert _read(merge_shards(tmp_path / "job", 4, 2)) == reference
    assert (tmp_path / "job" / f"{shard_name(0)}.key").read_text() == (shipped / f"{shard_name(0)}.key").read_text()

    # Another dtype (or target, or settings): the shipped shards are not this job's, so it generates.
    counting = Counting(generate)
    other = regenerate(records, tokenizer, counting, tmp_path / "bf16", reusing, dtype="bfloat16", progress=False)
    assert other["written"] == [0, 1] and counting.calls == 4  # two turns a shard
    # More records than were shipped: the shipped shards are copied, only the rest generated.
    counting = Counting(generate)
    more = regenerate(_records(6), tokenizer, counting, tmp_path / "more", reusing, progress=False)
    assert more == {"written": [2], "skipped": [0, 1]} and counting.calls == 2


def test_a_job_may_take_shipped_shards_computed_in_another_dtype_when_asked(tmp_path, caplog):
    config = RegenerateConfig(enabled=True, max_new_tokens=4, batch_size=2, shard_size=2)
    generate = hf_generate_fn(tiny_model(), pad_id=0, eos_ids=[2])
    records, tokenizer = _records(4), ToyTokenizer()
    regenerate(records, tokenizer, generate, tmp_path / "made", config, progress=False, dtype="bfloat16")
    shipped = _pack(tmp_path / "made", tmp_path / "shipped")
    reference = _read(merge_shards(tmp_path / "made", 4, 2))

    # An fp32 job: bf16 shards are not its own unless it names bf16 among the dtypes it accepts.
    counting = Counting(generate)
    strict = dataclasses.replace(config, reuse_from=str(shipped))
    assert regenerate(records, tokenizer, counting, tmp_path / "strict", strict, progress=False)["written"] == [0, 1]
    assert counting.calls == 4
    lenient = dataclasses.replace(strict, reuse_dtypes=["bfloat16"])
    never = Counting(generate, fail_after=0)
    with caplog.at_level("WARNING", logger="data.regenerate"):
        done = regenerate(records, tokenizer, never, tmp_path / "lenient", lenient, progress=False)
    assert done == {"written": [], "skipped": [0, 1]}
    assert _read(merge_shards(tmp_path / "lenient", 4, 2)) == reference
    assert "computed in ['bfloat16'], not this job's float32" in caplog.text
    # Copied once: a resumed job finds them done under the bf16 key, and generates nothing.
    assert regenerate(records, tokenizer, never, tmp_path / "lenient", lenient, progress=False)["written"] == []
    # The shard it writes itself (more records than shipped) carries its own dtype's key.
    counting = Counting(generate)
    more = regenerate(_records(6), tokenizer, counting, tmp_path / "lenient", lenient, progress=False)
    assert more == {"written": [2], "skipped": [0, 1]} and counting.calls == 2
    # What the job trained on, for its manifest: shards per dtype, read back from their keys.
    dtypes = ["float32", "bfloat16"]
    assert shard_dtypes(_records(6), tmp_path / "lenient", lenient, dtypes) == {"bfloat16": 2, "float32": 1}
    assert shard_dtypes(records, tmp_path / "strict", strict, dtypes) == {"float32": 2}
    assert shard_dtypes(records, tmp_path / "strict", strict, dtypes, seed=0, target_identity={"other": 1}) == \
        {"unknown": 2}


def test_reuse_dtypes_names_dtypes_only():
    from data.config import DataConfig

    with pytest.raises(ValueError, match="reuse_dtypes"):
        DataConfig(regenerate=RegenerateConfig(reuse_dtypes=["bf16x"])).check()


def test_a_reuse_folder_that_is_not_there_is_an_error(tmp_path):
    config = RegenerateConfig(enabled=True, max_new_tokens=4, shard_size=2, reuse_from=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="reuse_from: .*nowhere is not a folder"):
        regenerate(_records(2), ToyTokenizer(), lambda *a: [], tmp_path / "job", config, progress=False)
