"""`python -m eval` checks its settings before any model loads, and reports every error a user's
input can cause as one line (exit status 2), not a traceback."""
from __future__ import annotations

import pytest

import eval.__main__ as entry
from tests.tiny import tiny_target


def _no_target(config):
    raise AssertionError("the target must not load before the settings are checked")


@pytest.mark.parametrize("override, message", [
    ("runtime.tree_total_tokens=abc", "runtime.tree_total_tokens='abc' must be an int >= 2"),
    ("runtime.tree_total_tokens=1", "runtime.tree_total_tokens=1 must be an int >= 2"),
    ("runtime.top_p=0", "runtime.top_p=0"),
    ("runtime.seed=-1", "runtime.seed=-1"),
    ("runtime.temperature=inf", "runtime.temperature=inf must be a finite number >= 0"),
    ("runtime.temperature=nan", "runtime.temperature=nan must be a finite number >= 0"),
    ("runtime.drafters=[eagle_forest]", "runtime.drafters[]='eagle_forest'"),
    ("model.dtype=fp8", "model.dtype='fp8'"),
    ("engine=sglang", "engine='sglang' is not one of ['vllm']"),
    ("engine=vllm", "engine=vllm measures a head's export: give head=DIR"),
    ("+runtime.tree_totl_tokens=4", "runtime.tree_totl_tokens is not a setting: did you mean runtime.tree_total_tokens?"),
])
def test_settings_are_checked_before_the_target_loads(monkeypatch, capsys, override, message):
    monkeypatch.setattr("heads.target.load_target", _no_target)
    assert entry.cli([override, "progress=false"]) == 2
    assert message in capsys.readouterr().err


def test_a_prompts_folder_and_a_damaged_head_are_one_line_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("heads.target.load_target", _no_target)
    assert entry.cli([f"prompts_file={tmp_path}"]) == 2
    assert "a folder, not a JSONL file" in capsys.readouterr().err
    monkeypatch.undo()
    target = tiny_target()
    monkeypatch.setattr("heads.target.load_target", lambda config: target)
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "head_config.json").write_text("{not json")
    assert entry.cli([f"head={tmp_path / 'head'}"]) == 2
    assert "head_config.json: not valid JSON" in capsys.readouterr().err
    assert entry.cli([f"head={tmp_path / 'missing'}"]) == 2  # an OSError, reported too
    assert "missing" in capsys.readouterr().err


def test_the_wandb_mode_says_which_setting_won(caplog):
    import logging

    from eval.config import wandb_mode

    with caplog.at_level(logging.INFO):
        assert wandb_mode("offline", {}) == "offline"
    assert "W&B mode offline (logger.mode)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert wandb_mode("offline", {"WANDB_MODE": "online"}) == "online"
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "WANDB_MODE" in record.getMessage() and "this run uploads to W&B" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert wandb_mode("online", {"WANDB_MODE": "offline"}) == "offline"
    assert "not logger.mode=online" in caplog.text and not any(r.levelno >= logging.WARNING for r in caplog.records)


def test_a_damaged_checkpoint_and_an_uneven_head_config_are_refused_before_measuring(tmp_path, monkeypatch, capsys):
    """The one head loader eval, `trainer.init_from` and a job's `stages=[export]` read a head with."""
    import json

    from heads.eagle import EagleConfig, EagleHead
    from heads.io import save_head
    from train.checkpoint import save_checkpoint

    target = tiny_target()
    monkeypatch.setattr("heads.target.load_target", lambda config: target)
    monkeypatch.setattr("eval.stage.run_eval_stage", lambda *a, **k: pytest.fail("measured a head it must refuse"))
    config = EagleConfig.from_target(target)
    ckpt = save_checkpoint(tmp_path / "checkpoints", 3, EagleHead(config), config, {}, {}, [], {})
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size: only the recorded sha256 tells
    weights.write_bytes(bytes(data))
    assert entry.cli([f"head={ckpt}", f"out={tmp_path / 'out'}"]) == 2
    assert f"{weights}: sha256 differs" in capsys.readouterr().err
    uneven = tmp_path / "uneven"
    save_head(uneven, EagleHead(config), config)
    meta = json.loads((uneven / "head_config.json").read_text())
    meta["config"]["hidden_size"] = 66
    (uneven / "head_config.json").write_text(json.dumps(meta))
    assert entry.cli([f"head={uneven}", f"out={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert "head_config.json: config.hidden_size=66 is not a multiple of config.num_attention_heads=4" in err
    assert entry.cli([f"head={tmp_path / 'nope'}", f"out={tmp_path / 'out'}"]) == 2
    assert f"{tmp_path / 'nope'} does not exist" in capsys.readouterr().err


def test_an_unwritable_out_folder_is_refused_before_the_target_loads(tmp_path, monkeypatch, capsys):
    import os

    monkeypatch.setattr("heads.target.load_target", _no_target)
    if os.geteuid() == 0:  # permission bits do not bind root; /sys refuses new folders to everyone
        out = "/sys/specheads-eval-out"
    else:
        (tmp_path / "locked").mkdir(mode=0o555)
        out = str(tmp_path / "locked" / "eval")
    assert entry.cli([f"out={out}"]) == 2
    assert f"{out} cannot be written" in capsys.readouterr().err


def test_a_head_that_none_of_the_drafters_runs_is_an_error(tmp_path, monkeypatch, capsys):
    from heads.io import save_head
    from heads.medusa import MedusaConfig, MedusaHeads

    target = tiny_target()
    monkeypatch.setattr("heads.target.load_target", lambda config: target)
    config = MedusaConfig.from_target(target, num_heads=2, num_layers=1)
    save_head(tmp_path / "medusa", MedusaHeads(config), config)
    assert entry.cli([f"head={tmp_path / 'medusa'}", "runtime.drafters=[eagle_tree]", f"out={tmp_path / 'out'}"]) == 2
    assert "none of them runs a MedusaHeads head; use runtime.drafters=['medusa']" in capsys.readouterr().err


def test_a_prompt_longer_than_the_models_positions_is_refused_before_measuring(tmp_path, monkeypatch, capsys):
    import json

    from tests.helpers import ToyTokenizer

    target = tiny_target()  # max_position_embeddings=512
    target.tokenizer = ToyTokenizer()
    monkeypatch.setattr("heads.target.load_target", lambda config: target)
    monkeypatch.setattr("eval.run.evaluate", lambda *a, **k: pytest.fail("measured a prompt past the positions"))
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "short"}) + "\n" + json.dumps({"prompt": "x" * 600}) + "\n")
    assert entry.cli([f"prompts_file={path}", "runtime.max_prompt_tokens=20000", "runtime.max_new_tokens=12",
                      "runtime.drafters=[prompt_lookup]", f"out={tmp_path / 'out'}", "progress=false"]) == 2
    assert (f"{path} line 2: prompt has 605 tokens > 500 (the model's max_position_embeddings=512 less "
            "runtime.max_new_tokens=12)") in capsys.readouterr().err
