"""The run's target: dtype candidates per machine, the row counts measured, and an end-to-end eval in
each dtype whose speculative output equals plain decoding in that same dtype."""
import pytest
import torch

from eval.config import RuntimeConfig
from eval.prepare import candidate_dtypes, prepare_target, runtime_sizes, verify_size
from eval.run import evaluate
from heads.eagle import EagleConfig, EagleHead, init_from_target
from tests.tiny import tiny_target

CPU = torch.device("cpu")


def test_dtype_candidates_follow_the_setting_and_the_cpu():
    assert candidate_dtypes("auto", torch.float32, CPU, {"avx2", "fma"})[0] == [torch.float32]
    assert candidate_dtypes("auto", torch.float32, CPU, {"avx512f", "avx512_bf16"})[0] == [torch.float32,
                                                                                           torch.bfloat16]
    assert candidate_dtypes("auto", torch.float32, CPU, {"amx_bf16"})[0] == [torch.float32, torch.bfloat16]
    assert candidate_dtypes("auto", torch.bfloat16, torch.device("cuda"), set())[0] == [torch.bfloat16]
    assert candidate_dtypes("target", torch.float32, CPU, {"amx_bf16"})[0] == [torch.float32]
    assert candidate_dtypes("bf16", torch.float32, CPU, set())[0] == [torch.bfloat16]
    with pytest.raises(ValueError, match="runtime.dtype"):
        candidate_dtypes("float8", torch.float32, CPU, set())


def test_runtime_sizes_cover_the_trees_and_chains_it_may_run():
    runtime = RuntimeConfig(tree_total_tokens="auto", tree_auto_sizes=[2, 4, 8, 100], tree_sweep=[16],
                            chain_depth=3, prompt_lookup_tokens=5)
    sizes = runtime_sizes(runtime, ["eagle_tree", "medusa"])
    assert sizes[0] == 1 and {2, 4, 8, 16, 6}.issubset(sizes) and max(sizes) <= 64  # chain 3 + 1, lookup 5 + 1
    assert 9 in sizes and 100 not in sizes  # medusa: root + 8 nodes; trees past MAX_ROWS are not measured
    assert verify_size(runtime, sizes) == 4  # the middle of the tree sizes it may choose (2, 4, 8)
    assert verify_size(RuntimeConfig(tree_total_tokens=6), [1, 6, 8]) == 6


def test_prepare_builds_the_asked_dtype_and_names_it():
    target = tiny_target()
    runtime = RuntimeConfig(dtype="bfloat16", linear_paths="auto", linear_paths_repeats=1)
    lean, model, fields = prepare_target(target.model, runtime, [1, 2, 4], torch.arange(3, 9), 64)
    assert lean.embedding.dtype == next(model.parameters()).dtype == torch.bfloat16
    assert next(target.model.parameters()).dtype == torch.float32  # the loaded target is left as it was
    assert fields["dtype"]["chosen"] == "bfloat16"
    paths = fields["linear_paths"]
    assert paths["dtype"] == "bfloat16" and set(paths["verify_curve_ms"]) == {"bfloat16/default", "bfloat16/chosen"}
    chosen = paths["by_dtype"]["bfloat16"]
    assert chosen["sizes"] == [1, 2, 4] and set(chosen["chosen"]) == set(lean.linear_sites())
    assert chosen["memory_mb"]["held_after"] <= chosen["memory_mb"]["budget"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "auto"])
def test_speculative_equals_plain_in_the_runs_dtype(dtype, tmp_path):
    target = tiny_target()
    head = init_from_target(EagleHead(EagleConfig.from_target(target)), target).eval()
    runtime = RuntimeConfig(max_new_tokens=12, chain_depth=3, tree_top_k=2, tree_depth=3, tree_total_tokens=6,
                            tree_sweep=[], threads=1, dtype=dtype, linear_paths="auto", linear_paths_repeats=1)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 128, (6,), generator=generator).tolist() for _ in range(3)]
    report = evaluate(target, prompts, ["eagle_tree", "eagle_chain", "prompt_lookup"], runtime, head=head,
                      head_config=head.config, out_dir=tmp_path, progress=False)
    assert report["dtype"]["chosen"] in ("float32", "bfloat16")
    if dtype != "auto":
        assert report["dtype"]["chosen"] == dtype
    for row in report["drafters"]:
        assert row["greedy_identical"] is True, (dtype, row["name"])
    markdown = (tmp_path / "report.md").read_text()
    assert f"Target compute dtype: **{report['dtype']['chosen']}**" in markdown and "| lm_head |" in markdown
