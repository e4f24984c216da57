"""EAGLE drafting for the sequences of a batch at once (`EagleDrafter.propose_many`).

Each sequence keeps its own drafter and head cache (`LeanEagleHead`: committed positions from the
target's features, then this proposal's drafted entries), and catches up on its own newly
committed positions (their counts differ per sequence). The drafting itself — one head forward per
tree level (EAGLE-2) or chain step — runs for all sequences in one forward: the B*n rows go through
the head's linear layers together, each sequence's new K/V go into its own cache, and attention
reads the caches stacked and padded to the longest, under each sequence's own mask. Per sequence
it computes what `EagleDrafter.propose` computes (the same expansion and selection), so the drafts
differ from batch-1 drafts at most on floating-point near-ties; verification keeps the output exact
either way.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from eval.runtime.drafters import Candidates, DraftState
from eval.runtime.drafters.eagle_tree import select_tree
from eval.runtime.drafters.lean_head import LeanEagleHead
from eval.runtime.sampling import probabilities, sample


def draft_many(runtimes: Sequence[LeanEagleHead], embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
               masks: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """Feed n drafted entries per sequence after each runtime's current entries, in one forward.
    embeds, hidden: (B, n, D) (hidden: the parents' outputs, fed back as LeanEagleHead.draft does);
    positions: (B, n); masks[b]: (n, end_b) bool over runtime b's entries, end_b = its length +
    drafted + n (None: everything before plus causal among the n).
    Returns the outputs (B, n, D). Every runtime must hold the same head (runtimes[0]'s weights run)."""
    head = runtimes[0]
    b, n, d = embeds.shape
    H, Hkv, hd = head.heads, head.kv_heads, head.head_dim
    starts = [r.length + r.drafted for r in runtimes]
    ends = [start + n for start in starts]
    span = max(ends)
    for runtime in runtimes:
        runtime._reserve(span)  # K/V buffers and RoPE tables cover every position and slot used here
    fed_back = head.head_inputs.feedback(hidden.reshape(b * n, -1).to(head.dtype))  # as LeanEagleHead.draft
    x, residual = head.head_inputs.inputs(embeds.reshape(b * n, d).to(head.dtype), fed_back)
    qkv = head.qkv(x).view(b * n, H + 2 * Hkv, hd)
    q, k = head.rotated_qk(qkv, positions.reshape(-1).to(head.device))
    k, v = k.reshape(b, n, Hkv, hd), qkv[:, H + Hkv:].reshape(b, n, Hkv, hd)
    allowed = torch.zeros(b, 1, n, span, dtype=torch.bool, device=head.device)
    for row, (runtime, start, end) in enumerate(zip(runtimes, starts, ends)):
        runtime.k[:, start:end] = k[row].transpose(0, 1)
        runtime.v[:, start:end] = v[row].transpose(0, 1)
        runtime.drafted += n
        if masks is None:
            allowed[row, 0, :, :end] = torch.ones(n, end, dtype=torch.bool, device=head.device).tril_(start)
        else:
            allowed[row, 0, :, :end] = masks[row].to(head.device)
    keys = torch.stack([runtime.k[:, :span] for runtime in runtimes])  # (B, Hkv, span, hd)
    values = torch.stack([runtime.v[:, :span] for runtime in runtimes])
    out = F.scaled_dot_product_attention(q.view(b, n, H, hd).transpose(1, 2), keys, values, attn_mask=allowed,
                                         enable_gqa=H != Hkv)  # (B, H, n, hd)
    x = residual + head.o(out.transpose(1, 2).reshape(b * n, H * hd))
    gate, up = head.gate_up(head.post_norm(x)).chunk(2, dim=-1)
    return (x + head.down(F.silu(gate) * up)).view(b, n, -1)


def propose_many(drafters, states: Sequence[DraftState]) -> list[Candidates]:
    """What each `drafters[i].propose(states[i])` proposes, drafted in batched head forwards.
    The drafters come from one configuration (same head, mode, depth, top_k, total_tokens)."""
    features = torch.stack([drafter.catch_up(state) for drafter, state in zip(drafters, states)])  # (B, D)
    if drafters[0].mode == "chain":
        return _chains(drafters, states, features)
    nodes = expand_many(drafters, states, features)
    return [select_tree(*node_lists, drafter.total_tokens - 1) for node_lists, drafter in zip(nodes, drafters)]


def _chains(drafters, states: Sequence[DraftState], features: torch.Tensor) -> list[Candidates]:
    first, b = drafters[0], len(drafters)
    greedy = states[0].sampling.greedy
    tokens, rows = [[] for _ in range(b)], [[] for _ in range(b)]
    for i in range(first.depth):
        logits = first.runtime.logits(features)  # (B, Vd)
        if greedy:
            chosen = first._token_ids(logits.argmax(-1)).tolist()
        else:
            chosen = []
            for row, state in enumerate(states):
                q = probabilities(logits[row], state.sampling)
                chosen.append(int(first._token_ids(torch.tensor(sample(q, state.generator)))))
                rows[row].append(first._full_distribution(q))
        for row, token in enumerate(chosen):
            tokens[row].append(token)
        if i + 1 < first.depth:
            embeds = first._embed(torch.tensor(chosen))[:, None]  # (B, 1, D)
            positions = torch.tensor([[state.tokens.shape[0] - 1 + i] for state in states])
            features = draft_many([d.runtime for d in drafters], embeds, features[:, None], positions)[:, 0]
    return [Candidates.chain(t, None if greedy else torch.stack(r), deterministic=greedy) for t, r in zip(tokens, rows)]


def expand_many(drafters, states: Sequence[DraftState], features: torch.Tensor) -> list[tuple]:
    """`EagleDrafter.expand` for each sequence, every level's head forward batched. features:
    (B, D) the heads' outputs at each sequence's position T-2. Returns per sequence (tokens,
    parents, scores, depths)."""
    first, b, top_k = drafters[0], len(drafters), drafters[0].top_k
    logp = torch.log_softmax(first.runtime.logits(features), dim=-1)  # (B, Vd)
    scores, tokens = logp.topk(top_k, dim=-1)
    tokens = first._token_ids(tokens)
    node_tokens, node_scores = tokens.tolist(), scores.tolist()
    node_parents = [[-1] * top_k for _ in range(b)]
    node_depths = [[1] * top_k for _ in range(b)]
    node_slots: list[dict[int, int]] = [{} for _ in range(b)]
    frontiers = [list(range(top_k)) for _ in range(b)]
    frontier_features = features[:, None].expand(b, top_k, -1)  # (B, K, D)
    for depth in range(2, min(first.depth, first.total_tokens - 1) + 1):
        masks = []
        for row, drafter in enumerate(drafters):
            committed, drafted, slots = drafter.cache_length, len(node_slots[row]), node_slots[row]
            mask = torch.zeros(top_k, committed + drafted + top_k, dtype=torch.bool)
            mask[:, :committed] = True
            for index, node in enumerate(frontiers[row]):
                parent = node_parents[row][node]
                while parent >= 0:
                    mask[index, committed + slots[parent]] = True
                    parent = node_parents[row][parent]
                mask[index, committed + drafted + index] = True
                slots[node] = drafted + index
            masks.append(mask)
        embeds = first._embed(torch.tensor([[node_tokens[row][i] for i in frontiers[row]] for row in range(b)]))
        positions = torch.tensor([[state.tokens.shape[0] + depth - 3] * top_k for state in states])
        out = draft_many([d.runtime for d in drafters], embeds, frontier_features, positions, masks)  # (B, K, D)
        logp = torch.log_softmax(first.runtime.logits(out.reshape(b * top_k, -1)), dim=-1).view(b, top_k, -1)
        child_scores, child_tokens = logp.topk(top_k, dim=-1)  # (B, K, K)
        child_tokens = first._token_ids(child_tokens)
        frontier_scores = torch.tensor([[node_scores[row][i] for i in frontiers[row]] for row in range(b)])
        cumulative = frontier_scores[:, :, None] + child_scores  # (B, K, K)
        best = cumulative.flatten(1).topk(top_k, dim=-1).indices  # (B, K)
        for row in range(b):
            start = len(node_tokens[row])
            for index, parent in enumerate(frontiers[row]):
                node_tokens[row].extend(child_tokens[row, index].tolist())
                node_scores[row].extend(cumulative[row, index].tolist())
                node_parents[row].extend([parent] * top_k)
                node_depths[row].extend([depth] * top_k)
            frontiers[row] = [start + int(i) for i in best[row]]
        frontier_features = out[torch.arange(b)[:, None], best // top_k]  # (B, K, D)
    return [(node_tokens[r], node_parents[r], node_scores[r], node_depths[r]) for r in range(b)]
