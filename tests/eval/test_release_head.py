"""`python -m eval head=release`: the alias resolves to the shipped export folder (here a random tiny
EAGLE export written to tmp_path), loads through `load_export`, drafts losslessly, and a missing
folder fails with its path before the target loads."""
import pytest
import torch

import eval.__main__ as entry
from eval.runtime.drafters.eagle import EagleDrafter
from eval.runtime.generate import plain_generate, speculative_generate
from eval.runtime.model import LeanLlama
from export import export_head
from heads.eagle import EagleConfig, EagleHead, init_from_target
from tests.tiny import tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture
def release(target, tmp_path, monkeypatch):
    head = init_from_target(EagleHead(EagleConfig.from_target(target)), target, layer=-1, fc="feature").eval()
    folder = export_head(head, head.config, "native", tmp_path / "eagle_smollm2_135m", target, dtype="bfloat16")
    monkeypatch.setattr(entry, "RELEASE_HEAD_DIR", folder)
    return head, folder


def test_release_alias_points_into_the_repository():
    assert entry.RELEASE_HEAD_DIR == entry.ROOT / "heads" / "release" / "eagle_smollm2_135m"
    assert entry.resolve_head("runs/some/export") == entry.Path("runs/some/export")


def test_release_head_loads_and_drafts_losslessly(target, release):
    original, folder = release
    assert entry.resolve_head("release") == folder
    head, config = entry.load_eval_head("release", target)
    assert isinstance(head, EagleHead) and config.hidden_size == target.hidden_size and not head.training
    for name, value in original.state_dict().items():  # bf16 on disk, float32 in eval
        torch.testing.assert_close(head.state_dict()[name], value.to(torch.bfloat16).float(), atol=0, rtol=0)
    lean = LeanLlama.from_hf(target.model, max_seq_len=128)
    prompt = torch.tensor([5, 17, 9, 33, 2, 71])
    drafter = EagleDrafter(head, lean, mode="tree", depth=3, top_k=2, total_tokens=6)
    assert speculative_generate(lean, drafter, prompt, 12).tokens == plain_generate(lean, prompt, 12).tokens


def test_missing_release_head_names_the_path_before_loading_the_target(tmp_path, monkeypatch):
    missing = tmp_path / "heads" / "release" / "eagle_smollm2_135m"
    monkeypatch.setattr(entry, "RELEASE_HEAD_DIR", missing)
    with pytest.raises(FileNotFoundError, match=str(missing)):
        entry.resolve_head("release")

    def no_target(config):
        raise AssertionError("the target was loaded before the head was found")

    monkeypatch.setattr("heads.target.load_target", no_target)
    cfg = entry.compose_eval(["head=release"])
    assert cfg.head == "release" and cfg.runtime.tree_total_tokens == "auto" and cfg.runtime.fallback is True
    with pytest.raises(FileNotFoundError, match="head=release"):
        entry.run(cfg)
