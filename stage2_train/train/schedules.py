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
from typing import Any

import numpy as np
import torch

from shared.errors import CheckpointError
from stage2_train.train.config import NoiseConfig, OptimConfig


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
