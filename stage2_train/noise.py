"""Noise on the target features during training (vllm-project/speculators: uniform, std 0.05).

std_at(step) warms up linearly from 0 at step 0 to `noise.std` at `noise.warmup_steps`, then stays
there; with warmup_steps = 0 it is `std` from the first step, and with std = 0 it is exactly 0 and
`apply` returns its input untouched. Uniform noise of std s is U(-s*sqrt(3), s*sqrt(3)).

The schedule holds no mutable state: the trainer passes the optimizer step and a generator it
seeds with `noise_generator(seed, step, rank)`, so resumed runs draw the same noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from shared.config import Section


@dataclass(kw_only=True)
class NoiseConfig(Section):
    section: ClassVar[str] = "noise"
    std: float = 0.05  # target standard deviation after warmup; 0 turns noise off
    warmup_steps: int = 0  # optimizer steps of linear warmup from 0
    kind: Literal["uniform", "gaussian"] = "uniform"

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
                raise ValueError(
                    f"noise state: noise.{key} was {state.get(key)!r} when saved, is {value!r} now"
                )


def noise_generator(seed: int, step: int, rank: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from (seed, step, rank): independent per rank, reproducible per step."""
    mixed = int(np.random.SeedSequence([seed, step, rank]).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator(device=device).manual_seed(mixed & 0x7FFF_FFFF_FFFF_FFFF)
