"""Generation loops over the lean forward: plain decoding (the baseline) and speculative decoding
with any `Drafter`. Batch size 1."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch

from eval.runtime.clock import device_clock, module_device
from eval.runtime.drafters import Candidates, Drafter, DraftState
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import SamplingConfig, pick, probabilities
from eval.runtime.tree import TreeLayout, build_tree, candidate_parents_to_tree
from eval.runtime.verify import Verdict, verify_greedy, verify_sampled, verify_typical

VERIFICATIONS = ("lossless", "typical")


@dataclass
class GenerationResult:
    """tokens: the new tokens (prompt excluded), cut at max_new_tokens and after the first EOS.
    accepted: per verification step, drafted tokens accepted (the step commits accepted + 1).
    tree_sizes: per step, drafted tokens verified (root excluded).
    draft_times / verify_times: seconds per step (propose + accept / target forward + verify)."""

    tokens: list[int]
    prefill_time: float = 0.0
    total_time: float = 0.0
    accepted: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    draft_times: list[float] = field(default_factory=list)
    verify_times: list[float] = field(default_factory=list)

    @property
    def decode_time(self) -> float:
        return self.total_time - self.prefill_time

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput after the first token (prefill excluded)."""
        return max(len(self.tokens) - 1, 0) / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def acceptance_length(self) -> float:
        """tau: tokens committed per target forward, bonus token included."""
        return sum(a + 1 for a in self.accepted) / len(self.accepted) if self.accepted else 1.0


def _finish(tokens: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


@functools.lru_cache(maxsize=256)
def _tree(parents: tuple[int, ...]) -> tuple[TreeLayout, bool]:
    """Layout of a candidate tree (static trees repeat) and whether it is a plain chain."""
    tree = build_tree(candidate_parents_to_tree(parents))
    return tree, all(p == i - 1 for i, p in enumerate(tree.parents.tolist()))


def _prefill(model: LeanLlama, prompt: torch.Tensor, cache, hidden_layers=()):
    cache.truncate(0)
    out = model(prompt, cache, hidden_layers=hidden_layers, logits="last")
    cache.commit()
    return out


@torch.no_grad()
def plain_generate(
    model: LeanLlama,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    cache=None,
) -> GenerationResult:
    """Greedy or sampled decoding, one target forward per token. prompt_ids: (T,) int64."""
    clock = device_clock(module_device(model))
    start = clock()
    cache = cache if cache is not None else model.new_cache()
    eos = set(eos_token_ids)
    logits = _prefill(model, prompt_ids, cache).logits[-1]
    token = pick(logits, sampling, generator)
    tokens = [token]
    prefill_time = clock() - start
    step_input = torch.empty(1, dtype=torch.long)
    while len(tokens) < max_new_tokens and token not in eos:
        step_input[0] = token
        logits = model(step_input, cache).logits[-1]
        cache.commit()
        token = pick(logits, sampling, generator)
        tokens.append(token)
    return GenerationResult(_finish(tokens, max_new_tokens, eos), prefill_time, clock() - start)


def _verify(tree: TreeLayout, tokens: list[int], logits: torch.Tensor, candidates: Candidates,
            sampling: SamplingConfig, verification: str, generator) -> Verdict:
    if sampling.greedy:
        return verify_greedy(tree, tokens, logits)
    target_probs = probabilities(logits, sampling)
    if verification == "typical":
        return verify_typical(tree, tokens, target_probs, generator=generator)
    draft_probs = None if candidates.deterministic else candidates.draft_probs
    if not candidates.deterministic and draft_probs is None and len(candidates):
        raise ValueError("sampled (non-deterministic) candidates need draft_probs for lossless verification")
    return verify_sampled(tree, tokens, target_probs, draft_probs, generator)


@torch.no_grad()
def speculative_generate(
    model: LeanLlama,
    drafter: Drafter,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_token_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    verification: str = "lossless",
    cache=None,
) -> GenerationResult:
    """Speculative decoding: each step the drafter proposes a tree, one target forward scores
    root + tree, and verification commits the accepted path plus one target token.
    verification: "lossless" (greedy match at temperature 0, rejection sampling otherwise) or
    "typical" (Medusa typical acceptance, LOSSY; only differs when sampling)."""
    if verification not in VERIFICATIONS:
        raise ValueError(f"verification must be one of {VERIFICATIONS}, got {verification!r}")
    clock = device_clock(module_device(model))
    start = clock()
    cache = cache if cache is not None else model.new_cache()
    eos = set(eos_token_ids)
    layers = tuple(drafter.feature_layers)
    num_layers = model.config.num_layers
    drafter.reset(prompt_ids)
    out = _prefill(model, prompt_ids, cache, layers)
    token = pick(out.logits[-1], sampling, generator)
    buffer = torch.empty(prompt_ids.shape[0] + max_new_tokens + 1, dtype=torch.long)  # grown if needed
    buffer[: prompt_ids.shape[0]] = prompt_ids
    buffer[prompt_ids.shape[0]] = token
    length = prompt_ids.shape[0] + 1
    state = DraftState(buffer[:length], length - 1, out.hidden, num_layers, sampling, generator)
    result = GenerationResult([token], prefill_time=clock() - start)
    done = token in eos
    while len(result.tokens) < max_new_tokens and not done:
        t0 = clock()
        candidates = drafter.propose(state)
        t1 = clock()
        root = int(buffer[length - 1])
        tokens = [root] + candidates.tokens.tolist()
        tree, is_chain = _tree(tuple(candidates.parents.tolist()))
        out = model(
            torch.tensor(tokens), cache, positions=cache.length + tree.depths,
            tree_mask=None if is_chain else tree.mask, tree_bits=None if is_chain else tree.bits,
            hidden_layers=layers,
        )
        verdict = _verify(tree, tokens, out.logits, candidates, sampling, verification, generator)
        path = [0] + verdict.accepted
        cache.compact(path)
        new_tokens = [tokens[i] for i in verdict.accepted] + [verdict.next_token]
        if length + len(new_tokens) > buffer.shape[0]:
            buffer = torch.cat([buffer, torch.empty(buffer.shape[0], dtype=torch.long)])
        buffer[length: length + len(new_tokens)] = torch.tensor(new_tokens)
        length += len(new_tokens)
        index = torch.tensor(path)
        state = DraftState(buffer[:length], length - 1, {k: v[index] for k, v in out.hidden.items()},
                           num_layers, sampling, generator, state.step + 1)
        t2 = clock()
        drafter.accept(state, [i - 1 for i in verdict.accepted])
        t3 = clock()
        result.tokens.extend(new_tokens)
        done = bool(eos.intersection(new_tokens))
        result.accepted.append(len(verdict.accepted))
        result.tree_sizes.append(len(candidates))
        result.draft_times.append((t1 - t0) + (t3 - t2))
        result.verify_times.append(t2 - t1)
    result.tokens = _finish(result.tokens, max_new_tokens, eos)
    result.total_time = clock() - start
    return result
