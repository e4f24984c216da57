"""`specheads.json` (what an export is, for which base model, how to run it, how well it did) and
the generated `README.md` model card."""
from __future__ import annotations

import hashlib
import json
import time
from importlib import metadata
from pathlib import Path

from export.eagle3 import CONVENTIONS, ENTERING
from export.layout import EXPORT_FORMAT_VERSION, BaseModel, Format
from export.medusa import default_choices
from heads.io import head_type
from heads.recommended import CONFIGURED, DEFAULT, MEASURED, RecommendedRuntime

MANIFEST_NAME = "specheads.json"
README_NAME = "README.md"

# Where an embedded target's weights come from, for engines that load the base model by hub id.
_HUB_IDS = {"embedded:smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
# EAGLE-2 dynamic-tree defaults of the reference (FORMATS.md), used only when nothing was measured.
_EAGLE_DEFAULTS = {"top_k": 10, "depth": 6, "total_tokens": 60, "chain_depth": 4}
_KNOWN_EXTRA = ("runtime", "training", "eval", "base_model_id", "notes")


def hub_id_for(name: str) -> str:
    return _HUB_IDS.get(name, name)


def base_model_from_target(target, hub_id: str | None = None) -> BaseModel:
    """The identity and shared tensors of a `heads.target.FrozenTarget`."""
    config = target.config
    architecture = (getattr(config, "architectures", None) or [type(target.model).__name__])[0]
    return BaseModel(
        name=target.name, hub_id=hub_id or hub_id_for(target.name), architecture=architecture,
        model_type=getattr(config, "model_type", "llama"), embed_tokens=target.embed_tokens.weight,
        lm_head=target.lm_head.weight, bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_id=getattr(config, "eos_token_id", None), pad_token_id=getattr(config, "pad_token_id", None),
    )


def _text_hash(text: str | None) -> str | None:
    return hashlib.sha256(text.encode()).hexdigest()[:16] if text else None


def feature_convention(kind: str, num_layers: int, config=None, fmt: Format | None = None) -> dict:
    """Which target hidden states the head reads, spelled out (tools number layers differently).
    For EAGLE-3 heads, `layer_ids` names every file field that lists the aux layers, with the
    convention that field uses."""
    if kind == "dflash":  # EAGLE-3's streams through fc, read by a block drafter
        return {**feature_convention("eagle3", num_layers, config, fmt),
                "predicts": "a block [x_a, mask x (B-1)] at positions a.. attends to the fused streams of "
                            "positions < a; slot j predicts x_{a+j}; logits = the target's lm_head(norm(out))"}
    if kind in ("eagle3", "peagle"):  # P-EAGLE reads EAGLE-3's streams
        ids = list(config.aux_layer_ids)
        layer_ids = {f"{MANIFEST_NAME}:head_config.aux_layer_ids": {"values": ids, "convention": ENTERING}}
        if fmt is not None and fmt.name == "native":
            layer_ids[f"{fmt.config_file}:config.aux_layer_ids"] = {"values": ids, "convention": ENTERING}
        elif fmt is not None and hasattr(fmt, "file_layer_ids"):
            field, values, convention = fmt.file_layer_ids(config)
            layer_ids[f"{fmt.config_file}:{field}"] = {"values": values, "convention": convention}
        return {
            "hidden_states_indices": ids,
            "numbering": "transformers output_hidden_states: 0 = embedding output, i = output of decoder layer i-1 "
                         "(0-based) = the residual stream entering decoder layer i",
            "feature": f"cat of the target's residual streams hidden_states{ids} (pre-norm), in that order, "
                       "through fc",
            "predicts": "x_{t+2} from embed(x_{t+1}) and the aux streams at t; logits over the draft vocabulary, "
                        "draft id i = target id i + d2t[i]",
            "layer_ids": layer_ids,
            "conventions": dict(CONVENTIONS),
        }
    return {
        "hidden_states_index": num_layers,
        "numbering": "transformers output_hidden_states: 0 = embedding output, i = output of decoder layer i-1 "
                     f"(0-based), {num_layers} = last layer's output after the model's final norm",
        "feature": "the target's last hidden state after its final norm (what vLLM, SGLang and TensorRT-LLM "
                   "pass to EAGLE-1/2 and Medusa heads)",
        "predicts": ("f_{t+1}: input cat(embed(x_{t+1}), f_t), embedding first; logits = target lm_head(f_{t+1})"
                     if kind == "eagle" else "head k (0-based) predicts the token k+2 positions after the feature"),
    }


def serving_advice(where: dict | None) -> str:
    """What the engine settings are worth on a GPU server, given where they were measured."""
    if where is None:
        return "no setting was measured: defaults or configured values; tune on the serving GPU"
    if where.get("device_type") == "cuda":
        return f"measured on {where['hardware']}; re-measure on a different GPU or engine before relying on them"
    return (f"measured on {where['hardware']} ({where.get('device_type', 'unknown')}): NOT GPU serving advice. "
            "Which tree pays depends on the device; run `python -m eval head=THIS_FOLDER` on the serving GPU "
            "to choose the engine settings")


def recommended_runtime(config, runtime: RecommendedRuntime | None) -> dict:
    """The manifest's `runtime` section: eval's record (None: nothing measured) with a default
    for each setting it left unset, each setting labelled measured / configured / default, the
    hardware that timed them, and each engine's flag values for them."""
    runtime = runtime or RecommendedRuntime()
    if not isinstance(runtime, RecommendedRuntime):
        raise TypeError(f"recommended runtime: expected a RecommendedRuntime, got {type(runtime).__name__}")
    if head_type(config) == "dflash":  # the block fixes what one forward drafts
        return _with_batch_policy({"block_size": config.block_size, "source": "head config", "sources": {},
                                   "measured_on": None, "gpu_serving_advice": False,
                                   "advice": "block_size - 1 drafted tokens per step, set by the trained head",
                                   "vllm": {"num_speculative_tokens": config.block_size - 1}}, runtime.batch_policy)
    if head_type(config) in ("eagle", "eagle3", "peagle"):
        values = {key: int(getattr(runtime, key) if getattr(runtime, key) is not None else default)
                  for key, default in _EAGLE_DEFAULTS.items()}
        sources, source, where = runtime.provenance(tuple(_EAGLE_DEFAULTS))
        return _with_batch_policy({
            "tree": {key: values[key] for key in ("top_k", "depth", "total_tokens")},
            "chain_depth": values["chain_depth"], "source": source, "sources": sources,
            "measured_on": where, "gpu_serving_advice": bool(where and where.get("device_type") == "cuda"),
            "advice": serving_advice(where),
            "sglang": {"speculative_num_steps": values["depth"], "speculative_eagle_topk": values["top_k"],
                       "speculative_num_draft_tokens": values["total_tokens"]},
            # P-EAGLE: one pass drafts the head's K tokens, whatever chain eval measured
            "vllm": {"num_speculative_tokens": getattr(config, "speculative_tokens", values["chain_depth"])},
        }, runtime.batch_policy)
    sources, source, where = runtime.provenance(("medusa_choices",))
    choices = runtime.medusa_choices
    choices = [list(path) for path in choices] if choices else default_choices(config.num_heads)
    return _with_batch_policy({
        "medusa_choices": choices, "source": source, "sources": sources,
        "measured_on": where, "gpu_serving_advice": bool(where and where.get("device_type") == "cuda"),
        "advice": serving_advice(where),
        "tensorrt_llm": {"num_medusa_heads": config.num_heads, "max_draft_len": len(choices)},
    }, runtime.batch_policy)


def _with_batch_policy(runtime: dict, policy: dict | None) -> dict:
    """Add eval's speculation policy per batch size (`eval.policy`, from a batch-size sweep, with
    the hardware it was measured on) and its engine terms: vLLM's
    num_speculative_tokens_per_batch_size, TensorRT-LLM's draft_len_schedule."""
    if not policy:
        return runtime
    runtime["batch_policy"] = {**policy, "advice": serving_advice(policy.get("measured_on"))}
    runtime.setdefault("vllm", {})["num_speculative_tokens_per_batch_size"] = \
        policy["vllm"]["num_speculative_tokens_per_batch_size"]
    runtime.setdefault("tensorrt_llm", {})["draft_len_schedule"] = policy["tensorrt_llm"]["draft_len_schedule"]
    return runtime


def runtime_from_manifest(section) -> RecommendedRuntime | None:
    """The record behind a `runtime` section, for a re-export: a checkpoint's own record as it is;
    an export's only when something in it was measured (defaults and configured values are the
    new export's to choose), each setting keeping its label."""
    if not isinstance(section, dict):
        return None
    if "source" not in section:  # a checkpoint's meta holds eval's record itself
        return RecommendedRuntime.from_dict(section)
    if section["source"] != MEASURED:
        return None
    values = dict(section.get("tree") or {})
    for key in ("chain_depth", "medusa_choices", "batch_policy"):
        if key in section:
            values[key] = section[key]
    if "sources" not in section:  # written before sections labelled each setting: read as TIMED
        return RecommendedRuntime(**values)
    labels = {**section["sources"], **({"batch_policy": MEASURED} if "batch_policy" in section else {})}
    kept = {key: value for key, value in values.items() if labels.get(key, CONFIGURED) != DEFAULT}
    return RecommendedRuntime(**kept, measured=tuple(key for key, kind in labels.items() if kind == MEASURED),
                              measured_on=section.get("measured_on"))


def build_manifest(fmt: Format, config, base: BaseModel, target, dtype: str, files: dict,
                   extra: dict | None = None) -> dict:
    """The `specheads.json` content. `extra` may hold runtime/training/eval dicts (see export_head)."""
    extra = dict(extra or {})
    try:
        version = metadata.version("specheads")
    except metadata.PackageNotFoundError:
        version = "unknown"
    tokenizer = getattr(target, "tokenizer", None)
    manifest = {
        "format": fmt.name,
        "format_version": EXPORT_FORMAT_VERSION,
        "specheads_version": version,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "head_type": head_type(config),
        "engines": list(fmt.engines),
        "dtype": dtype,
        "weights_file": fmt.weights_file,
        "config_file": fmt.config_file,
        "head_config": config.to_dict(),
        "base_model": {
            "name_or_path": base.name,
            "hub_id": base.hub_id,
            "architecture": base.architecture,
            "fingerprint": target.fingerprint(),
            "tokenizer_hash": target.tokenizer_hash() if tokenizer is not None else None,
            "chat_template_hash": _text_hash(getattr(target, "chat_template", None)),
        },
        "feature_layer": feature_convention(head_type(config), target.num_layers, config, fmt),
        "runtime": recommended_runtime(config, extra.get("runtime")),
        "training": extra.get("training"),
        "eval": extra.get("eval"),
        "notes": list(extra.get("notes") or []),
        "files": files,
    }
    unknown = {key: value for key, value in extra.items() if key not in _KNOWN_EXTRA}
    if unknown:
        manifest["extra"] = unknown
    return manifest


def serve_command(manifest: dict, folder: str = "./THIS_FOLDER") -> str:
    """The launch command of the engine this format is for (see docs/serving.md)."""
    base, runtime, fmt = manifest["base_model"]["hub_id"], manifest["runtime"], manifest["format"]
    if fmt == "eagle":
        s = runtime["sglang"]
        return (f"python -m sglang.launch_server --model-path {base} \\\n  --speculative-algorithm EAGLE "
                f"--speculative-draft-model-path {folder} \\\n  --speculative-num-steps {s['speculative_num_steps']} "
                f"--speculative-eagle-topk {s['speculative_eagle_topk']} "
                f"--speculative-num-draft-tokens {s['speculative_num_draft_tokens']}")
    if fmt == "eagle_vllm":
        spec = json.dumps({"method": "eagle", "model": folder,
                           "num_speculative_tokens": runtime["vllm"]["num_speculative_tokens"]})
        return f"vllm serve {base} \\\n  --speculative-config '{spec}'"
    if fmt == "eagle3":
        s = runtime["sglang"]
        ids = next(entry["values"] for name, entry in manifest["feature_layer"]["layer_ids"].items()
                   if name.startswith("config.json:"))
        return (f"python -m sglang.launch_server --model-path {base} \\\n  --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {folder} \\\n  --speculative-num-steps {s['speculative_num_steps']} "
                f"--speculative-eagle-topk {s['speculative_eagle_topk']} "
                f"--speculative-num-draft-tokens {s['speculative_num_draft_tokens']}\n"
                f"# TensorRT-LLM (PyTorch flow), LLM API YAML: speculative_config: {{decoding_type: Eagle3, "
                f"speculative_model_dir: {folder}, max_draft_len: {runtime['chain_depth']}, "
                f"eagle3_layers_to_capture: {ids}}}")
    if fmt == "speculators_dflash":  # speculators format: vLLM finds the verifier and K in config.json
        spec = json.dumps({"method": "dflash", "model": folder,
                           "num_speculative_tokens": runtime["vllm"]["num_speculative_tokens"]})
        return f"vllm serve {folder}\n# or: vllm serve {base} \\\n  --speculative-config '{spec}'"
    if fmt in ("eagle3_vllm", "speculators", "medusa_vllm"):
        method = {"eagle3_vllm": "eagle3", "speculators": "eagle3", "medusa_vllm": "medusa"}[fmt]
        tokens = (manifest["head_config"]["num_heads"] if fmt == "medusa_vllm"
                  else runtime["vllm"]["num_speculative_tokens"])
        spec = json.dumps({"method": method, "model": folder, "num_speculative_tokens": tokens})
        command = f"vllm serve {base} \\\n  --speculative-config '{spec}'"
        if fmt == "speculators":
            command = f"vllm serve {folder}   # finds the verifier {base} in config.json\n# or: {command}"
        return command
    if fmt == "speculators_peagle":
        spec = json.dumps({"method": "eagle3", "model": folder, "parallel_drafting": True,
                           "num_speculative_tokens": runtime["vllm"]["num_speculative_tokens"]})
        return (f"vllm serve {folder}   # finds the verifier {base} in config.json (V1 engine)\n"
                f"# or: vllm serve {base} \\\n  --speculative-config '{spec}'")
    if fmt == "medusa":
        head, trt = manifest["head_config"], runtime["tensorrt_llm"]
        return (f"python examples/medusa/convert_checkpoint.py --model_dir <{base} folder> \\\n"
                f"  --medusa_model_dir {folder} --num_medusa_heads {head['num_heads']} "
                f"--num_medusa_layers {head['num_layers']} --max_medusa_token_len {max(63, trt['max_draft_len'])} \\\n"
                "  --output_dir ./tllm_ckpt --dtype float16\n"
                "trtllm-build --checkpoint_dir ./tllm_ckpt --output_dir ./engine \\\n"
                "  --speculative_decoding_mode medusa --gemm_plugin float16\n"
                "python examples/run.py --engine_dir ./engine --tokenizer_dir <base folder> \\\n"
                "  --medusa_choices=\"$(python -c 'import json; print(json.load(open(\"" + folder
                + "/config.json\"))[\"medusa_choices\"])')\" --temperature 1.0 --input_text 'Hello'")
    return f"python -m train trainer.init_from={folder}   # in Python: export.load_export('{folder}')"


def _table(values: dict | None) -> str:
    if not values:
        return "_not recorded_\n"
    rows = [f"| {key} | {json.dumps(value) if isinstance(value, (dict, list)) else value} |"
            for key, value in values.items()]
    return "| figure | value |\n| --- | --- |\n" + "\n".join(rows) + "\n"


def _settings_lines(runtime: dict) -> str:
    shown = {k: v for k, v in runtime.items() if k in ("tree", "chain_depth", "medusa_choices", "sglang", "vllm",
                                                        "tensorrt_llm")}
    sources = ", ".join(f"{key} {kind}" for key, kind in (runtime.get("sources") or {}).items())
    return (f"Recommended settings ({sources or runtime.get('source')}): `{json.dumps(shown)}`\n\n"
            f"Where they come from: {runtime.get('advice', runtime.get('source'))}.")


def model_card(manifest: dict) -> str:
    """A hub-pushable README.md for the export folder."""
    kind, fmt, base = manifest["head_type"], manifest["format"], manifest["base_model"]
    # each tag once: a native export's engine is "specheads" itself
    tags = list(dict.fromkeys(["speculative-decoding", kind, "specheads", *manifest["engines"]]))
    files = "\n".join(f"| `{name}` | {info['bytes']} | `{info['sha256'][:16]}…` |"
                      for name, info in manifest["files"].items())
    notes = "".join(f"- {note}\n" for note in manifest["notes"]) or "- none\n"
    return f"""---
base_model: {base['hub_id']}
library_name: specheads
tags: [{', '.join(tags)}]
---
# {kind.upper()} head for {base['hub_id']} (`{fmt}` export)

A speculative-decoding draft head trained by specheads on the frozen target `{base['name_or_path']}`
({base['architecture']}). Layout `{fmt}` (format version {manifest['format_version']}), weights in
{manifest['dtype']}, for: {', '.join(manifest['engines'])}.

## Serve it

```bash
{serve_command(manifest)}
```

{_settings_lines(manifest['runtime'])}

## Base model

- fingerprint id `{base['fingerprint'].get('id')}` (architecture numbers + embedding/lm_head digests);
  `python -m export validate THIS_FOLDER base=<model>` checks a base model against it
- tokenizer hash `{base['tokenizer_hash']}`, chat-template hash `{base['chat_template_hash']}`
- feature: {manifest['feature_layer']['feature']}; {manifest['feature_layer']['predicts']}

## Training

{_table(manifest['training'])}
## Evaluation

{_table(manifest['eval'])}
## Files

| file | bytes | sha256 |
| --- | --- | --- |
{files}

## Notes

{notes}"""
