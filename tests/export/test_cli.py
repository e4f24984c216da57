"""`python -m export` and `python -m export validate` on a tiny base model saved as a folder."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from export import ExportError, validate_export
from export.__main__ import CONF_DIR, cli, run_export, run_validate, to_export_config
from export.config import ExportConfig
from heads.io import save_head
from heads.recommended import RecommendedRuntime
from tests.export.conftest import SIZES, make_eagle, make_eagle3
from tests.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _save_base(folder: Path, seed: int) -> str:
    """A tiny Llama plus a word-level tokenizer, saved like a hub model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(SIZES["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t3", pad_token="t0", bos_token="t1",
                                   eos_token="t2")
    tiny_model(seed, **SIZES).save_pretrained(folder)
    fast.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from export.__main__ import load_base

    root = tmp_path_factory.mktemp("cli")
    base, other = _save_base(root / "base", 0), _save_base(root / "other", 1)
    target = load_base(base)
    head, config = make_eagle(target)
    save_head(root / "ckpt", head, config, extra={"training": {"steps": 7}})
    return {"root": root, "base": base, "other": other, "ckpt": str(root / "ckpt"), "target": target}


def _run(*args):
    return subprocess.run([sys.executable, "-m", "export", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.integration  # one interpreter start-up (~5 s quiet, ~20 s on a loaded 2-core machine)
def test_python_m_export_runs(saved):
    out = saved["root"] / "eagle-out"
    done = _run(f"ckpt={saved['ckpt']}", "format=eagle", f"out={out}", "dtype=float16")
    assert done.returncode == 0, done.stderr
    assert validate_export(out, saved["target"])["dtype"] == "float16"


def test_cli_export_then_validate_against_two_bases(saved, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["export"])
    out = saved["root"] / "cli-out"
    assert cli([f"ckpt={saved['ckpt']}", "format=eagle_vllm", f"out={out}", f"base={saved['base']}"]) == 0
    assert validate_export(out, saved["target"])["format"] == "eagle_vllm"
    assert capsys.readouterr().out.strip() == f"eagle_vllm: {out}"
    assert cli(["validate", str(out), f"base={saved['base']}"]) == 0
    assert json.loads(capsys.readouterr().out)["valid"] is True
    assert cli(["validate", str(out), f"base={saved['other']}"]) == 1
    assert "base_model.fingerprint" in capsys.readouterr().err


def test_cli_reports_config_and_export_errors(saved, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["export"])
    assert cli(["no_such_key=1"]) != 0  # Hydra's own override error
    assert "no_such_key" in capsys.readouterr().err
    assert cli([f"ckpt={saved['ckpt']}"]) == 2
    assert "out=" in capsys.readouterr().err


def test_run_export_writes_every_format_with_the_checkpoints_training_figures(saved):
    out = saved["root"] / "all"
    paths = run_export(ExportConfig(ckpt=saved["ckpt"], out=str(out), base=saved["base"]))
    assert set(paths) == {"native", "eagle", "eagle_vllm"}
    manifest = json.loads((paths["eagle"] / "specheads.json").read_text())
    assert manifest["training"] == {"steps": 7}
    assert manifest["base_model"]["tokenizer_hash"] == saved["target"].tokenizer_hash()
    # An export folder is itself a valid `ckpt`.
    again = run_export(ExportConfig(ckpt=str(paths["eagle"]), out=str(out / "again"), format="eagle_vllm",
                                    base=saved["base"]))
    assert validate_export(again["eagle_vllm"], saved["target"])["format"] == "eagle_vllm"


def test_run_export_needs_ckpt_and_out(saved):
    with pytest.raises(ExportError, match="out="):
        run_export(ExportConfig(ckpt=saved["ckpt"]))


def test_run_validate_exit_codes(saved, capsys):
    folder = saved["root"] / "v"
    run_export(ExportConfig(ckpt=saved["ckpt"], out=str(folder), format="eagle", base=saved["base"]))
    assert run_validate([str(folder), f"base={saved['base']}"]) == 0
    assert json.loads(capsys.readouterr().out)["valid"] is True
    (folder / "config.json").write_text("{}")
    assert run_validate([str(folder)]) == 1
    assert "config.json: sha256 differs" in capsys.readouterr().err
    assert run_validate([]) == 2 and run_validate([str(folder), "bogus=1"]) == 2


def test_conf_default_matches_the_dataclass():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="default", overrides=["format=medusa", "out=/tmp/x"])
    assert to_export_config(cfg) == ExportConfig(format="medusa", out="/tmp/x")


def test_reexport_keeps_measured_runtime_settings(saved):
    from export import export_head

    head, config = make_eagle(saved["target"])
    runtime = RecommendedRuntime(top_k=3, depth=2, total_tokens=7, chain_depth=2)
    first = export_head(head, config, "eagle", saved["root"] / "measured", saved["target"],
                        manifest_extra={"runtime": runtime})
    again = run_export(ExportConfig(ckpt=str(first), out=str(saved["root"] / "measured2"), format="eagle_vllm",
                                    base=saved["base"]))["eagle_vllm"]
    manifest = json.loads((again / "specheads.json").read_text())
    assert manifest["runtime"]["source"] == "measured"
    assert manifest["runtime"]["tree"] == {"top_k": 3, "depth": 2, "total_tokens": 7}
    assert manifest["runtime"]["vllm"] == {"num_speculative_tokens": 2}


def test_cli_refuses_to_replace_a_user_folder(saved, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["export"])
    mine = saved["root"] / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    for extra in ([], ["overwrite=true"]):
        assert cli([f"ckpt={saved['ckpt']}", "format=eagle", f"out={mine}", f"base={saved['base']}", *extra]) == 2
        assert "is not a specheads export" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["thesis.tex"]


def test_cli_exports_an_eagle3_checkpoint_in_every_layout(saved, capsys, monkeypatch):
    from export import load_export

    monkeypatch.setattr(sys, "argv", ["export"])
    head, config = make_eagle3(saved["target"], aux_layer_ids=[1, 1, 1])  # the tiny base has two layers
    ckpt = saved["root"] / "eagle3-ckpt"
    save_head(ckpt, head, config, extra={"runtime": {"top_k": 3, "depth": 2, "total_tokens": 7, "chain_depth": 2}})
    out = saved["root"] / "eagle3-speculators"
    assert cli([f"ckpt={ckpt}", "format=speculators", f"out={out}", f"base={saved['base']}"]) == 0
    assert capsys.readouterr().out.strip() == f"speculators: {out}"
    spec = json.loads((out / "config.json").read_text())["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 2  # the measured chain depth
    assert cli(["validate", str(out), f"base={saved['base']}"]) == 0
    paths = run_export(ExportConfig(ckpt=str(out), out=str(saved["root"] / "eagle3-all"), base=saved["base"]))
    assert set(paths) == {"native", "eagle3", "eagle3_vllm", "speculators"}
    for fmt, folder in paths.items():
        loaded, loaded_config, _ = load_export(folder, saved["target"])
        assert loaded_config == config, fmt
        assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)


def test_export_carries_an_eval_reports_batch_policy_and_keeps_it_on_reexport(saved):
    from eval.policy import choose_policy

    policy = choose_policy("eagle_tree", {1: 10.0, 4: 30.0}, {1: {6: 13.0}, 4: {6: 25.0}}, {6: 2},
                           {"device_type": "cpu", "hardware": "CPU test, 2 threads"}).to_dict()
    report = saved["root"] / "report.json"
    report.write_text(json.dumps({"recommended_runtime": {
        "top_k": 2, "depth": 2, "total_tokens": 6, "chain_depth": 3, "measured": ["total_tokens", "batch_policy"],
        "measured_on": policy["measured_on"], "batch_policy": policy}}))
    first = run_export(ExportConfig(ckpt=saved["ckpt"], out=str(saved["root"] / "policy"), format="eagle_vllm",
                                    base=saved["base"], eval_report=str(report)))["eagle_vllm"]
    again = run_export(ExportConfig(ckpt=str(first), out=str(saved["root"] / "policy2"), format="eagle",
                                    base=saved["base"]))["eagle"]
    for folder in (first, again):
        runtime = json.loads((folder / "specheads.json").read_text())["runtime"]
        assert runtime["vllm"]["num_speculative_tokens_per_batch_size"] == [[1, 3, 2], [4, 1 << 20, 0]]
        assert runtime["tensorrt_llm"]["draft_len_schedule"] == {"3": 2}
        assert runtime["batch_policy"]["measured_on"]["hardware"] == "CPU test, 2 threads"
    with pytest.raises(ValueError, match="eval_report="):
        run_export(ExportConfig(ckpt=saved["ckpt"], out=str(saved["root"] / "p3"), eval_report=str(saved["root"])))


def _damaged_checkpoint(saved, name: str) -> Path:
    """A training checkpoint whose weights then change one byte at the same size (a bad disk or
    copy): every size check passes, only the sha256 its trainer_state.json recorded differs."""
    from train.checkpoint import save_checkpoint

    head, config = make_eagle(saved["target"])
    path = save_checkpoint(saved["root"] / name, 5, head, config, {}, {}, [], {})
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    return path


def test_a_checkpoint_damaged_at_the_same_size_is_refused_by_export_and_validate(saved, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["export"])
    ckpt = _damaged_checkpoint(saved, "damaged")
    out = saved["root"] / "from-damaged"
    assert cli([f"ckpt={ckpt}", "format=eagle", f"out={out}", f"base={saved['base']}"]) == 2
    assert "model.safetensors: sha256 differs" in capsys.readouterr().err and not out.exists()
    assert cli(["validate", str(ckpt)]) == 1
    assert "model.safetensors: sha256 differs" in capsys.readouterr().err
    from train.checkpoint import save_checkpoint

    head, config = make_eagle(saved["target"])
    whole = save_checkpoint(saved["root"] / "whole", 5, head, config, {}, {}, [], {})
    assert cli(["validate", str(whole), f"base={saved['base']}"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "checkpoint"


def test_a_missing_path_says_it_does_not_exist_and_validate_has_help(saved, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["export"])
    missing = saved["root"] / "no-such-ckpt"
    assert cli([f"ckpt={missing}", "format=eagle", f"out={saved['root'] / 'x'}", f"base={saved['base']}"]) == 2
    assert f"{missing} does not exist" in capsys.readouterr().err
    assert cli(["validate", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"{missing} does not exist" in err and "not a valid export" not in err
    for flag in ("--help", "-h"):
        assert cli(["validate", flag]) == 0
        assert "python -m export validate DIR" in capsys.readouterr().out


def test_a_head_config_whose_width_does_not_split_into_its_heads_is_one_line(saved, capsys, monkeypatch):
    from tests.helpers import tamper_json

    monkeypatch.setattr(sys, "argv", ["export"])
    ckpt = saved["root"] / "uneven-ckpt"
    head, config = make_eagle(saved["target"])
    save_head(ckpt, head, config)
    meta = json.loads((ckpt / "head_config.json").read_text())
    meta["config"]["hidden_size"] = 50
    (ckpt / "head_config.json").write_text(json.dumps(meta))
    assert cli([f"ckpt={ckpt}", "format=eagle", f"out={saved['root'] / 'u'}", f"base={saved['base']}"]) == 2
    err = capsys.readouterr().err
    assert f"{ckpt / 'head_config.json'}: config.hidden_size=50 is not a multiple of config.num_attention_heads=4" \
        in err and "Traceback" not in err
    folder = saved["root"] / "uneven-export"
    run_export(ExportConfig(ckpt=saved["ckpt"], out=str(folder), format="eagle", base=saved["base"]))
    tamper_json(folder, "config.json", lambda values: values.update(hidden_size=50))
    manifest = json.loads((folder / "specheads.json").read_text())
    manifest["head_config"]["hidden_size"] = 50
    (folder / "specheads.json").write_text(json.dumps(manifest))
    assert cli(["validate", str(folder)]) == 1
    assert "head_config: config.hidden_size=50 is not a multiple" in capsys.readouterr().err
    assert cli([f"ckpt={folder}", "format=eagle_vllm", f"out={saved['root'] / 'u2'}", f"base={saved['base']}"]) == 2
    assert "config.hidden_size=50 is not a multiple" in capsys.readouterr().err
