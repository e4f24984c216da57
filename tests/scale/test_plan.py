"""Dry-run plans: parameter counts against real modules, ZeRO accounting, fit checks."""
import math

import pytest

from tests.tiny import tiny_llama_config, tiny_model
from train.__main__ import compose_job
from train.job import ConfigError, TargetArch
from train.plan import format_plan, head_parameter_counts, make_plan, target_parameter_count


def _tiny_arch() -> TargetArch:
    c = tiny_llama_config()
    return TargetArch(hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
                      num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                      intermediate_size=c.intermediate_size, vocab_size=c.vocab_size)


def test_target_parameter_count_matches_a_real_llama():
    model = tiny_model()
    assert target_parameter_count(_tiny_arch()) == sum(p.numel() for p in model.parameters())


def test_eagle_head_count_matches_fc_plus_one_decoder_layer_without_input_norm():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    job = compose_job(["heads=eagle"])
    job.model.arch = _tiny_arch()
    layer = LlamaDecoderLayer(tiny_llama_config(), layer_idx=0)
    D = job.model.arch.hidden_size
    expected = sum(p.numel() for p in layer.parameters()) - D + 2 * D * D  # no input norm; fc [D, 2D]
    trainable, frozen = head_parameter_counts(job)
    assert trainable == expected
    assert frozen == 2 * job.model.arch.vocab_size * D


def test_medusa_counts_independent_blocks_and_lm_heads():
    job = compose_job(["heads=medusa", "heads.medusa.num_heads=3", "heads.medusa.num_layers=2"])
    job.model.arch = _tiny_arch()
    D, V = 64, 128
    assert head_parameter_counts(job) == (3 * 2 * (D * D + D) + 3 * V * D, 0)
    job.heads.medusa.share_lm_head = True
    assert head_parameter_counts(job) == (3 * 2 * (D * D + D), V * D)


@pytest.mark.parametrize("recipe", ["eagle_llama3_70b", "eagle_llama3_8b", "medusa_vicuna_7b", "eagle3_smollm2_135m",
                                    "eagle3_smollm2_135m_long"])
@pytest.mark.parametrize("extra", [[], ["data.mode=offline"]])
def test_recipe_plans_print(recipe, extra):
    text = format_plan(make_plan(compose_job([f"+recipe={recipe}", *extra])))
    assert "head parameters" in text and "optimizer states" in text and "steps per epoch" in text
    assert ("feature cache on disk" in text) == (compose_job([f"+recipe={recipe}", *extra]).data.mode == "offline")


def test_eagle3_70b_head_and_training_fit_offline():
    plan = make_plan(compose_job(["+recipe=eagle_llama3_70b"]), cache_dir="/")
    assert plan.head_type == "eagle3"
    D, I, V, Vd = 8192, 28672, 128256, 32000
    layer = 2 * D * (64 + 2 * 8) * 128 + 64 * 128 * D + 3 * D * I  # q/k/v read 2D columns
    assert plan.trainable_parameters == 3 * D * D + layer + 4 * D + Vd * D  # fc [D, 3D], 4 norms, draft lm_head
    assert plan.frozen_head_parameters == 2 * V * D
    assert not any("training needs" in p for p in plan.problems)


def test_eagle_70b_head_is_about_one_billion_and_training_fits_offline():
    plan = make_plan(compose_job(["+recipe=eagle_llama3_70b", "heads=eagle"]), cache_dir="/")
    assert 0.95e9 < plan.trainable_parameters < 1.05e9  # fc 134M + attention 168M + MLP 705M
    assert plan.feature_extraction and plan.cache_bytes > 100e9  # hundreds of GB of hidden states
    assert not any("training needs" in p for p in plan.problems)
    assert plan.extraction_replicas_per_node == 2  # 141 GB bf16 target: 4 GPUs of 80 GB per copy


def test_70b_one_command_plan_keeps_the_split_target_for_eval():
    """All stages in one launch: 2 processes per node (one per 4-GPU copy of the target), the target
    resident while the head trains, and eval on rank 0 needing the target, a KV cache and the head."""
    job = compose_job(["+recipe=eagle_llama3_70b"])
    plan = make_plan(job, cache_dir="/")
    assert plan.processes_per_node == 2 and plan.world_size == 2
    assert plan.global_batch == 32  # micro-batch 1 x 16 accumulated x 2 processes
    training = {item.name: item for item in plan.training}
    assert "frozen target shard" in training and "target decoder layers" not in training
    target = plan.target_parameters * 2 / 1e9
    evaluation = {item.name: item.gigabytes for item in plan.evaluation}
    assert evaluation["frozen target shard"] == pytest.approx(target / 4)
    kv = 2 * 80 * 8 * 128 * (256 + 256 + 64 + 8) * 2 / 1e9  # prompt + new tokens + longest tree + 8, bf16
    assert evaluation["KV cache"] == pytest.approx(kv / 4)
    assert evaluation["head"] == pytest.approx(2 * plan.trainable_parameters * 4 / 1e9)
    assert not [p for p in plan.problems if "disk" not in p]
    text = format_plan(plan)
    assert "peak = target + KV cache + head" in text and "launch_single_node.sh -n 2 +recipe=eagle_llama3_70b" in text
    parts_only = make_plan(compose_job(["+recipe=eagle_llama3_70b", "stages=[train]"]), cache_dir="/")
    assert parts_only.processes_per_node == 8 and not parts_only.evaluation
    assert "target decoder layers" in {item.name for item in parts_only.training}


def test_zero2_shards_gradients_and_optimizer_but_not_weights():
    small = make_plan(compose_job(["+recipe=eagle_llama3_8b", "deepspeed.num_gpus=2"]))
    large = make_plan(compose_job(["+recipe=eagle_llama3_8b", "deepspeed.num_gpus=8"]))
    by_name = lambda plan: {item.name: item.gigabytes for item in plan.training}  # noqa: E731
    assert by_name(small)["optimizer states"] == pytest.approx(4 * by_name(large)["optimizer states"])
    assert by_name(small)["head gradients"] == pytest.approx(4 * by_name(large)["head gradients"])
    assert by_name(small)["head weights"] == pytest.approx(by_name(large)["head weights"])
    assert small.steps_per_epoch == pytest.approx(4 * large.steps_per_epoch, abs=4)
    zero3 = make_plan(compose_job(["+recipe=eagle_llama3_8b", "deepspeed.zero_stage=3"]))
    assert by_name(zero3)["head weights"] == pytest.approx(by_name(large)["head weights"] / 8)


def test_replicated_70b_target_online_is_named_as_not_fitting():
    job = compose_job(["+recipe=eagle_llama3_70b", "data.mode=online", "deepspeed.target_placement=replicate"])
    plan = make_plan(job, num_records=1000, tokens_per_record=500)
    assert any("frozen target shard" in p for p in plan.problems)
    assert "does not fit" in format_plan(plan)


def test_small_gpu_names_training_problem_and_counts_records_given():
    plan = make_plan(compose_job(["+recipe=eagle_llama3_8b", "deepspeed.gpu_memory_gb=16"]), num_records=64_000)
    assert plan.num_records == 64_000 and not plan.records_assumed
    assert plan.steps_per_epoch == math.ceil(64_000 / (4 * 1 * plan.world_size))
    assert any(p.startswith("training needs") for p in plan.problems)


def test_bad_deepspeed_values_are_config_errors():
    with pytest.raises(ConfigError, match="deepspeed.target_placement"):
        compose_job(["deepspeed.target_placement=everywhere"])
    with pytest.raises(ConfigError, match="deepspeed.num_gpus"):
        compose_job(["deepspeed.num_gpus=0"])


@pytest.mark.parametrize("overrides", [["heads=eagle"], ["heads=eagle", "heads.eagle.fc_bias=true"],
                                       ["heads=medusa", "heads.medusa.num_layers=2"],
                                       ["heads=medusa", "heads.medusa.share_lm_head=true"],
                                       ["heads=eagle3", "heads.eagle3.aux_layer_ids=[0,1,1]",
                                        "heads.draft_vocab_size=40"],
                                       ["heads=eagle3", "heads.eagle3.aux_layer_ids=[1]", "heads.draft_vocab_size=0"]])
def test_planned_trainable_count_is_the_real_heads(overrides):
    from heads.eagle import EagleConfig
    from heads.eagle3 import Eagle3Config
    from heads.io import build_head
    from heads.medusa import MedusaConfig
    from tests.tiny import tiny_target

    job = compose_job(overrides)
    job.model.arch = _tiny_arch()
    target = tiny_target()
    if job.heads.type == "eagle":
        config = EagleConfig.from_target(target, fc_bias=job.heads.eagle.fc_bias)
    elif job.heads.type == "eagle3":
        config = Eagle3Config.from_target(target, draft_vocab_size=job.heads.draft_vocab_size or None,
                                          aux_layer_ids=job.heads.eagle3.aux_layer_ids)
    else:
        m = job.heads.medusa
        config = MedusaConfig.from_target(target, num_heads=m.num_heads, num_layers=m.num_layers,
                                          share_lm_head=m.share_lm_head)
    head = build_head(config)
    trained = sum(p.numel() for p in head.parameters() if p.requires_grad)
    assert head_parameter_counts(job)[0] == trained


def test_offline_eagle_training_counts_the_target_layers_loaded_beside_the_cache():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from train.plan import decoder_layer_parameter_count

    layer = LlamaDecoderLayer(tiny_llama_config(), layer_idx=0)
    assert decoder_layer_parameter_count(_tiny_arch()) == sum(p.numel() for p in layer.parameters())
    plan = make_plan(compose_job(["+recipe=eagle_llama3_70b", "heads=eagle", "heads.eagle.init_layer=-1",
                                  "stages=[train]"]), cache_dir="/")  # from a finished cache
    layers = next(item for item in plan.training if item.name == "target decoder layers")
    assert layers.gigabytes == pytest.approx(2 * 0.856e9 * 2 / 1e9, rel=0.01)  # layers 0 and 79 in bf16
    plan = make_plan(compose_job(["+recipe=eagle_llama3_70b", "heads=eagle", "stages=[train]"]),
                     cache_dir="/")  # random init: layer 0
    layers = next(item for item in plan.training if item.name == "target decoder layers")
    assert layers.gigabytes == pytest.approx(0.856e9 * 2 / 1e9, rel=0.01)
    medusa = make_plan(compose_job(["+recipe=medusa_vicuna_7b", "data.mode=offline", "stages=[train]"]),
                       cache_dir="/")
    assert not any(item.name == "target decoder layers" for item in medusa.training)


def test_eagle3_feature_cache_holds_three_aux_layers_and_the_final_state():
    eagle = make_plan(compose_job(["+recipe=eagle_llama3_70b", "heads=eagle"]), cache_dir="/")
    eagle3 = make_plan(compose_job(["+recipe=eagle_llama3_70b", "heads.eagle3.ttt_steps=3", "stages=[train]"]),
                       cache_dir="/")
    assert (eagle.cache_layers, eagle3.cache_layers) == (1, 4)
    assert eagle3.cache_bytes == pytest.approx(4 * eagle.cache_bytes, rel=1e-3)  # ids and mask are per token
    assert "4 layer(s) per token" in format_plan(eagle3)
    layers = {item.name: item for item in eagle3.training}["target decoder layers"]
    assert layers.gigabytes == pytest.approx(0.856e9 * 2 / 1e9, rel=0.01)  # layer 0's shape only
    two = make_plan(compose_job(["+recipe=eagle_llama3_70b", "heads.eagle3.aux_layer_ids=[10,40]"]), cache_dir="/")
    assert two.cache_layers == 3
    longer = make_plan(compose_job(["+recipe=eagle_llama3_70b"]), cache_dir="/")  # the recipe's 7 steps
    activations = lambda plan: {i.name: i.gigabytes for i in plan.training}["activations"]  # noqa: E731
    assert activations(longer) > 2 * activations(eagle3)  # every unrolled step keeps its activations


def test_time_estimate_scales_with_steps_and_assumed_throughput():
    base = make_plan(compose_job(["+recipe=eagle_llama3_70b"]), cache_dir="/")
    faster = make_plan(compose_job(["+recipe=eagle_llama3_70b", "deepspeed.gpu_tflops=800"]), cache_dir="/")
    longer = make_plan(compose_job(["+recipe=eagle_llama3_70b", "trainer.max_steps=400000"]), cache_dir="/")
    assert faster.training_hours == pytest.approx(base.training_hours / 2)
    assert faster.extraction_hours == pytest.approx(base.extraction_hours / 2)
    assert longer.training_hours == pytest.approx(2 * base.training_hours)
    tokens = base.num_records * base.tokens_per_record  # one forward of the target per token, 2 copies
    assert base.extraction_hours == pytest.approx(2 * base.target_parameters * tokens / (2 * 400e12) / 3600)
    assert "time (compute only, estimate at deepspeed.gpu_tflops=400" in format_plan(base)


def test_the_default_job_plans_the_processes_a_launch_here_would_start(monkeypatch):
    """No deepspeed.num_gpus in the job: one process without a GPU (a plain python -m train), one
    per GPU with them; a count the user (or a cluster recipe) gives is planned as given."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    plan = make_plan(compose_job([]))
    B, accumulation = compose_job([]).trainer.batch_size, compose_job([]).trainer.grad_accumulation
    assert (plan.world_size, plan.processes_per_node, plan.global_batch) == (1, 1, B * accumulation)
    text = format_plan(plan)
    assert "1 data-parallel process(es) (no GPU here" in text and "launch: 1 process (python -m train" in text
    assert make_plan(compose_job(["deepspeed.num_gpus=4"])).world_size == 4
    assert make_plan(compose_job(["+recipe=eagle_llama3_8b"])).world_size == 8  # a cluster recipe names its GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert make_plan(compose_job([])).world_size == 2
    assert make_plan(compose_job(["model.device=cpu"])).world_size == 1
