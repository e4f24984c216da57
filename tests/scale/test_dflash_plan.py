"""DFlash's dry-run numbers: its parameter count against the real module, the features it caches."""
from tests.tiny import tiny_llama_config, tiny_target
from train.__main__ import compose_job
from train.job import TargetArch
from train.plan import dflash_queries, feature_layers, format_plan, head_parameter_counts, make_plan


def _tiny_arch() -> TargetArch:
    c = tiny_llama_config()
    return TargetArch(hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
                      num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                      intermediate_size=c.intermediate_size, vocab_size=c.vocab_size)


def test_dflash_count_matches_the_module():
    from heads.dflash import DflashConfig, DflashHead

    job = compose_job(["heads=dflash", "heads.dflash.num_layers=3", "heads.dflash.aux_layer_ids=[0,1]"])
    job.model.arch = _tiny_arch()
    head = DflashHead(DflashConfig.from_target(tiny_target(), aux_layer_ids=[0, 1], num_layers=3))
    trainable, frozen = head_parameter_counts(job)
    assert trainable == sum(p.numel() for p in head.parameters())
    assert frozen == 2 * 128 * 64
    assert feature_layers(job) == 3  # two aux streams and the final state


def test_dflash_plan_prints_block_rows_and_the_feature_cache():
    job = compose_job(["heads=dflash", "model=llama3_8b_instruct", "data.mode=offline", "deepspeed.num_gpus=8",
                       "data.max_length=2048", "trainer.batch_size=1", "runtime.drafters=[prompt_lookup]"])
    assert dflash_queries(job) == 512 * 16
    text = format_plan(make_plan(job))
    assert "8192 block rows" in text and "block attention mask" in text
    assert "feature cache on disk" in text and "4 layer(s) per token" in text
