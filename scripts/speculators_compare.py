"""Load specheads' EAGLE-3 exports with vLLM's `speculators` library and compare draft logits.

    python scripts/speculators_compare.py [--ckpt DIR] [--out DIR] [--steps 3] [--dtype bfloat16]

Exports an EAGLE-3 head (a checkpoint or export given by --ckpt; default: two randomly initialised
heads for the embedded SmolLM2, one per route) as `speculators` and as `eagle3`, computes the
head's own draft logits for `steps` training-time-test steps on real SmolLM2 features of a fixed
text, and runs scripts/speculators_check.py in the separate venv of scripts/setup_speculators.sh
(built on first use, ~4 min). That script loads the `speculators` folder with
`SpeculatorModel.from_pretrained` and the `eagle3` folder through `speculators convert
--algorithm eagle3`, attached to the dequantized SmolLM2 verifier, and reports the max abs logit
difference per step plus a key-by-key audit of what the loader took. Prints the JSON report.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TEXT = ("Speculative decoding drafts a few tokens with a small head and lets the large model check them "
        "all in one forward pass, so the output is exactly what the large model would have written.")


def speculators_python(venv: str | os.PathLike | None = None) -> Path:
    """The speculators venv's python, built by scripts/setup_speculators.sh when missing (one
    builder at a time; the others wait on a lock)."""
    from eval.engine import loader_python

    return loader_python(venv, "SPECULATORS_VENV", ".venv-speculators", "setup_speculators.sh")


def verifier_folder(target) -> str:
    """The local folder transformers loads the target from (the dequantized cache for embedded)."""
    from heads.target import TargetConfig, resolve_source

    path = resolve_source(TargetConfig(name_or_path=target.name, device="cpu"))[0]
    if not Path(path, "config.json").is_file():
        raise FileNotFoundError(f"{target.name} has no local folder ({path}); pass --verifier")
    return path


def random_head(target, norm_before_residual: bool, seed: int, draft_vocab_size: int = 4096, **options):
    """An EAGLE-3 head as training starts it (lm_head rows and final norm from the target, over a
    random sorted draft vocabulary), with its three layer norms (and fc's input norms, under the
    EAGLE-3.1 `options`) randomised so that a loader that swapped or skipped one would show."""
    from heads.eagle3 import Eagle3Config, Eagle3Head, init_from_target

    config = Eagle3Config.from_target(target, draft_vocab_size=draft_vocab_size,
                                      norm_before_residual=norm_before_residual, **options)
    torch.manual_seed(seed)
    head = Eagle3Head(config)
    generator = torch.Generator().manual_seed(seed)
    init_from_target(head, target, torch.randperm(config.vocab_size, generator=generator)[:draft_vocab_size].sort().values)
    with torch.no_grad():
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            getattr(head.midlayer, name).weight.normal_(1.0, 0.2, generator=generator)
        for name, weight in head.named_parameters():
            if name.startswith(("input_norm.", "fc_norm.")):
                weight.normal_(1.0, 0.2, generator=generator)
    return head.eval(), config


@torch.no_grad()
def ttt_inputs(head, target, embedding: torch.Tensor, steps: int, text: str = TEXT) -> dict[str, torch.Tensor]:
    """The head's own logits for `steps` training-time-test steps, as speculators runs them:
    step k reads the next tokens shifted k left (zero-padded), the previous step's output as
    hidden (normed under norm_output), positions + k, and attends to the causal step-0 prefix plus itself at earlier steps.
    `embedding` (V, D): the one the draft reads (the export's copy of the target's)."""
    tokens = torch.tensor([target.tokenizer(text)["input_ids"]])
    ids, following = tokens[:, :-1], tokens[:, 1:]
    T = ids.shape[1]
    layers = head.config.aux_layer_ids
    features = target.features(ids, layers=layers).hidden
    aux = torch.cat([features[i] for i in layers], dim=-1).float()  # (1, T, n·Ht)
    positions = torch.arange(T)[None]
    causal, eye = torch.ones(T, T, dtype=torch.bool).tril(), torch.eye(T, dtype=torch.bool)
    hidden, past, current, logits = head.project(aux), None, following, []
    for k in range(steps):
        mask = torch.cat([causal, *[eye] * k], dim=1)[None, None]  # (1, 1, T, (k+1)T)
        out, past = head(embedding[current].float(), hidden, positions + k, mask, past, use_cache=True)
        logits.append(head.logits(out))
        hidden = head.feedback(out)
        current = torch.cat([following[:, k + 1:], following.new_zeros(1, k + 1)], dim=1)
    return {"hidden_states": aux.contiguous(), "input_ids": following.contiguous(),
            "position_ids": positions.contiguous(), "logits": torch.stack(logits).contiguous()}


def rename_key(folder: Path, old: str, new: str, out: Path) -> Path:
    """A copy of an export folder whose weights name one tensor differently (a loader must notice)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors[new] = tensors.pop(old)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def run_check(python: Path, cases: list[tuple[str, Path, Path]], verifier: str, work: Path,
              timeout: int = 900) -> dict:
    command = [str(python), str(REPO / "scripts" / "speculators_check.py"), "--verifier", verifier, "--work", str(work)]
    for route, folder, inputs in cases:
        command += ["--case", route, str(folder), str(inputs)]
    return _report(command, "speculators_check.py", timeout)


def _report(command: list[str], script: str, timeout: int, **env_extra: str) -> dict:
    """Run a check in the speculators venv, offline and away from the project's packages; its JSON
    report (the last line of its stdout)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore", **env_extra}
    env.pop("PYTHONPATH", None)
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0:
        raise RuntimeError(f"{script} failed ({run.returncode}):\n{(run.stdout + run.stderr)[-6000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def run_script(script: str, folder: Path, inputs: Path, target, timeout: int = 900) -> dict:
    """One of the per-kind checks (scripts/peagle_speculators_check.py, scripts/dflash_speculators_check.py)
    on export `folder` and the logits file `inputs`, in the speculators venv: its JSON report."""
    command = [str(speculators_python()), str(REPO / "scripts" / script), "--export", str(folder),
               "--inputs", str(inputs), "--verifier", verifier_folder(target)]
    return _report(command, script, timeout, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


# EAGLE-3.1 heads (folder name -> options), loaded the speculators route only: SGLang's layout has no
# place for the options.
EAGLE31_CASES = {"speculators-norm_before_fc": {"norm_before_fc": True, "norm_output": True},
                 "speculators-fc_norm": {"fc_norm": True}}


def compare(target, out: Path, steps: int = 3, dtype: str = "bfloat16", head_and_config=None,
            verifier: str | None = None, python: Path | None = None, with_renamed_key: bool = False,
            with_eagle31: bool = False) -> dict:
    """Export, compute our logits from the exported files (what a user ships), run the check.
    Cases come in the order speculators, eagle3, then (with_eagle31) EAGLE31_CASES, then the
    renamed key."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from export import export_head, load_export

    out.mkdir(parents=True, exist_ok=True)
    if head_and_config is None:  # folder name -> (route, head and config)
        heads = {"speculators": ("speculators", random_head(target, norm_before_residual=True, seed=0)),
                 "eagle3": ("eagle3", random_head(target, norm_before_residual=False, seed=1))}
        if with_eagle31:
            heads.update({name: ("speculators", random_head(target, norm_before_residual=True, seed=2 + i, **options))
                          for i, (name, options) in enumerate(EAGLE31_CASES.items())})
    else:  # SGLang's layout cannot hold norm_before_residual or the 3.1 options: those go the speculators route only
        heads = {"speculators": ("speculators", head_and_config)}
        c = head_and_config[1]
        if not (c.norm_before_residual or c.norm_before_fc or c.fc_norm or c.norm_output):
            heads["eagle3"] = ("eagle3", head_and_config)
    cases = []
    for name, (route, (head, config)) in heads.items():
        folder = export_head(head, config, route, out / name, target, dtype)
        loaded, _, _ = load_export(folder, target, dtype="float32")
        inputs = out / f"{name}-inputs.safetensors"
        with safe_open(str(folder / "model.safetensors"), "pt") as handle:
            embedding = handle.get_tensor("embed_tokens.weight").float()
        save_file(ttt_inputs(loaded.eval(), target, embedding, steps), str(inputs))
        cases.append((route, folder, inputs))
    if with_renamed_key:
        renamed = rename_key(out / "eagle3", "midlayer.hidden_norm.weight", "midlayer.hidden_normx.weight",
                             out / "eagle3-renamed")
        cases.append(("eagle3", renamed, out / "eagle3-inputs.safetensors"))
    return run_check(python or speculators_python(), cases, verifier or verifier_folder(target), out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", help="EAGLE-3 checkpoint or export folder (default: random heads)")
    parser.add_argument("--base", default=None, help="target model (default: the head's, else embedded SmolLM2)")
    parser.add_argument("--verifier", default=None, help="local folder of the target (default: its cache folder)")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "speculators-compare")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    from export import load_export
    from heads.target import EMBEDDED_SMOLLM2, TargetConfig, load_target

    head_and_config = None
    if args.ckpt:
        head, config, _ = load_export(args.ckpt, dtype="float32")
        head_and_config = (head.eval(), config)
    name = args.base or (head_and_config[1].target_name if head_and_config else EMBEDDED_SMOLLM2)
    target = load_target(TargetConfig(name_or_path=name, device="cpu"))
    with contextlib.suppress(FileExistsError):
        args.out.mkdir(parents=True)
    if any(args.out.iterdir()):
        sys.exit(f"--out {args.out} is not empty: give a new folder")
    print(json.dumps(compare(target, args.out, args.steps, args.dtype, head_and_config, args.verifier), indent=2))


if __name__ == "__main__":
    main()
