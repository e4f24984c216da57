"""Tiny random models for unit tests (vocab 128, hidden 64, 2 layers): milliseconds per forward."""
from __future__ import annotations

import torch

from heads.target import FrozenTarget, TargetConfig, load_target


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    values = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_model(seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = tiny_llama_config(**overrides)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    # Larger-than-default weights make logits peaky, so greedy paths are not all ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    return model


def tiny_target(seed: int = 0, **overrides) -> FrozenTarget:
    model = tiny_model(seed, **overrides)
    return load_target(TargetConfig(name_or_path="tiny-random-llama", device="cpu"), model=model, tokenizer=None)


def tiny_eagle_setup(max_seq_len: int = 256):
    """(target, lean forward, EAGLE head started from the target's last layer with fc passing f_t
    through, in eval mode): drafts that the tiny target accepts now and then."""
    from eval.model import LeanLlama
    from heads.eagle import EagleConfig, EagleHead, init_from_target

    torch.manual_seed(0)
    target = tiny_target()
    lean = LeanLlama.from_hf(target.model, max_seq_len=max_seq_len)
    head = init_from_target(EagleHead(EagleConfig.from_target(target)), target, layer=-1, fc="feature").eval()
    return target, lean, head
