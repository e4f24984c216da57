"""Load a specheads EAGLE-3 export with vLLM's `speculators` library (0.9.0) and compare its draft
logits with the ones specheads' own Eagle3Head gave on the same features and tokens.

Runs in the venv that scripts/setup_speculators.sh builds (never the project's; it imports only
torch, safetensors and speculators), from the repository root:

    .venv-speculators/bin/python scripts/speculators_check.py --verifier VERIFIER_DIR --work DIR \
        --case speculators EXPORT_DIR INPUTS.safetensors [--case eagle3 EXPORT_DIR INPUTS.safetensors ...]

Routes:
  speculators  `SpeculatorModel.from_pretrained(DIR)` on the `speculators` export as it is.
  eagle3       `speculators convert DIR --algorithm eagle3 --verifier VERIFIER_DIR` on the `eagle3`
               (SGLang) export, then `from_pretrained` of the converted folder. The converter loads
               with strict=False and only logs missing / unexpected keys, so its log is parsed and
               the loaded model is audited key by key against the files.

VERIFIER_DIR is a local copy of the target (the dequantized SmolLM2 folder): the export names the
hub id, which an offline machine cannot fetch, so the verifier path is pointed there and the hub
id in the file is reported. INPUTS (written by the caller): hidden_states (1, T, n·Ht) = the aux
streams concatenated, input_ids (1, T) = the tokens after each position, position_ids (1, T) and
logits (K, 1, T, Vd) = specheads' draft logits for K training-time-test steps (step k reads the
token ids shifted k left, zero-padded, the previous step's output as hidden and positions + k;
its attention sees the causal step-0 prefix plus itself at every earlier step), all in float32.

On CPU the draft runs with sdpa attention and the explicit causal document mask that speculators
builds from `document_ids`. Prints one JSON object on the last line of stdout, one report per case.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors import safe_open

VERIFIER_OWNED = {"embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"}  # loaded from the target


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


def convert(export: Path, verifier: str, out: Path) -> dict:
    """Run `speculators convert --algorithm eagle3` and collect the keys its loader complained about."""
    config = json.loads((export / "config.json").read_text())
    # The SGLang file numbers aux layers by the layer they leave; speculators by the layer they
    # enter, and its converter does not read `eagle_config`: pass them, one higher.
    ids = [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    command = [str(Path(sys.executable).parent / "speculators"), "convert", str(export), "--algorithm", "eagle3",
               "--verifier", verifier, "--output-path", str(out),
               "--algorithm-kwargs", json.dumps({"eagle_aux_hidden_state_layer_ids": ids})]
    run = subprocess.run(command, capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode != 0:
        raise SystemExit(f"speculators convert failed ({run.returncode}):\n{log[-4000:]}")
    complaints = {}
    for kind in ("Missing", "Unexpected"):
        found = re.findall(rf"{kind} keys in checkpoint: (\[.*?\])", log)
        complaints[kind.lower()] = sorted({key for listing in found for key in re.findall(r"'([^']+)'", listing)})
    return {"aux_layer_ids_passed": ids, "converter_missing_keys": complaints["missing"],
            "converter_unexpected_keys": complaints["unexpected"],
            "converter_warnings": [line for line in log.splitlines() if "WARNING" in line]}


def load(folder: Path, verifier: str):
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(folder)
    named = config.speculators_config.verifier.name_or_path
    config.speculators_config.verifier.name_or_path = verifier
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention needs a GPU
    model = SpeculatorModel.from_pretrained(folder, config=config, dtype=torch.float32).eval()
    return model, named


def verifier_embedding(verifier: str) -> torch.Tensor:
    for path in sorted(Path(verifier).glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for key in handle.keys():
                if key.endswith("embed_tokens.weight"):
                    return handle.get_tensor(key)
    raise SystemExit(f"no embed_tokens.weight in {verifier}")


def audit(model, files: dict[str, torch.Tensor]) -> dict:
    """Every key of the file loaded into the model unchanged, every model tensor loaded from
    somewhere: a silent key mismatch shows up here even where the loader only warned."""
    state = model.state_dict()
    unexpected = sorted(set(files) - set(state))
    missing = sorted(set(state) - set(files) - VERIFIER_OWNED)
    changed = sorted(key for key, value in files.items()
                     if key in state and not torch.equal(state[key].to(value.dtype), value))
    nan = sorted(key for key, value in state.items() if value.is_floating_point() and bool(value.isnan().any()))
    return {"unexpected_keys": unexpected, "missing_keys": missing, "changed_keys": changed, "nan_keys": nan}


@torch.no_grad()
def draft_logits(model, inputs: dict[str, torch.Tensor], steps: int) -> torch.Tensor:
    captured = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: captured.append(out.detach().float()))
    try:
        model(hidden_states=inputs["hidden_states"], input_ids=inputs["input_ids"],
              document_ids=torch.zeros_like(inputs["input_ids"]), position_ids=inputs["position_ids"],
              ttt_steps=steps)
    finally:
        hook.remove()
    return torch.stack(captured)  # (K, 1, T, Vd)


def check(route: str, export: Path, inputs_file: Path, verifier: str, work: Path) -> dict:
    inputs = read_tensors(inputs_file)
    ours = inputs.pop("logits")
    report = {"route": route, "export": str(export)}
    folder = export
    if route == "eagle3":
        folder = work / f"{export.name}-converted"
        report.update(convert(export, verifier, folder))
    model, named = load(folder, verifier)
    report["verifier_in_file"] = named
    report["attention"] = model.config.transformer_layer_config._attn_implementation
    report["aux_layer_ids_loaded"] = list(model.config.eagle_aux_hidden_state_layer_ids or [])
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        report[f"{flag}_loaded"] = bool(getattr(model.config, flag))
    files = read_tensors(folder / "model.safetensors")
    report.update(audit(model, files))
    # The draft reads the target's embedding (rounded to the file's dtype when the file has a
    # copy): a loader that left it unset (zeros) must show.
    reference = verifier_embedding(verifier)
    if "embed_tokens.weight" in files:
        reference = reference.to(files["embed_tokens.weight"].dtype)
    report["embedding_is_verifiers"] = torch.equal(model.embed_tokens.weight.to(reference.dtype), reference)
    if route == "eagle3":  # the converted model against our file: same tensors, layer renamed
        original = {key.replace("midlayer.", "layers.0.", 1): value
                    for key, value in read_tensors(export / "model.safetensors").items()}
        report["against_export"] = audit(model, original)
    theirs = draft_logits(model, inputs, ours.shape[0])
    if theirs.shape != ours.shape:
        raise SystemExit(f"speculators gave logits of shape {list(theirs.shape)}, ours are {list(ours.shape)}")
    diff = (theirs - ours).abs()
    report.update({
        "steps": ours.shape[0], "tokens": ours.shape[2], "draft_vocab": ours.shape[3],
        "max_abs_diff_per_step": [float(d.max()) for d in diff],
        "max_abs_diff": float(diff.max()), "max_abs_logit": float(ours.abs().max()),
        "argmax_agreement": float((theirs.argmax(-1) == ours.argmax(-1)).float().mean()),
    })
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", nargs=3, action="append", required=True, metavar=("ROUTE", "EXPORT", "INPUTS"),
                        help="route (speculators | eagle3), export folder, inputs file; repeat for more cases")
    parser.add_argument("--verifier", required=True, help="local folder of the target model")
    parser.add_argument("--work", type=Path, required=True, help="where the eagle3 route writes converted folders")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    reports = []
    for route, export, inputs in args.case:
        if route not in ("speculators", "eagle3"):
            parser.error(f"route {route!r} is not one of speculators, eagle3")
        reports.append(check(route, Path(export), Path(inputs), args.verifier, args.work))
    return {"speculators": version("speculators"), "transformers": version("transformers"),
            "torch": torch.__version__, "cases": reports}


if __name__ == "__main__":
    print(json.dumps(main()))
