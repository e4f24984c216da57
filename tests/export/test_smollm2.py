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


@pytest.mark.integration
def test_smollm2_eagle3_exports(tmp_path, smollm2):
    from heads.eagle3 import Eagle3Config, Eagle3Head

    config = Eagle3Config.from_target(smollm2, draft_vocab_size=1024)
    assert config.aux_layer_ids == [2, 15, 27]  # [2, L//2, L-3] for L = 30
    paths = export_all(Eagle3Head(config), config, ["engine"], tmp_path / "eagle3", smollm2)
    for fmt, folder in paths.items():
        assert validate_export(folder, smollm2)["format"] == fmt
    configs = {fmt: json.loads((folder / "config.json").read_text()) for fmt, folder in paths.items()}
    assert configs["eagle3"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert configs["eagle3_vllm"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert configs["speculators"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    verifier = configs["speculators"]["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "architectures": ["LlamaForCausalLM"]}
    layer = configs["speculators"]["transformer_layer_config"]
    assert (layer["head_dim"], layer["num_attention_heads"], layer["num_key_value_heads"]) == (64, 9, 3)
    assert configs["eagle3"]["draft_vocab_size"] == 1024 and configs["eagle3"]["vocab_size"] == 49152
    head, loaded_config, _ = load_export(paths["speculators"], smollm2)
    assert loaded_config == config
