"""The small stateful components of a run, each with its own `state_dict` / `load_state_dict`, as
the checkpointer's registry expects (`saver.Checkpointer.register`):

    Progress      step, tokens seen, time spent (wall and CPU), the last train and eval rows
    RngState      this rank's Python, numpy, torch and CUDA generators (one file per rank)
    RunRecord     the resolved run config, saved for the resume check (compared before anything loads)
    Description   the drafter's description (drafter.json): what the weights are

and `run_info`, everything about a run decided at start-up (the run_start event, the saved config),
and `StepStats`, one optimizer step's record before its train row is written.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from stage2_train.model.description import DrafterDescription
from stage2_train.train.checkpoint.format import rng_state, set_rng_state
from stage2_train.train.schedules import warmup_steps


@dataclass
class StepStats:
    """One optimizer step on this rank; tensors stay on the device until a log step reads them."""

    epoch: int
    step_in_epoch: int
    steps_in_epoch: int
    counts: dict[str, Any]  # torch tensors
    num_tokens: int  # context tokens of the whole step, all ranks
    num_samples: int  # all ranks
    grad_norm: Any  # a torch tensor
    lr: float
    noise_std: float
    skipped: bool = False  # non-finite loss or gradients: no weight changed
    times: dict[str, float] = field(default_factory=dict)
    stop: str | None = None  # a rank was signalled (SIGTERM/SIGUSR1): every rank stops after this step


class Progress:
    """Where the run is, and what it has cost so far (resumed runs add to the earlier runs' time)."""

    def __init__(self) -> None:
        self.step = 0  # optimizer steps done
        self.tokens_seen = 0
        self.elapsed_before = 0.0  # wall time of earlier runs of this training
        self.cpu_before = 0.0  # process CPU time of earlier runs (all threads: what a CPU run costs)
        self.total_steps = 0
        self.world_size = 1
        self.epoch = 0
        self.step_in_epoch = 0
        self.last_row: dict[str, Any] = {}
        self.last_eval: dict[str, Any] | None = None
        # This rank's scored blocks of the epoch so far (a device tensor while training: reading it
        # every step would be a host sync before the optimizer's kernels; read at the epoch's end and at a save) and whether a preemption stopped the run at a step whose eval
        # was due: both carried over a resume, so epoch_end counts the whole epoch and no eval is lost.
        self.epoch_blocks: Any = 0
        self.blocks_epoch: int | None = None  # the epoch epoch_blocks were counted in
        self.eval_owed = False
        # Non-finite steps in a row: carried over a resume, so a run that is preempted or relaunched
        # while diverging still reaches train.max_nonfinite_steps instead of starting the count anew.
        self.nonfinite_in_a_row = 0
        self.restart_clock()

    def add_blocks(self, blocks: Any, epoch: int) -> None:
        self.epoch_blocks, self.blocks_epoch = blocks + self.epoch_blocks, epoch

    def restart_clock(self) -> None:
        self._start, self._cpu_start = time.perf_counter(), time.process_time()

    def elapsed_s(self) -> float:
        return self.elapsed_before + time.perf_counter() - self._start

    def cpu_s(self) -> float:
        return self.cpu_before + time.process_time() - self._cpu_start

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "tokens_seen": self.tokens_seen,
            "elapsed_s": self.elapsed_s(),
            "cpu_s": self.cpu_s(),
            "total_steps": self.total_steps,
            "world_size": self.world_size,
            "last_row": self.last_row,
            "last_eval": self.last_eval,
            # A save between an epoch's last step and its epoch_end (checkpoint.keep_best saves at the
            # eval, which comes first) holds the finished epoch's count: the next epoch starts from 0.
            "epoch_blocks": int(self.epoch_blocks) if self.blocks_epoch in (None, self.epoch) else 0,
            "eval_owed": self.eval_owed,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.elapsed_before = float(state["elapsed_s"])
        self.cpu_before = float(state.get("cpu_s", 0.0))
        self.last_row = state.get("last_row") or {}
        self.last_eval = state.get("last_eval")
        self.epoch_blocks = int(state.get("epoch_blocks", 0))  # checkpoints before it: counted from the resume
        self.eval_owed = bool(state.get("eval_owed", False))
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        self.restart_clock()


class RngState:
    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state)


class RunRecord:
    """The run's resolved config: saved so a resume can compare (train/resume.py) before loading."""

    def __init__(self, config: dict[str, Any]):
        self.config = config

    def state_dict(self) -> dict[str, Any]:
        return self.config

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the resume has already compared it and refused what changed."""


class Description:
    """The drafter's description (drafter.json), beside its weights."""

    def __init__(self, description: DrafterDescription):
        self.description = description

    def state_dict(self) -> dict[str, Any]:
        return self.description.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the resume has compared it with the run's own description, field by
        field, before anything loaded (train/resume.py `check_compatible`), and refused a difference
        unless train.resume_force (then the run goes on as its own description says)."""


def store_digest(manifest: dict[str, Any]) -> str:
    """The store's contents in one hash (every listed shard's content checksum, in order): a resume
    on a reprocessed store, or another one, is refused naming it."""
    return hashlib.sha256("".join(r["checksum"] for r in manifest["shards"]).encode()).hexdigest()[:16]


def run_info(
    cfg: Any, data: Any, model: Any, description: DrafterDescription, *, total_steps: int, world_size: int,
    mixed_precision: str, device: Any, initialised: bool,
) -> dict[str, Any]:
    """Everything about this run decided at start-up, built once: the config with the values
    resolved at run time (checkpoints compare them on resume) and the flat hyper-parameters
    (the run_start event and wandb)."""
    resolved = {
        "layer_ids": data.target.layer_ids,
        "target_fingerprint": data.target.weights_sha256,
        "mask_token_id": data.target.mask_token_id,
        "world_size": world_size,
        "store": data.reader.url,
        "store_digest": store_digest(data.reader.manifest),
        "num_train_samples": len(data.train_indices),
        "num_heldout_samples": len(data.heldout_indices),
    }
    hyper = {
        **{f"optim.{k}": v for k, v in cfg.optim.to_dict().items()},
        "seed": cfg.seed, "epochs": cfg.train.epochs, "max_steps": cfg.train.max_steps, "total_steps": total_steps,
        "warmup_steps": warmup_steps(total_steps, cfg.optim), "steps_per_epoch": data.sampler.steps_per_epoch,
        "world_size": world_size, "grad_accum": cfg.train.grad_accum, "micro_batch_tokens": cfg.sampler.micro_batch_tokens,
        "tokens_per_step": cfg.sampler.micro_batch_tokens * cfg.train.grad_accum * world_size,
        "max_anchors_per_seq": cfg.sampler.max_anchors_per_seq, "block_size": cfg.model.block_size,
        "variant": cfg.model.variant,
        "num_layers": cfg.model.num_layers, "init_from": cfg.model.init_from if initialised else None,
        "loss.gamma": cfg.loss.gamma, "loss.ce_weight": cfg.loss.ce_weight, "loss.kl_weight": cfg.loss.kl_weight,
        "noise.std": cfg.noise.std, "noise.warmup_steps": cfg.noise.warmup_steps, "noise.kind": cfg.noise.kind,
        "mixed_precision": mixed_precision, "device": str(device),
        "recipe_warnings": cfg.recipe_warnings(),
    }
    return {
        "config": {**cfg.to_dict(), "resolved": resolved},
        "hyperparameters": hyper,
        "drafter": description.to_dict(),
        "num_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "num_frozen_params": sum(b.numel() for b in {id(b): b for b in model.buffers()}.values()),
        "train_tokens": int(data.train_reader.lengths.sum()),
    }
