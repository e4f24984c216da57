import pytest
import torch

from data.collate import collate, length_grouped_batches


def test_collate_right_pads_and_masks_padding():
    rows = [{"id": "a", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
            {"id": "b", "input_ids": [8], "loss_mask": [1]}]
    batch = collate(rows, pad_id=0)
    assert torch.equal(batch["input_ids"], torch.tensor([[5, 6, 7], [8, 0, 0]]))
    assert torch.equal(batch["attention_mask"], torch.tensor([[1, 1, 1], [1, 0, 0]]))
    assert torch.equal(batch["loss_mask"], torch.tensor([[0, 1, 1], [1, 0, 0]]))
    assert all(t.dtype == torch.long for t in batch.values())


def test_collate_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="'a'"):
        collate([{"id": "a", "input_ids": [1, 2], "loss_mask": [1]}], pad_id=0)


def test_length_grouped_batches_cover_all_rows_with_similar_lengths():
    lengths = [(i * 37) % 101 for i in range(200)]
    batches = length_grouped_batches(lengths, batch_size=8, seed=0, group_batches=25)
    assert sorted(i for b in batches for i in b) == list(range(200))
    assert all(len(b) == 8 for b in batches)
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
    assert spread < 10  # random batches would spread ~80
    assert batches == length_grouped_batches(lengths, 8, seed=0, group_batches=25)
    assert batches != length_grouped_batches(lengths, 8, seed=1, group_batches=25)
