"""The self-distilled corpus shipped in data/corpora/ (scripts/pack_corpus.py): every shard is the
one the corpus recipes' regenerate stage would write for the embedded target in the dtype the
corpus names, so a job on a machine that computes in that dtype copies it instead of regenerating."""
from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpora" / "sharegpt_first_exchange"
RECIPES = ["eagle3_smollm2_135m_corpus", "eagle_smollm2_135m_corpus", "peagle_smollm2_135m_corpus",
           "dflash_smollm2_135m_corpus"]


def _manifest() -> dict:
    return json.loads((CORPUS / "corpus.json").read_text())


def test_every_shipped_shard_is_what_its_manifest_lists():
    manifest = _manifest()
    assert manifest["shards"], "an empty corpus"
    listed = {shard["name"] for shard in manifest["shards"]}
    assert {p.name.removesuffix(".gz") for p in CORPUS.glob("*.jsonl.gz")} == listed
    for shard in manifest["shards"]:
        raw = gzip.decompress((CORPUS / f"{shard['name']}.gz").read_bytes())
        assert hashlib.sha256(raw).hexdigest() == shard["sha256"], shard["name"]
        lines = raw.decode("utf-8").split("\n")[:-1]  # not splitlines: replies hold U+2028 and the like
        assert len(lines) == shard["conversations"] and all(json.loads(line)["conversations"] for line in lines)
        assert (CORPUS / f"{shard['name']}.key").is_file()


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_corpus_recipes_reuse_the_shipped_corpus(recipe):
    from train.__main__ import compose_job

    job = compose_job([f"+recipe={recipe}"])
    assert job.data.regenerate.reuse_from == "data/corpora/sharegpt_first_exchange"
    assert job.data.regenerate.max_new_tokens == _manifest()["settings"]["max_new_tokens"]


@pytest.mark.long(30)
@pytest.mark.integration
def test_the_shipped_keys_are_the_recipes_keys_for_the_embedded_target(smollm2):
    from train.__main__ import compose_job
    from train.selfdistill import shard_keys, target_identity

    manifest = _manifest()
    assert manifest["target"] == target_identity(smollm2)
    # The corpus may cover more records than the recipe asks for: keyed as a job asking for them all.
    job = compose_job([f"+recipe={manifest['recipe']}", f"data.max_records={manifest['records']}"])
    keys = shard_keys(job, smollm2, manifest["dtype"])
    for shard in manifest["shards"]:
        assert (CORPUS / f"{shard['name']}.key").read_text().strip() == keys[shard["name"]], shard["name"]
