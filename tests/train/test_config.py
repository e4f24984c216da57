"""Every YAML under conf/ composes into a valid JobConfig; config errors name the key."""
from __future__ import annotations

from pathlib import Path

import pytest

from train.__main__ import CONF_DIR, compose_job
from train.job import ConfigError, JobConfig, validate_job

CONF = Path(CONF_DIR)
GROUP_FILES = sorted(p for p in CONF.rglob("*.yaml") if p.parent != CONF and p.parent.name != "recipe")
RECIPES = sorted((CONF / "recipe").glob("*.yaml"))


def test_conf_tree_is_found():
    assert (CONF / "config.yaml").is_file()
    assert len(GROUP_FILES) >= 8 and len(RECIPES) >= 5


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: str(p.relative_to(CONF)))
def test_every_group_option_composes(path):
    group = path.parent.relative_to(CONF).as_posix()
    job = compose_job([f"{group}={path.stem}"])
    assert isinstance(job, JobConfig)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_composes(path):
    job = compose_job([f"+recipe={path.stem}"])
    assert job.recipe == path.stem


def test_required_recipes_exist():
    names = {p.stem for p in RECIPES}
    assert {"eagle_smollm2_135m", "medusa_smollm2_135m", "eagle_llama3_8b", "medusa_vicuna_7b",
            "eagle_llama3_70b"} <= names


def test_default_job_is_the_embedded_eagle_job():
    job = compose_job([])
    assert job.model.name_or_path.startswith("embedded:")
    assert job.heads.type == "eagle"
    assert job.data.source == "embedded:sharegpt"


def test_70b_recipe_numbers():
    job = compose_job(["+recipe=eagle_llama3_70b"])
    arch = job.model.arch
    assert (arch.hidden_size, arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads,
            arch.intermediate_size, arch.vocab_size) == (8192, 80, 64, 8, 28672, 128256)
    assert job.deepspeed.enabled and job.deepspeed.zero_stage == 2
    assert job.data.max_length == 2048 and job.data.mode == "offline"
    assert job.heads.type == "eagle3" and job.heads.eagle3.ttt_steps == 7 and job.heads.draft_vocab_size == 32000
    assert job.trainer.learning_rate == pytest.approx(5e-5) and job.trainer.warmup_ratio == pytest.approx(0.06)


@pytest.mark.parametrize("recipe", ["eagle_llama3_8b", "eagle_llama3_70b"])
def test_big_eagle_recipes_train_eagle1_one_override_away(recipe):
    """heads=eagle switches the head and, with it, the trainer group to the EAGLE-1/2 reference's."""
    job = compose_job([f"+recipe={recipe}", "heads=eagle"])
    assert job.heads.type == "eagle" and job.recipe == recipe
    assert job.trainer.learning_rate == pytest.approx(3e-5) and job.trainer.warmup_ratio == pytest.approx(0.01)
    assert job.trainer.max_grad_norm == 0.5 and job.trainer.mixed_precision == "bf16"
    assert job.heads.draft_vocab_size == 0  # the full vocabulary, as the EAGLE-1/2 reference trains it
    assert compose_job(["heads=eagle", f"+recipe={recipe}"]).heads.type == "eagle"  # either order


@pytest.mark.parametrize("override, key", [
    ("trainer.no_such_key=1", "trainer.no_such_key"),
    ("trainer.max_steps=many", "trainer.max_steps"),
])
def test_unknown_key_or_wrong_type_names_the_key(override, key):
    with pytest.raises(Exception) as info:
        compose_job([override])
    assert key in str(info.value)


@pytest.mark.parametrize("override, message", [
    ("+trainer.learnin_rate=1e-3", "trainer.learnin_rate is not a setting: did you mean trainer.learning_rate?"),
    ("+heads.eagle.feature_los_weight=2", "did you mean heads.eagle.feature_loss_weight?"),
    ("+zzz=1", "zzz is not a setting: the settings here are ['data', 'deepspeed', "),
])
def test_an_added_key_no_setting_takes_is_refused_naming_the_closest(override, message):
    with pytest.raises(ConfigError) as info:
        compose_job([override])
    assert message in str(info.value)


def test_python_m_train_reports_an_added_unknown_key_as_one_line(capsys):
    from train.__main__ import cli

    assert cli(["+trainer.learnin_rate=1e-3", "trainer.dry_run=true"]) == 2  # dry run: nothing loads even if accepted
    assert "did you mean trainer.learning_rate?" in capsys.readouterr().err


@pytest.mark.parametrize("override, key", [
    ("trainer.max_steps=0", "trainer.max_steps"),
    ("trainer.learning_rate=-1", "trainer.learning_rate"),
    ("heads.type=lstm", "heads.type"),
    ("data.overflow=wrap", "data.overflow"),
    ("runtime.top_p=0", "runtime.top_p"),
    ("heads.hidden_size=4096", "heads.hidden_size"),
    ("heads.eagle3.loss_decay=0", "heads.eagle3.loss_decay"),
    ("heads.eagle3.ttt_steps=0", "heads.eagle3.ttt_steps"),
    ("heads.eagle3.aux_layer_ids=[2,15,30]", "heads.eagle3.aux_layer_ids"),  # SmolLM2 has 30 layers
    ("heads.eagle3.aux_layer_ids=[]", "heads.eagle3.aux_layer_ids"),
    ("trainer.log_every=0", "trainer.log_every"),
    ("trainer.eval_batches=0", "trainer.eval_batches"),
    ("trainer.num_threads=-1", "trainer.num_threads"),
    ("trainer.seed=-3", "trainer.seed"),
    ("runtime.tree_total_tokens=abc", "runtime.tree_total_tokens"),  # was a TypeError
    ("runtime.tree_total_tokens=1", "runtime.tree_total_tokens"),
    ("runtime.max_new_tokens=0", "runtime.max_new_tokens"),
    ("runtime.temperature=inf", "runtime.temperature"),
    ("runtime.temperature=nan", "runtime.temperature"),
    ("stages=[]", "stages"),
])
def test_impossible_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose_job([override])


def test_python_m_train_refuses_an_empty_stage_list_before_the_target_loads(capsys, monkeypatch):
    from train.__main__ import cli

    monkeypatch.setattr("heads.target.load_target", lambda *a, **k: pytest.fail("the target loaded for stages=[]"))
    assert cli(["stages=[]"]) == 2
    assert "stages=[] runs nothing" in capsys.readouterr().err


def test_validate_is_cheap_and_pure():
    job = JobConfig()
    assert validate_job(job) is job


@pytest.mark.parametrize("recipe", ["eagle_smollm2_135m", "eagle_smollm2_135m_long"])
def test_self_distilled_training_never_sees_the_prompts_python_m_eval_holds_out(recipe):
    """Regeneration reads the first N conversations of ShareGPT, held-out ones included; the split
    is a hash threshold on the conversation id, so a training set split at a fraction at least
    `python -m eval`'s (same seed) keeps every prompt it measures on out of training."""
    from eval.__main__ import compose_eval

    job, measured = compose_job([f"+recipe={recipe}"]), compose_eval([])
    assert job.data.regenerate.enabled and job.data.source == measured.data.source
    assert job.data.eval_fraction >= measured.data.eval_fraction
    assert job.data.split_seed == measured.data.split_seed


def test_each_config_section_checks_its_own_fields():
    """The sections validate themselves (validate_job only adds rules that relate sections)."""
    from data.config import DataConfig
    from export.config import ExportConfig
    from heads.config import HeadsConfig
    from heads.target import TargetConfig
    from train.config import DeepSpeedConfig, LoggerConfig, TrainerConfig

    for section, key in ((DataConfig(overflow="wrap"), "data.overflow"), (HeadsConfig(type="lstm"), "heads.type"),
                         (TargetConfig(dtype="int8"), "model.dtype"), (TrainerConfig(schedule="step"), "trainer.schedule"),
                         (LoggerConfig(kind="tensorboard"), "logger.kind"), (DeepSpeedConfig(zero_stage=4), "deepspeed.zero_stage"),
                         (ExportConfig(formats=["gguf"]), "export.formats")):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            section.check()
    for section in (DataConfig(), HeadsConfig(), TargetConfig(), TrainerConfig(), LoggerConfig(), DeepSpeedConfig(),
                    ExportConfig()):
        section.check()


def test_a_job_sets_its_threads_once():
    with pytest.raises(ConfigError, match="runtime.threads=2 differs from trainer.num_threads=None"):
        compose_job(["runtime.threads=2"])
    assert compose_job(["runtime.threads=2", "trainer.num_threads=2"]).runtime.threads == 2
