"""Multi-process training on CPU (gloo): DDP and DeepSpeed ZeRO-2/3 in 2 processes match 1 process
with the same global batch, and head state saved by any layout resumes in any other.

Tolerance: the runs are fp32 and differ only in reduction order (all-reduce of two half-batch
gradients vs one full-batch gradient): measured max relative loss difference ~2e-7; asserted 1e-5.
The three launches run the worker (tests/scale/worker.py) through torchrun --standalone (a free
port); TORCH_EXTENSIONS_DIR points at an empty folder that must stay empty: no DeepSpeed JIT build.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train.config import DeepSpeedConfig, TrainerConfig
from train.distributed import LaunchError, accelerate_num_processes, check_world, deepspeed_config, load_deepspeed_file

WORKER = str(Path(__file__).with_name("worker.py"))
ROOT = str(Path(__file__).resolve().parents[2])
# One launch of worker processes (the module fixture, ~25 s) serves every test here.
pytestmark = pytest.mark.long(2)
RTOL = 1e-5


def test_deepspeed_config_takes_batch_accumulation_precision_clip_from_trainer():
    trainer = TrainerConfig(batch_size=3, grad_accumulation=5, max_grad_norm=0.7, mixed_precision="bf16")
    config = deepspeed_config(trainer, DeepSpeedConfig(enabled=True, zero_stage=2, offload_optimizer=True), world_size=4)
    assert config["train_micro_batch_size_per_gpu"] == 3 and config["gradient_accumulation_steps"] == 5
    assert config["train_batch_size"] == 3 * 5 * 4 and config["gradient_clipping"] == 0.7
    assert config["bf16"]["enabled"] and not config["fp16"]["enabled"]
    assert config["zero_optimization"]["stage"] == 2 and config["zero_optimization"]["elastic_checkpoint"]
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "optimizer" not in config and "scheduler" not in config  # no FusedAdam / CPUAdam build
    zero3 = deepspeed_config(trainer, DeepSpeedConfig(enabled=True, zero_stage=3), world_size=1)
    assert zero3["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]


def test_explicit_deepspeed_file_must_agree_with_trainer(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3}}))
    config = load_deepspeed_file(str(path), TrainerConfig(batch_size=2), world_size=8)
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["train_batch_size"] == 16
    path.write_text(json.dumps({"gradient_accumulation_steps": 7}))
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        load_deepspeed_file(str(path), TrainerConfig(grad_accumulation=1), world_size=1)


def test_world_size_mismatch_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LaunchError, match="WORLD_SIZE=2"):
        check_world(1)  # torchrun + a plain Accelerator() on CPU
    check_world(2)


def test_accelerate_single_process_launcher_is_recognised():
    argv = ["/venv/bin/python", "/venv/bin/accelerate", "launch", "--cpu", "--num_processes", "2", "train.py"]
    assert accelerate_num_processes(argv) == 2
    assert accelerate_num_processes(["accelerate", "launch", "--num_processes=4", "x.py"]) == 4
    assert accelerate_num_processes(["torchrun", "--nproc_per_node", "2", "x.py"]) is None


def _launch(nproc: int, out: Path, scenarios: list[dict], env: dict) -> dict:
    launcher = [sys.executable, WORKER] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", WORKER]
    result = subprocess.run(launcher + ["--out", str(out), "--plan", json.dumps(scenarios)],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scale")
    extensions = tmp / "torch_extensions"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(extensions), "PYTHONPATH": ROOT}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    state = lambda name: str(tmp / f"{name}.safetensors")  # noqa: E731
    results = _launch(1, tmp / "one.json", [
        {"name": "single", "steps": 4, "save_at": 2, "save": state("single")}], env)
    results |= _launch(2, tmp / "two.json", [
        {"name": "ddp", "steps": 4, "save_at": 2, "save": state("ddp")},
        {"name": "zero2", "deepspeed": 2, "steps": 4, "save_at": 2, "save": state("zero2")},
        {"name": "ddp_from_single", "steps": 4, "resume": state("single")},
        {"name": "zero2_from_single", "deepspeed": 2, "steps": 4, "resume": state("single")},
        {"name": "zero3", "deepspeed": 3, "steps": 4, "save_at": 2, "save": state("zero3")},
        {"name": "zero3_from_single", "deepspeed": 3, "steps": 4, "resume": state("single")}], env)
    results |= _launch(1, tmp / "resume.json", [
        {"name": "single_from_ddp", "steps": 4, "resume": state("ddp")},
        {"name": "single_from_zero2", "steps": 4, "resume": state("zero2")},
        {"name": "single_from_zero3", "steps": 4, "resume": state("zero3")}], env)
    results["jit_builds"] = sorted(str(p) for p in extensions.rglob("*")) if extensions.exists() else []
    return results


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["ddp", "zero2", "zero3"])
def test_two_processes_match_one_process(runs, layout):
    assert runs[layout]["world"] == 2 and runs["single"]["world"] == 1
    assert runs[layout]["losses"] == pytest.approx(runs["single"]["losses"], rel=RTOL)
    assert runs[layout]["losses"][0] != pytest.approx(runs[layout]["losses"][-1], rel=1e-3)  # it trained
    assert runs[layout]["weight_checksum"] == pytest.approx(runs["single"]["weight_checksum"], rel=RTOL)
    assert runs[layout]["full_checksum"] == pytest.approx(runs["single"]["weight_checksum"], rel=RTOL)


@pytest.mark.integration
@pytest.mark.parametrize("resumed", ["ddp_from_single", "zero2_from_single", "zero3_from_single",
                                     "single_from_ddp", "single_from_zero2", "single_from_zero3"])
def test_state_saved_in_one_layout_resumes_in_another(runs, resumed):
    assert runs[resumed]["losses"] == pytest.approx(runs["single"]["losses"][2:], rel=RTOL)
    assert runs[resumed]["weight_checksum"] == pytest.approx(runs["single"]["weight_checksum"], rel=RTOL)


@pytest.mark.integration
def test_no_deepspeed_op_was_jit_compiled(runs):
    assert runs["jit_builds"] == []


def test_split_target_gpu_groups_tile_the_node():
    from train.placement import target_gpu_group, target_max_memory

    assert [target_gpu_group(r, 8, 4) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert target_gpu_group(5, 8, 1) == [5]
    assert target_max_memory(1, 8, 4, 80) == {4: "72GiB", 5: "72GiB", 6: "72GiB", 7: "72GiB"}
    with pytest.raises(ValueError, match="-n 2"):
        target_gpu_group(2, 8, 4)
    with pytest.raises(ValueError, match="tile"):
        target_gpu_group(0, 8, 3)


def test_zero3_refuses_medusa_heads_that_own_their_lm_heads():
    from train.__main__ import compose_job
    from train.job import ConfigError

    with pytest.raises(ConfigError, match="share_lm_head"):
        compose_job(["+recipe=medusa_vicuna_7b", "deepspeed=zero3"])
    assert compose_job(["+recipe=medusa_vicuna_7b", "deepspeed=zero3", "heads.medusa.share_lm_head=true"])
    assert compose_job(["+recipe=eagle_llama3_8b", "deepspeed=zero3"])
