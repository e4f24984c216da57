"""Head-group settings (the `heads` config group): which head to build and its shape options.

The full rebuildable description of a trained head (sizes + target fingerprint) lives in each
head's own config dataclass (`heads.eagle.EagleConfig`, `heads.eagle3.Eagle3Config`,
`heads.medusa.MedusaConfig`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from heads.checks import choice, fraction, positive

HEAD_TYPES = ("eagle", "eagle3", "medusa", "dflash", "peagle")  # heads.io maps each to its config and module
INIT_FC = ("feature", "random", "ridge")  # heads.eagle.init_from_target's fc starts
EAGLE3_INIT_FC = ("random", "ridge")  # heads.eagle3's fc starts


@dataclass
class MedusaOptions:
    num_heads: int = 4
    num_layers: int = 1
    share_lm_head: bool = False  # True: use the target's frozen lm_head instead of K trainable copies
    loss_decay: float = 0.8  # head k weighs decay**k; 1.0 reproduces FasterDecoding

    def check(self, key: str = "heads.medusa") -> None:
        positive(f"{key}.num_heads", self.num_heads)
        positive(f"{key}.num_layers", self.num_layers)
        fraction(f"{key}.loss_decay", self.loss_decay)


@dataclass
class EagleOptions:
    fc_bias: bool = False  # vLLM's EAGLE fc has no bias
    feature_loss_weight: float = 1.0  # SmoothL1 on the predicted feature
    logit_loss_weight: float = 0.1  # soft cross-entropy against the target's distribution
    input_noise: float = 0.2  # uniform noise U(-a/2, a/2) added to input features in training
    eval_steps: int = 4  # held-out evaluation feeds the head its own predictions this many steps
    init_layer: int | None = -1  # start the decoder layer from this target layer; None: random init
    init_fc: str = "feature"  # feature: fc = [0 | I] (passes f_t through) | random | ridge (fitted on data)
    ridge_tokens: int = 20000  # init_fc=ridge: positions the linear fit uses
    ridge_penalty: float = 1e-3  # init_fc=ridge: L2 penalty per position
    train_steps: int = 1  # >1: unroll the head on its own outputs in training (EAGLE-3's training-time test)
    unroll_loss_decay: float = 0.8  # step j of the unroll weighs decay**j
    fc_learning_rate_scale: float = 1.0  # fc trains at this fraction of trainer.learning_rate

    def check(self, key: str = "heads.eagle") -> None:
        for name in ("feature_loss_weight", "logit_loss_weight", "input_noise", "ridge_penalty", "unroll_loss_decay",
                     "fc_learning_rate_scale"):
            positive(f"{key}.{name}", getattr(self, name), allow_zero=True)
        for name in ("eval_steps", "ridge_tokens", "train_steps"):
            positive(f"{key}.{name}", getattr(self, name))
        choice(f"{key}.init_fc", self.init_fc, INIT_FC)


@dataclass
class Eagle3Options:
    # target streams fc reads, in transformers' hidden_states numbering (i = the stream entering
    # decoder layer i; vLLM's convention); None: [2, L//2, L-3]
    aux_layer_ids: list[int] | None = None
    ttt_steps: int = 3  # training-time test: steps unrolled on the head's own outputs
    loss_decay: float = 0.8  # unrolled step j weighs decay**j
    norm_before_residual: bool = False  # True: the decoder layer's residual is hidden_norm(h)
    # EAGLE-3.1 (speculators' names): fc reads RMS-normalised aux streams, one norm over all
    # (norm_before_fc) or one per stream (fc_norm; not both); norm_output: step k > 0 reads the
    # normed output of step k-1, the state the draft scores, instead of its pre-norm output
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    eval_steps: int = 4  # held-out evaluation drafts this many steps on the head's own outputs
    # random | ridge: fc fitted in closed form so the head starts as the linear map aux_t -> the
    # target's next state (its attention and MLP outputs zeroed), on the first ridge_tokens positions
    init_fc: str = "random"
    ridge_tokens: int = 20000
    ridge_penalty: float = 1e-3
    fc_learning_rate_scale: float = 1.0  # fc trains at this fraction of trainer.learning_rate

    def check(self, key: str = "heads.eagle3") -> None:
        positive(f"{key}.ttt_steps", self.ttt_steps)
        positive(f"{key}.eval_steps", self.eval_steps)
        positive(f"{key}.ridge_tokens", self.ridge_tokens)
        positive(f"{key}.ridge_penalty", self.ridge_penalty, allow_zero=True)
        positive(f"{key}.fc_learning_rate_scale", self.fc_learning_rate_scale, allow_zero=True)
        choice(f"{key}.init_fc", self.init_fc, EAGLE3_INIT_FC)
        fraction(f"{key}.loss_decay", self.loss_decay)
        if self.norm_before_fc and self.fc_norm:
            raise ValueError(f"{key}.norm_before_fc and {key}.fc_norm are exclusive: one RMSNorm over all aux "
                             "streams, or one per stream; set one of them")
        if self.aux_layer_ids is not None and not self.aux_layer_ids:
            raise ValueError(f"{key}.aux_layer_ids is empty: EAGLE-3 reads at least one target layer "
                             "(null: the default [2, L//2, L-3])")


@dataclass
class DflashOptions:
    aux_layer_ids: list[int] | None = None  # as heads.eagle3.aux_layer_ids; None: [2, L//2, L-3]
    num_layers: int = 1  # L_d draft decoder layers
    block_size: int = 16  # B: the anchor plus B-1 drafted tokens, proposed in one forward
    mask_token_id: int = 0  # the token of the B-1 slots to fill (SmolLM2: <|endoftext|>)
    max_anchors: int = 512  # blocks per sequence and step, drawn at random among loss positions
    dpace_alpha: float = 0.5  # slot weights: prefix products of (1-a)·exp(-CE) + a, summed to the end
    eval_anchors: int = 64  # blocks per held-out sequence (a fixed draw, the same at every evaluation)

    def check(self, key: str = "heads.dflash") -> None:
        for name in ("num_layers", "max_anchors", "eval_anchors"):
            positive(f"{key}.{name}", getattr(self, name))
        positive(f"{key}.mask_token_id", self.mask_token_id, allow_zero=True)
        fraction(f"{key}.dpace_alpha", self.dpace_alpha)
        if self.block_size < 2:
            raise ValueError(f"{key}.block_size={self.block_size}: a block is the anchor plus at least one "
                             "drafted token")
        if self.aux_layer_ids is not None and not self.aux_layer_ids:
            raise ValueError(f"{key}.aux_layer_ids is empty: DFlash reads at least one target layer "
                             "(null: the default [2, L//2, L-3])")


@dataclass
class PeagleOptions:
    """P-EAGLE (heads/peagle.py): the EAGLE-3 head drafting K tokens in one forward, trained as
    speculators trains it (train/peagle_objective.py)."""
    aux_layer_ids: list[int] | None = None  # as heads.eagle3.aux_layer_ids; None: [2, L//2, L-3]
    speculative_tokens: int = 8  # K: the bonus slot plus K-1 mask slots (the reference's num_depths)
    mask_token_id: int = 0  # the token of the mask slots (SmolLM2: <|endoftext|>)
    norm_before_residual: bool = True  # the reference trainer's default for peagle
    # COD sampling: depth d >= 1 keeps max(ratio**d, ratio_min) x (seeds - d) chains of the
    # surviving ones; seeds: at most max_anchors loss positions per sequence
    down_sample_ratio: float = 0.7
    down_sample_ratio_min: float = 0.2
    max_anchors: int = 512
    eval_anchors: int = 64  # held-out chains scored per forward (all chains are scored, this many at a time)
    init_fc: str = "random"  # random | ridge: as heads.eagle3.init_fc (slot 0 starts as the linear fit)
    ridge_tokens: int = 20000
    ridge_penalty: float = 1e-3
    fc_learning_rate_scale: float = 1.0  # fc trains at this fraction of trainer.learning_rate
    # Every weight but mask_hidden (the EAGLE-3 head's own) trains at this fraction of
    # trainer.learning_rate, fc at this times fc_learning_rate_scale: below 1 when trainer.init_from
    # starts the head from a trained EAGLE-3 head, whose slot 0 the mask slots' updates would wear down
    eagle3_learning_rate_scale: float = 1.0

    def check(self, key: str = "heads.peagle") -> None:
        for name in ("speculative_tokens", "max_anchors", "eval_anchors", "ridge_tokens"):
            positive(f"{key}.{name}", getattr(self, name))
        positive(f"{key}.mask_token_id", self.mask_token_id, allow_zero=True)
        positive(f"{key}.ridge_penalty", self.ridge_penalty, allow_zero=True)
        positive(f"{key}.fc_learning_rate_scale", self.fc_learning_rate_scale, allow_zero=True)
        positive(f"{key}.eagle3_learning_rate_scale", self.eagle3_learning_rate_scale, allow_zero=True)
        fraction(f"{key}.down_sample_ratio", self.down_sample_ratio)
        fraction(f"{key}.down_sample_ratio_min", self.down_sample_ratio_min)
        choice(f"{key}.init_fc", self.init_fc, EAGLE3_INIT_FC)
        if self.aux_layer_ids is not None and not self.aux_layer_ids:
            raise ValueError(f"{key}.aux_layer_ids is empty: P-EAGLE reads at least one target layer "
                             "(null: the default [2, L//2, L-3])")


@dataclass
class HeadsConfig:
    type: str = "eagle"  # eagle | eagle3 | medusa
    hidden_size: int | None = None  # None: the target's; set only to check a recipe
    # Every kind's draft vocabulary: the N most frequent tokens at the training split's loss positions,
    # counted once and stored in the head (0: the full vocabulary). The loss scores it (EAGLE's logit
    # loss, Medusa's cross-entropy, EAGLE-3's lm_head has N rows) and the drafters draft over it.
    draft_vocab_size: int = 0
    medusa: MedusaOptions = field(default_factory=MedusaOptions)
    eagle: EagleOptions = field(default_factory=EagleOptions)
    eagle3: Eagle3Options = field(default_factory=Eagle3Options)
    dflash: DflashOptions = field(default_factory=DflashOptions)
    peagle: PeagleOptions = field(default_factory=PeagleOptions)

    def check(self) -> None:
        """Each field's own rule; raises ValueError naming the key."""
        choice("heads.type", self.type, HEAD_TYPES)
        positive("heads.draft_vocab_size", self.draft_vocab_size, allow_zero=True)
        self.medusa.check()
        self.eagle.check()
        self.eagle3.check()
        self.dflash.check()
        self.peagle.check()
