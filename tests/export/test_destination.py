"""An export replaces its destination folder only when that folder is an earlier export: a user's
folder, a file or the working folder are never replaced, with or without overwrite."""
from __future__ import annotations

import json

import pytest

from export import ExportError, export_all, export_head, validate_export
from tests.export.conftest import make_eagle


def _user_folder(path):
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    (path / "sub").mkdir()
    (path / "sub" / "data.bin").write_bytes(b"\x00" * 10)
    return path


def _listing(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_that_is_not_an_export_is_never_replaced(tmp_path, target, overwrite):
    head, config = make_eagle(target)
    folder = _user_folder(tmp_path / "mine")
    before = _listing(folder)
    with pytest.raises(ExportError, match=r"mine exists and is not a specheads export.*specheads.json: missing"):
        export_head(head, config, "eagle", folder, target, overwrite=overwrite)
    assert _listing(folder) == before and (folder / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]  # no temp folder left either


def test_a_broken_manifest_is_not_a_valid_export(tmp_path, target):
    head, config = make_eagle(target)
    folder = _user_folder(tmp_path / "mine")
    (folder / "specheads.json").write_text("{not json")
    with pytest.raises(ExportError, match="not valid JSON"):
        export_head(head, config, "eagle", folder, target, overwrite=True)
    assert (folder / "notes.txt").is_file()


def test_the_working_folder_is_never_replaced(tmp_path, target, monkeypatch):
    head, config = make_eagle(target)
    work = _user_folder(tmp_path / "work")
    monkeypatch.chdir(work)
    with pytest.raises(ExportError, match="working folder"):
        export_head(head, config, "eagle", ".", target, overwrite=True)
    with pytest.raises(ExportError, match="working folder"):
        export_head(head, config, "eagle", "..", target, overwrite=True)
    assert (work / "notes.txt").read_text() == "mine"


def test_a_file_is_refused(tmp_path, target):
    head, config = make_eagle(target)
    (tmp_path / "out").write_text("a file")
    with pytest.raises(ExportError, match="is a file"):
        export_head(head, config, "eagle", tmp_path / "out", target)
    assert (tmp_path / "out").read_text() == "a file"


def test_an_empty_folder_is_used(tmp_path, target):
    head, config = make_eagle(target)
    (tmp_path / "out").mkdir()
    export_head(head, config, "eagle", tmp_path / "out", target)
    assert validate_export(tmp_path / "out", target)["format"] == "eagle"


def test_another_kind_of_export_needs_overwrite(tmp_path, target):
    head, config = make_eagle(target)
    out = export_head(head, config, "eagle", tmp_path / "out", target)
    with pytest.raises(ExportError, match=r"holds a eagle export of a eagle head.*overwrite=true"):
        export_head(head, config, "eagle_vllm", out, target)
    assert validate_export(out)["format"] == "eagle"
    export_head(head, config, "eagle_vllm", out, target, overwrite=True)
    assert validate_export(out)["format"] == "eagle_vllm"
    assert json.loads((out / "specheads.json").read_text())["format"] == "eagle_vllm"


def test_export_all_refuses_a_user_folder_under_the_root(tmp_path, target):
    head, config = make_eagle(target)
    _user_folder(tmp_path / "native")
    with pytest.raises(ExportError, match="native exists and is not a specheads export"):
        export_all(head, config, ["native"], tmp_path, target)
    assert (tmp_path / "native" / "notes.txt").is_file()


def test_a_re_export_keeps_the_files_a_user_added(tmp_path, target):
    head, config = make_eagle(target)
    out = export_head(head, config, "eagle", tmp_path / "out", target, dtype="float32")
    (out / "serve_notes.sh").write_text("mine")
    (out / "extra").mkdir()
    (out / "extra" / "prompts.jsonl").write_text("{}\n")
    export_head(head, config, "eagle", out, target, dtype="bfloat16")
    assert validate_export(out, target)["dtype"] == "bfloat16"
    assert (out / "serve_notes.sh").read_text() == "mine"
    assert (out / "extra" / "prompts.jsonl").read_text() == "{}\n"
    export_head(head, config, "eagle_vllm", out, target, overwrite=True)  # another format keeps them too
    assert (out / "serve_notes.sh").read_text() == "mine" and (out / "extra" / "prompts.jsonl").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_user_file_named_like_a_new_export_file_is_refused(tmp_path, target):
    head, config = make_eagle(target)
    out = export_head(head, config, "eagle", tmp_path / "out", target)
    (out / "head_config.json").write_text("mine")  # the eagle layout does not write it; native does
    with pytest.raises(ExportError, match="holds head_config.json, which the earlier export did not write"):
        export_head(head, config, "native", out, target, overwrite=True)
    assert (out / "head_config.json").read_text() == "mine" and validate_export(out)["format"] == "eagle"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
