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
    from eval.runtime.model import LeanLlama
    from heads.eagle import EagleConfig, EagleHead, init_from_target

    torch.manual_seed(0)
    target = tiny_target()
    lean = LeanLlama.from_hf(target.model, max_seq_len=max_seq_len)
    head = init_from_target(EagleHead(EagleConfig.from_target(target)), target, layer=-1, fc="feature").eval()
    return target, lean, head


def tiny_eagle3_setup(max_seq_len: int = 256, draft_vocab: torch.Tensor | None = None):
    """(target, lean forward, EAGLE-3 head reading aux layers [0, 1], in eval mode) that agrees with
    the target most of the time. The target is made simple enough for one draft layer to follow:
    its layer 0 adds nothing (zero output projections) and its embeddings are small next to layer 1's
    output, so its next token is decided by layer 1 over normalised embeddings. The head's layer is
    that layer on its embedding half; hidden_norm is zero and norm_before_residual set, so the
    hidden input and the residual vanish; norm and lm_head are the target's (rows of `draft_vocab`,
    sorted target ids; None = all). Its drafts then differ from the target's only in missing the
    first token of the context. fc stays random: it is computed, and ignored."""
    from eval.runtime.model import LeanLlama
    from heads.eagle3 import Eagle3Config, Eagle3Head, init_from_target

    torch.manual_seed(0)
    target = tiny_target()
    model = target.model.model
    with torch.no_grad():
        model.layers[0].self_attn.o_proj.weight.zero_()
        model.layers[0].mlp.down_proj.weight.zero_()
        model.embed_tokens.weight.mul_(1e-3)
    lean = LeanLlama.from_hf(target.model, max_seq_len=max_seq_len)
    vocab_size = target.vocab_size if draft_vocab is None else draft_vocab.numel()
    config = Eagle3Config.from_target(target, draft_vocab_size=vocab_size, aux_layer_ids=[0, 1],
                                      norm_before_residual=True)
    head = Eagle3Head(config)
    source, layer, D = model.layers[1], head.midlayer, config.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(layer.self_attn, name).weight[:, :D] = getattr(source.self_attn, name).weight
        layer.self_attn.o_proj.load_state_dict(source.self_attn.o_proj.state_dict())
        layer.mlp.load_state_dict(source.mlp.state_dict())
        layer.input_layernorm.weight.copy_(source.input_layernorm.weight)
        layer.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)
        layer.hidden_norm.weight.zero_()
    return target, lean, init_from_target(head, target, draft_vocab).eval()
