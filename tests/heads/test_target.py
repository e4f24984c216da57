"""The frozen-target adapter: frozen, features by layer, fingerprint, GGUF cache."""
from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from heads.target import (TargetConfig, _dequantized_cache, compute_fingerprint, embedded_gguf_path,
                          load_target, resolve_dtype, resolve_source)
from tests.tiny import tiny_model, tiny_target


def test_target_is_frozen():
    target = tiny_target()
    assert not any(p.requires_grad for p in target.parameters())
    target.train()
    assert not target.model.training


def test_features_match_hidden_states():
    target = tiny_target()
    ids = torch.randint(0, 128, (2, 7))
    out = target.features(ids, layers=(0, 1, -1), return_logits=True)
    ref = target.model(ids, output_hidden_states=True)
    assert set(out.hidden) == {0, 1, 2}
    for layer in (0, 1, 2):
        torch.testing.assert_close(out.hidden[layer], ref.hidden_states[layer])
    torch.testing.assert_close(out.logits, ref.logits)
    # The final state is post-norm: the lm_head of it gives the logits.
    torch.testing.assert_close(target.lm_head(out.hidden[2]), ref.logits)


def test_fingerprint_is_stable_and_discriminating():
    a, b, c = tiny_target(seed=0), tiny_target(seed=0), tiny_target(seed=1)
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint()["id"] != c.fingerprint()["id"]
    # fp32 and bf16 copies of one model agree (the hash is taken at bf16 precision).
    model = tiny_model()
    fp32 = compute_fingerprint(model.config, model.get_input_embeddings().weight, model.lm_head.weight)
    bf16 = compute_fingerprint(model.config, model.get_input_embeddings().weight.bfloat16(),
                               model.lm_head.weight.bfloat16())
    assert fp32 == bf16
    wider = tiny_target(intermediate_size=256)
    assert wider.fingerprint()["id"] != a.fingerprint()["id"]


def test_dtype_resolution():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError, match="model.dtype"):
        resolve_dtype("float8", torch.device("cpu"))


def test_missing_sources_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_source(TargetConfig(name_or_path=str(tmp_path / "nope.gguf"), cache_dir=str(tmp_path)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_source(TargetConfig(name_or_path=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="unknown embedded"):
        resolve_source(TargetConfig(name_or_path="embedded:gpt-17"))


def test_local_folder_loads(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "tiny")
    target = load_target(TargetConfig(name_or_path=str(tmp_path / "tiny"), device="cpu"), tokenizer=object())
    ids = torch.randint(0, 128, (1, 5))
    torch.testing.assert_close(target.features(ids, return_logits=True).logits, model(ids).logits)


def _load_from_cache(args):
    gguf, cache = args
    folder = _dequantized_cache(Path(gguf), Path(cache))
    return str(folder), sorted(p.name for p in folder.iterdir())


@pytest.mark.integration
def test_gguf_cache_concurrent_first_use(tmp_path):
    """Two processes dequantizing the same GGUF at once end with one complete cache folder."""
    gguf = embedded_gguf_path()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        results = pool.map(_load_from_cache, [(str(gguf), str(tmp_path))] * 2)
    assert results[0] == results[1]
    folder = Path(results[0][0])
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(results[0][1])
    leftovers = [p.name for p in folder.parent.iterdir() if ".tmp-" in p.name]
    assert leftovers == []


@pytest.mark.integration
def test_embedded_smollm2(smollm2):
    assert (smollm2.hidden_size, smollm2.num_layers, smollm2.vocab_size) == (576, 30, 49152)
    assert smollm2.dtype == torch.float32
    assert "<|im_start|>" in smollm2.chat_template
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = smollm2.features(ids, return_logits=True)
    assert smollm2.tokenizer.decode(out.logits[0, -1].argmax()).strip() == "Paris"
