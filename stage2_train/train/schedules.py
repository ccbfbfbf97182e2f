"""The schedules of a run: the optimizer and its learning rate, and noise on the target features.

Learning rate (`lr_factor`): linear warmup over ceil(warmup_ratio * total_steps) optimizer steps,
then cosine (or linear) decay to lr * min_lr_ratio; `warmup_steps(total, cfg)` is the one place
that warmup length is computed. AdamW defaults follow the recipe: betas (0.9, 0.999), weight
decay 0, clip 1.0 ((0.9, 0.98) has been reported to give NaN losses, z-lab/dflash issue #115).

Noise (vllm-project/speculators: uniform, std 0.05).

std_at(step) warms up linearly from 0 at step 0 to `noise.std` at `noise.warmup_steps`, then stays
there; with warmup_steps = 0 it is `std` from the first step, and with std = 0 it is exactly 0 and
`apply` returns its input untouched. Uniform noise of std s is U(-s*sqrt(3), s*sqrt(3)).

The schedule holds no mutable state: the trainer passes the optimizer step and a generator it
seeds with `noise_generator(seed, step, rank)`, so resumed runs draw the same noise.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from shared.config import Section
from shared.errors import CheckpointError

RECIPE_BETAS = (0.9, 0.999)


class OptimConfig(Section):
    section: ClassVar[str] = "optim"
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

    def validate(self) -> None:
        self.require(math.isfinite(self.lr) and self.lr > 0, "lr", "must be a finite number > 0")
        self.require(all(0.0 <= b < 1.0 for b in self.betas), "betas", "must both be in [0, 1)")
        self.require(self.eps > 0, "eps", "must be > 0")
        self.require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        self.require(0.0 <= self.warmup_ratio < 1.0, "warmup_ratio", "must be in [0, 1)")
        self.require(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "must be in [0, 1]")
        self.require(math.isfinite(self.grad_clip) and self.grad_clip > 0, "grad_clip", "must be a finite number > 0")

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
        return out


def warmup_steps(total_steps: int, cfg: OptimConfig) -> int:
    return math.ceil(cfg.warmup_ratio * total_steps)


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of optim.lr for 0-based optimizer step `step`: linear warmup to 1 over
    ceil(warmup_ratio * total) steps (step 0 already gets 1/warmup), then decay to min_lr_ratio."""
    warmup = warmup_steps(total_steps, cfg)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


class NoiseConfig(Section):
    section: ClassVar[str] = "noise"
    std: float = 0.05
    """Target standard deviation after warmup; 0 turns noise off."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0."""
    kind: Literal["uniform", "gaussian"] = "uniform"
    """Uniform noise U(-s*sqrt(3), s*sqrt(3)) as speculators adds it, or Gaussian."""

    def validate(self) -> None:
        self.require(math.isfinite(self.std) and self.std >= 0, "std", "must be a finite number >= 0")
        self.require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")


class NoiseSchedule:
    def __init__(self, cfg: NoiseConfig):
        self.cfg = cfg

    def std_at(self, step: int) -> float:
        cfg = self.cfg
        if step >= cfg.warmup_steps:
            return cfg.std
        return cfg.std * max(step, 0) / cfg.warmup_steps

    def apply(self, context_TF: torch.Tensor, step: int, generator: torch.Generator) -> torch.Tensor:
        """context + noise of std std_at(step), drawn from `generator` (on context's device)."""
        std = self.std_at(step)
        if std == 0.0:
            return context_TF
        shape, device = context_TF.shape, context_TF.device
        if self.cfg.kind == "uniform":
            half_width = std * math.sqrt(3.0)
            noise = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
            noise = noise.mul_(2.0 * half_width).sub_(half_width)
        else:
            noise = torch.randn(shape, generator=generator, device=device, dtype=torch.float32).mul_(std)
        return context_TF + noise.to(context_TF.dtype)

    def state_dict(self) -> dict[str, Any]:
        return self.cfg.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing moves (the step comes from the trainer); refuse a resume under another schedule."""
        for key, value in self.state_dict().items():
            if state.get(key) != value:
                raise CheckpointError(
                    f"noise state: noise.{key} was {state.get(key)!r} when saved, is {value!r} now"
                )


def noise_generator(seed: int, step: int, rank: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from (seed, step, rank): independent per rank, reproducible per step."""
    mixed = int(np.random.SeedSequence([seed, step, rank]).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator(device=device).manual_seed(mixed & 0x7FFF_FFFF_FFFF_FFFF)
