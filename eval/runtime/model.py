"""A lean forward for the Llama family (Llama 2/3, Mistral, Qwen2 with q/k/v bias, Qwen3 with q/k
norm; SmolLM2 is Llama), built from a transformers model's weights by name, gpt-fast style.

Batch size is 1 and tensors drop the batch dimension: N new tokens (a prefill, one decode token, a
chain or a tree) are processed against a preallocated `KVCache` with explicit position ids and an
explicit boolean mask among the new tokens. Linear weights are stored transposed and contiguous
(`x @ W_t`): on the CPU this is ~2x faster than `F.linear` for one row (PERF-NOTES.md).
Mistral's sliding window is not applied (contexts here are far below it).

A target split across devices (transformers' `hf_device_map`, e.g. a 70B target over a GPU group)
runs where it lies: each decoder layer computes on the device holding its weights, its KV cache
lives there, and the activations (with the rotary tables and the tree mask) move at each boundary;
logits and hidden states come back on the lm_head's device (`output_device`).

Weights (`eval.runtime.placement.weight_copies_allowed`): the lean forward keeps weight copies in other
layouts (the transposed and oneDNN-packed layouts of `eval.runtime.linear_paths`, fused q|k|v and gate|up)
only for a target on the CPU, in one piece, with memory for two more copies. Otherwise it runs on
the target's own tensors: every linear layer reads the (out, in) weight in place (GPU matmuls read
that layout at full speed), and fusing concatenates q|k|v (gate|up) once and makes the transformers
module's parameters views of the fused tensor, so the model holds one copy either way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from eval.runtime import linear_paths, placement
from eval.runtime.attention import resolve_backend, tree_attention
from eval.runtime.attention.reference import additive_mask
from eval.runtime.kv_cache import KVCache


@dataclass
class LeanConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_seq_len: int = 2048
    attention: str = "auto"  # tree attention backend: auto | reference | triton
    fuse_projections: bool = True  # one q|k|v and one gate|up matmul: fewer ops per decode step
    pack_multi_row: bool = True  # CPU fp32: oneDNN-packed weight copies for N >= 2 rows (see Linear)
    weight_copies: bool = True  # False: the target's own weights only (module docstring)


@dataclass
class ForwardOutput:
    """logits: (N, V), or (1, V) with logits="last", or None.
    hidden: {layer: (N, D)} in transformers' numbering (0 = embeddings, i = output of layer i-1,
    num_layers = the final state after the last norm, the EAGLE feature)."""

    logits: torch.Tensor | None
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)


class Linear(nn.Module):
    """A frozen linear layer that runs each row count through its own path (eval.runtime.linear_paths).

    Default rule (before any measurement, `linear_paths.default_plan`): one row through `x @ W_t`
    with W_t (in, out) contiguous when in <= out (q|k|v, o, gate|up, lm_head: ~2x faster than
    `F.linear` on the CPUs measured), and through `F.linear(x, W)` with W (out, in) contiguous when
    in > out (down_proj); with `pack=True` (oneDNN on the CPU, fp32 or bf16) two or more rows go
    through a oneDNN-blocked copy of the weight. `use` installs a measured plan instead; the layer
    then keeps only the layouts that plan runs on, plus one plain layout for `weight_t`.
    `share=True` lets an (out, in) layout be the source tensor itself (no copy; it must not change).
    `copies=False` runs on the source tensor only (every row count through `F.linear`, unless a plan
    names another path on that layout) and refuses to build any other layout.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = False,
                 share: bool = False, copies: bool = True):
        super().__init__()
        weight = weight.detach()
        if not copies and not weight.is_contiguous():
            raise ValueError("a linear layer without weight copies needs a contiguous (out, in) weight")
        self.copies = copies
        self.row_major = weight.shape[1] > weight.shape[0] or not copies  # in > out
        self._source = weight if (share or not copies) and weight.is_contiguous() else None  # (out, in), shared
        stored = (self._source if self._source is not None else weight.contiguous().clone()) if self.row_major \
            else weight.t().contiguous()
        self.weight_stored = nn.Parameter(stored, requires_grad=False)
        bias = None if bias is None else bias.detach() if not copies else bias.detach().clone()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.layouts: dict[str, torch.Tensor] = {"rm" if self.row_major else "t": stored}
        if pack and copies and linear_paths.can_pack(weight):
            self.layouts["dnnl"] = linear_paths.build_layout("dnnl", weight)
        self.plan: dict[int, str] | None = None  # measured size -> path; None: the default rule
        self.use(None)

    @property
    def weight_t(self) -> torch.Tensor:
        """(in, out): a view; contiguous unless the layer is row-major."""
        return self.weight_stored.t() if self.row_major else self.weight_stored

    @property
    def packed(self) -> torch.Tensor | None:
        return self.layouts.get("dnnl")

    def layout(self, name: str) -> torch.Tensor:
        """The weight in layout `name`, built (and kept) if missing."""
        if name not in self.layouts:
            if not self.copies:
                raise ValueError(f"linear layout {name!r} would copy the weights of a target whose weights are "
                                 f"used as they are (split, not on the CPU, or short of memory: "
                                 f"eval.runtime.placement.weight_copies_allowed); only paths on the (out, in) layout run")
            source = self._source if self._source is not None else self.weight_t.t()
            self.layouts[name] = linear_paths.build_layout(name, source)
        return self.layouts[name]

    def release(self, names) -> None:
        """Drop layouts, the costlier first. The last plain layout (`weight_t` reads it) stays, or gives
        way to the source tensor where that is shared."""
        for name in sorted(names, key=self.layout_bytes, reverse=True):
            if name not in self.layouts:
                continue
            if name in linear_paths.PLAIN_LAYOUTS and not any(k in linear_paths.PLAIN_LAYOUTS and k != name
                                                              for k in self.layouts):
                if name == "rm" or self._source is None:
                    continue
                self.layouts["rm"] = self._source  # the source's own memory: free
            del self.layouts[name]
        if "t" in self.layouts:
            self.row_major, self.weight_stored.data = False, self.layouts["t"]
        else:
            self.row_major, self.weight_stored.data = True, self.layouts["rm"]

    def layout_bytes(self, name: str) -> int:
        """Bytes layout `name` holds (or would hold) beyond the source model's own memory."""
        if name == "rm" and self._source is not None:
            return 0
        numel = self.weight_stored.numel()
        if name == "dnnl" and name in self.layouts:
            numel = self.layouts[name].numel()
        return numel * self.weight_stored.element_size()

    def use(self, plan: dict[int, str] | None, beyond: str | None = None, trim: bool = True) -> None:
        """Run row count n through plan[nearest measured size] (`linear_paths.table`); None restores
        the default rule. Builds the layouts the plan needs; with `trim`, drops the others."""
        rule = plan or linear_paths.default_plan(self.row_major, "dnnl" in self.layouts)
        names = linear_paths.table(rule, beyond)
        paths = {p: linear_paths.PATHS[p] for p in set(names)}
        bound = {p: path.bind(self.layout(path.layout), self.bias) for p, path in paths.items()}
        self.plan = None if plan is None else dict(plan)
        self.beyond = beyond
        self.needed = {path.layout for path in paths.values()}
        self.table = [bound[p] for p in names]  # the callable per row count (index MAX_ROWS: and above)
        if trim:
            self.trim()

    def trim(self) -> None:
        """Drop the layouts the installed paths do not use."""
        self.release(set(self.layouts) - self.needed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return self.table[n if n < linear_paths.MAX_ROWS else linear_paths.MAX_ROWS](x)


class RMSNorm(nn.Module):
    """share=True reads `weight` in place (a frozen target's); otherwise a copy (a head may train on)."""

    def __init__(self, weight: torch.Tensor, eps: float, share: bool = False):
        super().__init__()
        weight = weight.detach()
        self.weight = nn.Parameter(weight if share else weight.clone(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op on the hot path
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in transformers' rotate_half layout: x * cos + rotate_half(x) * sin, with
    rotate_half(x) * sin = roll(x, hd/2) * [-sin, sin]. x: (N, H, hd); cos, signed_sin: (N, 1, hd)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


class Attention(nn.Module):
    def __init__(self, config: LeanConfig, layer: int, q, k, v, o, q_norm=None, k_norm=None,
                 qkv: Linear | None = None):
        """qkv: the fused q|k|v projection when already built (then q, k, v are unused)."""
        super().__init__()
        self.config, self.layer = config, layer
        self.o_proj, self.q_norm, self.k_norm = o, q_norm, k_norm
        if config.fuse_projections:
            self.qkv_proj = qkv if qkv is not None else _fused(q, k, v)
        else:
            self.q_proj, self.k_proj, self.v_proj = q, k, v

    def _project(self, x, cos, sin):
        c = self.config
        n, heads, kv_heads = x.shape[0], c.num_heads, c.num_kv_heads
        if not c.fuse_projections:
            q = self.q_proj.forward(x).view(n, heads, c.head_dim)  # (N, H, hd)
            k = self.k_proj.forward(x).view(n, kv_heads, c.head_dim)  # (N, Hkv, hd)
            v = self.v_proj.forward(x).view(n, kv_heads, c.head_dim)
        else:
            qkv = self.qkv_proj.forward(x).view(n, heads + 2 * kv_heads, c.head_dim)
            if self.q_norm is None:  # rope on q and k in one go
                qk = _rotate(qkv[:, : heads + kv_heads], cos, sin)
                return qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
            q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def forward(self, x, cos, sin, cache: KVCache, tree_mask, tree_bits, bias=None) -> torch.Tensor:
        c = self.config
        n = x.shape[0]
        q, k, v = self._project(x, cos, sin)
        cache.write(self.layer, k.transpose(0, 1), v.transpose(0, 1))
        length, keys, values = cache.length, cache.k[self.layer], cache.v[self.layer]  # (Hkv, S, hd)
        dtype = _attention_dtype(x.dtype, x.device)
        if dtype != x.dtype:  # the live part of the cache, upcast
            q, keys, values = q.to(dtype), keys[:, : length + n].to(dtype), values[:, : length + n].to(dtype)
        if n == 1:  # one decode token sees the whole prefix: no mask, no backend dispatch
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None, :, : length + 1],
                                                 values[None, :, : length + 1],
                                                 enable_gqa=c.num_heads != c.num_kv_heads)[0]
        else:
            out = tree_attention(q.transpose(0, 1), keys, values, length, tree_mask, tree_bits=tree_bits,
                                 backend=c.attention, bias=bias)  # (H, N, hd)
        return self.o_proj.forward(out.transpose(0, 1).reshape(n, c.num_heads * c.head_dim).to(x.dtype))


def _attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Attention runs in fp32 on the CPU: its bf16 SDPA measured 1.1-4x slower than upcasting the
    live cache and running fp32 (one query: 4x; docs/performance.md), and the decode step and the
    verification then compute alike."""
    return torch.float32 if device.type == "cpu" else dtype


def _fused(*linears: Linear) -> Linear:
    """One Linear computing the concatenated outputs of several (same input)."""
    weight = torch.cat([linear.weight_t for linear in linears], dim=1).t()
    pack = any(linear.packed is not None for linear in linears)
    if all(linear.bias is None for linear in linears):
        return Linear(weight, pack=pack)
    return Linear(weight, torch.cat([linear.weight_t.new_zeros(linear.weight_t.shape[1]) if linear.bias is None
                                     else linear.bias for linear in linears]), pack=pack)


class MLP(nn.Module):
    def __init__(self, gate, up, down, fuse: bool = False, gate_up: Linear | None = None):
        super().__init__()
        self.down_proj = down
        if fuse:
            self.gate_up_proj = gate_up if gate_up is not None else _fused(gate, up)
        else:
            self.gate_proj, self.up_proj = gate, up
        self.fuse = fuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fuse:
            gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
            return self.down_proj.forward(F.silu(gate) * up)
        return self.down_proj.forward(F.silu(self.gate_proj.forward(x)) * self.up_proj.forward(x))


class Block(nn.Module):
    def __init__(self, attention: Attention, mlp: MLP, input_norm: RMSNorm, post_norm: RMSNorm):
        super().__init__()
        self.attention, self.mlp = attention, mlp
        self.input_norm, self.post_norm = input_norm, post_norm

    def forward(self, x, cos, sin, cache, tree_mask, tree_bits, bias=None) -> torch.Tensor:
        # Submodules are called through .forward: nn.Module.__call__ costs a few microseconds each,
        # ~1 ms per SmolLM2 decode step over 9 calls x 30 layers (no hooks are used here).
        x = x + self.attention.forward(self.input_norm.forward(x), cos, sin, cache, tree_mask, tree_bits, bias)
        return x + self.mlp.forward(self.post_norm.forward(x))


class LeanLlama(nn.Module):
    """The target (or a truncated copy of it) as a plain forward over an explicit KV cache."""

    def __init__(self, config: LeanConfig, embedding: torch.Tensor, blocks: Sequence[Block], norm: RMSNorm,
                 lm_head: Linear, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                 keys: Sequence | None = None, devices: Sequence[torch.device] | None = None,
                 weights_note: str = ""):
        """keys, devices: the placement (`eval.runtime.placement.locate`) of the embedding, each block and
        the head; default: all on the embedding's device."""
        super().__init__()
        self.config = config
        self.embedding = nn.Parameter(embedding, requires_grad=False)  # (V, D), shared with the HF model
        self.blocks = nn.ModuleList(blocks)
        self.norm, self.lm_head = norm, lm_head
        if devices is None:
            devices = [embedding.device] * (config.num_layers + 2)
            keys = [str(embedding.device)] * len(devices)
        self.keys, self.devices = list(keys), list(devices)
        self.stages, self.head_stage = placement.stages(self.keys, self.devices, config.num_layers)
        self.weights_note = weights_note
        positions = torch.arange(config.max_seq_len, dtype=torch.float32, device=embedding.device)
        angles = torch.outer(positions, inv_freq.to(embedding.device).float())
        cos, sin = angles.cos() * attention_scaling, angles.sin() * attention_scaling  # (S, hd/2)
        dtype = embedding.dtype
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1).to(dtype), persistent=False)  # (S, hd)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1).to(dtype), persistent=False)  # signed

    @property
    def output_device(self) -> torch.device:
        """Where logits and hidden states come back: the lm_head's device."""
        return self.head_stage.device

    @property
    def is_split(self) -> bool:
        return len(set(self.keys)) > 1

    def placement(self) -> dict:
        """Where each run of decoder layers and the head compute, for the report: a split target's
        record of its devices (`key` is the device map's name for one)."""
        runs = [*self.stages, self.head_stage]
        return {"split": self.is_split, "boundaries": sum(s.cross for s in runs),
                "stages": [{"layers": "head" if s is self.head_stage else [s.start, s.end],
                            "key": str(self.keys[-1] if s is self.head_stage else self.keys[1 + s.start]),
                            "device": str(s.device)} for s in runs]}

    @classmethod
    @torch.no_grad()
    def from_hf(cls, hf_model: nn.Module, max_seq_len: int = 2048, attention: str = "auto",
                fuse_projections: bool = True, pack_multi_row: bool = True, weight_copies: bool | None = None,
                device_map: Mapping[str, Any] | None = None, devices: Mapping[Any, Any] | None = None) -> "LeanLlama":
        """Build from a transformers *ForCausalLM of the Llama family by parameter name, computing
        each part where its weights lie (`eval.runtime.placement.locate`: device_map, devices).
        weight_copies: None applies `eval.runtime.placement.weight_copies_allowed`; False runs on the
        target's own weights, fusing q|k|v and gate|up in place."""
        hf_config = hf_model.config
        keys, where = placement.locate(hf_model, device_map, devices)
        note = "weight copies as asked" if weight_copies else "the target's own weights, as asked"
        if weight_copies is None:
            weight_bytes = sum(p.numel() * p.element_size() for p in hf_model.parameters())
            weight_copies, note = placement.weight_copies_allowed(where, keys, weight_bytes)
        weights = dict(hf_model.named_parameters())
        weights.update(dict(hf_model.named_buffers()))
        num_heads = hf_config.num_attention_heads
        config = LeanConfig(
            vocab_size=hf_model.get_output_embeddings().weight.shape[0],
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_seq_len=max_seq_len,
            attention=attention,
            fuse_projections=fuse_projections,
            pack_multi_row=pack_multi_row and weight_copies,
            weight_copies=weight_copies,
        )

        def linear(name: str) -> Linear:
            return Linear(weights[f"{name}.weight"], weights.get(f"{name}.bias"), pack=config.pack_multi_row,
                          share=True, copies=weight_copies)

        def fused(prefix: str, names: Sequence[str]) -> Linear | None:
            """Without copies: the parts fused in place in the HF modules (none are built alone)."""
            if weight_copies or not fuse_projections:
                return None
            modules = [hf_model.get_submodule(f"{prefix}.{n}") for n in names]
            rows = [m.weight.shape[0] for m in modules]
            return Linear(placement.fuse_in_place([m.weight for m in modules], rows),
                          placement.fuse_in_place([m.bias for m in modules], rows), copies=False)

        def unfused(name: str, fuse: Linear | None) -> Linear | None:
            return None if fuse is not None else linear(name)

        def norm(name: str) -> RMSNorm | None:
            weight = weights.get(f"{name}.weight")
            return None if weight is None else RMSNorm(weight, config.rms_norm_eps, share=True)

        blocks = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}"
            qkv = fused(f"{p}.self_attn", ("q_proj", "k_proj", "v_proj"))
            attention_module = Attention(
                config, i, *(unfused(f"{p}.self_attn.{n}_proj", qkv) for n in "qkv"), linear(f"{p}.self_attn.o_proj"),
                q_norm=norm(f"{p}.self_attn.q_norm"), k_norm=norm(f"{p}.self_attn.k_norm"), qkv=qkv,
            )
            gate_up = fused(f"{p}.mlp", ("gate_proj", "up_proj"))
            mlp = MLP(unfused(f"{p}.mlp.gate_proj", gate_up), unfused(f"{p}.mlp.up_proj", gate_up),
                      linear(f"{p}.mlp.down_proj"), fuse=fuse_projections, gate_up=gate_up)
            blocks.append(Block(attention_module, mlp, norm(f"{p}.input_layernorm"),
                                norm(f"{p}.post_attention_layernorm")))
        rotary = hf_model.model.rotary_emb
        final_norm = RMSNorm(weights["model.norm.weight"].to(where[-1]), config.rms_norm_eps, share=True)
        return cls(
            config, hf_model.get_input_embeddings().weight.detach(), blocks, final_norm,
            Linear(hf_model.get_output_embeddings().weight, pack=config.pack_multi_row, share=True,
                   copies=weight_copies),
            rotary.inv_freq.detach(),
            float(getattr(rotary, "attention_scaling", 1.0)),
            keys, where, note,
        )

    def linear_sites(self) -> dict[str, list[Linear]]:
        """The linear layers grouped by role (q|k|v, o, gate|up, down, ... in every block; lm_head)."""
        sites: dict[str, list[Linear]] = {}
        for block in self.blocks:
            for module in (block.attention, block.mlp):
                for name, child in module.named_children():
                    if isinstance(child, Linear):
                        sites.setdefault(name, []).append(child)
        sites["lm_head"] = [self.lm_head]
        return sites

    def truncated(self, num_layers: int) -> "LeanLlama":
        """A draft model sharing this model's first `num_layers` blocks, its norm and lm_head
        (self-speculation). Needs its own cache (`new_cache`)."""
        if not 1 <= num_layers <= self.config.num_layers:
            raise ValueError(f"truncated: num_layers must be in [1, {self.config.num_layers}]")
        draft = LeanLlama.__new__(LeanLlama)
        nn.Module.__init__(draft)
        draft.config = LeanConfig(**{**self.config.__dict__, "num_layers": num_layers})
        draft.embedding = self.embedding
        draft.blocks = nn.ModuleList(self.blocks[:num_layers])
        draft.norm, draft.lm_head = self.norm, self.lm_head
        draft.keys = self.keys[:1 + num_layers] + self.keys[-1:]
        draft.devices = self.devices[:1 + num_layers] + self.devices[-1:]
        draft.stages, draft.head_stage = placement.stages(draft.keys, draft.devices, num_layers)
        draft.weights_note = self.weights_note
        draft.register_buffer("cos", self.cos, persistent=False)
        draft.register_buffer("sin", self.sin, persistent=False)
        return draft

    def new_cache(self, max_length: int | None = None) -> KVCache:
        """A cache whose layer entries live on their layers' devices."""
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_length or c.max_seq_len,
                       dtype=self.embedding.dtype, device=self.devices[1:1 + c.num_layers])

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        tree_bits: torch.Tensor | None = None,
        hidden_layers: Sequence[int] = (),
        logits: str = "all",
    ) -> ForwardOutput:
        """Run N new tokens against the cache and leave their K/V pending in it.

        tokens: (N,) int64. positions: (N,) int64, default cache.length + arange(N) (a chain).
        tree_mask: (N, N) bool, True where new token i may attend to new token j (it always sees
        the whole committed prefix); None = causal. tree_bits: (N,) int64 ancestor bitmask of the
        same mask (optional; the Triton backend uses it). hidden_layers: transformers numbering,
        negative counts from the final post-norm state. logits: "all" (N, V) | "last" (1, V) | "none".
        Logits and hidden states are on `output_device`.
        Call `cache.commit()` or `cache.compact(accepted)` afterwards.
        """
        n = tokens.shape[0]
        cache.reserve(n)
        device = self.embedding.device
        tokens = tokens.to(device)
        if positions is None:
            positions = torch.arange(cache.length, cache.length + n, device=device)
        positions = positions.to(device)
        tree_mask = None if tree_mask is None else tree_mask.to(device)
        tree_bits = None if tree_bits is None else tree_bits.to(device)
        cos = self.cos[positions].unsqueeze(1)  # (N, 1, hd)
        sin = self.sin[positions].unsqueeze(1)
        num_layers = self.config.num_layers
        wanted = {layer % (num_layers + 1) for layer in hidden_layers}
        hidden = {}
        x = self.embedding[tokens]  # (N, D)
        for stage in self.stages:
            if stage.cross:
                x, cos, sin, tree_mask, tree_bits = placement.move((x, cos, sin, tree_mask, tree_bits), stage.device)
            bias = None  # the reference attention's mask, built once for the stage's layers
            if n > 1 and cache.length > 0 and resolve_backend(self.config.attention, stage.device) == "reference":
                bias = additive_mask(cache.length, tree_mask, n, _attention_dtype(self.embedding.dtype, stage.device),
                                     stage.device)
            for i in range(stage.start, stage.end):
                if i in wanted:
                    hidden[i] = x
                x = self.blocks[i].forward(x, cos, sin, cache, tree_mask, tree_bits, bias)
        if self.head_stage.cross:
            x, = placement.move((x,), self.head_stage.device)
        if num_layers in wanted:
            x = hidden[num_layers] = self.norm(x)
        else:
            x = self.norm(x[-1:] if logits == "last" else x)
        if logits == "last":
            x = x[-1:]
        out = None if logits == "none" else self.lm_head(x)
        if self.is_split:
            hidden = {layer: state.to(self.output_device) for layer, state in hidden.items()}
        return ForwardOutput(out, hidden)
