"""The launch scripts build the right torchrun command (PYTHON=echo prints it instead of running)."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": "echo"}
    return subprocess.run(["bash", str(ROOT / "scripts" / script), *args], env=env, capture_output=True, text=True)


def test_single_node_uses_standalone_torchrun_with_n_processes():
    out = _run("launch_single_node.sh", "-n", "4", "+recipe=eagle_llama3_8b", "deepspeed=zero3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                                  "-m", "train", "+recipe=eagle_llama3_8b", "deepspeed=zero3"]


def test_single_node_rejects_a_bad_count():
    assert _run("launch_single_node.sh", "-n", "zero").returncode == 2


def test_multi_node_reads_nodes_and_slots_from_the_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# comment\nnode-a slots=8\nnode-b slots=8\nnode-c slots=8\n")
    out = _run("launch_multi_node.sh", "-f", str(hostfile), "-p", "29555", "-i", "job7", "+recipe=eagle_llama3_70b")
    assert out.returncode == 0, out.stderr
    args = out.stdout.split()
    assert args[args.index("--nnodes") + 1] == "3" and args[args.index("--nproc_per_node") + 1] == "8"
    assert args[args.index("--rdzv_endpoint") + 1] == "node-a:29555" and args[args.index("--rdzv_id") + 1] == "job7"
    assert args[-3:] == ["-m", "train", "+recipe=eagle_llama3_70b"]


def test_multi_node_refuses_uneven_slots_and_missing_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=8\nnode-b slots=4\n")
    assert _run("launch_multi_node.sh", "-f", str(hostfile)).returncode == 2
    assert _run("launch_multi_node.sh").returncode == 2
