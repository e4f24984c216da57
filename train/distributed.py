"""Process-group and precision setup: the one place that builds the `Accelerator`.

The training loop calls `make_accelerator` and never touches torch.distributed directly, so the
same loop runs in one CPU process, under DDP (torchrun), or under DeepSpeed ZeRO-2/3. Batch size,
accumulation, precision and clipping live once in `TrainerConfig`; `deepspeed_config` writes them
into the DeepSpeed dict handed to accelerate, so the two can never disagree.

Traps measured on a CPU machine, each refused or avoided here:
- `torchrun` + a plain `Accelerator()` on CPU gives N unsynchronised single-process runs
  (accelerate only forms a CPU process group with `cpu=True`): `check_world` refuses.
- `accelerate launch --cpu --num_processes 2` starts ONE process: `check_world` refuses.
- DeepSpeed under accelerate on CPU needs the gloo backend passed explicitly; without it
  accelerate counts one process and DeepSpeed fails its batch-size assertion.
- DeepSpeed JIT-compiles its CPU shared-memory all-reduce op (~100 s) at the first
  `deepspeed.initialize` of a fresh machine; gloo does the same job, so the op is switched off.
  Its optimizer section would build FusedAdam (~100 s): the loop's torch AdamW is used instead.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket

import torch

from train.config import DeepSpeedConfig, TrainerConfig

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """The processes that started are not the processes that were asked for."""


def resolve_mixed_precision(trainer: TrainerConfig, target_dtype: torch.dtype | None = None) -> str:
    """auto: bf16 on a GPU; on a CPU, bf16 where the frozen target computes in bf16 (the dtype rule
    measured it faster on this CPU: its bf16 matrix units serve the head's steps as well), else no.
    The head keeps fp32 master weights either way; only its steps' matmuls run in bf16."""
    if trainer.mixed_precision != "auto":
        return trainer.mixed_precision
    if torch.cuda.is_available():
        return "bf16"
    return "bf16" if target_dtype == torch.bfloat16 else "no"


def deepspeed_config(trainer: TrainerConfig, deepspeed: DeepSpeedConfig, world_size: int) -> dict:
    """The DeepSpeed JSON for this job, every shared value taken from `trainer`.

    No optimizer or scheduler section: the loop's torch AdamW and schedule are wrapped by ZeRO
    (a DeepSpeed optimizer section would JIT-build FusedAdam / CPUAdam).
    """
    precision = resolve_mixed_precision(trainer)
    zero: dict = {"stage": deepspeed.zero_stage, "contiguous_gradients": True, "overlap_comm": torch.cuda.is_available()}
    if deepspeed.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True)
    else:  # ZeRO-1/2 checkpoints that load into a different number of processes
        zero["elastic_checkpoint"] = True
    if deepspeed.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {
        "train_micro_batch_size_per_gpu": trainer.batch_size,
        "gradient_accumulation_steps": trainer.grad_accumulation,
        "train_batch_size": trainer.batch_size * trainer.grad_accumulation * world_size,
        "gradient_clipping": trainer.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # offload keeps the torch optimizer: no CPUAdam build
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    return config


def load_deepspeed_file(path: str, trainer: TrainerConfig, world_size: int) -> dict:
    """An explicit DeepSpeed JSON; its batch, accumulation and clip must match `trainer`."""
    import json

    with open(path) as handle:
        config = json.load(handle)
    expected = {
        "train_micro_batch_size_per_gpu": trainer.batch_size,
        "gradient_accumulation_steps": trainer.grad_accumulation,
        "train_batch_size": trainer.batch_size * trainer.grad_accumulation * world_size,
        "gradient_clipping": trainer.max_grad_norm,
    }
    for key, value in expected.items():
        if key in config and config[key] not in ("auto", value):
            raise ValueError(f"deepspeed.config_file {path}: {key}={config[key]} but the trainer config gives {value}; "
                             "set it once (trainer.*) and use \"auto\" in the file")
        config[key] = value
    return config


def avoid_deepspeed_jit() -> None:
    """On CPU, mark DeepSpeed's shared-memory comm op unavailable so no process JIT-compiles it
    (~100 s on a fresh machine); collectives then go through gloo. No-op on CUDA (NCCL)."""
    if torch.cuda.is_available():
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def launched_world_size() -> int:
    """Processes the launcher asked for: WORLD_SIZE (torchrun, deepspeed, accelerate multi-process)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def accelerate_num_processes(argv: list[str]) -> int | None:
    """--num_processes of an `accelerate launch` command line, or None if argv is not one."""
    if not any(arg.endswith("accelerate") for arg in argv) or "launch" not in argv:
        return None
    for index, arg in enumerate(argv):
        if arg.startswith(("--num_processes=", "--num-processes=")):
            return int(arg.split("=", 1)[1])
        if arg in ("--num_processes", "--num-processes") and index + 1 < len(argv):
            return int(argv[index + 1])
    return None


def _parent_argv() -> list[str]:
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as handle:
            return handle.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def check_world(num_processes: int) -> None:
    """Refuse a run whose process group is not what the launcher asked for."""
    asked = launched_world_size()
    if asked != num_processes:
        raise LaunchError(
            f"the launcher started WORLD_SIZE={asked} processes but the accelerator formed a group of "
            f"{num_processes}: the processes would train unsynchronised copies. Build the accelerator "
            "with train.distributed.make_accelerator (it forms a gloo group on CPU)")
    # accelerate's single-process launcher sets no WORLD_SIZE: read its command line instead
    accelerate_asked = accelerate_num_processes(_parent_argv()) if "WORLD_SIZE" not in os.environ else None
    if accelerate_asked and accelerate_asked > num_processes:
        raise LaunchError(
            f"`accelerate launch --num_processes {accelerate_asked}` started {num_processes} process "
            "(on CPU accelerate ignores --num_processes without --multi_gpu, and --cpu disables that); "
            "use scripts/launch_single_node.sh or torchrun --nproc_per_node N")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _single_process_env() -> None:
    """DeepSpeed without a launcher: a group of one, as torchrun would describe it."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
        os.environ.setdefault(key, value)


def make_accelerator(trainer: TrainerConfig, deepspeed: DeepSpeedConfig, target_dtype: torch.dtype | None = None):
    """The Accelerator for this process: plain (one process), DDP (torchrun, gloo on CPU, NCCL on
    GPU) or DeepSpeed ZeRO; refuses a launch whose group does not match WORLD_SIZE.

    Pass only the heads and their optimizer to `accelerator.prepare`, never the frozen target.
    """
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    on_gpu = torch.cuda.is_available()
    # On a CPU the training loop autocasts the steps itself (train/loop.py): accelerate fixes one
    # precision per process and wraps the head's forward in it, held-out scoring included.
    precision = resolve_mixed_precision(trainer, target_dtype) if on_gpu else "no"
    if not deepspeed.enabled:
        accelerator = Accelerator(
            gradient_accumulation_steps=trainer.grad_accumulation, mixed_precision=precision, cpu=not on_gpu,
        )
        check_world(accelerator.num_processes)
        return accelerator
    _single_process_env()
    avoid_deepspeed_jit()
    world = launched_world_size()
    if deepspeed.config_file:
        config = load_deepspeed_file(deepspeed.config_file, trainer, world)
    else:
        config = deepspeed_config(trainer, deepspeed, world)
    # zero3_init_flag=False: transformers would otherwise partition every model loaded after this
    # point under ZeRO-3, the frozen target included.
    plugin = DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=False)
    handlers = [] if on_gpu else [InitProcessGroupKwargs(backend="gloo")]
    accelerator = Accelerator(
        gradient_accumulation_steps=trainer.grad_accumulation, mixed_precision=precision,
        deepspeed_plugin=plugin, kwargs_handlers=handlers,
    )
    check_world(accelerator.num_processes)
    log.info("DeepSpeed ZeRO-%d on %d process(es), %s", deepspeed.zero_stage, accelerator.num_processes, precision)
    return accelerator


# -- world-size independent training state ---------------------------------------------------------
# ZeRO checkpoints are partitioned by process count and DeepSpeed refuses to load one into another
# count without a universal-checkpoint conversion. The heads are small next to the target, so the
# loop's checkpoint holds the full fp32 weights and Adam moments instead: gathered from any layout,
# restored into any layout (1 process, DDP, ZeRO-1/2/3), with the same file for all of them.

def _is_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def _trained(accelerator, model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad]


def _zero_optimizer(optimizer):
    zero = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper -> DeepSpeed's ZeRO optimizer
    if not (hasattr(zero, "single_partition_of_fp32_groups") or hasattr(zero, "fp32_partitioned_groups_flat")):
        raise NotImplementedError(f"world-size independent state covers DeepSpeed's ZeRO-1/2/3 optimizers, "
                                  f"not {type(zero).__name__}")
    return zero


def _is_zero3(zero) -> bool:
    return hasattr(zero, "fp32_partitioned_groups_flat")


@contextlib.contextmanager
def full_parameters(accelerator, model):
    """The trained module with whole parameters inside the block (ZeRO-3 gathers its partitions,
    read-only, e.g. to save its state_dict); elsewhere a no-op. Under ZeRO-3 every process enters."""
    module = accelerator.unwrap_model(model)
    if not (_is_deepspeed(accelerator) and any(hasattr(p, "ds_id") for p in module.parameters())):
        yield module
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        yield module


def gather_head_state(accelerator, model, optimizer) -> dict[str, torch.Tensor]:
    """Full fp32 weights and optimizer moments of the trained parameters, by name:
    `param.<name>`, `<moment>.<name>` (exp_avg, exp_avg_sq), `step` and each param group's current
    learning rate `group<i>.lr` (float64). Collective under ZeRO:
    every process calls it; the result is the same on all of them."""
    state: dict[str, torch.Tensor] = {}
    if _is_deepspeed(accelerator):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        zero = _zero_optimizer(optimizer)
        base_state = next(iter(zero.optimizer.state.values()), {})
        keys = [k for k, v in base_state.items() if torch.is_tensor(v) and v.dim() > 0]
        for name, p in _trained(accelerator, model):
            state[f"param.{name}"] = safe_get_full_fp32_param(p).detach().cpu().float()
            for key in keys:
                state[f"{key}.{name}"] = safe_get_full_optimizer_state(p, key).detach().cpu().float()
        step = base_state.get("step", 0)
    else:
        base = getattr(optimizer, "optimizer", optimizer)
        step = 0
        for name, p in _trained(accelerator, model):
            state[f"param.{name}"] = p.detach().cpu().float().clone()
            for key, value in base.state.get(p, {}).items():
                if key == "step":
                    step = value
                elif torch.is_tensor(value) and value.shape == p.shape:
                    state[f"{key}.{name}"] = value.detach().cpu().float().clone()
    state["step"] = torch.tensor(float(step))
    for index, group in enumerate(optimizer.param_groups):  # the scheduled lr of the last step
        state[f"group{index}.lr"] = torch.tensor(float(group["lr"]), dtype=torch.float64)
    return state


def _moments(state: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """{moment: tensor} of one parameter; keys are `<moment>.<name>`, moments have no dots."""
    moments = {}
    for key, value in state.items():
        moment, _, rest = key.partition(".")
        if rest == name and moment != "param":
            moments[moment] = value
    return moments


@torch.no_grad()
def restore_head_state(accelerator, model, optimizer, state: dict[str, torch.Tensor]) -> None:
    """Load what `gather_head_state` returned, whatever process count or ZeRO stage saved it."""
    params = _trained(accelerator, model)
    missing = [name for name, _ in params if f"param.{name}" not in state]
    if missing:
        raise KeyError(f"head state lacks {missing[:4]}{'...' if len(missing) > 4 else ''}")
    step = state["step"].float()
    for index, group in enumerate(optimizer.param_groups):
        if f"group{index}.lr" in state:
            group["lr"] = float(state[f"group{index}.lr"])
    if not _is_deepspeed(accelerator):
        base = getattr(optimizer, "optimizer", optimizer)
        for name, p in params:
            p.copy_(state[f"param.{name}"].to(p.dtype))
            moments = _moments(state, name)
            if moments:
                base.state[p] = {"step": step.clone(), **{k: v.to(p.device).clone() for k, v in moments.items()}}
        return
    zero = _zero_optimizer(optimizer)
    if _is_zero3(zero):
        _restore_zero3(zero, params, state, step)
        return
    by_id = {id(p): name for name, p in params}
    for group_index, flat in enumerate(zero.single_partition_of_fp32_groups):
        flat_state = zero.optimizer.state[flat]
        for lp in zero.bit16_groups[group_index]:
            name = by_id.get(id(lp))
            if name is None:
                continue
            full = state[f"param.{name}"]
            lp.copy_(full.to(lp.dtype))  # ZeRO-1/2: every process holds the whole low-precision weight
            mapping = getattr(lp, "_hp_mapping", None)
            if mapping is None:  # this process's partition holds no piece of lp
                continue
            lp_at, hp_at = mapping.lp_fragment_address, mapping.hp_fragment_address
            piece = lambda t: t.flatten().narrow(0, lp_at.start, lp_at.numel)  # noqa: E731
            mapping.hp_fragment.copy_(piece(full))
            for key, value in _moments(state, name).items():
                if key not in flat_state:
                    flat_state[key] = torch.zeros_like(flat)
                flat_state[key].narrow(0, hp_at.start, hp_at.numel).copy_(piece(value))
        if flat_state:
            flat_state["step"] = step.clone()


def _restore_zero3(zero, params, state: dict[str, torch.Tensor], step: torch.Tensor) -> None:
    """ZeRO-3: each process keeps its slice of every weight and moment; DeepSpeed's setters cut the
    slice from the full tensor, then the module's own partitions are refreshed from the fp32 master
    (as DeepSpeed's universal-checkpoint loader does)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    moments = {name: _moments(state, name) for name, _ in params}
    keys = sorted({key for values in moments.values() for key in values})
    for flat in zero.fp32_partitioned_groups_flat:
        if flat.numel() and keys:  # Adam's state appears at the first step: create it to fill it
            flat_state = zero.optimizer.state[flat]
            for key in keys:
                flat_state.setdefault(key, torch.zeros_like(flat))
            flat_state["step"] = step.clone()
    for name, p in params:
        device = p.ds_tensor.device
        safe_set_full_fp32_param(p, state[f"param.{name}"].to(device))
        for key, value in moments[name].items():
            safe_set_full_optimizer_state(p, value.to(device), key)
    for group, flat in enumerate(zero.fp32_partitioned_groups_flat):
        if flat.numel():
            zero.fp16_partitioned_groups_flat[group].data.copy_(flat.data)
            pieces = zero.unflatten(zero.fp16_partitioned_groups_flat[group], zero.fp16_partitioned_groups[group])
            for partition, piece in zip(zero.fp16_partitioned_groups[group], pieces):
                partition.data = piece.data


# -- stages that run once per job ------------------------------------------------------------------
# Eval and export need one process: eight evaluations of the same head measure nothing new, and
# concurrent exports race on the output folder. Rank 0 runs them; the other ranks wait on a gloo
# group whose deadline is long enough for a 70B evaluation (an NCCL barrier would time out after
# the group's 30 minutes and hold a GPU stream while it waits).
MAIN_ONLY_TIMEOUT_HOURS = 24


class MainProcessFailed(RuntimeError):
    """Rank 0 failed in a stage the other ranks were waiting for."""


def _wait_group():
    """A gloo group over every process of the job, with a long deadline. Forms the default group
    from torchrun's environment when no stage formed one (e.g. `stages=[eval]`); it then stays for
    the life of the process (forming it again on the same port can race with a slower rank)."""
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(hours=MAIN_ONLY_TIMEOUT_HOURS)
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo", timeout=timeout)
    return dist.new_group(backend="gloo", timeout=timeout)


def run_on_main_process(work, what: str = "stage"):
    """`work()` on rank 0 only; every other rank waits, then returns rank 0's result. When rank 0
    raises, it re-raises there and every other rank raises `MainProcessFailed`, so no rank hangs.
    One process (no WORLD_SIZE > 1): just `work()`."""
    if launched_world_size() <= 1:
        return work()
    import torch.distributed as dist

    group = _wait_group()
    try:
        if dist.get_rank() == 0:
            try:
                result = work()
            except BaseException as error:
                dist.broadcast_object_list([{"error": f"{type(error).__name__}: {error}"}], src=0, group=group)
                raise
            dist.broadcast_object_list([{"result": result}], src=0, group=group)
            return result
        log.info("rank %d waits for rank 0's %s", dist.get_rank(), what)
        message = [None]
        dist.broadcast_object_list(message, src=0, group=group)
        if "error" in message[0]:
            raise MainProcessFailed(f"rank 0 failed in its {what}: {message[0]['error']}")
        return message[0]["result"]
    finally:
        dist.destroy_process_group(group)
