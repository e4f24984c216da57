import torch

from data.collate import collate
from train.objectives import MemoizedFeatures, OnlineFeatures
from tests.tiny import tiny_target


def _batch(rows):
    batch = collate(rows, 0)
    batch["ids"] = [row["id"] for row in rows]
    return batch


def test_memoized_features_match_online_and_skip_the_target():
    online = OnlineFeatures(tiny_target())
    calls = []

    def counting(batch):
        calls.append(len(batch["ids"]))
        return online(batch)

    rows = [{"id": f"r{i}", "input_ids": list(range(3, 3 + n)), "loss_mask": [1] * n} for i, n in enumerate((5, 9, 7))]
    memo = MemoizedFeatures(counting, max_megabytes=1)
    first = memo(_batch(rows[:2]))
    assert calls == [2]
    again = memo(_batch([rows[1], rows[0]]))  # another batch order and padding length
    assert calls == [2]
    torch.testing.assert_close(again[0, :9], first[1, :9])
    torch.testing.assert_close(again[1, :5], first[0, :5])
    assert (again[1, 5:] == 0).all()
    memo(_batch(rows[1:]))  # r2 unseen: the target runs, and r2 is kept
    assert calls == [2, 2] and set(memo.rows) == {"r0", "r1", "r2"}
    tiny = MemoizedFeatures(counting, max_megabytes=5 * 64 * 4 / 2**20)  # room for 5 positions only
    tiny(_batch(rows[:2]))
    assert set(tiny.rows) == {"r0"}
