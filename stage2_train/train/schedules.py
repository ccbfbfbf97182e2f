"""The schedules of a run: the optimizer(s) and their learning rate, and noise on the target features.

Optimizers (`Optimizers`): AdamW over every trainable parameter (the recipe), or, with
`optim.name=muon`, torch.optim.Muon over the 2-D weight matrices (min(shape) > 1: attention and
MLP projections, fc) and AdamW over the rest (norms), as speculators splits them (PR #746). The
vocabulary-indexed tables (DSpark's Markov factors, DFlash2's codebooks) are matrices Muon must not
orthogonalise: a row's update would no longer follow its own token's gradient (a rare token's row
moves as far as a frequent one's). They go to AdamW in a group of their own at Muon's lr and weight
decay (speculators' `_ADAMW_NAME_HINTS`). One LR schedule drives both optimizers; their states are
checkpointed together.

Learning rate (`lr_factor`, in the torch-free `curves.py` the doctor also reads): linear warmup over ceil(warmup_ratio * total_steps) optimizer steps,
then cosine (or linear) decay to lr * min_lr_ratio; `warmup_steps(total, cfg)` is the one place
that warmup length is computed. AdamW defaults follow the recipe: betas (0.9, 0.999), weight
decay 0, clip 1.0 ((0.9, 0.98) has been reported to give NaN losses, z-lab/dflash issue #115).

Noise (vllm-project/speculators: uniform, U(-0.05, 0.05), which its config calls std 0.05: the
standard deviation is 0.05/sqrt(3) = 0.0289, noise.std's default; 0.05 here is sqrt(3) times wider).

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
from stage2_train.data.sampler import start_anew
from stage2_train.train.checkpoint.format import load_optimizer_state, optimizer_state
from stage2_train.train.config import NoiseConfig, OptimConfig
from stage2_train.train.curves import lr_factor, noise_std_at, warmup_steps  # noqa: F401 - the trainer's and tests' names


class NoiseSchedule:
    def __init__(self, cfg: NoiseConfig):
        self.cfg = cfg

    def std_at(self, step: int) -> float:
        return noise_std_at(step, self.cfg.std, self.cfg.warmup_steps)

    def apply_(self, context_TF: torch.Tensor, step: int, generator: torch.Generator, rows: int = 4096) -> torch.Tensor:
        """Add noise of std std_at(step), drawn from `generator` (on context's device), to the context
        in place, `rows` tokens at a time: neither a noisy copy of the context nor a noise tensor of
        its size ever exists (at the 8B preset those were ~0.6 GiB each). The context is the step's
        own copy of the micro-batch (the loader's buffer on CPU, read by nothing else afterwards)."""
        std = self.std_at(step)
        if std == 0.0:
            return context_TF
        for start in range(0, context_TF.shape[0], rows):
            part = context_TF[start : start + rows]
            if self.cfg.kind == "uniform":
                half_width = std * math.sqrt(3.0)
                noise = torch.rand(part.shape, generator=generator, device=part.device, dtype=torch.float32)
                noise = noise.mul_(2.0 * half_width).sub_(half_width)
            else:
                noise = torch.randn(part.shape, generator=generator, device=part.device, dtype=torch.float32).mul_(std)
            part.add_(noise.to(part.dtype))
        return context_TF

    def state_dict(self) -> dict[str, Any]:
        return self.cfg.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing moves (the step comes from the trainer); refuse a resume under another schedule."""
        for key, value in self.state_dict().items():
            if state.get(key) != value:
                raise CheckpointError(
                    f"noise state: noise.{key} was {state.get(key)!r} when saved, is {value!r} now (the noise of every "
                    f"resumed step; train.resume_force does not change it): set noise.{key}={state.get(key)} to resume. "
                    f"{start_anew()}"
                )


def noise_generator(seed: int, step: int, rank: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from (seed, step, rank): independent per rank, reproducible per step."""
    mixed = int(np.random.SeedSequence([seed, step, rank]).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator(device=device).manual_seed(mixed & 0x7FFF_FFFF_FFFF_FFFF)


# Matrices indexed by token id, by name: embeddings and heads (frozen buffers in this drafter), DSpark's
# Markov factors (markov_w1 is an nn.Embedding) and DFlash2's predecessor/successor codebooks.
VOCAB_TABLE_HINTS = ("embed_tokens", "lm_head", "codebook", "markov_w1", "markov_w2")

Named = list[tuple[str, torch.nn.Parameter]]


def muon_params(model: torch.nn.Module) -> tuple[Named, Named, Named]:
    """(Muon's, AdamW's, the vocabulary tables') trainable parameters: matrices with min(shape) > 1
    go to Muon unless a name in VOCAB_TABLE_HINTS says they are indexed by token id."""
    muon, adamw, tables = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim != 2 or min(param.shape) <= 1:
            adamw.append((name, param))
        elif any(h in name for h in VOCAB_TABLE_HINTS):
            tables.append((name, param))
        else:
            muon.append((name, param))
    return muon, adamw, tables


class Optimizers:
    """The run's optimizer(s) and their schedulers, stepped together (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, total_steps: int):
        self.cfg = cfg
        if cfg.name == "muon":
            muon, adamw, tables = muon_params(model)
        else:
            muon, adamw, tables = [], [(n, p) for n, p in model.named_parameters() if p.requires_grad], []
        self.named: dict[str, torch.optim.Optimizer] = {}
        if muon:
            self.named["muon"] = torch.optim.Muon(
                [p for _, p in muon], lr=cfg.muon_lr or cfg.lr, momentum=cfg.muon_momentum,
                weight_decay=cfg.muon_weight_decay, ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_adjust_lr,
            )
        # The tables are left out of Muon for their shape, not to train slower: Muon's lr and decay
        # (speculators). The norms' group stays first: last_lr() reads it.
        groups = [{"params": [p for _, p in adamw]}] if adamw else []
        if tables:
            groups.append({"params": [p for _, p in tables], "lr": cfg.muon_lr or cfg.lr, "weight_decay": cfg.muon_weight_decay})
        if groups:
            self.named["adamw"] = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
        # Stepped by us once per optimizer step (an Accelerate-prepared scheduler steps once per rank).
        self.schedulers = {
            name: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total_steps, cfg)) for name, opt in self.named.items()
        }

    def all(self) -> list[torch.optim.Optimizer]:
        return list(self.named.values())

    def replace(self, prepared: list[Any]) -> None:
        """Put back the optimizers as Accelerate wrapped them (same order as `all()`)."""
        self.named = dict(zip(self.named, prepared))

    def step(self) -> None:
        for opt in self.named.values():
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.named.values():
            opt.zero_grad(set_to_none=True)

    def schedule_step(self) -> None:
        for scheduler in self.schedulers.values():
            scheduler.step()

    def last_lr(self) -> float:
        """The lr AdamW's next update applies (optim.lr x the factor; Muon's follows the same factor):
        read from the optimizer, not the scheduler's record of it, so the log shows what was applied."""
        scheduler = self.schedulers.get("adamw") or next(iter(self.schedulers.values()))
        return scheduler.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict[str, Any]:
        """AdamW alone: its state as before (older checkpoints load); with Muon: one entry each."""
        if list(self.named) == ["adamw"]:
            return optimizer_state(self.named["adamw"])
        return {name: optimizer_state(opt) for name, opt in self.named.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The moments (and Muon's momentum buffers) from the checkpoint; the hyper-parameters this
        run's config gives (betas, eps, weight decay, Muon's momentum...): torch's load would put the
        checkpoint's back, so a resume that changed them on the record trained with the old ones. The
        lr is the schedule's (`Schedule.load_state_dict`, loaded after this)."""
        parts = {"adamw": state} if list(self.named) == ["adamw"] else state
        for name, opt in self.named.items():
            if name not in parts:
                raise CheckpointError(f"optimizer state has no {name!r} part: the checkpoint was trained with another optim.name")
            saved = [len(group["params"]) for group in parts[name]["param_groups"]]
            mine = [len(group["params"]) for group in opt.param_groups]
            if saved != mine:  # torch would say only that a group "doesn't match"
                raise CheckpointError(
                    f"optimizer state: {name} held parameter groups of {saved} tensors when saved, has {mine} now (a Muon "
                    f"run saved before the vocabulary tables left Muon for AdamW, or another drafter). {start_anew()}"
                )
            own = [{k: v for k, v in group.items() if k not in ("params", "lr", "initial_lr")} for group in opt.param_groups]
            load_optimizer_state(opt, parts[name])
            for group, settings in zip(opt.param_groups, own):
                group.update(settings)

    @property
    def schedule(self) -> Schedule:
        """The schedulers as a checkpoint component of their own ("scheduler")."""
        return Schedule(self.schedulers)


class Schedule:
    def __init__(self, schedulers: dict[str, Any]):
        self.schedulers = schedulers

    def state_dict(self) -> dict[str, Any]:
        if list(self.schedulers) == ["adamw"]:
            return self.schedulers["adamw"].state_dict()
        return {name: s.state_dict() for name, s in self.schedulers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The schedulers' step, and this run's lr at it: the checkpoint holds the lr its own schedule
        gave and its peak, and a resume under another total_steps (train.max_steps, train.epochs) or
        optim.lr follows the run's schedule from its first step (the optimizer, restored before this
        component by the checkpointer's registry order, held the old lr)."""
        parts = {"adamw": state} if list(self.schedulers) == ["adamw"] else state
        for name, scheduler in self.schedulers.items():
            bases = list(scheduler.base_lrs)  # this run's optim.lr (muon_lr): the checkpoint holds the old one
            scheduler.load_state_dict(parts[name])
            scheduler.base_lrs = bases
            lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(bases, scheduler.lr_lambdas)]
            for group, base, lr in zip(scheduler.optimizer.param_groups, bases, lrs):
                group["initial_lr"], group["lr"] = base, lr
            scheduler._last_lr = lrs
