"""The lean target forward over a batch of sequences, each with its own cache length.

`BatchKVCache` holds one `KVCache` view per slot over shared (L, B, Hkv, S, hd) buffers: a
sequence's committed entries, its pending entries and its compaction are those of a batch-1 cache,
so `KVCache.compact` works per sequence as it is. The active sequences occupy slots [0, B); a
finished one leaves by `move`-ing the last active slot into its place, so the batch forward always
runs over a contiguous prefix of slots and a finished sequence costs nothing.

`batch_forward` runs N new tokens per sequence (a decode token, a chain, a tree; padded to the
longest) through the blocks of a `LeanLlama` with the B*N rows flattened for the linear layers, and
attention per sequence: query i of sequence b sees b's committed prefix [0, length_b) and its own
new tokens where tree_mask[b, i] allows. Padding rows see only themselves and are never seen; their
K/V land in pending slots that `compact` drops. One sequence takes the model's own batch-1 forward
(the fast path, unchanged).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from eval.runtime.kv_cache import KVCache
from eval.runtime.model import ForwardOutput, LeanLlama, _attention_dtype


class BatchKVCache:
    """k, v: (L, B, Hkv, S, hd); `caches[b]` the batch-1 view of slot b."""

    def __init__(self, model: LeanLlama, batch: int, max_length: int | None = None):
        if len(set(model.devices)) > 1:  # its buffers live on one device
            raise ValueError(f"batched decoding (runtime.batch_sizes) runs a target on one device; this one is "
                             f"split across {sorted(set(map(str, model.devices)))}")
        c = model.config
        shape = (c.num_layers, batch, c.num_kv_heads, max_length or c.max_seq_len, c.head_dim)
        self.k = torch.zeros(shape, dtype=model.embedding.dtype, device=model.embedding.device)
        self.v = torch.zeros_like(self.k)
        self.caches = [KVCache.over(self.k[:, b], self.v[:, b]) for b in range(batch)]

    @property
    def capacity(self) -> int:
        return len(self.caches)

    @property
    def max_length(self) -> int:
        return self.k.shape[3]

    def move(self, source: int, target: int) -> None:
        """Slot `source`'s committed entries into slot `target` (whose entries are dropped)."""
        length = self.caches[source].length
        self.k[:, target, :, :length] = self.k[:, source, :, :length]
        self.v[:, target, :, :length] = self.v[:, source, :, :length]
        self.caches[target].length, self.caches[target].pending = length, 0
        self.caches[source].truncate(0)


def _attention_bias(lengths: torch.Tensor, tree_mask: torch.Tensor | None, n: int, dtype, device) -> torch.Tensor:
    """(B, 1, N, max(lengths) + N) additive mask: 0 where query i of sequence b may attend key slot s
    (s < length_b, or s = length_b + j with tree_mask[b, i, j]; None = causal), -inf elsewhere."""
    b = lengths.shape[0]
    if tree_mask is None:
        tree_mask = torch.ones(n, n, dtype=torch.bool, device=device).tril_().expand(b, n, n)
    slots = torch.arange(int(lengths.max()) + n, device=device)
    relative = slots[None, :] - lengths[:, None]  # (B, S): key slot minus the sequence's prefix length
    inside = (relative >= 0) & (relative < n)
    gathered = tree_mask.gather(2, relative.clamp(0, n - 1)[:, None, :].expand(b, n, -1))  # (B, N, S)
    allowed = (relative < 0)[:, None, :] | (inside[:, None, :] & gathered)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    return bias[:, None]


@torch.no_grad()
def batch_forward(model: LeanLlama, tokens: torch.Tensor, cache: BatchKVCache, positions: torch.Tensor | None = None,
                  tree_mask: torch.Tensor | None = None, hidden_layers=(), logits: str = "all") -> ForwardOutput:
    """Run N new tokens for each of the first B slots of `cache` and leave their K/V pending.

    tokens: (B, N) int64. positions: (B, N), default length_b + arange(N). tree_mask: (B, N, N)
    bool, True where new token i of a sequence may attend to its new token j (None = causal).
    Returns logits (B, N, V) ("all"), (B, 1, V) ("last") or None ("none"); hidden {layer: (B, N, D)}.
    Then `commit` or `compact` each `cache.caches[b]`."""
    b, n = tokens.shape
    if b == 1:  # the batch-1 forward, unchanged
        out = model.forward(tokens[0], cache.caches[0], None if positions is None else positions[0],
                            None if tree_mask is None else tree_mask[0], hidden_layers=hidden_layers, logits=logits)
        return ForwardOutput(None if out.logits is None else out.logits[None],
                             {k: v[None] for k, v in out.hidden.items()})
    c, device = model.config, model.embedding.device
    views = cache.caches[:b]
    for view in views:
        view.reserve(n)
    lengths = torch.tensor([view.length for view in views], device=device)  # (B,)
    slots = lengths[:, None] + torch.arange(n, device=device)  # (B, N): where the new K/V go
    if positions is None:
        positions = slots
    positions, tokens = positions.to(device), tokens.to(device)
    attention_dtype = _attention_dtype(model.embedding.dtype, device)
    bias = _attention_bias(lengths, None if tree_mask is None else tree_mask.to(device), n, attention_dtype, device)
    span = bias.shape[-1]
    cos = model.cos[positions].view(b * n, 1, -1)  # (B*N, 1, hd)
    sin = model.sin[positions].view(b * n, 1, -1)
    rows = torch.arange(b, device=device)[:, None]
    wanted = {layer % (c.num_layers + 1) for layer in hidden_layers}
    hidden = {}
    x = model.embedding[tokens.reshape(-1)]  # (B*N, D)
    for i, block in enumerate(model.blocks):
        if i in wanted:
            hidden[i] = x.view(b, n, -1)
        attention = block.attention
        q, k, v = attention._project(block.input_norm.forward(x), cos, sin)  # (B*N, H|Hkv, hd)
        keys, values = cache.k[i], cache.v[i]  # (Bmax, Hkv, S, hd)
        keys[rows, :, slots] = k.view(b, n, c.num_kv_heads, c.head_dim)
        values[rows, :, slots] = v.view(b, n, c.num_kv_heads, c.head_dim)
        keys, values = keys[:b, :, :span], values[:b, :, :span]
        q = q.view(b, n, c.num_heads, c.head_dim).transpose(1, 2)  # (B, H, N, hd)
        if attention_dtype != x.dtype:
            q, keys, values = q.to(attention_dtype), keys.to(attention_dtype), values.to(attention_dtype)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias,
                                             enable_gqa=c.num_heads != c.num_kv_heads)  # (B, H, N, hd)
        out = out.transpose(1, 2).reshape(b * n, c.num_heads * c.head_dim).to(x.dtype)
        x = x + attention.o_proj.forward(out)
        x = x + block.mlp.forward(block.post_norm.forward(x))
    x = x.view(b, n, -1)
    if c.num_layers in wanted:
        x = hidden[c.num_layers] = model.norm(x)
    else:
        x = model.norm(x[:, -1:] if logits == "last" else x)
    if logits == "last":
        x = x[:, -1:]
    out = None if logits == "none" else model.lm_head(x.reshape(-1, x.shape[-1])).view(b, x.shape[1], -1)
    return ForwardOutput(out, hidden)
