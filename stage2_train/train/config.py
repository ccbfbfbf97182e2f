"""The train room's config sections: the run, the optimizer and its schedule, feature noise,
checkpoints and the held-out evaluation. No torch here, so `check` and the doctor validate a config
without loading it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import ClassVar, Literal

from shared.config import Section
from shared.paths import RunPaths

RECIPE_BETAS = (0.9, 0.999)


class TrainConfig(Section):
    section: ClassVar[str] = "train"
    renamed: ClassVar[dict[str, str]] = {"prefetch": "prefetch_micro_batches"}
    epochs: int = 6
    """Passes over the training split (recipe: 6)."""
    max_steps: int | None = None
    """At most this many optimizer steps (the LR schedule spans them); null = every epoch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank (gradients accumulate; one update per step)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when torch sees a GPU, else CPU."""
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """auto: bf16 autocast on GPU, fp32 on CPU."""
    num_data_threads: int = 2
    """Loader threads per rank."""
    prefetch_micro_batches: int = 4
    """Micro-batches prepared ahead per rank."""
    cpu_threads: int = 0
    """Torch intra-op threads when training on CPU; 0 = torch's default."""
    resume: str = "auto"
    """auto: the newest checkpoint that verifies, if any; never; or a checkpoint path."""
    resume_force: bool = False
    """Resume even when block size, gamma, layers, batch or ranks changed."""
    max_nonfinite_steps: int = 3
    """Optimizer steps in a row with a non-finite loss or gradient norm (each skipped) before the run stops."""
    allow_stale_store: bool = False
    """Train on a store that `python -m stage1_extract status` calls stale against this config (edited
    rows, another chat template, top_k or max_length, generated answers from other prompts). Refused by
    default, naming the shards and `reprocess`; when set, the run logs a `stale_store` event saying what differs."""

    def validate(self) -> None:
        self.require(self.epochs >= 1, "epochs", "must be >= 1")
        self.require(self.max_steps is None or self.max_steps >= 1, "max_steps", "must be >= 1 or null")
        self.require(self.grad_accum >= 1, "grad_accum", "must be >= 1")
        self.require(self.num_data_threads >= 1, "num_data_threads", "must be >= 1")
        self.require(self.prefetch_micro_batches >= 1, "prefetch_micro_batches", "must be >= 1")
        self.require(self.cpu_threads >= 0, "cpu_threads", "must be >= 0")
        self.require(bool(self.resume), "resume", "must be auto, never, or a checkpoint path")
        self.require(self.max_nonfinite_steps >= 0, "max_nonfinite_steps", "must be >= 0")

    def recipe_warnings(self) -> list[str]:
        if self.epochs != 6:
            return [f"train.epochs={self.epochs} departs from the recipe (6)"]
        return []


class OptimConfig(Section):
    section: ClassVar[str] = "optim"
    name: Literal["adamw", "muon"] = "adamw"
    """adamw (the recipe), or muon: torch.optim.Muon for the 2-D weight matrices, AdamW for the norms
    (speculators' split: every trainable matrix with min(shape) > 1 except those indexed by token id,
    DSpark's Markov factors and DFlash2's codebooks, which AdamW trains at Muon's lr and decay)."""
    lr: float = 6e-4
    """Peak learning rate of AdamW (recipe: 6e-4)."""
    betas: tuple[float, float] = RECIPE_BETAS
    """AdamW betas (recipe: 0.9, 0.999)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (recipe: 0)."""
    warmup_ratio: float = 0.04
    """Share of the run's optimizer steps spent warming up linearly."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup."""
    min_lr_ratio: float = 0.0
    """The decay ends at lr * min_lr_ratio."""
    grad_clip: float = 1.0
    """Max global L2 norm of the gradients."""
    muon_lr: float | None = None
    """Muon's peak lr; null = optim.lr (with muon_adjust_lr=match_rms_adamw the update's RMS then
    matches AdamW's at that lr, which is why speculators 0.9.0 uses one lr for both)."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov)."""
    muon_weight_decay: float = 0.1
    """Muon's decoupled weight decay (speculators: 0.1; the AdamW group keeps optim.weight_decay)."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations of Muon's orthogonalisation."""
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """How Muon scales its lr by a matrix's shape (torch.optim.Muon's adjust_lr_fn)."""

    def validate(self) -> None:
        self.require(math.isfinite(self.lr) and self.lr > 0, "lr", "must be a finite number > 0")
        self.require(all(0.0 <= b < 1.0 for b in self.betas), "betas", "must both be in [0, 1)")
        self.require(self.eps > 0, "eps", "must be > 0")
        self.require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        self.require(0.0 <= self.warmup_ratio < 1.0, "warmup_ratio", "must be in [0, 1)")
        self.require(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "must be in [0, 1]")
        self.require(math.isfinite(self.grad_clip) and self.grad_clip > 0, "grad_clip", "must be a finite number > 0")
        self.require(self.muon_lr is None or (math.isfinite(self.muon_lr) and self.muon_lr > 0), "muon_lr", "must be > 0 or null")
        self.require(0.0 <= self.muon_momentum < 1.0, "muon_momentum", "must be in [0, 1)")
        self.require(self.muon_weight_decay >= 0, "muon_weight_decay", "must be >= 0")
        self.require(self.muon_ns_steps >= 1, "muon_ns_steps", "must be >= 1")

    def recipe_warnings(self) -> list[str]:
        out = []
        if tuple(self.betas) != RECIPE_BETAS:
            out.append(
                f"optim.betas={list(self.betas)} departs from the recipe (0.9, 0.999); "
                f"(0.9, 0.98) has been reported to give NaN losses (z-lab/dflash issue #115)"
            )
        for key, recipe in (("lr", 6e-4), ("warmup_ratio", 0.04), ("grad_clip", 1.0), ("weight_decay", 0.0)):
            if getattr(self, key) != recipe:
                out.append(f"optim.{key}={getattr(self, key):g} departs from the recipe ({recipe:g})")
        if self.schedule != "cosine":
            out.append(f"optim.schedule={self.schedule} departs from the recipe (cosine)")
        if self.name != "adamw":
            out.append(f"optim.name={self.name}: Muon for the weight matrices (speculators' default); the recipe trains with AdamW")
        return out

    def alternatives(self) -> list[str]:
        if self.name == "muon":
            return []
        return ["optim.name=muon: speculators' default; tau -0.057 [-0.077, -0.037] against AdamW on the CPU default at lr 1e-3 (\"levers\")"]


class NoiseConfig(Section):
    section: ClassVar[str] = "noise"
    std: float = 0.0289
    """Target standard deviation after warmup; 0 turns noise off. 0.0289 is speculators' noise:
    its AddUniformNoise(std=0.05) draws U(-0.05, 0.05), whose standard deviation is 0.05/sqrt(3)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0."""
    kind: Literal["uniform", "gaussian"] = "uniform"
    """Uniform noise of standard deviation s, U(-s*sqrt(3), s*sqrt(3)), as speculators adds it, or Gaussian."""

    def validate(self) -> None:
        self.require(math.isfinite(self.std) and self.std >= 0, "std", "must be a finite number >= 0")
        self.require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")


class CheckpointConfig(Section):
    section: ClassVar[str] = "checkpoint"
    every_steps: int = 0
    """Save every N optimizer steps; 0 = no periodic saves, only the trainer's final save at the end."""
    keep_latest_k: int = 2
    """Complete checkpoints kept; older ones are deleted after each successful save (>= 2: a fallback)."""
    async_save: bool = True
    """Write in a background thread after a CPU snapshot; false = the loop waits for the whole write."""
    dir: str | None = None
    """Where checkpoints go; null = <run_dir>/checkpoints. Several nodes need a shared file system."""
    keep_best: bool = False
    """Keep the checkpoint whose held-out walk_tau (the offline estimate of online tau) is the best of
    the run's evals (accept_len when eval.offline_max_anchors_per_seq samples anchors): a `best`
    pointer committed as `latest` is, never pruned; `export --checkpoint best` and `eval
    --checkpoint best` use it. Needs eval.every_steps > 0."""

    def validate(self) -> None:
        self.require(self.every_steps >= 0, "every_steps", "must be >= 0 (0 = only the final save)")
        self.require(
            self.keep_latest_k >= 2, "keep_latest_k", "must be >= 2 (a crash mid-save needs a fallback)"
        )

    def alternatives(self) -> list[str]:
        if self.keep_best:
            return []
        return ["checkpoint.keep_best=true: keep the checkpoint whose held-out walk_tau is best (export/eval --checkpoint best)"]

    def resolve_dir(self, run_dir: str | os.PathLike) -> Path:
        return RunPaths(Path(run_dir), checkpoint_dir=self.dir).checkpoints


class EvalConfig(Section):
    """The held-out split and the evaluations on it."""

    section: ClassVar[str] = "eval"
    renamed: ClassVar[dict[str, str]] = {"offline_token_budget": "offline_batch_tokens"}
    holdout_fraction: float = 0.02
    """Share of samples never trained on, chosen by a hash of their content (identical samples stay together)."""
    split_seed: int = 0
    """Fixes the split independently of the training seed. `eval` of a saved drafter uses the split it
    was trained with (a command-line value that contradicts it is refused)."""
    allow_other_store: bool = False
    """`eval` refuses a store whose contents differ from the one the checkpoint was trained on
    (reprocessed, or another store); true evaluates on it anyway, and the report says so."""
    every_steps: int = 0
    """Offline eval during training every N optimizer steps; 0 = only at the end."""
    offline_max_samples: int = 16
    """Held-out samples scored by the offline eval."""
    offline_max_anchors_per_seq: int | None = None
    """Anchors scored per sample by the evals during training; null = every anchor (adds walk_tau;
    dearer). The final eval of a run and `eval` always score every anchor. With a number, checkpoint.keep_best
    compares accept_len instead of walk_tau."""
    offline_batch_tokens: int = 8192
    """Context tokens per offline-eval forward."""
    online_num_prompts: int = 8
    """`eval` command: held-out prompts decoded speculatively with the target."""
    online_max_new_tokens: int = 64
    """`eval` command: tokens generated per prompt."""
    online_dtype: Literal["fp32", "bf16", "fp16", "auto"] = "fp32"
    """The target's dtype for online decoding. In bf16, near-equal logits tie often and a batched
    verification can round a tie the other way than one-token decoding, so speculative output would
    differ from the greedy reference for reasons that are not the drafter's; fp32 makes that rare."""

    confidence_stop: float | None = None
    """DSpark decoding: end a block's draft before the slot where the confidence head's predicted chance
    that every draft so far is accepted (prod sigmoid(c_k)) falls below this; null = draft the whole
    block (DeepSpec's default). At least one token is drafted. Other variants ignore it."""

    def validate(self) -> None:
        self.require(
            self.confidence_stop is None or 0.0 < self.confidence_stop < 1.0, "confidence_stop", "must be in (0, 1) or null"
        )
        self.require(0.0 <= self.holdout_fraction < 1.0, "holdout_fraction", "must be in [0, 1)")
        self.require(self.every_steps >= 0, "every_steps", "must be >= 0")
        self.require(self.offline_max_samples >= 1, "offline_max_samples", "must be >= 1")
        self.require(
            self.offline_max_anchors_per_seq is None or self.offline_max_anchors_per_seq >= 1,
            "offline_max_anchors_per_seq",
            "must be >= 1 or null (every anchor)",
        )
        self.require(self.offline_batch_tokens >= 1, "offline_batch_tokens", "must be >= 1")
        self.require(self.online_num_prompts >= 0, "online_num_prompts", "must be >= 0")
        self.require(self.online_max_new_tokens >= 1, "online_max_new_tokens", "must be >= 1")
