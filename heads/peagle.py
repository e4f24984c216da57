"""P-EAGLE draft model: the EAGLE-3 head (heads/eagle3.py) plus a learned `mask_hidden`, drafting
K tokens in one forward (FORMATS.md "P-EAGLE").

One draft pass, after the committed rows (x_{t+1}, fc(aux_t)) of every verified position t:
- slot 0 is the last committed row itself: the bonus token with fc(aux) of the last verified
  position; its output scores the first draft;
- slots 1..K-1 read `mask_token_id` and fc(mask_hidden) at the next consecutive positions, under
  causal attention; slot d's output scores the draft d positions further on.
No slot reads a drafted token, so all K drafts come from the same forward.

The embedding stays the target's, frozen and passed in as for EAGLE-3, although the reference
trainer trains a copy (`embed_requires_grad: true`): the depth-0 rows read real tokens, for which
the target's embedding is the right input; the mask slots' learned input is `mask_hidden` (through
fc), so a trainable mask-token row adds little; and a trained copy of a V x D embedding would be
most of the head's parameters and optimizer state (525M of them for Llama-3-8B). The export writes
`embed_requires_grad: false` and the target's embedding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from heads.eagle3 import Eagle3Config, Eagle3Head


@dataclass
class PeagleConfig(Eagle3Config):
    mask_token_id: int = 0  # the token every slot after the first reads (SmolLM2: <|endoftext|>)
    speculative_tokens: int = 8  # K: tokens one draft pass proposes (the reference trainer's num_depths)

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"PeagleConfig.mask_token_id={self.mask_token_id} must lie in [0, {self.vocab_size})")
        if self.speculative_tokens < 1:
            raise ValueError(f"PeagleConfig.speculative_tokens={self.speculative_tokens} must be >= 1")


class PeagleHead(Eagle3Head):
    """Eagle3Head's weights plus `mask_hidden` (1, 1, n·Ht): the aux input of every mask slot."""

    def __init__(self, config: PeagleConfig):
        super().__init__(config)
        # As the reference initialises it; training moves it where fc maps it to a useful input.
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, len(config.aux_layer_ids) * config.target_hidden_size))

    def mask_state(self) -> torch.Tensor:
        """(D,) the hidden input of a mask slot: project(mask_hidden), through fc's own norms."""
        return self.project(self.mask_hidden)[0, 0]

    def slot_inputs(self, embed, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs of `count` mask slots: (embeds (count, D), hidden (count, D)); `embed` maps
        token ids to the target's embeddings."""
        token = torch.full((count,), self.config.mask_token_id, dtype=torch.long, device=self.mask_hidden.device)
        hidden = self.mask_state().to(dtype).expand(count, -1)
        return embed(token).to(dtype), hidden


def slot_attention_mask(anchors: torch.Tensor, depths: torch.Tensor, context: int) -> torch.Tensor:
    """The block mask of P-EAGLE's mask rows, dense (our sizes allow it): row i is chain
    anchors[i] at depth depths[i] >= 1; it sees the committed rows s <= anchor (s < `context`)
    and the rows of its own chain at depths <= its own. anchors, depths (B, M) long; an anchor
    of -1 marks a padding row (it sees only padding rows, so no row is empty). Returns bool
    (B, 1, M, context + M)."""
    keys = torch.arange(context, device=anchors.device)
    committed = keys <= anchors[..., None]  # (B, M, context)
    own = (anchors[..., :, None] == anchors[..., None, :]) & (depths[..., None, :] <= depths[..., :, None])
    return torch.cat([committed, own], -1)[:, None]
