"""The measurement: drafters against plain decoding with the same lean forward and against
transformers' `generate`, on one prompt set, in one run (per prompt every method runs in turn, so
load on a shared machine hits all of them alike). Library code: `python -m eval` and the training
pipeline call `evaluate`."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from eval.batch_eval import evaluate_batches
from eval.calibrate import eagle_tree_budget, medusa_choices, peagle_tree_budget, verify_costs
from eval.config import DRAFTERS, RuntimeConfig
from eval.divergence import classify
from eval.prepare import dtype_name, head_in_dtype, prepare_target, runtime_sizes
from eval.recommend import head_fields, recommended_runtime
from eval.report import write_report
from eval.runtime.clock import device_clock, module_device
from eval.runtime.drafters import Drafter
from eval.runtime.drafters.adaptive import FallbackDrafter, SpeculationGate
from eval.runtime.drafters.draft_model import DynamicGamma, self_speculation_drafter
from eval.runtime.drafters.eagle import EagleDrafter
from eval.runtime.drafters.kinds import drafters_for, head_drafters, kind_drafters, kinds_running
from eval.runtime.drafters.medusa import MedusaDrafter
from eval.runtime.drafters.peagle import peagle_tree
from eval.runtime.drafters.prompt_lookup import PromptLookupDrafter
from eval.runtime.generate import GenerationResult, plain_generate, speculative_generate
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import SamplingConfig
from eval.timing import measured_on
from heads.eagle3 import Eagle3Head
from heads.vocab import draft_ids

log = logging.getLogger(__name__)

GATED_DRAFTERS = (*head_drafters(), "prompt_lookup")  # runtime.fallback (draft models gate themselves)


@dataclass
class Method:
    """One measured configuration: a name, how to build its drafter, and what the report says."""

    name: str
    build: Callable[[], Drafter] | None  # None: plain decoding
    verification: str = "lossless"
    settings: dict = field(default_factory=dict)
    sweep: bool = False  # a tree-size sweep point (eagle_tree at another total_tokens)


def _eagle(head, lean, mode, runtime: RuntimeConfig, total_tokens: int, draft_vocab=None) -> EagleDrafter:
    return EagleDrafter(head, lean, mode=mode, depth=runtime.chain_depth if mode == "chain" else runtime.tree_depth,
                        top_k=runtime.tree_top_k, total_tokens=total_tokens, draft_vocab=draft_vocab)


def _fixed_tree_total_tokens(runtime: RuntimeConfig) -> int | None:
    """runtime.tree_total_tokens as an int, or None for "auto"."""
    total = runtime.tree_total_tokens
    if total == "auto":
        return None
    if isinstance(total, bool) or not isinstance(total, int) or total < 2:
        raise ValueError(f"runtime.tree_total_tokens must be an integer >= 2 or 'auto', got {total!r}")
    return total


def _plain_seconds(lean: LeanLlama, prompts) -> float:
    prompt = prompts[0] if len(prompts) else torch.zeros(1, dtype=torch.long)
    return verify_costs(lean, prompt, (1,))[1]


def _gated(build: Callable[[], Drafter], runtime: RuntimeConfig, plain_seconds: float, lean: LeanLlama,
           initial_tau: float = 2.0) -> Callable[[], Drafter]:
    if not runtime.fallback:
        return build
    clock = device_clock(module_device(lean))  # the gate compares step times: on CUDA they must include the work
    return lambda: FallbackDrafter(build(), SpeculationGate(plain_seconds, initial_tau, runtime.fallback_probe_every),
                                   clock)


def measured_verify_cost(lean: LeanLlama, prompts, max_gamma: int) -> tuple[float, ...]:
    """DynamicGamma's verify_cost measured here: a target forward over gamma + 1 tokens in plain
    decode steps, gamma = 0..max_gamma."""
    prompt = prompts[0] if len(prompts) else torch.zeros(1, dtype=torch.long)
    costs = verify_costs(lean, prompt, tuple(range(1, max_gamma + 2)))
    return tuple(costs[n] / costs[1] for n in sorted(costs))


def _draft_cost(lean: LeanLlama, layers: int) -> float:
    """Bytes a draft step reads relative to a target step: lm_head + `layers` blocks."""
    per_block = sum(p.numel() for p in lean.blocks[0].parameters())
    head = lean.lm_head.weight_t.numel()
    return (head + layers * per_block) / (head + lean.config.num_layers * per_block)


def _vocabulary_note(head) -> dict:
    """What the head drafts over, for the report; logs the fallback of a head without a vocabulary."""
    ids = draft_ids(head)
    if ids is not None:
        log.info("draft vocabulary: the head's own %d tokens", len(ids))
        return {"size": len(ids), "source": "the head"}
    vocab_size = head.config.vocab_size
    log.warning("the head carries no draft vocabulary (saved before heads stored one, or trained with "
                "heads.draft_vocab_size=0): it drafts over the full vocabulary of %d tokens", vocab_size)
    return {"size": vocab_size, "source": "none stored: the full vocabulary"}


def build_methods(names: Sequence[str], runtime: RuntimeConfig, lean: LeanLlama, head=None, prompts=(),
                  eos=(), progress: bool = False) -> tuple[list[Method], dict]:
    """Drafter names -> Methods (plain first). Head drafters whose head is missing are skipped
    with a warning. Head drafters draft over the head's own vocabulary (heads.vocab.draft_ids:
    EAGLE-1/2 and Medusa an id list, EAGLE-3 its d2t map inside the head). Returns (methods, extra
    report fields). `progress`: bars over the calibrations."""
    names, methods, extra = list(names), [Method("plain", None)], {}
    ids = draft_ids(head) if head is not None else None
    draft_vocab = None if isinstance(head, Eagle3Head) else ids  # an EAGLE-3 head maps its own ids (d2t)
    gate = {"fallback": runtime.fallback}
    plain_seconds = _plain_seconds(lean, prompts) if runtime.fallback and set(names) & set(GATED_DRAFTERS) else 0.0
    for name in names:
        if name not in DRAFTERS:
            raise ValueError(f"runtime.drafters: unknown drafter {name!r} (one of {DRAFTERS})")
        kinds = kinds_running(name)
        if kinds and (head is None or name not in drafters_for(head)):
            log.warning("skipping %s: it needs a %s head (got %s)", name, " or ".join(kinds), type(head).__name__)
            continue
        vocab = {} if ids is None else {"draft_vocab": len(ids)}
        if name == "prompt_lookup":
            methods.append(Method(name, _gated(lambda: PromptLookupDrafter(runtime.prompt_lookup_tokens), runtime,
                                               plain_seconds, lean),
                                  settings={"num_draft": runtime.prompt_lookup_tokens, **gate}))
        elif name in ("self_speculation", "draft_model"):
            layers = runtime.draft_layers or max(1, lean.config.num_layers // 4)
            cost = _draft_cost(lean, layers)
            if "verify_cost" not in extra:  # one curve for both chain drafters, measured on this machine
                extra["verify_cost"] = list(measured_verify_cost(lean, prompts, DynamicGamma.max_gamma))
            curve = extra["verify_cost"]
            methods.append(Method(name, lambda layers=layers, cost=cost: self_speculation_drafter(
                lean, layers, DynamicGamma(draft_cost=cost, verify_cost=curve)),
                settings={"draft_layers": layers, "draft_cost": round(cost, 3),
                          "verify_cost": [round(c, 3) for c in curve]}))
        elif name == "eagle_tree":
            tree, initial_tau = {"top_k": runtime.tree_top_k, "depth": runtime.tree_depth, **vocab}, 2.0
            total = _fixed_tree_total_tokens(runtime)
            if total is None:
                total, extra["eagle_tree_budget"] = eagle_tree_budget(head, lean, runtime, prompts, eos, draft_vocab,
                                                                        progress)
                initial_tau = extra["eagle_tree_budget"]["expected_tau_by_size"][total]
                tree["total_tokens_auto"] = True
            methods.append(Method(name, _gated(lambda total=total: _eagle(head, lean, "tree", runtime, total, draft_vocab),
                                               runtime, plain_seconds, lean, initial_tau),
                                  settings={**tree, "total_tokens": total, **gate}))
            tree.pop("total_tokens_auto", None)
            for size in runtime.tree_sweep:
                if size != total:
                    methods.append(Method(f"eagle_tree@{size}",
                                          lambda size=size: _eagle(head, lean, "tree", runtime, size, draft_vocab),
                                          settings={**tree, "total_tokens": size, "fallback": False}, sweep=True))
        elif name == "medusa":
            choices, calibration = medusa_choices(head, lean, runtime, prompts, eos, draft_vocab, progress)
            extra["medusa"] = {"choices": [list(c) for c in choices], **calibration}
            verification = "typical" if runtime.typical_acceptance else "lossless"
            methods.append(Method(name, _gated(lambda choices=choices: MedusaDrafter(head, lean, choices, draft_vocab),
                                               runtime, plain_seconds, lean),
                                  verification, settings={"tree_nodes": len(choices), "choices": runtime.medusa_choices,
                                                          **vocab, **gate}))
        elif name == "peagle_tree":
            depth = min(runtime.chain_depth, head.config.speculative_tokens)
            total, initial_tau, auto = runtime.peagle_tree_tokens, 2.0, {}
            if total == "auto":
                total, budget = peagle_tree_budget(head, lean, runtime, depth, prompts, eos, progress)
                extra["peagle_tree_budget"], initial_tau = budget, budget["expected_tau_by_size"][total]
                auto = {"total_tokens_auto": True}
            methods.append(Method(name, _gated(lambda depth=depth, total=total: peagle_tree(head, lean, depth, total),
                                               runtime, plain_seconds, lean, initial_tau),
                                  settings={**auto, "total_tokens": total, "depth": depth, **vocab, **gate}))
        else:  # the head kind's chain (eval.runtime.drafters.kinds): eagle_chain, and a new kind's drafter as it is
            chain = kind_drafters(head).chain
            methods.append(Method(name, _gated(lambda chain=chain: chain(head, lean, runtime.chain_depth, draft_vocab), runtime,
                                               plain_seconds, lean),
                                  settings={"depth": runtime.chain_depth, **vocab, **gate}))
    return methods, extra


class _Clock:
    """A transformers streamer that timestamps the first generated token (the end of prefill)."""

    def __init__(self, now: Callable[[], float]):
        self.now, self.calls, self.first_token = now, 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.first_token = self.now()

    def end(self):
        pass


@torch.no_grad()
def transformers_generate(model, prompt: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig,
                          eos: Sequence[int]) -> GenerationResult:
    """transformers' `generate` on the same prompt, timed like the lean loops."""
    now = device_clock(module_device(model))
    clock = _Clock(now)
    options = dict(do_sample=False) if sampling.greedy else dict(
        do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)
    start = now()
    out = model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=max_new_tokens,
                         min_new_tokens=0, eos_token_id=list(eos) or None, pad_token_id=(list(eos) or [0])[0],
                         streamer=clock, **options)
    end = now()
    tokens = out[0, prompt.shape[0]:].tolist()
    prefill = (clock.first_token or end) - start
    return GenerationResult(tokens, prefill_time=prefill, total_time=end - start)


def summarize(results: list[GenerationResult], reference: list[list[int]] | None) -> dict:
    """Aggregate one method's per-prompt results. reference: plain greedy tokens per prompt, to
    check lossless greedy output (None when sampling)."""
    new_tokens = sum(len(r.tokens) for r in results)
    decode_tokens = sum(max(len(r.tokens) - 1, 0) for r in results)
    decode_time = sum(r.decode_time for r in results)
    steps = [a for r in results for a in r.accepted]
    summary = {
        "prompts": len(results),
        "new_tokens": new_tokens,
        "tokens_per_second": decode_tokens / decode_time if decode_time > 0 else 0.0,
        "end_to_end_tokens_per_second": new_tokens / max(sum(r.total_time for r in results), 1e-9),
        "prefill_seconds": sum(r.prefill_time for r in results),
        "decode_seconds": decode_time,
    }
    if steps:
        depth = max(max(r.tree_sizes) for r in results if r.tree_sizes)
        speculated = [a for r in results for a, size in zip(r.accepted, r.tree_sizes) if size > 0]
        # Per speculative step: the gate's plain steps accept nothing by construction, and counting
        # them would show a head that drafts well but rarely speculates as one that drafts badly.
        depths = range(1, min(depth, max(speculated, default=0) + 1) + 1) if speculated else range(0)
        summary.update(
            steps=len(steps),
            tau=sum(a + 1 for a in steps) / len(steps),
            speculated_fraction=len(speculated) / len(steps),
            tau_when_speculating=sum(a + 1 for a in speculated) / len(speculated) if speculated else None,
            acceptance_per_depth=[sum(a >= d for a in speculated) / len(speculated) for d in depths],
            mean_tree_size=sum(s for r in results for s in r.tree_sizes) / len(steps),
            draft_ms_per_step=1000 * sum(t for r in results for t in r.draft_times) / len(steps),
            verify_ms_per_step=1000 * sum(t for r in results for t in r.verify_times) / len(steps),
        )
    if reference is not None:
        mismatches = [i for i, (r, ref) in enumerate(zip(results, reference)) if r.tokens != ref]
        summary["greedy_identical"] = not mismatches
        summary["mismatched_prompts"] = mismatches
    return summary


def evaluate(target, prompts: Sequence[Sequence[int]], drafter_specs: Sequence[str] | None = None,
             runtime: RuntimeConfig = RuntimeConfig(), head=None, head_config=None,
             out_dir: str | Path = "runs/eval", progress: bool = True,
             eos_token_ids: Sequence[int] | None = None, prepared: tuple | None = None) -> dict:
    """Measure every drafter in `drafter_specs` (default runtime.drafters) on `prompts` (token id
    lists) with the target (a `heads.target.FrozenTarget`; `head` an EagleHead, Eagle3Head or
    MedusaHeads, or None for head-free drafters only). The head drafts over the vocabulary it
    carries; one without (saved before heads stored one, or trained with heads.draft_vocab_size=0)
    drafts over the full vocabulary, with a warning. prepared: (lean forward, transformers model,
    report fields) from `eval.prepare` (default: built here from the runtime's dtype and linear-path
    settings). Writes report.json, report.md and PNG plots to out_dir; logs to W&B when a run is
    active. Returns the report dict."""
    from tqdm import tqdm

    prompts = [torch.as_tensor(list(p), dtype=torch.long) for p in prompts]
    if not prompts:
        raise ValueError("evaluate: no prompts")
    sampling = SamplingConfig(runtime.temperature, runtime.top_k, runtime.top_p)
    if eos_token_ids is None:
        eos = getattr(getattr(target, "tokenizer", None), "eos_token_id", None)
        eos_token_ids = [] if eos is None else [eos]
    fixed = _fixed_tree_total_tokens(runtime)
    longest_tree = max([fixed or 0, *runtime.tree_auto_sizes, *runtime.tree_sweep, 64])
    max_len = max(p.shape[0] for p in prompts) + runtime.max_new_tokens + longest_tree + 8
    specs = list(drafter_specs or runtime.drafters)
    if prepared is None:
        prepared = prepare_target(target.model, runtime, runtime_sizes(runtime, specs), prompts[0], max_len)
    lean, hf_model, setup = prepared
    if head is not None:  # it reads the target's final features and lm_head: a split target's last device
        head = head.to(lean.output_device)
        if runtime.head_dtype == "runtime":
            head = head_in_dtype(head, lean.embedding.dtype)
        setup = {**setup, "head_dtype": dtype_name(next(head.parameters()).dtype)}
    vocabulary = _vocabulary_note(head) if head is not None else None
    sweep = bool(runtime.batch_sizes)  # per batch size the policy decides when to speculate: no fallback gate
    methods, extra = build_methods(specs, dataclasses.replace(runtime, fallback=False) if sweep else runtime, lean,
                                   head, prompts, eos_token_ids, progress)
    if vocabulary is not None:
        extra["draft_vocab"] = vocabulary
    extra = {**setup, **extra}
    if sweep:
        return evaluate_batches(lean, methods, prompts, runtime, sampling, eos_token_ids, max_len, out_dir, target,
                                head_config, extra, progress)
    compare_hf = runtime.compare_transformers
    names = [m.name for m in methods] + (["transformers"] if compare_hf else [])
    results: dict[str, list[GenerationResult]] = {name: [] for name in names}
    drafters = {m.name: m.build() for m in methods if m.build is not None}
    plain_generate(lean, prompts[0][:8], 4, sampling, eos_token_ids)  # warm-up: first-call overheads
    bar = tqdm(total=len(prompts) * len(names), desc="eval", disable=not progress)
    for index, prompt in enumerate(prompts):
        for method in methods:
            generator = torch.Generator().manual_seed(runtime.seed + index)
            bar.set_postfix_str(method.name)
            if method.build is None:
                result = plain_generate(lean, prompt, runtime.max_new_tokens, sampling, eos_token_ids, generator)
            else:
                result = speculative_generate(lean, drafters[method.name], prompt, runtime.max_new_tokens, sampling,
                                              eos_token_ids, generator, method.verification)
            results[method.name].append(result)
            bar.update()
        if compare_hf:
            bar.set_postfix_str("transformers")
            torch.manual_seed(runtime.seed + index)
            results["transformers"].append(
                transformers_generate(hf_model, prompt, runtime.max_new_tokens, sampling, eos_token_ids))
            bar.update()
    bar.close()
    reference = [r.tokens for r in results["plain"]] if sampling.greedy else None
    summaries = {name: summarize(results[name], reference if name != "plain" else None) for name in names}
    for name, summary in summaries.items():
        if summary.get("greedy_identical") is False:
            summary.update(classify(lean, prompts, reference, [r.tokens for r in results[name]]))
            _log_mismatch(name, summary, lean.embedding.dtype)
    report = _assemble(methods, summaries, runtime, target, head_config, len(prompts), sampling, extra)
    report["files"] = {k: str(v) for k, v in write_report(report, out_dir).items()}
    return report


def _log_mismatch(name: str, summary: dict, dtype: torch.dtype) -> None:
    real = [d["prompt"] for d in summary["greedy_divergences"] if not d["near_tie"]]
    ties = [d["prompt"] for d in summary["greedy_divergences"] if d["near_tie"]]
    if real and name == "transformers":
        log.warning("transformers generate differs from the lean plain greedy output on prompts %s beyond a "
                    "near-tie (its kernels are not the lean forward's; speculative outputs are checked against the "
                    "lean one)", real)
    elif real:
        log.error("GREEDY MISMATCH: %s differs from plain greedy decoding on prompts %s where the target's logits "
                  "are not a near-tie — a bug in the runtime or drafter", name, real)
    if ties:
        log.warning("%s leaves plain greedy decoding on prompts %s at %s near-ties (top logits within rounding): "
                    "the dtype rounds a one-row decode step and a multi-row verification differently; "
                    "runtime.dtype=float32 gives token-identical output", name, ties, str(dtype).removeprefix("torch."))


def _assemble(methods: list[Method], summaries: dict, runtime: RuntimeConfig, target, head_config,
              num_prompts: int, sampling: SamplingConfig, extra: dict) -> dict:
    plain = summaries["plain"]["tokens_per_second"]
    hf = summaries.get("transformers", {}).get("tokens_per_second")
    rows = []
    for method in methods[1:]:
        row = {"name": method.name, "verification": method.verification, "lossy": method.verification == "typical",
               "sweep": method.sweep, "settings": method.settings, **summaries[method.name]}
        row["speedup_vs_plain"] = row["tokens_per_second"] / plain if plain else None
        row["speedup_vs_transformers"] = row["tokens_per_second"] / hf if hf else None
        if plain and row.get("verify_ms_per_step") is not None:  # cost of one step in plain decode steps
            row["verify_cost_in_plain_steps"] = row["verify_ms_per_step"] * plain / 1000.0
            row["break_even_tau"] = (row["verify_ms_per_step"] + row["draft_ms_per_step"]) * plain / 1000.0
        rows.append(row)
    baselines = {"plain": summaries["plain"]}
    if "transformers" in summaries:
        baselines["transformers"] = summaries["transformers"]
        baselines["plain"]["speedup_vs_transformers"] = plain / hf if hf else None
    fingerprint = target.fingerprint() if hasattr(target, "fingerprint") else {}
    where = measured_on(getattr(target, "device", None))
    recommended = recommended_runtime(rows, runtime, extra, where)
    report = {
        "target": getattr(target, "name", "?"),
        "target_fingerprint": fingerprint.get("id") if isinstance(fingerprint, dict) else None,
        "head": None if head_config is None else {"type": type(head_config).__name__, **head_fields(head_config)},
        "num_prompts": num_prompts,
        "sampling": asdict(sampling),
        "runtime": asdict(runtime),
        "threads": torch.get_num_threads(),
        "notes": [
            "tau = tokens committed per target forward, bonus token INCLUDED (plain decoding = 1.0).",
            "tokens/s = decode throughput after the first token (prefill excluded), summed over prompts.",
            "speedups are ratios of tokens/s measured in this run, methods interleaved per prompt.",
            "acceptance_per_depth[d-1] = fraction of speculative steps that accepted at least d drafted tokens "
            "(plain steps of the fallback gate are left out; `speculated` says how many steps speculated).",
            "speculated = fraction of target forwards that verified drafts; the rest were plain decode steps "
            "(fallback: speculation off while it does not pay, or no draft, e.g. no prompt-lookup match); "
            "tau_when_speculating counts those steps only.",
            "break_even_tau = (draft + verify time per step) / plain time per token: the tau a drafter needs "
            "at its measured costs to match plain decoding.",
            "verification 'typical' (Medusa typical acceptance) is LOSSY; all others are lossless.",
        ],
        "baselines": baselines,
        "drafters": rows,
        "measured_on": where,
        "recommended_runtime": recommended.to_dict() if recommended else {},  # RecommendedRuntime.from_dict reads it
        **extra,
    }
    return report
