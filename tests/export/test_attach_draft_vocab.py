"""scripts/attach_draft_vocab.py: a head saved without a draft vocabulary gets the one its training
job counts, in a new export folder; its weights and its manifest's records stay as they were."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RELEASE = ROOT / "heads" / "release" / "eagle_smollm2_135m"
SLICE = ROOT / "tests" / "assets" / "goldens" / "selfdistill_slice.jsonl"


def _without_vocab(target, out: Path) -> Path:
    """The release head as it was saved before heads carried a draft vocabulary."""
    from export import export_head, load_export
    from heads.vocab import VOCAB_KEY

    head, config, manifest = load_export(RELEASE, target, dtype="float32")
    del head._buffers[VOCAB_KEY]
    config.draft_vocab_size = 0
    return export_head(head, config, "native", out, target, "bfloat16",
                       {"training": manifest["training"], "eval": manifest["eval"]})


@pytest.mark.long(15)
@pytest.mark.integration
def test_a_head_without_a_vocabulary_gets_its_jobs_vocabulary(tmp_path, smollm2):
    from data.pipeline import prepare_data
    from export import load_export
    from heads.vocab import draft_ids
    from train.__main__ import compose_job
    from train.objectives import frequent_reply_tokens

    old_head = _without_vocab(smollm2, tmp_path / "old")

    data = [f"data.source={SLICE}", "data.format=jsonl", "data.regenerate.enabled=false", "data.max_records=null",
            f"data.cache_dir={tmp_path / 'cache'}", "heads.draft_vocab_size=512"]
    out = tmp_path / "with_vocab"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "attach_draft_vocab.py"), str(old_head), str(out),
                           *data], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]

    job = compose_job(["+recipe=eagle_smollm2_135m_long", *data])
    expected = frequent_reply_tokens(prepare_data(job.data, smollm2.tokenizer).train, 512, smollm2.vocab_size)
    old, _, old_manifest = load_export(old_head, smollm2, dtype="float32")
    new, _, new_manifest = load_export(out, smollm2, dtype="float32")
    assert draft_ids(old) is None and torch.equal(draft_ids(new).cpu(), expected)
    old_state, new_state = old.state_dict(), new.state_dict()
    assert all(torch.equal(old_state[key], new_state[key]) for key in old_state)  # weights untouched
    assert new_manifest["training"] == old_manifest["training"] and new_manifest["eval"] == old_manifest["eval"]
    assert new_manifest["format"] == "native" and new_manifest["dtype"] == "bfloat16"
    assert any("attached after training" in note for note in new_manifest["notes"])
    # A head that already carries one, and an existing destination, are refused.
    again = subprocess.run([sys.executable, str(ROOT / "scripts" / "attach_draft_vocab.py"), str(out),
                            str(tmp_path / "again"), *data], capture_output=True, text=True, cwd=tmp_path)
    assert again.returncode != 0 and "already carries a 512-id draft vocabulary" in again.stderr
    taken = subprocess.run([sys.executable, str(ROOT / "scripts" / "attach_draft_vocab.py"), str(old_head), str(out)],
                           capture_output=True, text=True, cwd=tmp_path)
    assert taken.returncode != 0 and "exists" in taken.stderr
    assert json.loads((out / "specheads.json").read_text())["draft_vocab"]
