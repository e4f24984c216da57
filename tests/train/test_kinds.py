"""Head kinds: the loop reaches every kind-specific piece through the HeadKind protocol."""
import json
import re
from collections import Counter

import pytest
import torch

from train import kinds as kinds_module
from train.kinds import EagleKind, MedusaKind, head_kind
from train.loop import train_heads
from train.objectives import FINAL, MemoizedFeatures, OnlineFeatures
from tests.tiny import tiny_target
from tests.train.loop_fixtures import tiny_data, tiny_job


class Recording:
    """A kind that forwards to a real one and counts the loop's calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, Counter()
        self.name, self.unit, self.drafters = inner.name, inner.unit, inner.drafters

    def __getattr__(self, attribute):
        member = getattr(self.inner, attribute)
        if not callable(member):
            return member

        def call(*args, **kwargs):
            self.calls[attribute] += 1
            return member(*args, **kwargs)

        return call

    @property
    def eval_rows(self):
        return self.inner.eval_rows


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa", "peagle"])
def test_the_loop_runs_each_kind_through_the_protocol(tmp_path, monkeypatch, kind):
    made = []
    real = dict(kinds_module.KINDS)
    monkeypatch.setitem(kinds_module.KINDS, kind, lambda heads: made.append(Recording(real[kind](heads))) or made[-1])
    job = tiny_job(tmp_path, kind, max_steps=2, eval_every=2, save_every=2, grad_accumulation=2)
    if kind == "eagle":
        job.heads.eagle.init_fc, job.heads.eagle.ridge_tokens = "ridge", 100
    if kind == "peagle":  # the tiny target has 2 layers, as for EAGLE-3
        job.heads.peagle.aux_layer_ids, job.heads.peagle.speculative_tokens = [0, 1, 1], 3
    result = train_heads(job, tiny_target(), tiny_data())
    calls = made[0].calls
    assert calls["build"] == 1 and calls["param_groups"] == 1 and calls["prepare"] == 1
    assert calls["feature_layers"] == 1
    assert calls["step"] == 4 and calls["figures"] == 4  # 2 optimizer steps x 2 micro-batches
    assert calls["eval_counts"] == 2  # at step 0 and at step 2, one held-out batch each
    assert result.head_type == kind
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    unit = "head" if kind == "medusa" else "step"
    train_keys = set().union(*(r for r in rows if "train/loss" in r))
    assert f"train/top1_{unit}0" in train_keys
    assert {f"eval/top1_{unit}{i}" for i in range(made[0].eval_rows)} <= set(rows[-1])


def test_prepare_is_skipped_when_the_head_comes_from_init_from(tmp_path, monkeypatch):
    target, data = tiny_target(), tiny_data()
    first = train_heads(tiny_job(tmp_path / "first", max_steps=1), target, data)
    made = []
    monkeypatch.setitem(kinds_module.KINDS, "eagle",
                        lambda heads: made.append(Recording(EagleKind(heads.eagle))) or made[-1])
    train_heads(tiny_job(tmp_path / "second", max_steps=1, init_from=str(first.last_checkpoint)), target, data)
    assert made[0].calls["prepare"] == 0 and made[0].calls["build"] == 0


def test_a_custom_kind_logs_its_own_figures(tmp_path, monkeypatch):
    class Renamed(MedusaKind):
        def figures(self, out):
            means, rates = super().figures(out)
            return {"custom_loss": sum(means.values())}, {"custom_rate": rates["top1_head0"]}

    monkeypatch.setitem(kinds_module.KINDS, "medusa", lambda heads: Renamed(heads.medusa))
    train_heads(tiny_job(tmp_path, "medusa", max_steps=1, eval_at_start=False), tiny_target(), tiny_data())
    row = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][0]
    assert {"train/custom_loss", "train/custom_rate", "train/loss"} <= set(row)
    assert not any(key.startswith("train/loss_head") for key in row)


def test_feature_sources_return_the_layers_a_kind_asks_for():
    target = tiny_target()
    batch = {"input_ids": torch.randint(3, 128, (2, 9)), "attention_mask": torch.ones(2, 9, dtype=torch.long),
             "ids": ["a", "b"]}
    out = target.features(batch["input_ids"], batch["attention_mask"], layers=(1, -1))
    final, stream = out.hidden[target.num_layers], out.hidden[1]
    assert torch.equal(OnlineFeatures(target)(batch), final)
    both = OnlineFeatures(target, (1, FINAL))
    torch.testing.assert_close(both(batch), torch.cat([stream, final], -1))
    memo = MemoizedFeatures(both, 10)
    assert memo.layers == (1, FINAL)
    torch.testing.assert_close(memo(batch), both(batch))
    torch.testing.assert_close(memo(batch), both(batch))  # the second call is served from memory
    assert head_kind(tiny_job("x").heads).feature_layers(target.num_layers) == (FINAL,)


def test_the_loop_refuses_a_source_for_other_layers(tmp_path):
    target = tiny_target()
    with pytest.raises(ValueError, match=r"supplies target layers \(1, -1\).*reads \(-1,\)"):
        train_heads(tiny_job(tmp_path, max_steps=1), target, tiny_data(), source=OnlineFeatures(target, (1, FINAL)))


def test_head_kind_names_the_allowed_types():
    job = tiny_job("x")
    job.heads.type = "nope"
    allowed = ", ".join(repr(name) for name in sorted(kinds_module.KINDS))
    assert {"eagle", "eagle3", "medusa", "peagle"} <= set(kinds_module.KINDS)
    with pytest.raises(ValueError, match=re.escape(f"heads.type='nope' is not one of [{allowed}]")):
        head_kind(job.heads)
    eagle = EagleKind(job.heads.eagle)
    job.heads.eagle.init_layer = -1
    assert eagle.init_layers() == [0, -1] and MedusaKind(job.heads.medusa).init_layers() == []
