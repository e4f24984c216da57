"""Batched generation over the lean forward: the sequences of a batch decode together, one target
forward per step for all of them, plain or speculative with any `Drafter` (one drafter instance
per sequence, so a stateful drafter such as EAGLE's head cache stays per sequence).

Each step every active sequence proposes its own tree (of its own size, maybe empty), the trees
are padded to the longest and verified in one `batch_forward` with (B, N, N) masks and (B, N)
positions; each sequence then accepts its own path (acceptance is ragged), compacts its own cache
and commits accepted + 1 tokens. A sequence that reaches EOS or its token budget leaves the batch
at once (its slot is refilled by the last active one), and a new one may join between steps
(`BatchDecoder.join`: continuous batching). Per sequence the arithmetic and the random draws are
those of `eval.runtime.generate` at batch 1 (same verification functions, one generator per sequence), so
greedy output is token-identical to batch-1 decoding and sampling stays exactly lossless.

Times per request: `GenerationResult.prefill_time` is the time to first token (from the request's
arrival), `total_time` its end-to-end latency; `time_per_output_token` the mean time between its
later tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from eval.runtime.batch_model import BatchKVCache, batch_forward
from eval.runtime.clock import device_clock, module_device
from eval.runtime.drafters import Candidates, Drafter, DraftState
from eval.runtime.generate import VERIFICATIONS, GenerationResult, _finish, _tree, _verify
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import SamplingConfig, pick


@dataclass
class Request:
    """One sequence in a `BatchDecoder`. `result.tokens` grows as it decodes."""

    key: Any
    max_new_tokens: int
    generator: torch.Generator | None
    drafter: Drafter | None
    arrived: float
    result: GenerationResult
    buffer: torch.Tensor  # committed tokens (prompt + generated), grown when full
    length: int
    state: DraftState | None = None
    done: bool = False

    @property
    def root(self) -> int:
        return int(self.buffer[self.length - 1])


def time_per_output_token(result: GenerationResult) -> float | None:
    """Mean seconds between a request's tokens after its first (None for a single token)."""
    count = len(result.tokens) - 1
    return result.decode_time / count if count > 0 else None


class BatchDecoder:
    """Up to `capacity` sequences decoding together on `model`. drafter_factory: builds one drafter
    per sequence (None: plain decoding); drafter_pool: a list of idle drafters from that factory
    to draw from and return to (shared by decoders of one drafter). verification: "lossless" |
    "typical" (LOSSY). batched_drafting: drafters whose class has `propose_many` draft the batch
    together (off: one sequence at a time)."""

    def __init__(self, model: LeanLlama, capacity: int, sampling: SamplingConfig = SamplingConfig(),
                 eos_token_ids: Sequence[int] = (), drafter_factory: Callable[[], Drafter] | None = None,
                 verification: str = "lossless", max_length: int | None = None, clock=None,
                 drafter_pool: list | None = None, batched_drafting: bool = True):
        if verification not in VERIFICATIONS:
            raise ValueError(f"verification must be one of {VERIFICATIONS}, got {verification!r}")
        if capacity < 1:
            raise ValueError(f"batch decoder: capacity must be >= 1, got {capacity}")
        self.model, self.sampling, self.eos = model, sampling, set(eos_token_ids)
        self.drafter_factory, self.verification = drafter_factory, verification
        self.cache = BatchKVCache(model, capacity, max_length)
        self.clock = clock or device_clock(module_device(model))
        self.active: list[Request] = []  # in slot order
        self._drafters: list[Drafter] = [] if drafter_pool is None else drafter_pool  # idle, reused by later requests
        self.layers: tuple[int, ...] = ()
        self.batched_drafting = batched_drafting

    @property
    def free(self) -> int:
        return self.cache.capacity - len(self.active)

    def _drafter(self) -> Drafter | None:
        if self.drafter_factory is None:
            return None
        drafter = self._drafters.pop() if self._drafters else self.drafter_factory()
        self.layers = tuple(drafter.feature_layers)
        return drafter

    @torch.no_grad()
    def join(self, prompt: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None = None,
             key: Any = None, arrived: float | None = None) -> Request:
        """Prefill `prompt` (T,) into a free slot and pick its first token; the request decodes with
        the others from the next `step`. arrived: the request's arrival time on `clock` (default
        now), from which its time to first token counts. A request done after one token (EOS,
        max_new_tokens 1) is returned finished and takes no slot."""
        if not self.free:
            raise RuntimeError(f"batch decoder: all {self.cache.capacity} slots are busy")
        arrived = self.clock() if arrived is None else arrived
        cache, drafter = self.cache.caches[len(self.active)], self._drafter()
        if drafter is not None:
            drafter.reset(prompt)
        cache.truncate(0)
        out = self.model(prompt, cache, hidden_layers=self.layers if drafter is not None else (), logits="last")
        cache.commit()
        token = pick(out.logits[-1], self.sampling, generator)
        buffer = torch.empty(prompt.shape[0] + max_new_tokens + 1, dtype=torch.long)
        buffer[: prompt.shape[0]] = prompt
        buffer[prompt.shape[0]] = token
        request = Request(key, max_new_tokens, generator, drafter, arrived,
                          GenerationResult([token], prefill_time=self.clock() - arrived), buffer, prompt.shape[0] + 1)
        if drafter is not None:
            request.state = DraftState(buffer[: request.length], request.length - 1, out.hidden,
                                       self.model.config.num_layers, self.sampling, generator)
        self.active.append(request)
        if token in self.eos or max_new_tokens <= 1:
            self._leave([len(self.active) - 1])
        return request

    @torch.no_grad()
    def step(self) -> list[Request]:
        """One target forward for every active sequence; returns the requests it finished."""
        if not self.active:
            return []
        if self.drafter_factory is None:
            self._plain_step()
        else:
            self._speculative_step()
        finished = [slot for slot, request in enumerate(self.active) if request.done]
        done = [self.active[slot] for slot in finished]
        self._leave(finished)
        return done

    def _append(self, request: Request, new_tokens: list[int]) -> None:
        if request.length + len(new_tokens) > request.buffer.shape[0]:
            request.buffer = torch.cat([request.buffer, torch.empty_like(request.buffer)])
        request.buffer[request.length: request.length + len(new_tokens)] = torch.tensor(new_tokens)
        request.length += len(new_tokens)
        request.result.tokens.extend(new_tokens)
        if len(request.result.tokens) >= request.max_new_tokens or self.eos.intersection(new_tokens):
            request.done = True

    def _plain_step(self) -> None:
        tokens = torch.tensor([[request.root] for request in self.active])  # (B, 1)
        start = self.clock()
        logits = batch_forward(self.model, tokens, self.cache, logits="last").logits  # (B, 1, V)
        for slot, request in enumerate(self.active):
            self.cache.caches[slot].commit()
            self._append(request, [pick(logits[slot, -1], self.sampling, request.generator)])
        seconds = self.clock() - start
        for request in self.active:
            request.result.verify_times.append(seconds)

    def _speculative_step(self) -> None:
        proposals = []
        for request, candidates in zip(self.active, self._propose()):
            tree, is_chain = _tree(tuple(candidates.parents.tolist()))
            proposals.append((candidates, tree, is_chain, [request.root] + candidates.tokens.tolist()))
        start = self.clock()
        b, n = len(proposals), max(len(p[3]) for p in proposals)
        uniform = all(is_chain and len(tokens) == n for _, _, is_chain, tokens in proposals)
        tokens = torch.zeros(b, n, dtype=torch.long)
        positions = torch.empty(b, n, dtype=torch.long)
        mask = torch.eye(n, dtype=torch.bool).repeat(b, 1, 1)  # padding rows see only themselves
        for slot, (candidates, tree, _, row) in enumerate(proposals):
            m, length = len(row), self.cache.caches[slot].length
            tokens[slot, :m] = torch.tensor(row)
            positions[slot] = length
            positions[slot, :m] += tree.depths
            mask[slot, :m, :m] = tree.mask
        out = batch_forward(self.model, tokens, self.cache, positions, None if uniform else mask, self.layers)
        verify_seconds = self.clock() - start
        num_layers = self.model.config.num_layers
        for slot, (request, (candidates, tree, _, row)) in enumerate(zip(self.active, proposals)):
            start = self.clock()
            verdict = _verify(tree, row, out.logits[slot, : len(row)], candidates, self.sampling, self.verification,
                              request.generator)
            path = [0] + verdict.accepted
            self.cache.caches[slot].compact(path)
            self._append(request, [row[i] for i in verdict.accepted] + [verdict.next_token])
            index = torch.tensor(path)
            request.state = DraftState(request.buffer[: request.length], request.length - 1,
                                       {k: v[slot, index] for k, v in out.hidden.items()}, num_layers, self.sampling,
                                       request.generator, request.state.step + 1)
            request.drafter.accept(request.state, [i - 1 for i in verdict.accepted])
            result = request.result
            result.accepted.append(len(verdict.accepted))
            result.tree_sizes.append(len(candidates))
            result.verify_times.append(verify_seconds)
            result.draft_times[-1] += self.clock() - start

    def _propose(self) -> list[Candidates]:
        """Every active sequence's tree: in one call where the drafters' class drafts batches
        (`propose_many`) and `batched_drafting` is on, else one by one. A request's draft time is
        its share of the batch's."""
        drafters = [request.drafter for request in self.active]
        for request in self.active:
            request.state.batch_size = len(self.active)
        many = getattr(type(drafters[0]), "propose_many", None)
        if self.batched_drafting and many is not None and len(drafters) > 1 and \
                all(type(d) is type(drafters[0]) for d in drafters):
            start = self.clock()
            proposals = many(drafters, [request.state for request in self.active])
            share = (self.clock() - start) / len(drafters)
            for request in self.active:
                request.result.draft_times.append(share)
            return proposals
        proposals = []
        for request in self.active:
            start = self.clock()
            proposals.append(request.drafter.propose(request.state))
            request.result.draft_times.append(self.clock() - start)
        return proposals

    def _leave(self, slots: Sequence[int]) -> None:
        """Finish the requests in `slots`; the last active slots fill the holes."""
        now = self.clock()
        for slot in sorted(slots, reverse=True):
            request = self.active[slot]
            request.done = True
            request.result.tokens = _finish(request.result.tokens, request.max_new_tokens, self.eos)
            request.result.total_time = now - request.arrived
            if request.drafter is not None:
                self._drafters.append(request.drafter)
            last = len(self.active) - 1
            if slot != last:
                self.cache.move(last, slot)
                self.active[slot] = self.active[last]
            else:
                self.cache.caches[slot].truncate(0)
            self.active.pop()


@torch.no_grad()
def batch_generate(model: LeanLlama, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                   sampling: SamplingConfig = SamplingConfig(), eos_token_ids: Sequence[int] = (),
                   generators: Sequence[torch.Generator | None] | None = None,
                   drafter_factory: Callable[[], Drafter] | None = None, verification: str = "lossless",
                   max_length: int | None = None, decoder: BatchDecoder | None = None) -> list[GenerationResult]:
    """Static batching: every prompt (T_b,) joins at once and the batch decodes until the last one
    finishes. One generator per prompt (None: the global RNG). Results in prompt order; times
    count from the batch's start. decoder: an idle one to reuse (its drafters and cache)."""
    decoder = decoder or BatchDecoder(model, len(prompts), sampling, eos_token_ids, drafter_factory, verification,
                                      max_length)
    generators = list(generators) if generators is not None else [None] * len(prompts)
    start = decoder.clock()
    requests = [decoder.join(prompt, max_new_tokens, generator, index, start)
                for index, (prompt, generator) in enumerate(zip(prompts, generators))]
    while decoder.active:
        decoder.step()
    return [request.result for request in requests]
