"""The stage-2 trainer: AdamW + warmup/cosine on Accelerate, exact per-token loss over ranks.

    .venv/bin/python -m stage2_train train --config configs/default.yaml train.max_steps=20
    torchrun --standalone --nproc_per_node 2 -m stage2_train train --config configs/default.yaml

`fit()` is the whole loop; each optimizer step is `train_step()`: take this rank's grad_accum
micro-batches, all_reduce their label weight sum, `forward_backward()` each, `optimizer_step()`.
Logging (every log.every_steps, all ranks reduce the counts, rank 0 writes), the held-out offline
eval (rank 0, every eval.every_steps and at the end) and checkpointing (every rank, the
Checkpointer's contract) are called at fixed points in `fit()`, never inside a step. A micro-batch
whose samples are all too short for one block gets a single unscored block (`with_a_block`), so
every rank still runs forward and backward.

The loss of a step is sum(w * CE) over every scored slot of every micro-batch on every rank,
divided by the step's global weight sum W, so 2 ranks x 1 micro-batch and 1 rank x 2 micro-batches
of the same global batch give the same loss and gradients: each rank backpropagates
sum_rank(w * CE) / (W / world_size) and DDP averages the ranks. The noise generator of micro-batch
j of the step (global index rank * grad_accum + micro) is seeded by (seed, step, j), so the layout
does not change the noise either.

The frozen embedding and LM head come from the target's safetensors, in the compute dtype; they are
non-persistent buffers, never trained, never in a checkpoint. Mixed precision: bf16 autocast on
GPU, fp32 on CPU (auto). Shape legend: N blocks, B block size, P = B - 1 scored positions.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from shared.config import Section
from stage2_train.batch import DrafterBatch
from stage2_train.data import EvalConfig, TrainData
from stage2_train.detectors import LiveDetectors, as_warning
from stage2_train.evaluate import offline_eval
from stage2_train.loader import LoadedBatch
from stage2_train.loss import COUNT_KEYS, IGNORE, LossConfig, dflash_loss, finalize_metrics, loss_weights
from stage2_train.metrics import MetricsSink
from stage2_train.noise import NoiseSchedule, noise_generator

RECIPE_BETAS = (0.9, 0.999)


@dataclass(kw_only=True)
class OptimConfig(Section):
    section: ClassVar[str] = "optim"
    lr: float = 6e-4
    betas: tuple[float, float] = RECIPE_BETAS
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04  # share of the run's optimizer steps spent warming up linearly
    schedule: Literal["cosine", "linear", "constant"] = "cosine"  # decay after warmup
    min_lr_ratio: float = 0.0  # the decay ends at lr * min_lr_ratio
    grad_clip: float = 1.0  # max global L2 norm of the gradients

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


@dataclass(kw_only=True)
class TrainConfig(Section):
    section: ClassVar[str] = "train"
    epochs: int = 6
    max_steps: int | None = None  # at most this many optimizer steps (the LR schedule spans them)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    num_data_threads: int = 2  # loader threads per rank
    prefetch: int = 4  # micro-batches prepared ahead per rank
    cpu_threads: int = 0  # torch intra-op threads when training on CPU; 0 = torch's default
    resume: str = "auto"  # auto: newest complete checkpoint if any; never; or a checkpoint path
    resume_force: bool = False  # resume even when block size, gamma, layers, batch or ranks changed

    def validate(self) -> None:
        self.require(self.epochs >= 1, "epochs", "must be >= 1")
        self.require(self.max_steps is None or self.max_steps >= 1, "max_steps", "must be >= 1 or null")
        self.require(self.num_data_threads >= 1, "num_data_threads", "must be >= 1")
        self.require(self.prefetch >= 1, "prefetch", "must be >= 1")
        self.require(self.cpu_threads >= 0, "cpu_threads", "must be >= 0")
        self.require(bool(self.resume), "resume", "must be auto, never, or a checkpoint path")

    def recipe_warnings(self) -> list[str]:
        if self.epochs != 6:
            return [f"train.epochs={self.epochs} departs from the recipe (6)"]
        return []


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of optim.lr for 0-based optimizer step `step`: linear warmup to 1 over
    ceil(warmup_ratio * total) steps (step 0 already gets 1/warmup), then decay to min_lr_ratio."""
    warmup = math.ceil(cfg.warmup_ratio * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def rng_state() -> dict[str, Any]:
    py = random.getstate()
    name, key, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    name, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class StepStats:
    """One optimizer step on this rank; tensors stay on the device until a log step reads them."""

    epoch: int
    step_in_epoch: int
    counts: dict[str, torch.Tensor]
    num_tokens: int  # context tokens of the whole step, all ranks
    num_samples: int  # all ranks
    grad_norm: torch.Tensor
    lr: float
    noise_std: float
    times: dict[str, float] = field(default_factory=dict)


class Trainer:
    def __init__(
        self,
        *,
        model: torch.nn.Module,
        data: TrainData,
        accelerator: Any,
        loss_cfg: LossConfig,
        optim_cfg: OptimConfig,
        train_cfg: TrainConfig,
        noise: NoiseSchedule,
        sink: MetricsSink,
        checkpointer: Any,
        seed: int,
        log_every: int = 1,
        eval_cfg: EvalConfig | None = None,
        detectors: LiveDetectors | None = None,
        run_config: dict[str, Any] | None = None,
        hyperparameters: dict[str, Any] | None = None,
        progress: bool = True,
    ):
        self.accelerator = accelerator
        self.device = accelerator.device
        self.rank, self.world_size = accelerator.process_index, accelerator.num_processes
        self.compute_dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
        self.model = model
        self.data = data
        self.loss_cfg, self.optim_cfg, self.train_cfg = loss_cfg, optim_cfg, train_cfg
        self.noise, self.sink, self.checkpointer = noise, sink, checkpointer
        self.seed = seed
        self.log_every = log_every
        self.eval_cfg = eval_cfg or EvalConfig()
        # The doctor's detectors, live: a spike, stall or cliff is a warning event the moment it shows.
        self.detectors = detectors or LiveDetectors()
        self.run_config = run_config or {}
        self.hyperparameters = hyperparameters or {}
        self.progress = progress and self.rank == 0
        self.grad_accum = data.sampler.cfg.grad_accum
        self.block_size = data.anchors.block_size

        full_steps = data.sampler.total_steps(train_cfg.epochs)
        self.total_steps = min(full_steps, train_cfg.max_steps or full_steps)
        self.warmup_steps = math.ceil(optim_cfg.warmup_ratio * self.total_steps)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params,
            lr=optim_cfg.lr,
            betas=tuple(optim_cfg.betas),
            eps=optim_cfg.eps,
            weight_decay=optim_cfg.weight_decay,
        )
        # Stepped by us once per optimizer step (an Accelerate-prepared scheduler steps once per rank).
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, self.total_steps, optim_cfg)
        )
        self.ddp_model, self.optimizer = accelerator.prepare(model, optimizer)
        self.step = 0  # optimizer steps done
        self.tokens_seen = 0
        self.elapsed_before = 0.0  # wall time of earlier runs of this training (resume)
        self._batches = None
        self._bar = None
        self._last_log = (0, 0, 0.0)  # (step, tokens_seen, time) at the previous train row

    # ---- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        resumed_from = self.resume()
        self.sink.event("run_start", self.step, **self.describe(), resumed_from=resumed_from)
        self._start = time.perf_counter()
        self._last_log = (self.step, self.tokens_seen, self._start)
        self._batches = self._step_batches()
        self._bar = self._progress_bar()
        last_row: dict[str, Any] = {}
        try:
            while self.step < self.total_steps:
                self.mark_epoch_start()
                stats = self.train_step()
                if self.step % self.log_every == 0 or self.step == self.total_steps:
                    last_row = self.log_step(stats)
                if self.eval_cfg.every_steps and self.step % self.eval_cfg.every_steps == 0 and self.step < self.total_steps:
                    self.evaluate()
                self.mark_epoch_end(stats)
                self.checkpointer.maybe_save(self.step, self.state_dict)
            eval_row = self.evaluate()
            self.checkpointer.save(self.step, self.state_dict, blocking=True)  # skipped if just saved
        finally:
            if self._bar is not None:
                self._bar.close()
            self.data.close()
            self.checkpointer.finalize()
        summary = {
            "steps": self.step,
            "total_steps": self.total_steps,
            "tokens_seen": self.tokens_seen,
            "elapsed_s": round(self.elapsed_s(), 2),
            "final_train": {k: last_row.get(k) for k in ("loss", "accuracy", "eal", "tok_per_s")},
            "final_eval": {k: eval_row.get(k) for k in ("ce", "accuracy", "eal", "tau", "walk_tau")} if eval_row else None,
            "log": str(self.sink.path),
        }
        self.sink.event("run_end", self.step, **summary)
        return summary

    def train_step(self) -> StepStats:
        """One optimizer step: this rank's grad_accum micro-batches, then the update."""
        start = time.perf_counter()
        loaded = next(self._batches)
        mask_id = self.data.target.mask_token_id
        batches = [with_a_block(lb.batch, mask_id).to(self.device, self.compute_dtype) for lb in loaded]
        data_s = time.perf_counter() - start  # waiting on the loader + host-to-device copies
        # The step's global label weight sum, before any backward: the exact per-token normaliser.
        weight_sum = sum(loss_weights(b.labels_NB, self.loss_cfg.gamma).sum() for b in batches)
        weight_sum = self.accelerator.reduce(weight_sum.float(), reduction="sum")
        normalizer = weight_sum.clamp_min(1e-12) / self.world_size
        parts, forward_s, backward_s = [], 0.0, 0.0
        for micro, batch in enumerate(batches):
            counts, f_s, b_s = self.forward_backward(batch, micro, normalizer)
            parts.append(counts)
            forward_s, backward_s = forward_s + f_s, backward_s + b_s
        lr, grad_norm, optim_s = self.optimizer_step()
        epoch, step_in_epoch = loaded[0].epoch, loaded[0].step_in_epoch
        bins = self.data.sampler.plan_epoch(epoch)[step_in_epoch]  # the global plan: all ranks' samples
        stats = StepStats(
            epoch=epoch,
            step_in_epoch=step_in_epoch,
            counts={k: torch.stack([p[k].float() for p in parts]).sum(0) for k in COUNT_KEYS},
            num_tokens=int(sum(self.data.train_reader.lengths[b].sum() for b in bins)),
            num_samples=sum(len(b) for b in bins),
            grad_norm=grad_norm,
            lr=lr,
            noise_std=self.noise.std_at(self.step),
            times={"data_s": data_s, "forward_s": forward_s, "backward_s": backward_s, "optim_s": optim_s},
        )
        self.step += 1
        self.tokens_seen += stats.num_tokens
        return stats

    def forward_backward(
        self, batch: DrafterBatch, micro: int, normalizer: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], float, float]:
        """Noise, forward, loss, backward of one micro-batch; gradients sync on the last one only."""
        start = time.perf_counter()
        generator = noise_generator(self.seed, self.step, self.rank * self.grad_accum + micro, self.device)
        batch = replace(batch, context_TF=self.noise.apply(batch.context_TF, self.step, generator))
        last = micro == self.grad_accum - 1
        with nullcontext() if last else self.accelerator.no_sync(self.ddp_model):
            with self.accelerator.autocast():
                hidden_NBH = self.ddp_model(batch)
                loss, metrics = dflash_loss(hidden_NBH, self.model.lm_head_VH, batch, self.loss_cfg, normalizer)
            self._sync()
            mid = time.perf_counter()
            self.accelerator.backward(loss)
            self._sync()
        return {k: metrics[k] for k in COUNT_KEYS}, mid - start, time.perf_counter() - mid

    def optimizer_step(self) -> tuple[float, torch.Tensor, float]:
        """Clip, AdamW, schedule; returns (lr used, grad norm before clipping, seconds)."""
        start = time.perf_counter()
        grad_norm = self.accelerator.clip_grad_norm_(self.ddp_model.parameters(), self.optim_cfg.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        return lr, grad_norm, time.perf_counter() - start

    # ---- fixed points of fit() ---------------------------------------------------------------
    def log_step(self, stats: StepStats) -> dict[str, Any]:
        """Reduce the step's counts over ranks and write one train row (every rank must call it)."""
        counts = self._reduce_counts(stats.counts)
        ratios = finalize_metrics(counts, self.loss_cfg)
        now = time.perf_counter()
        _, last_tokens, last_time = self._last_log
        interval = max(now - last_time, 1e-9)
        step_s = sum(stats.times.values())
        sampler = self.data.sampler
        row = {
            "epoch": stats.epoch,
            "step_in_epoch": stats.step_in_epoch,
            "steps_in_epoch": len(sampler.plan_epoch(stats.epoch)),
            "loss": ratios["loss"],
            "ce": ratios["ce"],
            "kl": ratios["kl"],
            "accuracy": ratios["accuracy"],
            "acc_per_pos": ratios["acc_per_pos"],
            "avg_streak": ratios["avg_streak"],
            "eal": ratios["eal"],
            "lr": stats.lr,
            "noise_std": stats.noise_std,
            "grad_norm": float(stats.grad_norm),
            "tokens": stats.num_tokens,
            "samples": stats.num_samples,
            "blocks": int(counts["num_blocks"]),
            "tok_per_s": (self.tokens_seen - last_tokens) / interval,
            "data_wait_frac": stats.times["data_s"] / max(step_s, 1e-9),
            **{k: round(v, 6) for k, v in stats.times.items()},
            "step_s": round(step_s, 6),
            "elapsed_s": round(self.elapsed_s(), 3),
        }
        row = {k: (v.item() if isinstance(v, torch.Tensor) and v.dim() == 0 else v) for k, v in row.items()}
        self.sink.log(self.step, row)
        for event in self.detectors.update({"kind": "train", "step": self.step, **row}):
            self.sink.event("warning", event["step"], **as_warning(event))
        self._last_log = (self.step, self.tokens_seen, now)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{row['loss']:.3f}", eal=f"{row['eal']:.2f}", tok_s=f"{row['tok_per_s']:.0f}")
            self._bar.update(self.step - self._bar.n)
        return row

    def mark_epoch_start(self) -> None:
        sampler = self.data.sampler
        if sampler.step_in_epoch == 0 and sampler.micro_step == 0:
            self.sink.event("epoch_start", self.step, epoch=sampler.epoch, steps_in_epoch=sampler.steps_per_epoch)

    def mark_epoch_end(self, stats: StepStats) -> None:
        if stats.step_in_epoch == len(self.data.sampler.plan_epoch(stats.epoch)) - 1:
            self.sink.event("epoch_end", self.step, epoch=stats.epoch, elapsed_s=round(self.elapsed_s(), 3))

    def evaluate(self) -> dict[str, Any] | None:
        """The offline eval (`evaluate.offline_eval`: accuracy per position, eal, tau) on the
        held-out samples, by rank 0 (the others go on to the next collective and wait there)."""
        data, cfg = self.data, self.eval_cfg
        if len(data.heldout_indices) == 0 or self.rank != 0:
            return None
        start = time.perf_counter()
        try:
            row = offline_eval(
                self.model,
                data.reader,
                data.heldout_indices[: cfg.offline_max_samples].tolist(),
                max_anchors_per_seq=cfg.offline_max_anchors_per_seq,
                token_budget=cfg.offline_token_budget,
                seed=self.seed,
                gamma=self.loss_cfg.gamma,
            )
        except ValueError as exc:  # e.g. no held-out sample long enough for one block
            self.sink.event("eval_skipped", self.step, reason=str(exc))
            return None
        row["eval_s"] = round(time.perf_counter() - start, 3)
        self.sink.log(self.step, row, kind="eval")
        self.detectors.update({"kind": "eval", "step": self.step, **row})  # eval time is not a stall
        return row

    # ---- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs (the checkpoint component's contract); this rank's RNG only."""
        sampler = self.data.sampler
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": sampler.state_dict(),
            "anchors": self.data.anchors.state_dict(),
            "noise": self.noise.state_dict(),
            "detectors": self.detectors.state_dict(),
            "rng": rng_state(),  # this rank's: the checkpointer keeps one file per rank
            "trainer": {
                "step": self.step,
                "epoch": sampler.epoch,
                "step_in_epoch": sampler.step_in_epoch,
                "tokens_seen": self.tokens_seen,
                "elapsed_s": self.elapsed_s(),
                "total_steps": self.total_steps,
                "world_size": self.world_size,
            },
            "config": self.run_config,
        }

    def load_state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        """Restore a saved state; returns what differs from the saved run (for the resume event)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.data.loader.load_state_dict(state["sampler"])
        self.data.anchors.load_state_dict(state["anchors"])
        self.noise.load_state_dict(state["noise"])
        if "detectors" in state:
            self.detectors.load_state_dict(state["detectors"])
        set_rng_state(state["rng"])
        trainer = state["trainer"]
        self.step = int(trainer["step"])
        self.tokens_seen = int(trainer["tokens_seen"])
        self.elapsed_before = float(trainer["elapsed_s"])
        return {
            "total_steps_before": trainer.get("total_steps"),
            "config_changes": config_changes(state.get("config") or {}, self.run_config),
        }

    def resume(self) -> str | None:
        """train.resume: auto (newest complete checkpoint, if any), never, or a checkpoint path.

        A checkpoint whose settings change what training computes is refused by name unless
        train.resume_force; every changed setting goes into the `resume` event either way."""
        choice = self.train_cfg.resume
        if choice == "never":
            return None
        path = self.checkpointer.latest() if choice == "auto" else Path(choice)
        if path is None:
            return None
        if not Path(path).is_dir():
            raise FileNotFoundError(f"train.resume={choice!r}: no checkpoint directory at {path}")
        state = self.checkpointer.load(path)
        forced = self.checkpointer.check_compatible(state["config"], self.run_config, self.train_cfg.resume_force)
        diff = self.load_state_dict(state)
        self.sink.event("resume", self.step, path=str(path), forced_differences=forced, **diff)
        return str(path)

    # ---- helpers -------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        data = self.data
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return {
            "config": self.run_config,
            "hyperparameters": {
                **self.hyperparameters,
                "total_steps": self.total_steps,
                "warmup_steps": self.warmup_steps,
                "steps_per_epoch": data.sampler.steps_per_epoch,
                "mixed_precision": self.accelerator.mixed_precision,
                "device": str(self.device),
            },
            "world_size": self.world_size,
            "num_params": trainable,
            "num_frozen_params": sum(b.numel() for b in {id(b): b for b in self.model.buffers()}.values()),
            "num_train_samples": len(data.train_indices),
            "num_heldout_samples": len(data.heldout_indices),
            "train_tokens": int(data.train_reader.lengths.sum()),
            "layer_ids": data.target.layer_ids,
            "mask_token_id": data.target.mask_token_id,
            "store": data.reader.url,
        }

    def _reduce_counts(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sum the COUNT_KEYS tensors over ranks in one all_reduce; returns CPU tensors."""
        flat = self.accelerator.reduce(torch.cat([local[k].reshape(-1).float() for k in COUNT_KEYS]), reduction="sum")
        flat = flat.cpu()
        out, offset = {}, 0
        for k in COUNT_KEYS:
            size = local[k].numel()
            out[k] = flat[offset : offset + size].reshape(local[k].shape)
            offset += size
        return out

    def elapsed_s(self) -> float:
        return self.elapsed_before + time.perf_counter() - getattr(self, "_start", time.perf_counter())

    def _step_batches(self):
        """Groups of grad_accum micro-batches, crossing epochs (the sampler rolls over by itself)."""
        group: list[LoadedBatch] = []
        for loaded in self.data.loader.stream():
            group.append(loaded)
            if len(group) == self.grad_accum:
                yield group
                group = []

    def _progress_bar(self):
        if not self.progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)

    def _sync(self) -> None:
        """Make phase timings honest on GPU, on log steps only (elsewhere they are not reported)."""
        if self.device.type == "cuda" and (self.step + 1) % self.log_every == 0:
            torch.cuda.synchronize(self.device)


def with_a_block(batch: DrafterBatch, mask_token_id: int) -> DrafterBatch:
    """The batch itself, or, when none of its samples yields a block (answers shorter than a block),
    the batch plus one unscored block: every rank must run forward and backward for DDP to reduce,
    and a block whose labels are all -100 adds nothing to the loss, the gradients or the metrics."""
    if batch.labels_NB.shape[0] > 0:
        return batch
    B = batch.labels_NB.shape[1]
    topk = {}
    if batch.topk_ids_NBK is not None:
        K = batch.topk_ids_NBK.shape[-1]
        topk = {"topk_logprobs_NBK": torch.zeros(1, B, K), "topk_ids_NBK": torch.zeros(1, B, K, dtype=torch.long)}
    return replace(
        batch,
        block_ids_NB=torch.full((1, B), mask_token_id, dtype=torch.long),
        block_seq_N=torch.zeros(1, dtype=torch.long),
        anchor_pos_N=torch.zeros(1, dtype=torch.long),
        labels_NB=torch.full((1, B), IGNORE, dtype=torch.long),
        **topk,
    )


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """Dotted key -> [saved value, current value] for every resolved setting that changed."""
    out: dict[str, list[Any]] = {}
    for section in sorted(set(before) | set(after)):
        a, b = before.get(section), after.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    out[f"{section}.{key}"] = [a.get(key), b.get(key)]
        elif a != b:
            out[section] = [a, b]
    return out
