import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from heads.io import load_head
from train.loop import TrainingDiverged, budget_fraction, lr_factor, lr_factor_by_budget, train_heads
from train.objectives import OnlineFeatures
from tests.tiny import tiny_target
from tests.train.loop_fixtures import tiny_data, tiny_job

ROOT = Path(__file__).resolve().parents[2]


def _metrics(run_dir, key="train/loss"):
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line[key] for line in lines if key in line}


def test_lr_schedule():
    assert lr_factor(0, 4, 20, "cosine") == 0.25 and lr_factor(3, 4, 20, "cosine") == 1.0
    assert lr_factor(12, 4, 20, "cosine") == pytest.approx(0.5)
    assert lr_factor(12, 4, 20, "linear") == pytest.approx(0.5)
    assert lr_factor(20, 4, 20, "linear") == 0.0 and lr_factor(19, 0, 20, "constant") == 1.0
    assert lr_factor(4 + 4, 4, 20, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_lr_schedule_over_the_budget():
    """schedule_clock=minutes: the same shape laid over the larger of the step and clock fractions."""
    assert budget_fraction(10, 100, 30.0, 1.0) == 0.5 and budget_fraction(80, 100, 30.0, 1.0) == 0.8
    assert budget_fraction(10, 100, 600.0, 1.0) == 1.0 and budget_fraction(10, 100, 600.0, None) == 0.1
    assert lr_factor_by_budget(0.0, 0.2, 20, "cosine") == 0.25  # one step's share, as lr_factor's first step
    assert lr_factor_by_budget(0.1, 0.2, 20, "cosine") == pytest.approx(0.5)
    assert lr_factor_by_budget(0.6, 0.2, 20, "cosine") == pytest.approx(0.5)
    assert lr_factor_by_budget(0.6, 0.2, 20, "linear") == pytest.approx(0.5)
    assert lr_factor_by_budget(1.0, 0.2, 20, "cosine") == pytest.approx(0.0)
    assert lr_factor_by_budget(0.9, 0.0, 20, "constant") == 1.0
    decay = [lr_factor_by_budget(f / 20, 0.2, 20, "cosine") for f in range(4, 21)]
    assert decay[0] == 1.0 and all(a > b for a, b in zip(decay, decay[1:]))


def test_a_run_the_clock_stops_still_decays(tmp_path, monkeypatch):
    """With schedule_clock=minutes a run ended by max_minutes long before max_steps has decayed its
    rate to ~0 by the end; laid over max_steps the same run would still be warming up."""
    import train.loop as loop

    fake = {"now": 1000.0}

    def clock():  # every reading advances the run's clock by 0.1 s
        fake["now"] += 0.1
        return fake["now"]

    monkeypatch.setattr(loop.time, "time", clock)
    job = tiny_job(tmp_path, max_steps=100000, max_minutes=0.1, schedule_clock="minutes", eval_every=1000,
                   save_every=1000, warmup_ratio=0.1)
    result = train_heads(job, tiny_target(), tiny_data())
    lrs = _metrics(tmp_path, "train/lr")
    peak, rate = max(lrs.values()), job.trainer.learning_rate
    assert result.stopped == "max_minutes" and 8 < result.steps < 1000
    assert peak > 0.9 * rate  # warmed up over the first tenth of the minutes, not of the 100,000 steps
    assert lrs[result.steps] < 0.05 * rate  # and decayed by the end
    with pytest.raises(ValueError, match="schedule_clock=minutes"):
        tiny_job(tmp_path / "b", schedule_clock="minutes").trainer.check()


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_tiny_training_lowers_the_loss(tmp_path, kind):
    target = tiny_target()
    job = tiny_job(tmp_path, kind, max_steps=24, eval_every=12, save_every=12, learning_rate=1e-2)
    result = train_heads(job, target, tiny_data())
    losses = _metrics(tmp_path)
    assert result.steps == 24 and result.stopped == "max_steps"
    assert sum(losses[s] for s in range(21, 25)) < 0.9 * sum(losses[s] for s in range(1, 5))
    assert "eval/acceptance_length" in result.final_eval
    head, config, meta = load_head(result.best_checkpoint, target)
    assert meta["type"] == kind and meta["step"] == result.best_eval["step"]
    assert json.loads((tmp_path / "result.json").read_text())["steps"] == 24


def test_the_best_checkpoint_carries_its_own_held_out_figures(tmp_path):
    """The export is the best checkpoint, so its manifest's held-out figures are what that
    checkpoint scored when saved, not the last evaluation (they differ when a later one scored lower)."""
    from train.checkpoint import read_state
    from train.pipeline import _training_figures

    target = tiny_target()
    job = tiny_job(tmp_path, "eagle", max_steps=24, eval_every=4, save_every=4, learning_rate=3e-2)
    result = train_heads(job, target, tiny_data())
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = {line["step"]: {k: v for k, v in line.items() if k.startswith("eval/") and k != "eval/wall_minutes"}
             for line in lines if "eval/acceptance_length" in line}
    best = max(evals, key=lambda step: (evals[step]["eval/acceptance_length"], -step))  # the first of equals
    assert result.best_eval["step"] == best and result.final_eval == evals[24]
    scored = read_state(result.best_checkpoint)["eval"]
    assert scored == evals[best]
    summary = {"train": {"final_eval": result.final_eval, "mixed_precision": result.mixed_precision}}
    assert _training_figures(summary, None, scored)["held_out"] == evals[best]
    assert _training_figures(summary, None, scored)["mixed_precision"] == "no"  # an fp32 target's job
    assert _training_figures(summary, None, None)["held_out"] == evals[24]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_bf16_target_trains_fp32_heads_on_the_cpu(tmp_path, kind):
    """The frozen target may compute in bf16 (heads/dtypes.py); the head keeps fp32 weights and
    reads fp32 features, embedding and lm_head."""
    target = tiny_target()
    target.model.to(torch.bfloat16)
    job = tiny_job(tmp_path, kind, max_steps=6, eval_every=6, save_every=6, learning_rate=1e-2)
    result = train_heads(job, target, tiny_data())
    assert result.steps == 6 and all(math.isfinite(v) for v in _metrics(tmp_path).values())
    head, _, _ = load_head(result.best_checkpoint, target)
    assert all(p.dtype == torch.float32 for p in head.parameters())
    assert result.mixed_precision == "bf16"  # auto: the steps' matmuls as the target computes


def test_cpu_steps_autocast_as_the_target_computes_and_held_out_scores_in_fp32(tmp_path, monkeypatch):
    """auto on a CPU: bf16 matmuls in the steps of a bf16 target's job, fp32 for an fp32 target's,
    each job in the same process (accelerate's precision is fixed once per process); held-out
    scoring in fp32 either way, as the CPU runtime drafts."""
    import train.loop as loop

    seen = []
    original = loop.run_held_out

    def scoring(model, *args, **kwargs):
        seen.append(("eval", torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None))
        return original(model, *args, **kwargs)

    monkeypatch.setattr(loop, "run_held_out", scoring)
    for name, dtype, expected in (("low", torch.bfloat16, "bf16"), ("full", torch.float32, "no")):
        target = tiny_target()
        target.model.to(dtype)
        job = tiny_job(tmp_path / name, "eagle3", max_steps=2, eval_every=2, save_every=2)
        steps = []
        kind_step = loop.head_kind(job.heads).__class__.step

        def step(self, *args, **kwargs):
            steps.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
            return kind_step(self, *args, **kwargs)

        monkeypatch.setattr(loop.head_kind(job.heads).__class__, "step", step)
        result = train_heads(job, target, tiny_data())
        monkeypatch.setattr(loop.head_kind(job.heads).__class__, "step", kind_step)
        assert result.mixed_precision == expected
        assert steps == [torch.bfloat16 if expected == "bf16" else None] * 2
    assert seen and all(dtype is None for _, dtype in seen)


def test_resume_after_a_crash_reproduces_the_losses(tmp_path):
    target, data = tiny_target(), tiny_data()
    job = tiny_job(tmp_path, keep_last=3)
    train_heads(job, target, data)
    uninterrupted = _metrics(tmp_path)
    # The run "died" after its step-4 checkpoint: the later checkpoint never happened.
    shutil.rmtree(tmp_path / "checkpoints" / "step-00000008")
    result = train_heads(job, target, data)
    resumed = _metrics(tmp_path)
    assert result.steps == 8 and sorted(resumed) == list(range(1, 9))
    for step in range(5, 9):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-6, abs=1e-7)


def test_a_checkpoint_between_log_lines_keeps_the_token_count(tmp_path):
    target, data = tiny_target(), tiny_data()
    job = tiny_job(tmp_path, log_every=3, save_every=2, keep_last=4)  # logs at 3, 6, 8; saves at 2, 4, 6, 8
    train_heads(job, target, data)
    uninterrupted = _metrics(tmp_path, "train/tokens_seen")
    # The run "died" after its step-4 checkpoint, one step past a log line.
    for step in (6, 8):
        shutil.rmtree(tmp_path / "checkpoints" / f"step-{step:08d}")
    train_heads(job, target, data)
    assert _metrics(tmp_path, "train/tokens_seen") == uninterrupted


_KILLED_RUN = """
import sys, time, torch
torch.set_num_threads(1)
sys.path.insert(0, {root!r})
from tests.tiny import tiny_target
from tests.train.loop_fixtures import tiny_data, tiny_job
from train.loop import train_heads
from train.objectives import OnlineFeatures
target = tiny_target()
online = OnlineFeatures(target)
def slow(batch):
    time.sleep(0.25)
    return online(batch)
train_heads(tiny_job({run_dir!r}, save_every=2, keep_last=3), target, tiny_data(), source=slow)
"""


def test_sigkill_mid_run_then_resume_matches_uninterrupted(tmp_path):
    target, data = tiny_target(), tiny_data()
    reference_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    train_heads(tiny_job(reference_dir, save_every=2, keep_last=3), target, data)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    process = subprocess.Popen([sys.executable, "-c", _KILLED_RUN.format(root=str(ROOT), run_dir=str(killed_dir))],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if (killed_dir / "metrics.jsonl").is_file() and max(_metrics(killed_dir), default=0) >= 5:
            break
        time.sleep(0.05)
    assert process.poll() is None, process.stderr.read().decode()[-2000:]
    process.send_signal(signal.SIGKILL)
    process.wait()
    steps_done = max(_metrics(killed_dir))
    assert 5 <= steps_done < 8
    result = train_heads(tiny_job(killed_dir, save_every=2, keep_last=3), target, data)
    assert result.steps == 8
    reference, resumed = _metrics(reference_dir), _metrics(killed_dir)
    assert sorted(resumed) == list(range(1, 9))
    for step in range(1, 9):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    target = tiny_target()
    online, calls = OnlineFeatures(target), []

    def poisoned(batch):
        features = online(batch)
        if not batch["ids"][0].startswith("r0-"):  # held-out rows (tiny_data: "r1-...")
            return features
        calls.append(1)
        return features * float("nan") if len(calls) == 3 else features

    job = tiny_job(tmp_path, save_every=2)
    with pytest.raises(TrainingDiverged, match=r"non-finite loss at step 3.*step-00000002"):
        train_heads(job, target, tiny_data(), source=poisoned)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000000", "step-00000002"]


def test_wandb_offline_run_folder_and_metrics_jsonl(tmp_path, monkeypatch):
    from train.metrics import read_lineage

    monkeypatch.setenv("WANDB_MODE", "offline")
    job = tiny_job(tmp_path, max_steps=4, eval_every=2)
    job.logger.kind = "wandb"
    train_heads(job, tiny_target(), tiny_data())
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert read_lineage(tmp_path)["checkpoint"]["type"] == "model"  # the kept head, as an artifact
    assert sorted(_metrics(tmp_path)) == [1, 2, 3, 4]
    assert sorted(_metrics(tmp_path, "eval/acceptance_length")) == [0, 2, 4]
    assert set(_metrics(tmp_path, "train/tokens_per_s")) == {1, 2, 3, 4}
    minutes = _metrics(tmp_path, "eval/wall_minutes")
    assert sorted(minutes) == [0, 2, 4] and 0 <= minutes[0] <= minutes[2] <= minutes[4]
    # the learning-curve script reads the same file: one row per evaluation, tokens accumulating
    sys.path.insert(0, str(ROOT / "scripts"))
    from learning_curve import curve, render

    rows = curve(tmp_path)
    assert [r["step"] for r in rows] == [0, 2, 4] and [r["minutes"] for r in rows] == list(minutes.values())
    assert rows[0]["tokens"] == 0 < rows[1]["tokens"] < rows[2]["tokens"]
    assert len(rows[2]["top1"]) == 4 and "| 4 |" in render("run", rows, markdown=True)
    assert all(r["walk"] is not None and 1.0 <= r["walk"][1] <= 5.0 for r in rows)  # the chain walk's figures
    assert "chain: mean length" in render("run", rows, markdown=True)


def test_max_minutes_stops_early(tmp_path):
    result = train_heads(tiny_job(tmp_path, max_minutes=1e-6), tiny_target(), tiny_data())
    assert result.stopped == "max_minutes" and result.steps == 1
    assert result.last_checkpoint.name == "step-00000001"


def test_init_from_a_native_checkpoint(tmp_path):
    from train.loop import build_head_for_job

    target = tiny_target()
    result = train_heads(tiny_job(tmp_path / "first", max_steps=2), target, tiny_data())
    job = tiny_job(tmp_path / "second", init_from=str(result.last_checkpoint))
    head, config = build_head_for_job(job, target)
    saved, _, _ = load_head(result.last_checkpoint, target)
    for key, value in saved.state_dict().items():
        assert torch.equal(head.state_dict()[key], value)
    job.heads.type = "medusa"
    with pytest.raises(ValueError, match="heads.type=medusa"):
        build_head_for_job(job, target)


@pytest.mark.parametrize("fmt", ["eagle", "native"])
def test_init_from_an_export_folder_reads_it_through_load_export(tmp_path, fmt):
    """An engine layout and a bf16 native export start training alike: in float32, with the
    exported (rounded) weights."""
    from export import export_head
    from train.loop import build_head_for_job

    target = tiny_target()
    result = train_heads(tiny_job(tmp_path / "first", max_steps=1), target, tiny_data())
    trained, config, _ = load_head(result.last_checkpoint, target)
    folder = export_head(trained, config, fmt, tmp_path / fmt, target, dtype="bfloat16")
    head, loaded_config = build_head_for_job(tiny_job(tmp_path / "second", init_from=str(folder)), target)
    assert loaded_config == config
    for key, value in trained.state_dict().items():
        loaded = head.state_dict()[key]
        expected = value.to(torch.bfloat16).float() if value.is_floating_point() else value
        assert loaded.dtype == expected.dtype and torch.equal(loaded, expected), key


def test_init_fc_ridge_fits_fc_on_the_first_training_batches(tmp_path):
    from heads.eagle import EagleConfig, EagleHead, set_fc_by_ridge
    from train.data_order import BatchStream
    from train.objectives import FrozenParts, ridge_sums

    target, data = tiny_target(), tiny_data()
    job = tiny_job(tmp_path, max_steps=1, learning_rate=1e-9)
    job.heads.eagle.init_fc, job.heads.eagle.ridge_tokens = "ridge", 150
    result = train_heads(job, target, data)
    trained, _, _ = load_head(result.last_checkpoint, target)
    stream = BatchStream(data.train, 4, 1, 0, job.trainer.seed, 0, "cpu")
    gram, cross, rows = ridge_sums(FrozenParts.from_target(target), (stream.next() for _ in range(8)),
                                   OnlineFeatures(target), 150)
    assert 150 <= rows < 250  # stops after the batch that passes the budget
    expected = EagleHead(EagleConfig.from_target(target))
    set_fc_by_ridge(expected, gram, cross, rows, job.heads.eagle.ridge_penalty)
    torch.testing.assert_close(trained.fc.weight, expected.fc.weight, atol=1e-5, rtol=1e-4)
    assert trained.layers[0].mlp.down_proj.weight.abs().max() < 1e-6


def _rms_normed(x: torch.Tensor, width: int, eps: float) -> torch.Tensor:
    """Each `width` columns of x RMS-normalised (unit weight), by hand."""
    return torch.cat([s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) for s in x.split(width, -1)], -1)


@pytest.mark.parametrize("options", [{}, {"norm_before_fc": True}, {"fc_norm": True, "norm_output": True}])
def test_eagle3_init_fc_ridge_starts_the_head_as_the_linear_fit(tmp_path, options):
    """Under norm_before_fc / fc_norm the fit is on the normalised streams fc reads."""
    from heads.eagle3 import Eagle3Config, Eagle3Head, set_fc_by_ridge
    from train.data_order import BatchStream
    from train.eagle3_objective import eagle3_ridge_sums, feature_layers, split_features
    from train.objectives import FrozenParts

    target, data = tiny_target(), tiny_data()
    job = tiny_job(tmp_path, "eagle3", max_steps=1, learning_rate=1e-9)
    job.heads.eagle3.init_fc, job.heads.eagle3.ridge_tokens = "ridge", 150
    for name, value in options.items():
        setattr(job.heads.eagle3, name, value)
    result = train_heads(job, target, data)
    trained, _, _ = load_head(result.last_checkpoint, target)
    assert all(getattr(trained.config, name) == value for name, value in options.items())
    aux_ids = trained.config.aux_layer_ids
    source = OnlineFeatures(target, layers=feature_layers(aux_ids))
    H, eps = target.hidden_size, trained.config.rms_norm_eps
    width = {"norm_before_fc": len(aux_ids) * H, "fc_norm": H}.get(next(iter(options), None))

    def fc_reads(batch):  # the aux streams as fc reads them, the final state as it is
        aux, final = split_features(source(batch), len(aux_ids))
        return torch.cat([_rms_normed(aux, width, eps) if width else aux, final], -1)

    stream = BatchStream(data.train, 4, 1, 0, job.trainer.seed, 0, "cpu")
    gram, cross, rows = eagle3_ridge_sums(FrozenParts.from_target(target), (stream.next() for _ in range(8)),
                                          fc_reads, len(aux_ids), target.final_norm.weight, 150)
    assert 150 <= rows < 250 and gram.shape == (3 * target.hidden_size,) * 2
    expected = Eagle3Head(Eagle3Config.from_target(target, aux_layer_ids=aux_ids))
    set_fc_by_ridge(expected, gram, cross, rows, job.heads.eagle3.ridge_penalty)
    torch.testing.assert_close(trained.fc.weight, expected.fc.weight, atol=1e-5, rtol=1e-4)
    assert trained.midlayer.self_attn.o_proj.weight.abs().max() < 1e-6
    assert trained.midlayer.mlp.down_proj.weight.abs().max() < 1e-6
    # The layer passes fc's output through, so step 0 scores the fit: better than a random head.
    batch = stream.next()
    aux, _ = split_features(source(batch), len(aux_ids))
    hidden = trained.project(aux[:, :-1])
    positions = torch.arange(hidden.shape[1]).expand(hidden.shape[0], -1)
    out, _ = trained(target.embed_tokens(batch["input_ids"][:, 1:]), hidden, positions)
    torch.testing.assert_close(out, hidden)


def test_fc_learning_rate_scale_zero_freezes_fc_and_logs_the_main_rate(tmp_path):
    target = tiny_target()
    job = tiny_job(tmp_path, max_steps=3, warmup_ratio=0.0, schedule="constant")
    job.heads.eagle.init_fc, job.heads.eagle.init_layer = "feature", None
    job.heads.eagle.fc_learning_rate_scale = 0.0
    job.heads.draft_vocab_size = 64
    torch.manual_seed(0)
    result = train_heads(job, target, tiny_data())
    trained, _, _ = load_head(result.last_checkpoint, target)
    D = trained.config.hidden_size
    torch.testing.assert_close(trained.fc.weight[:, D:], torch.eye(D))  # fc kept its [0 | I] start
    assert trained.fc.weight[:, :D].abs().max() == 0
    assert trained.layers[0].self_attn.o_proj.weight.abs().max() > 0  # the rest did train
    assert set(_metrics(tmp_path, "train/lr").values()) == {job.trainer.learning_rate}
