"""Tree attention backends: dispatch, and the Triton kernel against the reference (under the
interpreter on the CPU, in a subprocess; natively on a GPU for fp16/bf16)."""
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eval.runtime.attention import mask_to_bits, resolve_backend, tree_attention
from eval.runtime.attention.reference import additive_mask, reference_tree_attention
from eval.runtime.tree import build_tree
from tests.helpers import random_parents

ROOT = Path(__file__).resolve().parents[2]


def test_backend_resolution():
    assert resolve_backend("auto", torch.device("cpu")) == "reference"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    with pytest.raises(ValueError):
        resolve_backend("flash", torch.device("cpu"))


def test_causal_default_equals_explicit_chain_mask():
    q, k = torch.randn(4, 6, 8), torch.randn(2, 20, 8)
    v = torch.randn_like(k)
    chain = torch.ones(6, 6, dtype=torch.bool).tril()
    torch.testing.assert_close(tree_attention(q, k, v, 5, None), reference_tree_attention(q, k, v, 5, chain))
    assert mask_to_bits(None, 3, torch.device("cpu")).tolist() == [1, 3, 7]


@pytest.mark.parametrize("seed", range(4))
def test_precomputed_additive_mask_equals_boolean_tree_mask(seed):
    """The mask a forward builds once for all layers gives the same attention as the boolean tree
    mask (random trees, GQA), and None still means a causal chain."""
    rng = random.Random(seed)
    n, prefix = rng.randint(2, 12), rng.randint(1, 20)
    tree = build_tree(random_parents(n, rng))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(4, n, 8, generator=g)
    k, v = torch.randn(2, prefix + n + 3, 8, generator=g), torch.randn(2, prefix + n + 3, 8, generator=g)
    for mask in (tree.mask, None):
        bias = additive_mask(prefix, mask, n, torch.float32, q.device)
        torch.testing.assert_close(reference_tree_attention(q, k, v, prefix, mask, bias),
                                   reference_tree_attention(q, k, v, prefix, mask))


def test_triton_kernel_matches_reference_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "tests.eval.triton_parity"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("max abs error") == 7 and "tiny model tree forward" in run.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("n,context", [(16, 512), (64, 4096), (37, 1000)])
def test_triton_kernel_on_gpu(dtype, tolerance, n, context):
    from eval.runtime.attention.triton_kernel import triton_tree_attention

    tree = build_tree(random_parents(n, random.Random(n)))
    q = torch.randn(32, n, 128, device="cuda", dtype=dtype)
    k = torch.randn(8, context + n, 128, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    out = triton_tree_attention(q, k, v, context, tree.bits.cuda())
    expected = reference_tree_attention(q.float(), k.float(), v.float(), context, tree.mask.cuda())
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
