import json
import os
import random

import pytest
import torch

# Under pytest-xdist (the default run: pyproject's addopts) each worker's torch ops get their share
# of the cores; a run without workers gives one test both cores of a CI machine (the tests that
# start several processes give each one thread). SPECHEADS_TEST_THREADS overrides.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(int(os.environ.get("SPECHEADS_TEST_THREADS",
                                         str(max(1, min(2, os.cpu_count() or 1) // _WORKERS)))))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded SmolLM2 target (dequantized cache; ~30 s the first time on a machine)."""
    from heads.target import TargetConfig, load_target

    return load_target(TargetConfig(device="cpu"))


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template, saved with a 24-record chat JSONL."""
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





def _seconds(item) -> float:
    mark = item.get_closest_marker("long")
    return 0.0 if mark is None else float(mark.args[0] if mark.args else 30)


def pytest_collection_modifyitems(config, items):
    """Modules by the seconds their `long` tests take (the mark's argument: the real target's
    recipes, engine and worker processes, on a 2-core CPU), most first, each kept whole and in
    order: with pyproject's two xdist workers and `--dist loadfile` (a module's fixtures set up
    once) both workers start on the long modules and share the many short ones at the end, instead
    of one finishing a long module alone."""
    seconds, first = {}, {}
    for index, item in enumerate(items):
        seconds[item.path] = seconds.get(item.path, 0.0) + _seconds(item)
        first.setdefault(item.path, index)
    items.sort(key=lambda item: (-seconds[item.path], first[item.path]))
