"""The serving engine as an eval method: vLLM runs a head's export on the same prompts as our
runtime, and its acceptance is reported beside our runtime's chain and training's estimate.

vLLM runs in its own venv (scripts/setup_vllm.sh; this process never imports it) through
scripts/vllm_check.py, one request at a time, prompts given as token ids. vLLM drafts chains of K
tokens (no trees), so the row to compare is our runtime's chain at the same K, drafting as the
engine drafts: an EAGLE-1/2 or Medusa head over the full vocabulary (vLLM ignores the head's
draft vocabulary), an EAGLE-3 head over its d2t map.

One definition of per-position acceptance for every row: accepted at draft position i / drafts
(speculative steps), i = 1..K; the mean acceptance length is 1 + their sum. Both sides verify
greedily at temperature 0, so on the same prompts they agree up to the rounding of two different
sets of kernels; at a temperature they agree in distribution only.
"""
from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch

from eval.config import RuntimeConfig

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parent.parent
CHECK_SCRIPT = REPO / "scripts" / "vllm_check.py"
READY = ".specheads-ready"  # written by a loader venv's set-up script once the venv imports its loader
ENGINES = ("vllm",)
# The export layout vLLM loads for each head type, and the speculative method it runs it with.
# `peagle` is vLLM's eagle3 method with parallel drafting (scripts/vllm_check.py writes the flag).
VLLM_LAYOUTS = {"eagle3": "speculators", "eagle": "eagle_vllm", "medusa": "medusa_vllm",
                "peagle": "speculators_peagle", "dflash": "speculators_dflash"}
VLLM_METHODS = {"speculators": "eagle3", "eagle3_vllm": "eagle3", "eagle_vllm": "eagle", "medusa_vllm": "medusa",
                "speculators_peagle": "peagle", "speculators_dflash": "dflash"}
TOLERANCE = 0.02  # per-position acceptance, greedy, float32: see docs/serving.md for how it was measured


class EngineError(RuntimeError):
    """The engine could not run a case (it refused the folder, crashed or timed out)."""


def loader_python(venv: str | os.PathLike | None, variable: str, default: str, setup_script: str) -> Path:
    """The python of a third-party loader's own venv (`venv`, else $`variable`, else REPO/`default`),
    built by scripts/`setup_script` until the venv holds READY (one builder at a time: the others
    wait on a lock beside it)."""
    venv = Path(venv or os.environ.get(variable) or REPO / default).resolve()
    if not (venv / READY).is_file():
        venv.parent.mkdir(parents=True, exist_ok=True)
        with open(venv.parent / f".{venv.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (venv / READY).is_file():
                log.info("building %s (scripts/%s, a few minutes)", venv, setup_script)
                subprocess.run(["bash", str(REPO / "scripts" / setup_script)], cwd=REPO, check=True,
                               env={**os.environ, variable: str(venv)})
    return venv / "bin" / "python"


def vllm_python(venv: str | os.PathLike | None = None) -> Path:
    """The vLLM venv's python (scripts/setup_vllm.sh builds it when missing, ~2 minutes)."""
    return loader_python(venv, "VLLM_VENV", ".venv-vllm", "setup_vllm.sh")


def base_folder(target) -> Path:
    """The local folder the engine loads the base model from (the dequantized cache for embedded)."""
    from heads.target import TargetConfig, resolve_source

    path = Path(resolve_source(TargetConfig(name_or_path=target.name, device="cpu"))[0])
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{target.name}: no local model folder with config.json ({path}) for the engine")
    return path


@dataclass
class EngineCase:
    """One speculative run in the engine: a name, the folder it loads, K, the engine's method for
    that folder's layout (VLLM_METHODS) and how many of the job's prompts it runs (None: all)."""

    name: str
    folder: Path
    k: int
    method: str
    prompts: int | None = None

    def job(self) -> dict:
        return {"name": self.name, "method": self.method, "model": str(Path(self.folder).resolve()), "k": self.k,
                "prompts": self.prompts}


def run_vllm(target, prompts: Sequence[Sequence[int]], cases: Sequence[EngineCase], max_tokens: int,
             temperature: float, seed: int, work: Path, dtype: str = "float32", plain: bool = True,
             threads: int | None = None, python: Path | None = None, timeout: int = 1800) -> dict:
    """Run the engine's plain decoding (`plain`) and each case on `prompts`; returns
    scripts/vllm_check.py's answer ({version, runs: [{name, tokens, seconds, spec}]})."""
    work = Path(work).resolve()  # the engine runs in `work`: every path it reads is absolute
    work.mkdir(parents=True, exist_ok=True)
    job = {"target": str(base_folder(target)), "dtype": dtype, "prompts": [list(map(int, p)) for p in prompts],
           "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "plain": plain,
           "cases": [case.job() for case in cases]}
    job_path, answer_path, log_path = work / "vllm_job.json", work / "vllm_answer.json", work / "vllm.log"
    job_path.write_text(json.dumps(job))
    answer_path.unlink(missing_ok=True)
    threads = threads or torch.get_num_threads()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
           # in-process engine and worker: ~10 s per engine start instead of ~35 s
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "all")}
    env.pop("PYTHONPATH", None)
    start = time.perf_counter()
    with open(log_path, "w") as out:
        try:
            run = subprocess.run([str(python or vllm_python()), str(CHECK_SCRIPT), str(job_path), str(answer_path)],
                                 cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise EngineError(f"vLLM did not finish in {timeout} s (its log: {log_path})") from None
    if run.returncode != 0 or not answer_path.is_file():
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        raise EngineError(f"vLLM failed (exit {run.returncode}; log {log_path}):\n" + "\n".join(tail))
    answer = json.loads(answer_path.read_text())
    log.info("vLLM %s ran %d run(s) in %.0f s", answer["version"], len(answer["runs"]), time.perf_counter() - start)
    return answer


def step_counters(accepted: Sequence[int], drafted: Sequence[int], k: int) -> dict:
    """Our steps of one prompt -> the engine's counters: drafts (steps that drafted), draft and
    accepted tokens, accepted at position i = 1..K."""
    steps = [a for a, size in zip(accepted, drafted) if size > 0]
    return {"drafts": len(steps), "draft_tokens": sum(drafted), "accepted_tokens": sum(steps),
            "accepted_per_position_counts": [sum(a >= i for a in steps) for i in range(1, k + 1)]}


def rates(counters: Sequence[dict], k: int) -> dict:
    """Per-prompt counters summed -> the row's figures: accepted_per_position[i] = accepted at
    position i+1 / drafts, mean acceptance length = 1 + accepted tokens / drafts."""
    total = {key: sum(c[key] for c in counters) for key in ("drafts", "draft_tokens", "accepted_tokens")}
    counts = [sum(c["accepted_per_position_counts"][i] for c in counters
                  if i < len(c["accepted_per_position_counts"])) for i in range(k)]
    drafts = total["drafts"]
    return {**total, "accepted_per_position_counts": counts,
            "accepted_per_position": [c / drafts if drafts else 0.0 for c in counts],
            "mean_acceptance_length": 1 + total["accepted_tokens"] / drafts if drafts else None}


def paired_difference(a: Sequence[dict], b: Sequence[dict], resamples: int = 4000, seed: int = 0) -> dict:
    """Head `a` minus head `b`, run on the same prompts (per-prompt counters of each, in prompt
    order): the differences of mean acceptance length and of first-position acceptance, each with
    a paired bootstrap standard error over prompts. The prompts are resampled together for both
    heads, so a prompt that is easy for both cancels: what is left is how much the heads' order
    depends on which prompts were drawn."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_difference: {len(a)} and {len(b)} prompts (the same, at least one, are needed)")

    def columns(counters):
        return [torch.tensor([float(c[key]) for c in counters], dtype=torch.float64)
                for key in ("drafts", "accepted_tokens")] + [
            torch.tensor([float(c["accepted_per_position_counts"][0] if c["accepted_per_position_counts"] else 0)
                          for c in counters], dtype=torch.float64)]

    def figures(drafts, accepted, first):  # summed over prompts (last dim) -> mean length, first position
        return accepted.sum(-1) / drafts.sum(-1), first.sum(-1) / drafts.sum(-1)

    ca, cb = columns(a), columns(b)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(a), (resamples, len(a)), generator=generator)
    out = {"prompts": len(a), "resamples": resamples}
    whole = [x - y for x, y in zip(figures(*ca), figures(*cb))]
    drawn = [x - y for x, y in zip(figures(*(c[picks] for c in ca)), figures(*(c[picks] for c in cb)))]
    for name, value, sample in zip(("mean_acceptance_length", "first_position"), whole, drawn):
        sample = sample[torch.isfinite(sample)]  # a draw of prompts with no draft at all has no rate
        out[name] = {"difference": float(value), "standard_error": float(sample.std()) if len(sample) > 1 else None}
    return out


def training_estimate(manifest: dict, k: int) -> dict | None:
    """Training's held-out estimate at K: position i accepted with the product of the held-out
    top-1 of draft steps (Medusa: heads) 0..i-1 (the loop's acceptance estimate, cut at K)."""
    held_out = (manifest.get("training") or {}).get("held_out") or {}
    unit = "head" if "eval/top1_head0" in held_out else "step"  # Medusa: head i drafts position i+1
    accuracies = [held_out.get(f"eval/top1_{unit}{i}") for i in range(k)]
    if not accuracies or accuracies[0] is None:
        return None
    survival, survive = [], 1.0
    for accuracy in accuracies:
        if accuracy is None:
            break
        survive *= accuracy
        survival.append(survive)
    return {"accepted_per_position": survival, "mean_acceptance_length": 1 + sum(survival),
            "steps_known": len(survival), "source": "specheads.json training.held_out (top-1 per draft step)"}


def opening_walk(manifest: dict, k: int) -> dict | None:
    """Training's held-out chain walk over each reply's opening (train/heldout.py, OPENING_TOKENS),
    where the head was scored at depth K: what an engine run of that many new tokens a prompt
    should accept (None when the manifest has no such walk at this depth)."""
    held_out = (manifest.get("training") or {}).get("held_out") or {}
    unit = "head" if "eval/opening_chain_accept_head0" in held_out else "step"  # as training_estimate
    walked = [held_out.get(f"eval/opening_chain_accept_{unit}{i}") for i in range(k + 1)]
    if any(a is None for a in walked[:k]) or walked[k] is not None:
        return None
    return {"accepted_per_position": walked[:k], "mean_acceptance_length": 1 + sum(walked[:k]),
            "reply_tokens": held_out["eval/opening_tokens"],  # written with the walk (held_out_figures)
            "source": "specheads.json training.held_out (chain walk over reply openings)"}


def chain_drafter(head, lean, k: int):
    """Our runtime's chain at depth K, drafting as vLLM does (see the module docstring): argmax drafts
    at a temperature too (vLLM's default draft_sample_method), verified losslessly as one-hot drafts."""
    from eval.runtime.drafters.kinds import kind_drafters

    return kind_drafters(head).chain(head, lean, k, draft_vocab=None, greedy_drafts=True)


def run_ours(target, heads: Sequence, prompts: Sequence[Sequence[int]], k: int, runtime: RuntimeConfig,
             dtype: str = "float32", transformers: bool = True) -> dict:
    """Plain decoding, our chain at K for each of `heads` and (optionally) transformers' `generate`
    on `prompts`, in `dtype`, one prompt at a time, methods interleaved per prompt. Returns
    {plain, transformers, chains: [one per head]}, each with tokens and seconds per prompt; a chain
    also with its per-prompt counters (step_counters)."""
    from eval.runtime.generate import plain_generate, speculative_generate
    from eval.prepare import prepare_target
    from eval.run import transformers_generate
    from eval.runtime.sampling import SamplingConfig

    tensors = [torch.as_tensor(list(p), dtype=torch.long) for p in prompts]
    settings = replace(runtime, dtype=dtype, linear_paths="default", fallback=False)
    max_len = max(p.shape[0] for p in tensors) + runtime.max_new_tokens + k + 8
    lean, hf_model, _ = prepare_target(target.model, settings, [1, k + 1], tensors[0], max_len)
    sampling = SamplingConfig(runtime.temperature, runtime.top_k, runtime.top_p)
    eos_id = getattr(getattr(target, "tokenizer", None), "eos_token_id", None)
    eos = [] if eos_id is None else [eos_id]
    drafters = [chain_drafter(head.to(lean.output_device), lean, k) for head in heads]
    plain_generate(lean, tensors[0][:8], 4, sampling, eos)  # first-call overheads
    runs = {"plain": [], **{i: [] for i in range(len(heads))}, **({"transformers": []} if transformers else {})}
    for index, prompt in enumerate(tensors):
        def new():  # the same sampling stream for every method of a prompt
            return torch.Generator().manual_seed(runtime.seed + index)

        runs["plain"].append(plain_generate(lean, prompt, runtime.max_new_tokens, sampling, eos, new()))
        for i, drafter in enumerate(drafters):
            runs[i].append(speculative_generate(lean, drafter, prompt, runtime.max_new_tokens, sampling, eos, new()))
        if transformers:
            torch.manual_seed(runtime.seed + index)
            runs["transformers"].append(transformers_generate(hf_model, prompt, runtime.max_new_tokens, sampling, eos))

    def gathered(results, chain: bool = False) -> dict:
        out = {"tokens": [r.tokens for r in results], "seconds": sum(r.total_time for r in results),
               "per_prompt_seconds": [r.total_time for r in results], "new_tokens": sum(len(r.tokens) for r in results)}
        if chain:
            out["per_prompt"] = [step_counters(r.accepted, r.tree_sizes, k) for r in results]
        return out

    return {"plain": gathered(runs["plain"]), "chains": [gathered(runs[i], True) for i in range(len(heads))],
            **({"transformers": gathered(runs["transformers"])} if transformers else {})}


def agreement(ours: dict, engine: dict, tolerance: float = TOLERANCE) -> dict:
    """Per-position difference of two spec rows and whether it is within `tolerance`."""
    a, b = ours["accepted_per_position"], engine["accepted_per_position"]
    differences = [abs(x - y) for x, y in zip(a, b)] + [1.0] * abs(len(a) - len(b))
    return {"max_abs_difference": max(differences, default=0.0), "tolerance": tolerance,
            "within_tolerance": bool(differences) and max(differences) <= tolerance}


def sampled_tolerance(drafts: int, z: float = 4.0) -> float:
    """At a temperature both sides sample: a z-sigma band of a rate estimated from `drafts` steps
    on each side (worst case p = 0.5)."""
    return z * math.sqrt(2 * 0.25 / max(drafts, 1))
