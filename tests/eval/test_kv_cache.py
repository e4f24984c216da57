"""KV cache: in-place compaction of an accepted tree path, capacity checks."""
import pytest
import torch

from eval.runtime.kv_cache import KVCache
from eval.runtime.model import LeanLlama
from eval.runtime.tree import build_tree
from tests.tiny import tiny_model


def test_compact_moves_accepted_entries_in_place():
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=1, max_length=10)
    storage = cache.k.data_ptr()
    cache.reserve(3)
    for layer in range(2):
        cache.write(layer, torch.tensor([[[1.0], [2.0], [3.0]]]), torch.tensor([[[1.0], [2.0], [3.0]]]))
    cache.commit()
    cache.reserve(5)
    for layer in range(2):
        values = torch.arange(10.0, 15.0).view(1, 5, 1) + layer
        cache.write(layer, values, -values)
    cache.compact([0, 2, 4])
    assert cache.length == 6 and cache.k.data_ptr() == storage
    assert cache.k[1, 0, :6, 0].tolist() == [1, 2, 3, 11, 13, 15]
    assert cache.v[0, 0, :6, 0].tolist() == [1, 2, 3, -10, -12, -14]
    cache.reserve(2)
    cache.compact([0, 1])  # a prefix needs no copy
    assert cache.length == 8
    with pytest.raises(ValueError):
        cache.reserve(3)
    with pytest.raises(ValueError):
        cache.compact([5])


def test_decoding_after_compaction_equals_decoding_the_path_from_scratch():
    lean = LeanLlama.from_hf(tiny_model(), max_seq_len=64)
    prefix = torch.randint(0, 128, (6,))
    tree = build_tree([-1, 0, 0, 2, 2, 4])
    tokens = torch.randint(0, 128, (6,))
    path = [0, 2, 4, 5]
    follow_up = torch.randint(0, 128, (3,))

    cache = lean.new_cache()
    lean(prefix, cache)
    cache.commit()
    lean(tokens, cache, positions=cache.length + tree.depths, tree_mask=tree.mask)
    cache.compact(path)
    after_compaction = lean(follow_up, cache).logits

    fresh = lean.new_cache()
    lean(torch.cat([prefix, tokens[path]]), fresh)
    fresh.commit()
    torch.testing.assert_close(after_compaction, lean(follow_up, fresh).logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.k[:, :, :10], fresh.k[:, :, :10], atol=1e-5, rtol=1e-5)
