"""EAGLE-1/2 feature decoder: `fc(cat(embed(x_{t+1}), f_t))` -> one Llama decoder layer -> f̂_{t+1}.

Plain torch. The embedding and lm_head are the target's (frozen) and are passed in, never owned:
the state dict holds exactly the EAGLE-1/2 keys of FORMATS.md minus `embed_tokens`. The predicted
feature lives in the target's final post-norm space, so `logits = target.lm_head(f̂)`.
KV cache, positions and the attention mask are explicit arguments (tree masks come from outside).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # transformers rope_parameters minus rope_theta; None: plain RoPE
    max_position_embeddings: int = 2048
    fc_bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    target_name: str = ""
    target_fingerprint: dict = field(default_factory=dict)
    # Vd of the head's draft vocabulary (buffer `draft_vocab`: sorted target ids that the logit loss
    # and the drafters score); 0: none stored, the full vocabulary (heads saved before it existed)
    draft_vocab_size: int = 0

    @classmethod
    def from_target(cls, target, **options) -> "EagleConfig":
        """Shape the head after a FrozenTarget; `options` override fields (e.g. fc_bias=True)."""
        c = target.config
        rope = dict(getattr(c, "rope_parameters", None) or {})
        theta = float(rope.pop("rope_theta", getattr(c, "rope_theta", 10000.0)))
        scaling = rope if rope.get("rope_type", "default") != "default" else None
        attn = target.decoder_layers[0].self_attn
        values = dict(
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            vocab_size=target.vocab_size,
            rms_norm_eps=c.rms_norm_eps,
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=c.max_position_embeddings,
            qkv_bias=attn.q_proj.bias is not None,
            qk_norm=hasattr(attn, "q_norm"),
            target_name=target.name,
            target_fingerprint=target.fingerprint(),
        )
        values.update(options)
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)


def rope_inv_freq(config: EagleConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (hd/2,) and attention scaling, computed by transformers' RoPE init
    functions so llama3/yarn/linear scaling matches the target exactly."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    llama = LlamaConfig(
        hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rope_parameters=parameters,
    )
    if parameters["rope_type"] == "default":
        dim = config.head_dim
        return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    return ROPE_INIT_FUNCTIONS[parameters["rope_type"]](llama)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, n, T, hd); cos/sin (B, 1, T, hd) — transformers' rotate-half convention."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Llama attention; q/k/v read `input_size` columns (EAGLE-3's layer reads 2D)."""

    def __init__(self, config: EagleConfig, input_size: int | None = None):
        super().__init__()
        c = config
        width = input_size or c.hidden_size
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(width, c.num_attention_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(width, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(width, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x, cos, sin, attention_mask, past_key_values):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, nKV, T, hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, nH, T, hd)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, nKV, T, hd)
        if past_key_values is not None:
            k = torch.cat([past_key_values[0], k], dim=2)  # (B, nKV, S, hd)
            v = torch.cat([past_key_values[1], v], dim=2)
        S = k.shape[2]
        causal = attention_mask is None and T > 1
        if causal and S != T:  # queries sit at the end of the cache: bottom-right aligned causal mask
            attention_mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)[None, None]
            causal = False
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, is_causal=causal, enable_gqa=self.n_heads != self.n_kv
        )  # (B, nH, T, hd)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama decoder layer without input norm (EAGLE's layer 0)."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, attention_mask, past_key_values):
        attn, kv = self.self_attn(x, cos, sin, attention_mask, past_key_values)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(config)])
        inv_freq, self.attention_scaling = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if config.draft_vocab_size:  # the first Vd ids until heads.vocab.set_draft_vocab installs the real ones
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size))

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """position_ids (B, T) -> cos, sin (B, 1, T, hd)."""
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # (B, T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def forward(
        self,
        input_embeds: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: tuple[torch.Tensor, torch.Tensor] | None = None,
        use_cache: bool = False,
    ):
        """input_embeds (B, T, D) = embed(x_{t+1}); features (B, T, D) = f_t; position_ids (B, T);
        attention_mask bool (B, 1, T, S), True = attend, or None for causal; past_key_values
        (k, v) each (B, nKV, S - T, hd). Returns (f̂_{t+1} (B, T, D), (k, v) over S or None)."""
        x = self.fc(torch.cat([input_embeds, features], dim=-1))  # (B, T, D)
        cos, sin = self.rope(position_ids, x.dtype)
        x, kv = self.layers[0](x, cos, sin, attention_mask, past_key_values)
        return x, (kv if use_cache else None)


@torch.no_grad()
def init_from_target(head: EagleHead, target, layer: int | None = -1, fc: str = "feature") -> EagleHead:
    """Start the decoder layer from one of the target's layers (attention, MLP, post-attention
    norm; its input norm has no place in EAGLE's layer 0). `layer=None` keeps the random init.
    fc="feature" makes fc pass f_t through at start (fc = [0 | I]); "random" keeps it random;
    "ridge" leaves fc to `set_fc_by_ridge` (fitted on data) and zeroes the attention and MLP output
    projections, so the head starts as exactly that linear fit."""
    if layer is not None:
        source = target.decoder_layers[layer]
        own = head.layers[0].state_dict()
        theirs = {k: v for k, v in source.state_dict().items() if k in own}
        missing = set(own) - set(theirs)
        if missing:
            raise ValueError(f"target layer {layer} lacks {sorted(missing)}; cannot initialise from it")
        head.layers[0].load_state_dict({k: v.to(own[k].dtype) for k, v in theirs.items()})
    if fc == "feature":
        D = head.config.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, D:].copy_(torch.eye(D))
        if head.fc.bias is not None:
            head.fc.bias.zero_()
    elif fc == "ridge":
        head.layers[0].self_attn.o_proj.weight.zero_()
        head.layers[0].mlp.down_proj.weight.zero_()
    elif fc != "random":
        raise ValueError(f"heads.eagle.init_fc={fc!r} is not one of ['feature', 'random', 'ridge']")
    return head


def ridge_solution(gram: torch.Tensor, cross: torch.Tensor, rows: int, penalty: float,
                   bias_row: bool = False) -> torch.Tensor:
    """argmin_W |X W - Y|² + penalty·rows·|W|² from gram = XᵀX (F, F) and cross = XᵀY (F, D),
    float64; with `bias_row` the last row of X is the constant 1 and is not penalised. -> (F, D)."""
    gram, cross = gram.double(), cross.double()
    ridge = torch.full((gram.shape[0],), penalty * rows, dtype=torch.float64, device=gram.device)
    if bias_row:
        ridge[-1] = 0.0
    return torch.linalg.solve(gram + torch.diag(ridge), cross)


@torch.no_grad()
def set_fc_by_ridge(head: EagleHead, gram: torch.Tensor, cross: torch.Tensor, rows: int, penalty: float) -> None:
    """Set fc to the ridge-regression solution of fc(cat(e, f_t)) ~ f_{t+1}: gram = Σ x xᵀ (2D+1, 2D+1)
    and cross = Σ x yᵀ (2D+1, D) over `rows` inputs x = [e, f_t, 1] and targets y = f_{t+1};
    penalty * rows is added to the diagonal (not to the bias). The bias row is used iff fc has a bias."""
    size = gram.shape[0] - (0 if head.fc.bias is not None else 1)
    solution = ridge_solution(gram[:size, :size], cross[:size], rows, penalty, head.fc.bias is not None)  # (size, D)
    D2 = 2 * head.config.hidden_size
    head.fc.weight.copy_(solution[:D2].T.to(head.fc.weight.dtype))
    if head.fc.bias is not None:
        head.fc.bias.copy_(solution[D2].to(head.fc.bias.dtype))