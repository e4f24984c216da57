"""One training process for the multi-process tests: a tiny EAGLE head on a tiny random target,
stepped through `train.distributed.make_accelerator` with the real head and loss.

A head-only step harness (train/loop.py had not landed when this was written): each optimizer step
takes a fixed global batch of GLOBAL_BATCH sequences; rank r of W takes its contiguous slice, so
1 process and W processes see the same data per step. Every row is counted (full loss mask, equal
lengths), so the mean over ranks of per-rank mean losses equals the single-process mean.

    torchrun --nproc_per_node 2 tests/scale/worker.py --out results.json --plan \
        '[{"name": "ddp", "steps": 4, "save_at": 2, "save": "state.safetensors"}, {"name": "ds", "deepspeed": 2, "steps": 4}]'

A scenario: name, steps, and optionally deepspeed (ZeRO stage), save_at + save (a file), resume (a file saved by any scenario).
ZeRO-3 scenarios partition every parameter (stage3_param_persistence_threshold 0): with DeepSpeed's
default threshold (1e5 elements) the tiny head's weights would all stay whole on every process.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from heads.eagle import EagleConfig, EagleHead  # noqa: E402
from tests.tiny import tiny_target  # noqa: E402
from train.config import DeepSpeedConfig, TrainerConfig  # noqa: E402
from train.distributed import full_parameters, gather_head_state, make_accelerator, restore_head_state  # noqa: E402
from train.losses import eagle_loss  # noqa: E402

GLOBAL_BATCH = 4
NUM_ROWS = 16
SEQ_LEN = 12


def save_head_state(path: str, accelerator, model, optimizer) -> None:
    """Gather (all processes) the head state and write it as safetensors on the main process."""
    from safetensors.torch import save_file

    state = gather_head_state(accelerator, model, optimizer)
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in state.items()}, path)
    accelerator.wait_for_everyone()


def load_head_state(path: str, accelerator, model, optimizer) -> int:
    """Read a `save_head_state` file into the prepared model/optimizer; returns the saved step."""
    from safetensors.torch import load_file

    state = load_file(path)
    restore_head_state(accelerator, model, optimizer, state)
    return int(state["step"].item())


def run(scenario: dict, world: int) -> dict:
    """Train steps [start_step, steps) of one scenario; optionally save after step save_at."""
    trainer = TrainerConfig(batch_size=GLOBAL_BATCH // world, grad_accumulation=1, max_grad_norm=0.5,
                            mixed_precision="no", learning_rate=1e-2)
    stage = scenario.get("deepspeed")
    config_file = None
    if stage == 3:  # read once by make_accelerator
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
            json.dump({"zero_optimization": zero}, handle)
        config_file = handle.name
    accelerator = make_accelerator(trainer, DeepSpeedConfig(enabled=stage is not None, zero_stage=stage or 2,
                                                            config_file=config_file))
    if config_file:
        os.remove(config_file)

    target = tiny_target(seed=0)  # frozen: never given to prepare or the optimizer
    torch.manual_seed(1)
    head = EagleHead(EagleConfig.from_target(target))
    optimizer = torch.optim.AdamW(head.parameters(), lr=trainer.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    head, optimizer = accelerator.prepare(head, optimizer)
    if stage == 3:
        assert all(p.numel() == 0 for p in head.parameters()), "ZeRO-3 left some weights whole"
    start_step = load_head_state(scenario["resume"], accelerator, head, optimizer) if scenario.get("resume") else 0

    data = torch.randint(3, target.vocab_size, (NUM_ROWS, SEQ_LEN), generator=torch.Generator().manual_seed(2))
    rank, local = accelerator.process_index, GLOBAL_BATCH // accelerator.num_processes
    losses = []
    for step in range(start_step, scenario["steps"]):
        start = (step * GLOBAL_BATCH) % NUM_ROWS + rank * local
        ids = data[start:start + local]  # (b, T)
        hidden = target.features(ids, layers=(-1,)).hidden[target.num_layers]  # (b, T, D)
        embeds = target.embed_tokens(ids[:, 1:])  # (b, T-1, D)
        positions = torch.arange(SEQ_LEN - 1).expand(local, -1)
        predicted, _ = head(embeds, hidden[:, :-1], positions)  # (b, T-1, D)
        D = hidden.shape[-1]
        out = eagle_loss(predicted.reshape(-1, D), hidden[:, 1:].reshape(-1, D), None,
                         target.lm_head.weight, feature_loss_weight=1.0, logit_loss_weight=0.1)
        accelerator.backward(out["loss"])
        accelerator.clip_grad_norm_(head.parameters(), trainer.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(out["loss"].detach(), reduction="mean").item())
        if scenario.get("save_at") == step + 1:
            save_head_state(scenario["save"], accelerator, head, optimizer)
    weights = accelerator.get_state_dict(head)  # ZeRO-3: gathered on the main process only, else None
    with full_parameters(accelerator, head) as module:  # ZeRO-3: gathered on every process
        full = float(sum(v.double().abs().sum() for v in module.state_dict().values()))
    result = {"losses": losses, "world": accelerator.num_processes, "full_checksum": full,
              "weight_checksum": float(sum(v.double().abs().sum() for v in (weights or {}).values()))}
    accelerator.free_memory()
    return result


def main() -> None:
    """Run the scenarios of --plan (a JSON list) in order. accelerate keeps one process-wide state
    (and refuses a second DeepSpeed plugin), so it is reset between scenarios: a test-only shortcut
    that saves a process launch (~8 s of imports) per scenario; the process group is kept."""
    from accelerate.state import AcceleratorState

    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = {}
    for scenario in json.loads(args.plan):
        AcceleratorState._reset_state(reset_partial_state=True)
        results[scenario["name"]] = run(scenario, world)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as handle:
            json.dump(results, handle)


if __name__ == "__main__":
    main()
