"""The embedded default target (SmolLM2-135M, tied embedding/lm_head): every format exports,
validates against the real base model and names the hub id engines load."""
from __future__ import annotations

import json

import pytest

from export import export_all, export_head, load_export, validate_export
from heads.eagle import EagleConfig, EagleHead
from heads.medusa import MedusaConfig, MedusaHeads


@pytest.mark.integration
def test_smollm2_eagle_and_medusa_exports(tmp_path, smollm2):
    config = EagleConfig.from_target(smollm2)
    paths = export_all(EagleHead(config), config, ["native", "engine"], tmp_path / "eagle", smollm2)
    for fmt, folder in paths.items():
        assert validate_export(folder, smollm2)["format"] == fmt
    eagle_config = json.loads((paths["eagle"] / "config.json").read_text())
    assert eagle_config["architectures"] == ["LlamaForCausalLMEagle"]
    assert (eagle_config["hidden_size"], eagle_config["vocab_size"]) == (576, 49152)
    card = (paths["eagle_vllm"] / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "dequantized Q4_1 GGUF" in card
    head, loaded_config, _ = load_export(paths["eagle"], smollm2)
    assert loaded_config == config

    medusa_config = MedusaConfig.from_target(smollm2, num_heads=2, share_lm_head=True)
    folder = export_head(MedusaHeads(medusa_config), medusa_config, "medusa", tmp_path / "medusa", smollm2)
    assert validate_export(folder, smollm2)["parameters"] == 2 * (576 * 576 + 576 + 49152 * 576)
    medusa_json = json.loads((folder / "config.json").read_text())
    assert medusa_json["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
