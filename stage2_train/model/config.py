"""The model room's config sections: the drafter and its loss. No torch here, so `check` and the
doctor validate a config without loading it.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from shared.config import Section

RECIPE_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def recipe_gamma(block_size: int) -> float | None:
    """The published gamma for a block size, or None where the paper gives none."""
    return RECIPE_GAMMA.get(block_size)


VARIANTS = ("dflash", "dspark", "dflash2")


# The model fields each variant reads (the others' are inert there; a drafter's description holds only its own).
VARIANT_FIELDS = {
    "dflash": (),
    "dspark": ("markov_rank", "markov_head", "confidence_head"),
    "dflash2": ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"),
}
# The loss fields only one variant reads.
VARIANT_LOSS_FIELDS = {"dspark": ("confidence_weight",), "dflash2": ("selector_weight", "selector_misses")}


class DrafterConfig(Section):
    section: ClassVar[str] = "model"
    variant: Literal["dflash", "dspark", "dflash2"] = "dflash"
    """dflash: the published drafter (slot k predicts anchor + k, B - 1 drafts). dspark (speculators /
    DeepSpec): the DFlash backbone plus a Markov head (a low-rank logit bias from the previous token of
    the block) and a confidence head (each slot's chance of acceptance); slot k predicts anchor + k + 1,
    so a block drafts B tokens. dflash2 (z-lab / speculators): grouped dynamic convolutions over the
    block around attention and MLP in every layer, and a candidate selector that reranks each slot's
    top candidates given the token before it (model/dspark.py, model/dflash2.py)."""
    num_layers: int = 1
    """5 for the published Qwen3-8B drafter."""
    block_size: int = 16
    """Tokens per drafted block, the anchor included (16 drafts 15; published drafters: 16)."""
    intermediate_size: int | None = None
    """None: the target's."""
    attention: Literal["auto", "sdpa", "flex", "eager"] = "auto"
    """Auto: flex on CUDA, else sdpa."""
    attention_chunk_blocks: int = 64
    """Sdpa/eager: blocks per attention call (bounds the mask size)."""
    layer_types: tuple[str, ...] | None = None
    """Per drafter layer "full_attention" or "sliding_attention" (z-lab's and SpecForge's field);
    null = every layer full. speculators trains every layer sliding by default."""
    sliding_window: int | None = None
    """W of the sliding layers: the query at absolute position a + i sees keys k with (a + i) - k < W
    (its own included), so W - 1 - i context tokens at most (z-lab, SpecForge)."""
    is_causal: bool | None = None
    """z-lab's top-level field: null = sliding layers causal inside the block, full layers
    bidirectional; true / false = every layer causal / bidirectional inside the block."""
    feature_projection: Literal["none", "pca"] = "none"
    """none: fc reads the full concatenated target features; pca: a fixed basis P fitted on the training
    split projects them to projection_dim values first (fc reads P x; export folds P into fc, so what
    is served is a standard drafter): the stage-2 prototype of a projected store (data/projection.py)."""
    projection_dim: int | None = None
    """r, the basis' rank; null = the target's hidden size (F / r = the number of feature layers)."""
    projection_scale: Literal["none", "rms"] = "rms"
    """Per-dimension scale before the eigendecomposition (P = U^T S^-1): rms keeps a few massive
    outlier dimensions of the hidden states from taking the basis."""
    projection_fit_tokens: int = 4_000_000
    """Tokens of the training split the basis is fitted on (a seeded sample of it when it holds more),
    shared by the ranks: the fit's cost grows with tokens x F^2 (F = 20,480 at Qwen3-8B: ~0.2 PFLOP a
    rank of 8 at the default, seconds on a GPU; the whole of a 300K-sample split would take days)."""
    init_std: float = 0.02
    """Qwen3 initializer_range."""
    activation_checkpointing: bool = False
    """Keep only each layer's input for backward and recompute the rest: at 4096 wide a block row saves ~0.6 MB per layer otherwise, so a micro-batch of 16K tokens x 512 anchors needs it."""
    init: Literal["random", "target_layers"] = "random"
    """random (std init_std, the recipe), or target_layers: each drafter layer starts as one of the
    target's last decoder layers, the final norm as the target's, and fc passes the deepest feature
    layer through (a warm start: the drafter begins as the target's top applied to its own features)."""
    init_from: str | None = None
    """A drafter folder (exported here, or published by z-lab / SpecForge / speculators) to start training
    from instead of a random init, or a training checkpoint's step folder; checked against the target's
    hidden size, layer ids, mask token, variant and weights."""
    allow_other_target: bool = False
    """eval, export and model.init_from refuse a drafter recorded as trained against other target
    weights than target.path's (another model or revision of the same shape); true uses it anyway
    (the export then records both: the drafter's target and this one)."""
    markov_rank: int = 256
    """dspark: r of the Markov head's bias W2 W1[previous token] (speculators' markov_rank)."""
    markov_head: Literal["vanilla", "gated", "rnn"] = "vanilla"
    """dspark: vanilla (the bias of the previous token), gated (gated by the slot's hidden state) or rnn
    (a state carried along the block); vLLM serves vanilla only."""
    confidence_head: bool = True
    """dspark: a linear head on [hidden ; W1[previous token]] predicting each slot's acceptance."""
    conv_kernel_size: int = 2
    """dflash2: taps of each grouped dynamic convolution over the block's slots (<= block_size)."""
    conv_group_size: int = 16
    """dflash2: hidden channels sharing one dynamic coefficient (must divide the hidden size)."""
    selector_rank: int = 256
    """dflash2: r of the candidate selector's codebooks."""
    selector_top_k: int = 16
    """dflash2: candidates per slot the selector reranks (the drafter's own top-k)."""

    def validate(self) -> None:
        self.require(self.num_layers >= 1, "num_layers", "must be >= 1")
        self.require(
            2 <= self.block_size <= 256, "block_size", "must be in 2..256 (slot 0 is never scored; published: 16)"
        )
        self.require(
            self.intermediate_size is None or self.intermediate_size >= 1,
            "intermediate_size",
            "must be >= 1 or null (the target's)",
        )
        self.require(self.attention_chunk_blocks >= 1, "attention_chunk_blocks", "must be >= 1")
        if self.layer_types is not None:
            self.require(len(self.layer_types) == self.num_layers, "layer_types", f"must list one type per layer ({self.num_layers})")
            self.require(
                set(self.layer_types) <= {"full_attention", "sliding_attention"},
                "layer_types",
                "may hold only full_attention and sliding_attention",
            )
        self.require(self.projection_dim is None or self.projection_dim >= 1, "projection_dim", "must be >= 1 or null")
        self.require(self.projection_fit_tokens >= 1, "projection_fit_tokens", "must be >= 1")
        sliding = self.layer_types is not None and "sliding_attention" in self.layer_types
        self.require(
            not sliding or (self.sliding_window is not None and self.sliding_window >= 1),
            "sliding_window",
            "must be >= 1 when a layer is sliding_attention",
        )
        self.require(0 < self.init_std < 1, "init_std", "must be in (0, 1)")
        self.require(self.markov_rank >= 1, "markov_rank", "must be >= 1")
        self.require(
            1 <= self.conv_kernel_size <= self.block_size, "conv_kernel_size", f"must be in 1..model.block_size ({self.block_size})"
        )
        self.require(self.conv_group_size >= 1, "conv_group_size", "must be >= 1 (and divide the target's hidden size)")
        self.require(self.selector_rank >= 1, "selector_rank", "must be >= 1")
        self.require(self.selector_top_k >= 1, "selector_top_k", "must be >= 1")

    @property
    def label_shift(self) -> int:
        """0: slot k predicts the token at anchor + k (slot 0 unscored); 1 (dspark): anchor + k + 1."""
        return 1 if self.variant == "dspark" else 0

    @property
    def reads_topk(self) -> bool:
        """Whether the variant's heads train on the stored top-k (dspark's confidence target, dflash2's
        selector label: the target's top-1); the loss may read it too (`LossConfig.needs_topk`)."""
        return self.variant == "dflash2" or (self.variant == "dspark" and self.confidence_head)

    def recipe_warnings(self) -> list[str]:
        out = []
        if self.variant != "dflash":
            out.append(f"model.variant={self.variant}: the published recipe trains dflash")
        if self.block_size != 16:
            out.append(f"model.block_size={self.block_size}: the published DFlash drafters use 16")
        if self.layer_types is not None and "sliding_attention" in self.layer_types:
            out.append(
                f"model.layer_types={list(self.layer_types)}, sliding_window={self.sliding_window}: sliding-window layers "
                f"(z-lab / SpecForge semantics); the published recipe is every layer full"
            )
            if self.sliding_window is not None and self.sliding_window < self.block_size:
                out.append(
                    f"model.sliding_window={self.sliding_window} < block_size={self.block_size}: z-lab windows the block's "
                    f"own slots too (followed here), SpecForge does not, so the two serve such a drafter differently"
                )
        sliding = self.layer_types is not None and "sliding_attention" in self.layer_types
        if self.variant == "dspark" and (sliding or self.is_causal):
            # Found otherwise only by `export`, after the training: z-lab's layout has no DSpark, and speculators'
            # windows sliding layers at the anchor and has no is_causal (serve/export.py refuses both).
            out.append(
                f"model.variant=dspark with {'sliding_attention layers' if sliding else 'model.is_causal=true'}: no export "
                f"layout carries this drafter (z-lab's has no DSpark; speculators' computes sliding layers another way and "
                f"has no is_causal), so `python -m stage2_train export` will refuse it; train full-attention layers with model.is_causal unset to serve it"
            )
        return out

    def alternatives(self) -> list[str]:
        out = []
        if self.variant == "dflash":
            out.append(
                "model.variant=dflash2: tau +0.062 [+0.029, +0.096] over DFlash at equal steps on the CPU default and "
                "+0.138 [+0.092, +0.193] on cpu-long, with 6.6x the trained parameters and ~1.9x the step time there; "
                "dspark +0.025 [-0.004, +0.057] (noise) and +0.086 [+0.047, +0.128] "
                "(BENCHMARKS.md \"variants\", \"variants_long\"; docs/variants.md)"
            )
        if self.layer_types is None or "sliding_attention" not in self.layer_types:
            out.append(
                "model.layer_types=[sliding_attention, ..., full_attention] + model.sliding_window: attention cost "
                "falls with W on long contexts (0.43x score pairs at 8K context, W=2048; BENCHMARKS.md \"attention\"); "
                "tau +0.025 [+0.003, +0.047] with W=64 on the CPU default (\"levers\")"
            )
        if self.feature_projection == "none":
            out.append(
                "model.feature_projection=pca: measure whether a store projected to r values would do "
                "(bench/projection.py); it lost 0.07 of tau at r=H on the CPU default"
            )
        return out


class LossConfig(Section):
    section: ClassVar[str] = "loss"
    renamed: ClassVar[dict[str, str]] = {"ce_chunk": "ce_chunk_blocks"}
    gamma: float = 7.0
    """Position decay; 7 for B=16 (5 for B=10, 4 for B=8)."""
    ce_weight: float = 1.0
    """Weight of cross-entropy against the stored next token."""
    kl_weight: float = 0.0
    """Top-k KL against the stored target distribution; 0 in the recipe."""
    ce_chunk_blocks: int = 128
    """Blocks per LM-head chunk (Qwen3, V=151936: 128*16 rows ~ 1.2 GB fp32)."""
    full_vocab_slots: int | None = None
    """Slots 1..N get the softmax over the whole vocabulary; later slots a softmax over the stored
    top-k candidates of the target (and the label), ~1000x cheaper at a 50-150K vocab. null = every
    slot full (the recipe). Needs a store with top-k."""
    weighting: Literal["decay", "dpace"] = "decay"
    """Slot weights: decay = exp(-(k-1)/gamma) (the recipe); dpace = D-PACE (arXiv 2605.18810): each
    slot weighs the detached chance that the drafts before it and after it are accepted."""
    dpace_alpha: float = 0.5
    """D-PACE smoothing: s_k = (1 - alpha) * exp(-CE_k) + alpha (0.5 in speculators and SpecForge)."""
    distill_positions: Literal["assistant", "all"] = "assistant"
    """Where blocks are anchored and scored: assistant tokens only (the recipe), or every position the
    target read (prompts and template too). The extra slots get only the KL term against the stored
    top-k: their labels are the data's text, not the target's own samples, so cross-entropy stays on
    the assistant tokens. Needs loss.kl_weight > 0."""
    confidence_weight: float = 1.0
    """dspark: weight of the confidence head's BCE against each slot's acceptance estimate
    (speculators' confidence_head_alpha, 1.0). The estimate is sum over the stored top-k of
    min(p_target, q_drafter), a lower bound of speculators' full-vocabulary 1 - TV (README)."""
    selector_weight: float = 1.0
    """dflash2: weight of the selector's cross-entropy over each slot's top candidates
    (speculators' selector_loss_alpha, 1.0); its label is the target's own top-1 token."""
    selector_misses: Literal["inject", "drop"] = "inject"
    """dflash2: when the target's top-1 is not among the drafter's top candidates, put it in place of
    the weakest one (inject: speculators) or give that slot no selector loss (drop: SpecForge)."""

    def validate(self) -> None:
        self.require(self.confidence_weight >= 0, "confidence_weight", "must be >= 0")
        self.require(self.selector_weight >= 0, "selector_weight", "must be >= 0")
        self.require(self.gamma > 0 and math.isfinite(self.gamma), "gamma", "must be a finite number > 0")
        self.require(self.ce_weight >= 0, "ce_weight", "must be >= 0")
        self.require(self.kl_weight >= 0, "kl_weight", "must be >= 0")
        self.require(
            self.ce_weight + self.kl_weight > 0, "ce_weight", "and loss.kl_weight must not both be 0"
        )
        self.require(self.ce_chunk_blocks >= 1, "ce_chunk_blocks", "must be >= 1")
        self.require(
            self.full_vocab_slots is None or self.full_vocab_slots >= 0, "full_vocab_slots", "must be >= 0 or null"
        )
        self.require(0.0 < self.dpace_alpha <= 1.0, "dpace_alpha", "must be in (0, 1]")
        self.require(
            self.distill_positions == "assistant" or self.kl_weight > 0,
            "distill_positions",
            "=all scores prompt slots by the KL term only: set loss.kl_weight > 0",
        )

    @property
    def needs_topk(self) -> bool:
        """Whether the loss reads the stored top-k (the KL term, or candidate softmax slots). The
        variants read it too: `needs_topk(model, loss)`."""
        return self.kl_weight > 0 or self.full_vocab_slots is not None

    def recipe_warnings(self, block_size: int | None = None) -> list[str]:
        """Departures from the recipe; the gamma check needs model.block_size."""
        warnings = []
        if self.kl_weight > 0 or self.ce_weight != 1.0:
            warnings.append(
                f"loss.ce_weight={self.ce_weight}, loss.kl_weight={self.kl_weight}: the recipe trains CE only (1, 0)"
            )
        if self.weighting != "decay":
            warnings.append(f"loss.weighting={self.weighting} (alpha {self.dpace_alpha}): the recipe weights slots by exp(-(k-1)/gamma)")
        if self.distill_positions != "assistant":
            warnings.append("loss.distill_positions=all: blocks on prompt text too (KL only there); the recipe scores assistant tokens")
        if self.full_vocab_slots is not None:
            warnings.append(
                f"loss.full_vocab_slots={self.full_vocab_slots}: slots past it use a top-k candidate softmax; "
                f"the recipe scores every slot over the full vocabulary"
            )
        return warnings + (self.gamma_warnings(block_size) if block_size is not None else [])

    def gamma_warnings(self, block_size: int) -> list[str]:
        """gamma against the published value for `block_size` (model.block_size)."""
        expected = recipe_gamma(block_size)
        if expected is None:
            return [
                f"loss.gamma={self.gamma}: no published gamma for model.block_size={block_size} "
                f"(published: {', '.join(f'B={b}: {g:g}' for b, g in RECIPE_GAMMA.items())})"
            ]
        if self.gamma != expected:
            return [f"loss.gamma={self.gamma:g} departs from the recipe: {expected:g} for model.block_size={block_size}"]
        return []

    def alternatives(self) -> list[str]:
        out = []
        if self.weighting == "decay":
            out.append(
                "loss.weighting=dpace: online tau +0.11 [+0.08, +0.14] over decay on the CPU default (BENCHMARKS.md "
                "\"levers\"); speculators reports mean accepted length 2.484 -> 2.617 on Qwen3-8B (its PR #736)"
            )
        if self.distill_positions == "assistant":
            out.append("loss.distill_positions=all: KL on prompt text too; +0.003 [-0.018, +0.024] on the CPU default (noise)")
        return out
