"""Tree layout derivation, and the property that defines tree attention: attending over the tree
equals causal attention run separately along each root-to-leaf path."""
import random

import pytest
import torch
import torch.nn.functional as F

from eval.runtime.attention import mask_to_bits
from eval.runtime.attention.reference import reference_tree_attention
from eval.runtime.tree import build_tree, candidate_parents_to_tree, chain_parents
from tests.helpers import random_parents, tree_paths


def test_chain_layout():
    tree = build_tree(chain_parents(4))
    assert torch.equal(tree.mask, torch.ones(5, 5, dtype=torch.bool).tril())
    assert tree.depths.tolist() == [0, 1, 2, 3, 4] and tree_paths(tree.parents) == [[0, 1, 2, 3, 4]]
    assert candidate_parents_to_tree([-1, 0, -1]) == [-1, 0, 1, 0]


def test_branching_layout():
    tree = build_tree([-1, 0, 0, 1, 1, 2])
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2]
    assert tree_paths(tree.parents) == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    assert tree.mask[4].nonzero().flatten().tolist() == [0, 1, 4]
    assert tree.children(1) == [3, 4]


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 0, 3, 1]])
def test_invalid_trees_rejected(parents):
    with pytest.raises(ValueError):
        build_tree(parents)


@pytest.mark.parametrize("n", [1, 2, 7, 63, 64, 65, 130])
def test_bits_and_mask_agree(n):
    tree = build_tree(random_parents(n, random.Random(n)))
    for i, parent in enumerate(tree.parents.tolist()):  # mask row = own bit + parent's row
        expected = tree.mask[parent].clone() if parent >= 0 else torch.zeros(n, dtype=torch.bool)
        expected[i] = True
        assert torch.equal(tree.mask[i], expected)
    if n <= 64:
        assert torch.equal(tree.bits, mask_to_bits(tree.mask, n, tree.mask.device))
    else:
        assert tree.bits is None


@pytest.mark.parametrize("seed,n,max_children", [(0, 6, None), (1, 16, 2), (2, 31, 4), (3, 12, 1), (4, 40, None)])
def test_tree_attention_equals_causal_attention_per_path(seed, n, max_children):
    rng = random.Random(seed)
    tree = build_tree(random_parents(n, rng, max_children))
    heads, kv_heads, head_dim, prefix = 4, 2, 16, 5
    q = torch.randn(heads, n, head_dim)
    k = torch.randn(kv_heads, prefix + n + 3, head_dim)  # spare capacity after the tree
    v = torch.randn(kv_heads, prefix + n + 3, head_dim)
    out = reference_tree_attention(q, k, v, prefix, tree.mask)
    for path in tree_paths(tree.parents):
        slots = list(range(prefix)) + [prefix + i for i in path]
        keys = k[:, slots].repeat_interleave(heads // kv_heads, 0)
        values = v[:, slots].repeat_interleave(heads // kv_heads, 0)
        scores = q[:, path] @ keys.transpose(1, 2) / head_dim**0.5  # (H, P, prefix + P)
        causal = torch.ones(len(path), prefix + len(path), dtype=torch.bool).tril(prefix)
        expected = F.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ values
        torch.testing.assert_close(out[:, path], expected, atol=1e-5, rtol=1e-5)
