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


@pytest.mark.slow
@pytest.mark.integration
def test_gguf_cache_concurrent_first_use(tmp_path):
    """Two processes dequantizing the same GGUF at once end with one complete cache folder (two
    full dequantizations of the embedded target: ~50 s, so marked slow)."""
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


def _saved(tmp_path, **overrides) -> Path:
    folder = tmp_path / "tiny"
    tiny_model(**overrides).save_pretrained(folder)
    return folder


def test_device_map_goes_to_from_pretrained_and_the_model_stays_placed(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    folder = _saved(tmp_path)
    whole = load_target(TargetConfig(name_or_path=str(folder), device="cpu"), tokenizer=object())
    calls, original = [], AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    per_module = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    ids = torch.randint(0, 128, (2, 6))
    for device_map in ({"": "cpu"}, per_module):
        config = TargetConfig(name_or_path=str(folder), device="meta", device_map=device_map,
                              max_memory={"cpu": "1GiB", "0": "1GiB"})
        placed = load_target(config, tokenizer=object())  # device="meta" would fail if the model were moved
        assert calls[-1]["device_map"] == device_map and calls[-1]["max_memory"] == {"cpu": "1GiB", 0: "1GiB"}
        assert not placed.is_split and placed.device == torch.device("cpu")
        out = placed.features(ids, layers=(1, -1), return_logits=True)
        torch.testing.assert_close(out.logits, whole.features(ids, return_logits=True).logits)


def test_split_target_is_not_moved_and_features_come_back_on_the_inputs_device():
    target = tiny_target()
    target.model.hf_device_map = {"model.embed_tokens": 0, "model.layers": 1, "lm_head": 1}  # as dispatch sets it
    assert target.is_split
    assert target.to(torch.float64) is target and target.dtype == torch.float32
    out = target.features(torch.randint(0, 128, (1, 4)), layers=(0, -1), return_logits=True)
    assert {t.device for t in [*out.hidden.values(), out.logits]} == {torch.device("cpu")}


def _count_decoder_layers(monkeypatch) -> list[int]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    built, init = [], LlamaDecoderLayer.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(LlamaDecoderLayer, "__init__", counting)
    return built


@pytest.mark.parametrize("tied,shard", [(False, None), (True, "40KB")])
def test_parts_load_embedding_norm_lm_head_and_only_the_layers_asked_for(tmp_path, monkeypatch, tied, shard):
    from heads.target_parts import load_target_parts

    model = tiny_model(num_hidden_layers=4, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path / "tiny", **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "tiny" / "model.safetensors.index.json").is_file() == bool(shard)
    config = TargetConfig(name_or_path=str(tmp_path / "tiny"), device="cpu")
    whole = load_target(config, tokenizer=object())
    built = _count_decoder_layers(monkeypatch)
    parts = load_target_parts(config, layers=(0, -1), tokenizer=object())
    assert len(built) == 2 and parts.loaded_in_parts and parts.num_layers == 4
    assert parts.fingerprint() == whole.fingerprint()
    assert (parts.lm_head.weight is parts.embed_tokens.weight) == tied
    for name in ("embed_tokens", "lm_head", "final_norm"):
        torch.testing.assert_close(getattr(parts, name).weight, getattr(whole, name).weight, rtol=0, atol=0)
    torch.testing.assert_close(parts.decoder_layers[-1].state_dict(), whole.decoder_layers[3].state_dict(),
                               rtol=0, atol=0)
    assert not any(p.is_meta for p in parts.parameters())
    with pytest.raises(IndexError, match="not loaded"):
        parts.decoder_layers[1]
    with pytest.raises(RuntimeError, match="loaded in parts"):
        parts.features(torch.zeros(1, 3, dtype=torch.long))
