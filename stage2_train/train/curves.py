"""The learning-rate and noise curves as pure functions of the optimizer step, torch-free: the
trainer's schedulers (`schedules.py`) and the doctor's check of a log against the schedule its
run_start records (`expected_at`, handed to `observe/doctor.py` by `commands.py`) read the same ones.

    lr_factor(step, total_steps, cfg)        # multiplier of optim.lr at 0-based optimizer step `step`
    noise_std_at(step, std, warmup_steps)    # the feature noise's std at that step
    expected = expected_at(hyperparameters)  # run_start's record -> {"lr": ..., "noise_std": ...} per logged step
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from stage2_train.train.config import OptimConfig


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


def noise_std_at(step: int, std: float, warmup_steps: int) -> float:
    """Linear from 0 at step 0 to `std` at `warmup_steps`, then `std` (from the first step when 0)."""
    if step >= warmup_steps:
        return std
    return std * max(step, 0) / warmup_steps


def expected_at(hyperparameters: dict[str, Any]) -> Callable[[int], dict[str, float]] | None:
    """What a train row of logged step `step` (1-based: the row after optimizer step step - 1) should
    show for `lr` (AdamW's, which the trainer logs) and `noise_std`, from a run_start's
    `hyperparameters`; None when the record lacks the schedule (an older or another trainer's log)."""
    optim = {k.removeprefix("optim."): v for k, v in hyperparameters.items() if k.startswith("optim.")}
    total, std, noise_warmup = (hyperparameters.get(k) for k in ("total_steps", "noise.std", "noise.warmup_steps"))
    if not {"lr", "warmup_ratio", "schedule", "min_lr_ratio"} <= optim.keys():
        return None  # a partial record: defaults would stand in for what the run used
    try:
        cfg = OptimConfig(**optim)
    except (TypeError, ValueError):  # keys of another version: no schedule to hold the log against
        return None
    if not isinstance(total, int) or total < 1:
        return None

    def at(step: int) -> dict[str, float]:
        out = {"lr": cfg.lr * lr_factor(step - 1, total, cfg)}
        if isinstance(std, (int, float)) and isinstance(noise_warmup, int):
            out["noise_std"] = noise_std_at(step - 1, float(std), noise_warmup)
        return out

    return at
