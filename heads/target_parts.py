"""The frozen target in parts: its embedding, final norm, lm_head and chosen decoder layers read
from its safetensors (a local folder or a hub repository, only the shards that hold them), the
other layers neither built nor read. What training from a finished feature cache needs: for a 70B
target ~4 GB per process instead of 140 GB.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Sequence

import torch

from heads.target import FrozenTarget, PartialLayers, TargetConfig, resolve_device, resolve_dtype, resolve_source

log = logging.getLogger(__name__)


def _fetch(source: str, filename: str, revision: str | None) -> Path | None:
    """A file of a local model folder or a hub repository (downloaded alone), or None if absent."""
    if Path(source).is_dir():
        path = Path(source) / filename
        return path if path.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(source, filename, revision=revision))
    except EntryNotFoundError:
        return None


def read_checkpoint_tensors(source: str, names: Sequence[str],
                            revision: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors `names` of a safetensors checkpoint (single file or sharded with
    model.safetensors.index.json), opening only the shards that hold them; absent names are left out."""
    from safetensors import safe_open

    index = _fetch(source, "model.safetensors.index.json", revision)
    if index is not None:
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        single = _fetch(source, "model.safetensors", revision)
        if single is None:
            raise FileNotFoundError(f"{source} has no safetensors weights (model.safetensors[.index.json]); "
                                    "loading a target in parts reads them")
        with safe_open(str(single), framework="pt") as handle:
            weight_map = {key: "model.safetensors" for key in handle.keys()}
    by_file: dict[str, list[str]] = {}
    for name in names:
        if name in weight_map:
            by_file.setdefault(weight_map[name], []).append(name)
    tensors = {}
    for filename, keys in by_file.items():
        with safe_open(str(_fetch(source, filename, revision)), framework="pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in keys})
    return tensors


def load_target_parts(config: TargetConfig, layers: Sequence[int] = (), tokenizer=None) -> FrozenTarget:
    """The target's embedding, final norm and lm_head, plus the decoder `layers` asked for, read
    from its safetensors; the other decoder layers are neither built nor read. Enough to train
    heads from a finished feature cache (same fingerprint as the whole target); `features` refuses."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    source, extra = resolve_source(config)
    extra = {k: v for k, v in extra.items() if v is not None}
    model_config = AutoConfig.from_pretrained(source, trust_remote_code=config.trust_remote_code, **extra)
    total = model_config.num_hidden_layers
    keep = sorted({layer % total for layer in layers})
    model_config.num_hidden_layers = len(keep)  # build only these; the true count is restored below
    with init_empty_weights(include_buffers=False):  # parameters on meta, rotary buffers computed
        model = AutoModelForCausalLM.from_config(model_config, trust_remote_code=config.trust_remote_code)
    model_config.num_hidden_layers = total
    model.model.layers = PartialLayers(dict(zip(keep, model.model.layers)), total)
    wanted = list(model.state_dict().keys())
    tensors = read_checkpoint_tensors(source, wanted, extra.get("revision"))
    tied = getattr(model_config, "tie_word_embeddings", False)
    lm_head_key = next(name for name, module in model.named_modules() if module is model.get_output_embeddings())
    missing = [k for k in wanted if k not in tensors and not (tied and k == lm_head_key + ".weight")]
    if missing:
        raise KeyError(f"{source}: the checkpoint lacks {missing[:4]}{'...' if len(missing) > 4 else ''}")
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False, assign=True)
    if lm_head_key + ".weight" not in tensors:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=config.trust_remote_code, **extra)
    log.info("target %s loaded in parts: embedding, final norm, lm_head and decoder layers %s of %d",
             config.name_or_path, keep, total)
    return FrozenTarget(model.to(device), tokenizer, name=config.name_or_path)
