"""Parity of the Triton tree-attention kernel with the reference, run under the Triton interpreter
on the CPU. A script (the interpreter must be switched on before triton is imported), run in a
subprocess by test_attention.py: `python -m tests.eval.triton_parity` exits non-zero on a mismatch."""
import os
import random
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from eval.runtime.attention.reference import reference_tree_attention  # noqa: E402
from eval.runtime.attention.triton_kernel import triton_tree_attention  # noqa: E402
from eval.runtime.model import LeanLlama  # noqa: E402
from eval.runtime.tree import build_tree  # noqa: E402
from tests.helpers import random_parents  # noqa: E402
from tests.tiny import tiny_model  # noqa: E402

# (nodes, prefix, heads, kv_heads, head_dim, max_children): chains, bushy and deep trees, GQA/MHA/MQA,
# a 64-node tree (bit 63 is the int64 sign bit), an empty prefix, a head_dim that is not a power of 2.
CASES = [(5, 7, 4, 2, 16, None), (20, 70, 4, 1, 24, 2), (64, 3, 2, 2, 32, None), (1, 0, 4, 4, 16, None),
         (9, 0, 6, 2, 16, 1), (33, 130, 8, 2, 16, 3), (64, 65, 4, 2, 16, 1)]


def main() -> int:
    torch.manual_seed(0)
    failures = 0
    for case in CASES:
        n, prefix, heads, kv_heads, head_dim, max_children = case
        tree = build_tree(random_parents(n, random.Random(n + prefix), max_children))
        q = torch.randn(n, heads, head_dim).transpose(0, 1)  # a strided view, as the model passes it
        k = torch.randn(kv_heads, prefix + n + 5, head_dim)
        v = torch.randn_like(k)
        error = (triton_tree_attention(q, k, v, prefix, tree.bits)
                 - reference_tree_attention(q, k, v, prefix, tree.mask)).abs().max().item()
        print(f"case {case}: max abs error {error:.2e}")
        failures += not error < 1e-5
    lean = LeanLlama.from_hf(tiny_model(), max_seq_len=64)
    tree = build_tree([-1, 0, 0, 1, 2, 2, 4])
    prefix, tokens = torch.randint(0, 128, (9,)), torch.randint(0, 128, (7,))
    logits = {}
    for backend in ("reference", "triton"):
        lean.config.attention = backend
        cache = lean.new_cache()
        lean(prefix, cache)
        cache.commit()
        logits[backend] = lean(tokens, cache, cache.length + tree.depths, tree.mask, tree.bits).logits
    error = (logits["triton"] - logits["reference"]).abs().max().item()
    print(f"tiny model tree forward: max abs logit error {error:.2e}")
    failures += not error < 1e-4
    return failures


if __name__ == "__main__":
    sys.exit(main())
