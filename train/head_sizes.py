"""Sizes of a target and of the configured head, from architecture numbers only: parameter
counts per head kind, how many target layers the head reads, its draft vocabulary, P-EAGLE's rows
per token. The dry-run planner (train/plan.py) turns them into memory and disk."""
from __future__ import annotations

from train.job import JobConfig, TargetArch


def require_arch(arch: TargetArch) -> TargetArch:
    missing = [key for key, value in vars(arch).items() if value is None]
    if missing:
        raise ValueError(f"the dry-run plan needs model.arch.{', model.arch.'.join(missing)} in the model config")
    return arch


def decoder_layer_parameter_count(arch: TargetArch) -> int:
    """Parameters of one Llama-family decoder layer (attention, MLP, two norms)."""
    D, I = arch.hidden_size, arch.intermediate_size
    head_dim = D // arch.num_attention_heads
    attention = 2 * D * arch.num_attention_heads * head_dim + 2 * D * arch.num_key_value_heads * head_dim
    return attention + 3 * D * I + 2 * D


def target_parameter_count(arch: TargetArch) -> int:
    """Parameters of a Llama-family target with an untied lm_head."""
    D, V = arch.hidden_size, arch.vocab_size
    return 2 * V * D + arch.num_hidden_layers * decoder_layer_parameter_count(arch) + D


def head_parameter_counts(job: JobConfig) -> tuple[int, int]:
    """(trainable, frozen) parameters of the configured head for the target in `model.arch`.

    EAGLE-1: fc [D, 2D] (+bias) and one decoder layer without input norm; it reads the target's
    embedding and lm_head (frozen). Medusa: K heads of L ResBlocks [D, D]+bias, each with its own
    lm_head [V, D] unless `share_lm_head` (then the target's, frozen).
    """
    arch = require_arch(job.model.arch)
    D, I, V = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    if job.heads.type == "dflash":
        return _dflash_parameters(job)
    if job.heads.type in ("eagle3", "peagle"):  # P-EAGLE adds mask_hidden [1, 1, n·D] to EAGLE-3's weights
        head_dim = D // arch.num_attention_heads
        qkv = 2 * D * (arch.num_attention_heads + 2 * arch.num_key_value_heads) * head_dim  # reads 2D columns
        attention = qkv + arch.num_attention_heads * head_dim * D
        fc = aux_layer_count(job) * D * D
        mask_hidden = aux_layer_count(job) * D if job.heads.type == "peagle" else 0
        return fc + mask_hidden + attention + 3 * D * I + 4 * D + draft_vocab(job) * D, 2 * V * D
    if job.heads.type == "eagle":
        head_dim = D // arch.num_attention_heads
        attention = 2 * D * arch.num_attention_heads * head_dim + 2 * D * arch.num_key_value_heads * head_dim
        fc = 2 * D * D + (D if job.heads.eagle.fc_bias else 0)
        return fc + attention + 3 * D * I + D, 2 * V * D
    medusa = job.heads.medusa
    blocks = medusa.num_heads * medusa.num_layers * (D * D + D)
    if medusa.share_lm_head:
        return blocks, V * D
    return blocks + medusa.num_heads * V * D, 0


def _dflash_parameters(job: JobConfig) -> tuple[int, int]:
    """fc [D, n·D], hidden_norm and norm, and L_d Qwen3 layers (q/k norms of head_dim); the
    embedding and lm_head are the target's (frozen)."""
    arch = job.model.arch
    D, I, V = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    head_dim = D // arch.num_attention_heads
    attention = 2 * D * (arch.num_attention_heads + arch.num_key_value_heads) * head_dim + 2 * head_dim
    layer = attention + 3 * D * I + 2 * D
    return aux_layer_count(job) * D * D + 2 * D + job.heads.dflash.num_layers * layer, 2 * V * D


def feature_layers(job: JobConfig) -> int:
    """How many target hidden-state layers the head reads (EAGLE-1 and Medusa: the last one;
    EAGLE-3: its aux streams plus the final state its teacher's logits come from)."""
    return aux_layer_count(job) + 1 if job.heads.type in ("eagle3", "dflash", "peagle") else 1


def aux_layer_count(job: JobConfig) -> int:
    """EAGLE-3's aux streams (three by default: [2, L//2, L-3])."""
    options = {"dflash": job.heads.dflash, "peagle": job.heads.peagle}.get(job.heads.type, job.heads.eagle3)
    ids = options.aux_layer_ids
    return 3 if ids is None else len(ids)


def draft_vocab(job: JobConfig) -> int:
    """EAGLE-3's draft vocabulary size Vd (heads.draft_vocab_size; 0: V)."""
    size = job.heads.draft_vocab_size
    V = job.model.arch.vocab_size
    return min(size, V) if size else V


def peagle_rows_per_token(job: JobConfig) -> float:
    """Rows P-EAGLE runs per token of a sequence of data.max_length: every depth-0 row, plus the
    COD draw's mask rows, sum over d >= 1 of max(ratio**d, ratio_min) of at most max_anchors seeds."""
    o, T = job.heads.peagle, job.data.max_length
    kept = sum(max(o.down_sample_ratio**d, o.down_sample_ratio_min) for d in range(1, o.speculative_tokens))
    return 1 + kept * min(T, o.max_anchors) / T
