"""DFlash block drafter: L_d Qwen3-style decoder layers that draft a whole block in one forward.

Context: c = hidden_norm(fc(cat(aux_1..aux_n))) (C, D) of the verified positions, the target's
residual streams at `aux_layer_ids` (transformers' `hidden_states` numbering, as EAGLE-3's fc
reads them, heads/eagle3.py). Block: [anchor token, mask_token_id x (B-1)] at positions
anchor..anchor+B-1, embedded with the target's (frozen) embedding; slot j predicts the token at
anchor+j. In every layer the block's queries attend over keys/values [k/v_proj(c); k/v_proj(block)]:
the context enters each layer's attention directly (no input norm, the same c for every layer),
and attention within the block is bidirectional. Logits = lm_head(norm(out)): with the full
vocabulary (draft_vocab_size 0 or V) the target's lm_head, so neither embedding nor lm_head is
owned; with a draft vocabulary of Vd < V ids the head holds an lm_head of Vd rows (the target's
rows of those ids, frozen as in the speculators trainer) and the EAGLE-3 maps `d2t` (Vd,) and
`t2d` (V,): draft id i is target id i + d2t[i], as the speculators layout and vLLM store a DFlash
draft vocabulary. Every slot's
logit row costs Vd x D instead of V x D, which on a CPU is most of a block's draft cost.
Every layer has q_norm/k_norm (the speculators and vLLM DFlash layouts, FORMATS.md "DFlash").
The context's K/V depend on c alone, so a runtime computes them once per verified position
(`context_kv`) and passes them back in (`forward(..., context_kv=...)`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from heads.eagle import MLP, RMSNorm, apply_rope, rope_inv_freq
from heads.eagle3 import default_aux_layer_ids

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class DflashConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's V
    target_hidden_size: int  # Ht, width of each aux stream
    aux_layer_ids: list[int] = field(default_factory=list)  # hidden_states[i] = stream entering layer i
    target_num_layers: int = 0
    num_layers: int = 1  # L_d draft decoder layers
    block_size: int = 16  # B: the anchor plus B-1 drafted tokens
    mask_token_id: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    target_name: str = ""
    target_fingerprint: dict = field(default_factory=dict)
    draft_vocab_size: int = 0  # Vd: 0 or vocab_size = the target's vocabulary and lm_head

    # what heads.eagle's Attention / MLP / rope_inv_freq read from a config
    qkv_bias = False
    qk_norm = True

    def __post_init__(self):
        if not self.aux_layer_ids:
            raise ValueError("DflashConfig.aux_layer_ids is empty: DFlash reads at least one target layer")
        if self.target_num_layers and any(not 0 <= i < self.target_num_layers for i in self.aux_layer_ids):
            raise ValueError(f"DflashConfig.aux_layer_ids={self.aux_layer_ids} must lie in "
                             f"[0, {self.target_num_layers}) (hidden_states[i] enters decoder layer i)")
        if self.num_layers < 1 or self.block_size < 2:
            raise ValueError(f"DflashConfig needs num_layers >= 1 and block_size >= 2, got "
                             f"{self.num_layers} and {self.block_size}")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"DflashConfig.draft_vocab_size={self.draft_vocab_size} must lie in "
                             f"[0, {self.vocab_size}] (0: the target's vocabulary)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"DflashConfig.mask_token_id={self.mask_token_id} must lie in [0, {self.vocab_size})")

    @classmethod
    def from_target(cls, target, aux_layer_ids=None, **options) -> "DflashConfig":
        """Shape the draft layers after a FrozenTarget (sizes, RoPE); `aux_layer_ids` None takes
        [2, L//2, L-3]; `options` override other fields (num_layers, block_size, mask_token_id)."""
        from heads.eagle import EagleConfig

        base = EagleConfig.from_target(target).to_dict()
        for key in ("fc_bias", "qkv_bias", "qk_norm", "draft_vocab_size"):
            base.pop(key)
        L = target.num_layers
        values = dict(base, target_hidden_size=target.hidden_size, target_num_layers=L,
                      aux_layer_ids=list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(L))
        values.update(options)
        return cls(**values)

    @property
    def own_vocab(self) -> bool:
        """True when the head drafts over Vd < V ids with its own lm_head rows."""
        return 0 < self.draft_vocab_size < self.vocab_size

    def to_dict(self) -> dict:
        return asdict(self)


class DflashAttention(nn.Module):
    """Qwen3 attention whose keys/values are [context; block] and whose queries are the block's."""

    def __init__(self, config: DflashConfig):
        super().__init__()
        c = config
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KV:
        """x (B, S, D) -> k, v (B, nKV, S, hd); k normed and rotated at its positions."""
        B, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, S, self.n_kv, self.head_dim))
        v = self.v_proj(x).view(B, S, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k.transpose(1, 2), cos, sin), v

    def forward(self, x, cos, sin, context_kv: KV, attention_mask):
        B, N, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, N, self.n_heads, self.head_dim))
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, nH, N, hd)
        k, v = self.kv(x, cos, sin)
        k = torch.cat([context_kv[0], k], dim=2)  # (B, nKV, C + N, hd)
        v = torch.cat([context_kv[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask,
                                             enable_gqa=self.n_heads != self.n_kv)  # (B, nH, N, hd)
        return self.o_proj(out.transpose(1, 2).reshape(B, N, -1))


class DflashDecoderLayer(nn.Module):
    def __init__(self, config: DflashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DflashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, context_kv: KV, attention_mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_kv, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DflashHead(nn.Module):
    def __init__(self, config: DflashConfig):
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.fc = nn.Linear(len(config.aux_layer_ids) * config.target_hidden_size, D, bias=False)
        self.hidden_norm = RMSNorm(D, config.rms_norm_eps)
        self.layers = nn.ModuleList(DflashDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps)
        if config.own_vocab:  # identity maps until set_draft_vocab: draft id i = target id i
            Vd, V = config.draft_vocab_size, config.vocab_size
            self.lm_head = nn.Linear(D, Vd, bias=False)
            self.lm_head.weight.requires_grad_(False)  # the target's rows, frozen as the full vocabulary's are
            self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
            self.register_buffer("t2d", torch.arange(V) < Vd)
        inv_freq, self.attention_scaling = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """position_ids (B, T) -> cos, sin (B, 1, T, hd)."""
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # (B, T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def draft_ids(self) -> torch.Tensor | None:
        """(Vd,) the target ids of the draft vocabulary, ascending; None: the target's whole vocabulary."""
        if not self.config.own_vocab:
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def to_target_ids(self, draft: torch.Tensor) -> torch.Tensor:
        """Ids of `logits`' columns (any shape) -> target ids."""
        return draft + self.d2t[draft] if self.config.own_vocab else draft

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """aux (B, C, n·Ht), the target streams at aux_layer_ids in that order -> context (B, C, D)."""
        return self.hidden_norm(self.fc(aux))

    def context_kv(self, context: torch.Tensor, position_ids: torch.Tensor) -> list[KV]:
        """context (B, C, D) at position_ids (B, C) -> per layer (k, v), each (B, nKV, C, hd)."""
        cos, sin = self.rope(position_ids, context.dtype)
        return [layer.self_attn.kv(context, cos, sin) for layer in self.layers]

    def forward(self, block_embeds: torch.Tensor, position_ids: torch.Tensor, context_kv: list[KV],
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """block_embeds (B, N, D): embeddings of the block tokens (one or several blocks side by
        side); position_ids (B, N); context_kv from `context_kv` over C positions; attention_mask
        bool (B, 1, N, C + N), True = attend, or None: every query sees every key (one block).
        Returns out (B, N, D), pre-norm; `logits` scores it."""
        cos, sin = self.rope(position_ids, block_embeds.dtype)
        x = block_embeds
        for layer, kv in zip(self.layers, context_kv):
            x = layer(x, cos, sin, kv, attention_mask)
        return x

    def logits(self, out: torch.Tensor, lm_head_weight: torch.Tensor | None = None) -> torch.Tensor:
        """out (..., D) -> logits (..., Vd) through the head's own lm_head, or (..., V) through the
        target's lm_head weight (V, D) for a head over the whole vocabulary."""
        if self.config.own_vocab:
            return self.lm_head(self.norm(out))
        if lm_head_weight is None:
            raise ValueError("DflashHead.logits: a head over the target's vocabulary needs its lm_head weight")
        return F.linear(self.norm(out), lm_head_weight)


def block_tokens(anchor_tokens: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """anchor_tokens (...,) -> (..., B) blocks [anchor, mask x (B-1)]."""
    out = anchor_tokens.new_full((*anchor_tokens.shape, block_size), mask_token_id)
    out[..., 0] = anchor_tokens
    return out


@torch.no_grad()
def set_draft_vocab(head: DflashHead, ids: torch.Tensor) -> DflashHead:
    """Install the draft vocabulary of a head with its own: sorted target ids (Vd,), into the same
    d2t/t2d maps as EAGLE-3's (heads.eagle3.set_draft_vocab)."""
    from heads.eagle3 import set_draft_vocab as set_maps

    if not head.config.own_vocab:
        raise ValueError("this DFlash head drafts over the target's whole vocabulary (draft_vocab_size "
                         f"{head.config.draft_vocab_size}); a draft vocabulary is chosen when it is built "
                         "(heads.draft_vocab_size)")
    return set_maps(head, ids)


@torch.no_grad()
def init_from_target(head: DflashHead, target, ids: torch.Tensor | None = None) -> DflashHead:
    """The draft's final norm starts as the target's; a head with its own vocabulary takes `ids`
    (sorted target ids; None keeps its maps) and the target's lm_head rows of them. fc and the
    decoder layers keep their random init."""
    head.norm.weight.copy_(target.final_norm.weight.to(head.norm.weight))
    if head.config.own_vocab:
        if ids is not None:
            set_draft_vocab(head, ids)
        rows = head.draft_ids().to(target.lm_head.weight.device)
        head.lm_head.weight.copy_(target.lm_head.weight[rows].to(head.lm_head.weight))
    return head
