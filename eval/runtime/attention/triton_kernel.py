"""Tree attention as a Triton kernel: N tree queries against the cached prefix plus the tree.

The tree mask arrives as one int64 ancestor bitmask per node (bit j of bits[i] = node i may attend
to node j; N <= 64). GQA-aware: one program serves all query heads sharing a KV head, so each
key/value block is loaded once per group (rows = group x N queries). Flash-attention style online
softmax in fp32. On the CPU it runs under TRITON_INTERPRET=1 (set before importing triton), which
the parity tests use; `benchmark` compares it with the reference on a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bits_ptr,
    stride_qh, stride_qn, stride_kh, stride_ks, stride_vh, stride_vs, stride_oh, stride_on,
    prefix_length, num_nodes, head_dim, group, scale,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    kv_head = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # query rows of this KV group
    row_ok = rows < group * num_nodes
    head = kv_head * group + rows // num_nodes
    node = rows % num_nodes
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + head[:, None] * stride_qh + node[:, None] * stride_qn + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    bits = tl.load(bits_ptr + node, mask=row_ok, other=0)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh

    m_i = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    total = prefix_length + num_nodes
    for start in range(0, total, BLOCK_S):
        cols = start + tl.arange(0, BLOCK_S)  # key slots
        col_ok = cols < total
        k = tl.load(k_base + cols[:, None] * stride_ks + dims[None, :], mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vs + dims[None, :], mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_R, BLOCK_S)
        tree_col = cols - prefix_length  # node index of a tree key, negative for the prefix
        in_tree = (tree_col >= 0) & col_ok
        shift = tl.where(in_tree, tree_col, 0).to(tl.int64)
        ancestor = ((bits[:, None] >> shift[None, :]) & 1) != 0
        allowed = ((tree_col < 0)[None, :] | (in_tree[None, :] & ancestor)) & col_ok[None, :]
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(scores - m_safe[:, None])
        correction = tl.exp(m_i - m_safe)
        l_i = l_i * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + head[:, None] * stride_oh + node[:, None] * stride_on + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def triton_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_length: int,
                          tree_bits: torch.Tensor) -> torch.Tensor:
    """Same contract as `reference_tree_attention`, with the mask as (N,) int64 ancestor bits.
    q: (H, N, hd); k, v: (Hkv, S, hd), last dimension contiguous. Returns (H, N, hd)."""
    heads, num_nodes, head_dim = q.shape
    kv_heads = k.shape[0]
    if heads % kv_heads or num_nodes > 64 or tree_bits.shape != (num_nodes,):
        raise ValueError("triton tree attention: needs H % Hkv == 0, N <= 64 and (N,) bits")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(heads, num_nodes, head_dim, dtype=q.dtype, device=q.device)
    group = heads // kv_heads
    rows = group * num_nodes
    block_r = min(64, max(16, triton.next_power_of_2(rows)))
    grid = (kv_heads, triton.cdiv(rows, block_r))
    _tree_attention_kernel[grid](
        q, k, v, out, tree_bits.to(q.device, torch.int64).contiguous(),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        prefix_length, num_nodes, head_dim, group, head_dim**-0.5,
        BLOCK_R=block_r, BLOCK_S=64, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


def benchmark(tree_sizes=(16, 32, 64), contexts=(512, 2048, 8192), heads: int = 32, kv_heads: int = 8,
              head_dim: int = 128, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """GPU micro-benchmark: kernel vs reference (SDPA with a dense boolean tree mask): their max
    absolute difference and microseconds per call (do_bench synchronises), on random trees;
    returns and prints one row per (tree size, context)."""
    from triton.testing import do_bench

    from eval.runtime.attention.reference import reference_tree_attention
    from eval.runtime.tree import build_tree

    generator = torch.Generator().manual_seed(0)
    rows = []
    for n in tree_sizes:
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)]
        tree = build_tree(parents)
        mask, bits = tree.mask.cuda(), tree.bits.cuda()
        for context in contexts:
            q = torch.randn(heads, n, head_dim, device="cuda", dtype=dtype)
            k = torch.randn(kv_heads, context + n, head_dim, device="cuda", dtype=dtype)
            v = torch.randn_like(k)
            difference = (triton_tree_attention(q, k, v, context, bits).float()
                          - reference_tree_attention(q, k, v, context, mask).float()).abs().max().item()
            kernel_us = 1e3 * do_bench(lambda: triton_tree_attention(q, k, v, context, bits))
            reference_us = 1e3 * do_bench(lambda: reference_tree_attention(q, k, v, context, mask))
            rows.append(dict(tree_size=n, context=context, dtype=str(dtype), max_abs_diff=difference,
                             triton_us=kernel_us, reference_us=reference_us, speedup=reference_us / kernel_us))
            print(f"N={n:3d} context={context:5d}  triton {kernel_us:8.1f} us  reference {reference_us:8.1f} us"
                  f"  x{reference_us / kernel_us:.2f}")
    return rows
