"""The stage-2 trainer: AdamW + warmup/cosine on Accelerate, exact per-token loss over ranks.

    .venv/bin/python -m stage2_train train --config configs/default.yaml train.max_steps=20
    torchrun --standalone --nproc_per_node 2 -m stage2_train train --config configs/default.yaml

`Trainer(cfg, accelerator)` builds every component from the run config (data, drafter, optimizer,
schedules, metrics sink, detectors, checkpointer) and registers the stateful ones once
(`self.components`): a checkpoint is their `state_dict()`s, a resume their `load_state_dict()`s.
`fit()` is the whole loop; each optimizer step is `train_step()`: take this rank's grad_accum
micro-batches, all_reduce their label weight sum, `forward_backward()` each, `optimizer_step()`.
Logging (every log.every_steps, all ranks reduce the counts, rank 0 writes), the held-out offline
eval (rank 0, every eval.every_steps and at the end) and checkpointing (every rank, the
Checkpointer's contract) are called at fixed points in `fit()`, never inside a step.

The loss of a step is sum(w * CE) over every scored slot of every micro-batch on every rank,
divided by the step's global weight sum W, so 2 ranks x 1 micro-batch and 1 rank x 2 micro-batches
of the same global batch give the same loss and gradients: each rank backpropagates
sum_rank(w * CE) / (W / world_size) and DDP averages the ranks. The noise generator of micro-batch
j of the step (global index rank * grad_accum + micro) is seeded by (seed, step, j), so the layout
does not change the noise either. A micro-batch whose samples yield no block gets one unscored
block (`with_a_block`), so every rank still runs forward and backward.

A step whose loss or gradient norm is not finite changes no weight (the update is skipped and
logged); `train.max_nonfinite_steps` such steps in a row stop the run with DivergedError (exit 3),
and the checkpointer refuses non-finite weights, so the last good checkpoints survive.

The frozen embedding and LM head come from the target's safetensors, in the compute dtype; they are
non-persistent buffers, never trained, never in a checkpoint. Mixed precision: bf16 autocast on
GPU, fp32 on CPU (auto). Shape legend: N blocks, B block size, P = B - 1 scored positions.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.config import RunConfig
from shared.errors import CheckpointError, ConfigError, DataError, DivergedError
from shared.files import write_atomic
from shared.target_parts import load_embed_and_head, load_target_layers
from stage2_train.data.batch import DrafterBatch
from stage2_train.data.loader import LoadedBatch
from stage2_train.data.projection import basis as projection_basis
from stage2_train.data.projection import second_moment
from stage2_train.data.run_data import open_run_data, with_a_block
from stage2_train.data.view import TrainData
from stage2_train.model.drafter import DFlashDrafter, build_drafter, init_from_target_layers
from stage2_train.model.loss import (
    COUNT_KEYS,
    dflash_loss,
    finalize_metrics,
    objective_normalizer,
    sum_counts,
)
from stage2_train.observe.detectors import LiveDetectors, as_warning
from stage2_train.observe.metrics import MetricsSink
from stage2_train.train.checkpoint.format import (
    load_optimizer_state,
    optimizer_state,
    rng_state,
    set_rng_state,
    step_name,
)
from stage2_train.train.checkpoint.saver import Checkpointer
from stage2_train.train.config import TrainConfig
from stage2_train.train.evaluate import (
    empty_totals,
    flatten_totals,
    offline_row,
    offline_totals,
    unflatten_totals,
)
from stage2_train.train.preemption import EXIT_PREEMPTED, MARKER, Preempted, Preemption
from stage2_train.train.resume import find_resume_point
from stage2_train.train.schedules import NoiseSchedule, Optimizers, noise_generator, warmup_steps


@dataclass
class StepStats:
    """One optimizer step on this rank; tensors stay on the device until a log step reads them."""

    epoch: int
    step_in_epoch: int
    steps_in_epoch: int
    counts: dict[str, torch.Tensor]
    num_tokens: int  # context tokens of the whole step, all ranks
    num_samples: int  # all ranks
    grad_norm: torch.Tensor
    lr: float
    noise_std: float
    skipped: bool = False  # non-finite loss or gradients: no weight changed
    times: dict[str, float] = field(default_factory=dict)
    stop: str | None = None  # a rank was signalled (SIGTERM/SIGUSR1): every rank stops after this step


class Stateful:
    """A component of the checkpoint: how to take its state and how to put it back."""

    def __init__(self, save: Callable[[], Any], load: Callable[[Any], Any]):
        self.state_dict, self.load_state_dict = save, load


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        accelerator: Any,
        *,
        init_weights: dict[str, torch.Tensor] | None = None,
        progress: bool = True,
    ):
        self.cfg = cfg
        self.accelerator = accelerator
        self.device = accelerator.device
        self.rank, self.world_size = accelerator.process_index, accelerator.num_processes
        self.compute_dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
        self.show_progress = progress and self.rank == 0
        self.run_dir = Path(cfg.run_dir)
        self.sink = MetricsSink(cfg.log, self.run_dir, rank=self.rank, run_config=cfg.to_dict())
        self.data = self._build_data()
        self.model = self._build_model(init_weights)
        self.grad_accum = cfg.sampler.grad_accum
        # The schedule's length: epochs x epoch 0's steps (later epochs differ by a step or so and are
        # planned in the background as training reaches them), or train.max_steps when smaller.
        full_steps = self.data.sampler.estimated_total_steps(cfg.train.epochs)
        self.total_steps = min(full_steps, cfg.train.max_steps or full_steps)
        self.optimizers = Optimizers(self.model, cfg.optim, self.total_steps)
        self.ddp_model, *prepared = accelerator.prepare(self.model, *self.optimizers.all())
        self.optimizers.replace(prepared)
        self.noise = NoiseSchedule(cfg.noise)
        # The doctor's detectors, live: a spike, stall or cliff is a warning event the moment it shows.
        self.detectors = LiveDetectors(cfg.detectors)
        self.checkpointer = Checkpointer(
            cfg.checkpoint, cfg.checkpoint.resolve_dir(self.run_dir), self.sink, self.rank, self.world_size
        )
        self.info = self._run_info(init_weights is not None)
        self.step = 0  # optimizer steps done
        self.tokens_seen = 0
        self.elapsed_before = 0.0  # wall time of earlier runs of this training (resume)
        self.cpu_before = 0.0  # process CPU time of earlier runs (all threads: what a CPU run costs)
        self._cpu_start = time.process_time()
        self.nonfinite_in_a_row = 0
        self.last_row: dict[str, Any] = {}
        # Scored blocks of this epoch on this rank, kept on the device: reading it every step would
        # be a host sync before the optimizer's kernels are even launched.
        self.epoch_blocks = torch.zeros((), dtype=torch.long, device=self.device)
        self.last_eval: dict[str, Any] | None = None
        self.components = self._register_components()
        self._start = time.perf_counter()
        self._last_log = (0, 0, self._start)  # (step, tokens_seen, time) at the previous train row
        self._batches: Iterator[list[LoadedBatch]] | None = None
        self._bar = None
        self.preemption = Preemption()

    # ---- building -------------------------------------------------------------------------------
    def _build_data(self) -> TrainData:
        return open_run_data(self.cfg, rank=self.rank, world_size=self.world_size, pin_memory=self.device.type == "cuda")

    def _build_model(self, init_weights: dict[str, torch.Tensor] | None) -> DFlashDrafter:
        """The drafter from cfg.seed (identical on every rank) or from `init_weights`, with the
        target's frozen embedding and LM head in the compute dtype."""
        target = self.data.target
        embed_VH, lm_head_VH = load_embed_and_head(target.target_dir)
        weights = None if init_weights is None else {k: v.float() for k, v in init_weights.items()}
        projection = self._fit_projection() if self.cfg.model.feature_projection == "pca" else None
        if weights is not None and projection is not None:
            weights = project_init_weights(weights, projection)
        drafter = build_drafter(
            self.cfg.model,
            target.arch,
            len(target.layer_ids),
            target.mask_token_id,
            embed_VH,
            lm_head_VH,
            weights=weights,
            seed=self.cfg.seed,
            frozen_dtype=self.compute_dtype,
        )
        if projection is not None and weights is None:
            drafter.set_projection(projection)
        if weights is None and self.cfg.model.init == "target_layers":
            L, n = target.arch.num_hidden_layers, self.cfg.model.num_layers
            init_from_target_layers(drafter, load_target_layers(target.target_dir, list(range(L - n, L))))
        return drafter.train()

    def _fit_projection(self) -> torch.Tensor:
        """model.feature_projection=pca: the basis of the training split's features, fitted from
        every rank's share of the samples and one all_reduce of the second moments, so every rank
        holds the same bytes (stage2_train/data/projection.py)."""
        reader, train = self.data.train_reader, np.arange(len(self.data.train_reader))
        moment, tokens = second_moment(reader, train[self.rank :: self.world_size])
        if self.world_size > 1:
            packed = torch.cat([moment.reshape(-1), torch.tensor([float(tokens)], dtype=torch.float64)]).to(self.device)
            packed = self.accelerator.reduce(packed, reduction="sum").cpu()
            moment, tokens = packed[:-1].reshape(moment.shape), int(packed[-1])
        rank = self.cfg.model.projection_dim or self.data.target.arch.hidden_size
        P_RF, _ = projection_basis(moment, tokens, rank, self.cfg.model.projection_scale)
        if self.world_size > 1:  # rank 0's bytes everywhere: eigh on other CPUs (nodes) may differ in the last bits
            P_RF = P_RF.to(self.device)
            torch.distributed.broadcast(P_RF, src=0)
            P_RF = P_RF.cpu()
        return P_RF

    def _register_components(self) -> dict[str, Stateful]:
        """Every piece of state a resume needs, once: name -> how to save and load it."""
        data = self.data
        return {
            "model": Stateful(self.model.state_dict, self.model.load_state_dict),
            "optimizer": Stateful(
                lambda: self.optimizers.state_dict(optimizer_state),
                lambda s: self.optimizers.load_state_dict(s, load_optimizer_state),
            ),
            "scheduler": Stateful(self.optimizers.scheduler_state, self.optimizers.load_scheduler_state),
            "sampler": Stateful(data.loader.state_dict, data.loader.load_state_dict),
            "anchors": Stateful(data.anchors.state_dict, data.anchors.load_state_dict),
            "noise": Stateful(self.noise.state_dict, self.noise.load_state_dict),
            "detectors": Stateful(self.detectors.state_dict, self.detectors.load_state_dict),
            "rng": Stateful(rng_state, set_rng_state),  # this rank's: one file per rank
            "trainer": Stateful(self._progress_state, self._load_progress),
            "config": Stateful(lambda: self.info["config"], lambda _: None),  # compared before loading
        }

    def _run_info(self, initialised: bool) -> dict[str, Any]:
        """Everything about this run decided at start-up, built once: the config with the values
        resolved at run time (checkpoints compare them on resume) and the flat hyper-parameters
        (the run_start event and wandb)."""
        cfg, data = self.cfg, self.data
        resolved = {
            "layer_ids": data.target.layer_ids,
            "target_fingerprint": data.target.weights_sha256,
            "mask_token_id": data.target.mask_token_id,
            "world_size": self.world_size,
            "store": data.reader.url,
            "num_train_samples": len(data.train_indices),
            "num_heldout_samples": len(data.heldout_indices),
        }
        hyper = {
            **{f"optim.{k}": v for k, v in cfg.optim.to_dict().items()},
            "seed": cfg.seed,
            "epochs": cfg.train.epochs,
            "max_steps": cfg.train.max_steps,
            "total_steps": self.total_steps,
            "warmup_steps": warmup_steps(self.total_steps, cfg.optim),
            "steps_per_epoch": data.sampler.steps_per_epoch,
            "world_size": self.world_size,
            "grad_accum": cfg.sampler.grad_accum,
            "micro_batch_tokens": cfg.sampler.micro_batch_tokens,
            "tokens_per_step": cfg.sampler.micro_batch_tokens * cfg.sampler.grad_accum * self.world_size,
            "max_anchors_per_seq": cfg.sampler.max_anchors_per_seq,
            "block_size": cfg.model.block_size,
            "num_layers": cfg.model.num_layers,
            "init_from": cfg.model.init_from if initialised else None,
            "loss.gamma": cfg.loss.gamma,
            "loss.ce_weight": cfg.loss.ce_weight,
            "loss.kl_weight": cfg.loss.kl_weight,
            "noise.std": cfg.noise.std,
            "noise.warmup_steps": cfg.noise.warmup_steps,
            "noise.kind": cfg.noise.kind,
            "mixed_precision": self.accelerator.mixed_precision,
            "device": str(self.device),
            "recipe_warnings": cfg.recipe_warnings(),
        }
        return {
            "config": {**cfg.to_dict(), "resolved": resolved},
            "hyperparameters": hyper,
            "num_params": sum(p.numel() for p in self.model.parameters() if p.requires_grad),
            "num_frozen_params": sum(b.numel() for b in {id(b): b for b in self.model.buffers()}.values()),
            "train_tokens": int(data.train_reader.lengths.sum()),
        }

    # ---- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        try:
            resumed_from = self.resume()
            if self.rank == 0:  # only once the config has passed the store and checkpoint checks
                self.cfg.write_resolved(self.run_dir / "train_config.yaml")
                (self.run_dir / MARKER).unlink(missing_ok=True)  # this run continues what a preemption stopped
            if self.finished() and resumed_from is not None:
                return self._already_done(resumed_from)
            self.sink.event("run_start", self.step, **self.info, resumed_from=resumed_from)
            if self.rank == 0:
                for warning in self.info["hyperparameters"]["recipe_warnings"]:
                    print(f"note: {warning}", file=sys.stderr)
            self._start = time.perf_counter()
            self._cpu_start = time.process_time()
            self._last_log = (self.step, self.tokens_seen, self._start)
            self._batches = self._step_batches()
            self._bar = self._progress_bar()
            with self.preemption:
                while not self.finished():
                    self.mark_epoch_start()
                    stats = self.train_step()
                    if self.step % self.cfg.log.every_steps == 0 or self.finished() or stats.stop:
                        self.log_step(stats)
                    if stats.stop:
                        self.stop_preempted(stats.stop)
                    if self._eval_due():
                        self.evaluate()
                    self.mark_epoch_end(stats)
                    self.checkpointer.maybe_save(self.step, self.state_dict)
            self.evaluate(final=True)
            self.checkpointer.save(self.step, self.state_dict, blocking=True)  # skipped if just saved
        finally:
            if self._bar is not None:
                self._bar.close()
            self.data.close()
            self.checkpointer.finalize()
        summary = self.summary()
        self.sink.event("run_end", self.step, **summary)
        return summary

    def train_step(self) -> StepStats:
        """One optimizer step: this rank's grad_accum micro-batches, then the update."""
        start = time.perf_counter()
        loaded = next(self._batches)
        mask_id = self.data.target.mask_token_id
        batches = [with_a_block(lb.batch, mask_id).to(self.device, self.compute_dtype) for lb in loaded]
        # The pinned host buffers may be refilled once these copies have run (an event on this
        # rank's stream, no host sync); on CPU the batch may alias the buffer until the step ends.
        copied = None
        if self.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(self.device))
        data_s = time.perf_counter() - start  # waiting on the loader + issuing host-to-device copies
        # The step's global label weight sum, before any backward: the exact per-token normaliser.
        # A preemption flag rides in the same all_reduce: ranks agree on the step to stop after
        # without a collective of their own (read after the optimizer's sync, not here).
        weight_sum = sum(objective_normalizer(b, self.cfg.loss) for b in batches)
        signalled = torch.ones((), device=weight_sum.device) if self.preemption.requested else torch.zeros((), device=weight_sum.device)
        reduced = self.accelerator.reduce(torch.stack([weight_sum.float(), signalled]), reduction="sum")
        weight_sum, stop_votes = reduced[0], reduced[1]
        normalizer = weight_sum.clamp_min(1e-12) / self.world_size
        parts, forward_s, backward_s = [], 0.0, 0.0
        for micro, batch in enumerate(batches):
            counts, f_s, b_s = self.forward_backward(batch, micro, normalizer)
            parts.append(counts)
            forward_s, backward_s = forward_s + f_s, backward_s + b_s
        counts = sum_counts(parts)
        self.epoch_blocks = self.epoch_blocks + counts["num_blocks"].long()
        lr, grad_norm, skipped, optim_s = self.optimizer_step(counts)
        for lb in loaded:
            self.data.loader.release(lb, copied)
        first = loaded[0].ref
        stats = StepStats(
            epoch=first.epoch,
            step_in_epoch=first.step_in_epoch,
            steps_in_epoch=first.steps_in_epoch,
            counts=counts,
            num_tokens=first.step_tokens,
            num_samples=first.step_samples,
            grad_norm=grad_norm,
            lr=lr,
            noise_std=self.noise.std_at(self.step),
            skipped=skipped,
            times={"data_s": data_s, "forward_s": forward_s, "backward_s": backward_s, "optim_s": optim_s},
            stop=(self.preemption.requested or "a signal on another rank") if float(stop_votes) > 0 else None,
        )
        self.step += 1
        self.tokens_seen += stats.num_tokens
        return stats

    def forward_backward(
        self, batch: DrafterBatch, micro: int, normalizer: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], float, float]:
        """Noise, forward, loss, backward of one micro-batch; gradients sync on the last one only."""
        start = time.perf_counter()
        generator = noise_generator(self.cfg.seed, self.step, self.rank * self.grad_accum + micro, self.device)
        batch = replace(batch, context_TF=self.noise.apply(batch.context_TF, self.step, generator))
        last = micro == self.grad_accum - 1
        with nullcontext() if last else self.accelerator.no_sync(self.ddp_model):
            with self.accelerator.autocast():
                hidden_NBH = self.ddp_model(batch)
                loss, metrics = dflash_loss(hidden_NBH, self.model.lm_head_VH, batch, self.cfg.loss, normalizer)
            self._sync()
            mid = time.perf_counter()
            self.accelerator.backward(loss)
            self._sync()
        return {k: metrics[k] for k in COUNT_KEYS}, mid - start, time.perf_counter() - mid

    def optimizer_step(self, counts: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor, bool, float]:
        """Clip, AdamW, schedule; returns (lr used, grad norm before clipping, skipped, seconds).

        A non-finite loss or gradient norm skips the update (one host sync per optimizer step: the
        price of never writing NaN into the weights); too many in a row stop the run."""
        start = time.perf_counter()
        grad_norm = self.accelerator.clip_grad_norm_(self.ddp_model.parameters(), self.cfg.optim.grad_clip)
        lr = self.optimizers.last_lr()
        loss_sum = self.accelerator.reduce(counts["ce_sum"] + counts["kl_sum"], reduction="sum")
        finite = bool(torch.isfinite(torch.stack([grad_norm.float(), loss_sum.float()])).all())
        if finite:
            self.optimizers.step()
            self.nonfinite_in_a_row = 0
        else:
            self.nonfinite_in_a_row += 1
            self.sink.event("nonfinite_step", self.step + 1, grad_norm=grad_norm, loss_sum=loss_sum, in_a_row=self.nonfinite_in_a_row)
            if self.nonfinite_in_a_row > self.cfg.train.max_nonfinite_steps:
                raise DivergedError(
                    f"training diverged: {self.nonfinite_in_a_row} optimizer steps in a row (up to step {self.step + 1}) "
                    f"had a non-finite loss or gradient norm; no update was applied and no such checkpoint saved. "
                    f"Lower optim.lr, check the store with `python -m stage1_extract verify`, and resume from "
                    f"{self.checkpointer.dir}"
                )
        self.optimizers.schedule_step()
        self.optimizers.zero_grad()
        self._sync()
        return lr, grad_norm, not finite, time.perf_counter() - start

    # ---- fixed points of fit() ---------------------------------------------------------------
    def log_step(self, stats: StepStats) -> dict[str, Any]:
        """Reduce the step's counts over ranks and write one train row (every rank must call it)."""
        counts = self._reduce_counts(stats.counts)
        ratios = {k: v.tolist() if v.dim() else v.item() for k, v in finalize_metrics(counts, self.cfg.loss).items()}
        now = time.perf_counter()
        _, last_tokens, last_time = self._last_log
        step_s = sum(stats.times.values())
        row = {
            "epoch": stats.epoch,
            "step_in_epoch": stats.step_in_epoch,
            "steps_in_epoch": stats.steps_in_epoch,
            **ratios,
            "lr": stats.lr,
            "noise_std": stats.noise_std,
            "grad_norm": float(stats.grad_norm),
            "skipped_update": stats.skipped,
            "tokens": stats.num_tokens,
            "samples": stats.num_samples,
            "blocks": int(counts["num_blocks"]),
            "tok_per_s": (self.tokens_seen - last_tokens) / max(now - last_time, 1e-9),
            "data_wait_frac": stats.times["data_s"] / max(step_s, 1e-9),
            **{k: round(v, 6) for k, v in stats.times.items()},
            "step_s": round(step_s, 6),
            "elapsed_s": round(self.elapsed_s(), 3),
            "cpu_s": round(self.cpu_before + time.process_time() - self._cpu_start, 3),
        }
        self.sink.log(self.step, row)
        for event in self.detectors.update({"kind": "train", "step": self.step, **row}):
            self.sink.event("warning", event["step"], **as_warning(event))
        self._last_log = (self.step, self.tokens_seen, now)
        self.last_row = {k: row[k] for k in ("loss", "accuracy", "accept_len", "tok_per_s")}
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{row['loss']:.3f}", acc_len=f"{row['accept_len']:.2f}", tok_s=f"{row['tok_per_s']:.0f}")
            self._bar.update(self.step - self._bar.n)
        return row

    def stop_preempted(self, why: str) -> None:
        """Every rank agreed to stop after this step: save it synchronously, say so, and leave."""
        self.checkpointer.save(self.step, self.state_dict, blocking=True)
        path = self.checkpointer.dir / step_name(self.step)
        self.sink.event("preempted", self.step, signal=why, checkpoint=str(path), exit_code=EXIT_PREEMPTED)
        if self.rank == 0:
            write_atomic(self.run_dir / MARKER, json.dumps({"step": self.step, "signal": why, "checkpoint": str(path)}))
        raise Preempted(
            f"stopped by {why} after step {self.step}, saved {path}; run the same command again to resume from it "
            f"(exit {EXIT_PREEMPTED}; {self.run_dir / MARKER} says so to a job script)"
        )

    def mark_epoch_start(self) -> None:
        sampler = self.data.sampler
        if sampler.step_in_epoch == 0 and sampler.micro_step == 0:
            self.sink.event("epoch_start", self.step, epoch=sampler.epoch, steps_in_epoch=sampler.steps_per_epoch)

    def mark_epoch_end(self, stats: StepStats) -> None:
        """The epoch_end event; and a run whose epoch scored no block at all stops here (nothing to learn)."""
        if stats.step_in_epoch != stats.steps_in_epoch - 1:
            return
        blocks = int(self.accelerator.reduce(self.epoch_blocks.to(self.device), reduction="sum"))
        self.epoch_blocks = torch.zeros((), dtype=torch.long, device=self.device)
        self.sink.event("epoch_end", self.step, epoch=stats.epoch, blocks=blocks, elapsed_s=round(self.elapsed_s(), 3))
        if blocks == 0:
            raise DataError(
                f"epoch {stats.epoch} gave no block to train on: no training sample of {self.data.reader.url} has two "
                f"consecutive supervised tokens (loss_mask); check the data's assistant turns and loss masks"
            )

    def finished(self) -> bool:
        """Every epoch done (the sampler has rolled past the last one), or train.max_steps reached."""
        max_steps = self.cfg.train.max_steps
        return self.data.sampler.epoch >= self.cfg.train.epochs or (max_steps is not None and self.step >= max_steps)

    def _eval_due(self) -> bool:
        every = self.cfg.eval.every_steps
        return bool(every) and self.step % every == 0 and not self.finished()

    def evaluate(self, final: bool = False) -> dict[str, Any] | None:
        """The offline eval (`train/evaluate.py`: accuracy per position, accept_len, walk_tau and
        their standard errors) on the held-out samples, spread over the ranks: rank r scores samples
        r, r + W, ... of the first `eval.offline_max_samples`, and one all_reduce of the sums gives
        every rank the row one rank would compute. No rank waits in a collective while another
        evaluates alone (an NCCL timeout), and the eval takes 1/W of the time. A rank that fails
        says so in the same reduction, so every rank raises together.

        Evals during training score `eval.offline_max_anchors_per_seq` anchors per sample (null:
        every anchor, which adds walk_tau); the final one always scores every anchor."""
        cfg = self.cfg.eval
        anchors = None if final else cfg.offline_max_anchors_per_seq
        start = time.perf_counter()
        row = self._heldout_row(anchors)
        if row is None:
            return None
        row["eval_s"] = round(time.perf_counter() - start, 3)
        self.sink.log(self.step, row, kind="eval")
        # Eval time is not a stall; a held-out curve turning while training improves is a warning.
        for event in self.detectors.update({"kind": "eval", "step": self.step, **row}):
            self.sink.event("warning", event["step"], **as_warning(event))
        self.last_eval = {k: row.get(k) for k in ("ce", "accuracy", "accept_len", "walk_tau")}
        # checkpoint.keep_best compares the evals' common metric with the evals' own estimator:
        # walk_tau when they score every anchor, else accept_len over the same sampled anchors
        # (the final, dense eval's accept_len weighs blocks differently, so it is not compared).
        metric = "walk_tau" if cfg.offline_max_anchors_per_seq is None else "accept_len"
        value = row.get(metric)
        if final and metric == "accept_len" and self.cfg.checkpoint.keep_best:
            sampled = self._heldout_row(cfg.offline_max_anchors_per_seq, quiet=True)
            value = None if sampled is None else sampled["accept_len"]
        self.checkpointer.note_eval(self.step, value, self.state_dict, metric=metric)
        return row

    def _heldout_row(self, anchors: int | None, quiet: bool = False) -> dict[str, Any] | None:
        """The eval row of `anchors` per sample (None: every anchor), reduced over the ranks; None
        when there is nothing to score (said in an `eval_skipped` event unless `quiet`)."""
        data, cfg = self.data, self.cfg.eval
        if len(data.heldout_indices) == 0:
            return None
        mine = data.heldout_indices[: cfg.offline_max_samples][self.rank :: self.world_size].tolist()
        error: BaseException | None = None
        totals = empty_totals(self.model.block_size)
        try:
            totals = offline_totals(
                self.model,
                data.reader,
                mine,
                max_anchors_per_seq=anchors,
                batch_tokens=cfg.offline_batch_tokens,
                seed=self.cfg.seed,
                gamma=self.cfg.loss.gamma,
            )
        except Exception as exc:  # noqa: BLE001 - raised after the reduction, on every rank
            error = exc
        flat = torch.cat([flatten_totals(totals), torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64)])
        flat = self.accelerator.reduce(flat.to(self.device), reduction="sum").cpu()
        if error is not None:
            raise error
        if float(flat[-1]) > 0:
            raise RuntimeError("the held-out evaluation failed on another rank (its traceback is in that rank's log)")
        try:
            return offline_row(unflatten_totals(flat[:-1], self.model.block_size), self.cfg.loss.gamma, anchors is None)
        except ValueError as exc:  # e.g. no held-out sample long enough for one block
            if not quiet:
                self.sink.event("eval_skipped", self.step, reason=str(exc))
            return None

    def summary(self) -> dict[str, Any]:
        return {
            "steps": self.step,
            "total_steps": self.total_steps,
            "tokens_seen": self.tokens_seen,
            "elapsed_s": round(self.elapsed_s(), 2),
            "final_train": self.last_row,
            "final_eval": self.last_eval,
            "log": str(self.sink.path),
        }

    def _already_done(self, resumed_from: str) -> dict[str, Any]:
        """A finished training run again: nothing to train, nothing to save; the saved summary."""
        self.checkpointer.mark_saved(self.step)
        summary = {**self.summary(), "already_complete": True, "checkpoint": resumed_from}
        self.sink.event("run_already_complete", self.step, checkpoint=resumed_from)
        return summary

    # ---- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs (the checkpoint's schema): one entry per registered component."""
        return {name: component.state_dict() for name, component in self.components.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [name for name in self.components if name not in state]
        if missing:
            raise CheckpointError(f"checkpoint state lacks {missing}; it was written by another version")
        for name, component in self.components.items():
            component.load_state_dict(state[name])

    def _progress_state(self) -> dict[str, Any]:
        sampler = self.data.sampler
        return {
            "step": self.step,
            "epoch": sampler.epoch,
            "step_in_epoch": sampler.step_in_epoch,
            "tokens_seen": self.tokens_seen,
            "elapsed_s": self.elapsed_s(),
            "cpu_s": self.cpu_before + time.process_time() - self._cpu_start,
            "total_steps": self.total_steps,
            "world_size": self.world_size,
            "last_row": self.last_row,
            "last_eval": self.last_eval,
        }

    def _load_progress(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.elapsed_before = float(state["elapsed_s"])
        self.cpu_before = float(state.get("cpu_s", 0.0))
        self.last_row = state.get("last_row") or {}
        self.last_eval = state.get("last_eval")

    def resume(self) -> str | None:
        """Continue from the checkpoint `train.resume` chooses (`train/resume.py`: the one policy)."""
        point = find_resume_point(
            self.cfg.train.resume, self.cfg.train.resume_force, self.checkpointer, self.info["config"], self.rank
        )
        if point.state is not None:
            self.load_state_dict(point.state)
        if point.event is not None:
            self.sink.event("resume", self.step, **point.event)
        return None if point.path is None else str(point.path)

    # ---- helpers -------------------------------------------------------------------------------
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
        return self.elapsed_before + time.perf_counter() - self._start

    def _step_batches(self) -> Iterator[list[LoadedBatch]]:
        """Groups of grad_accum micro-batches, crossing epochs (the sampler rolls over by itself)."""
        group: list[LoadedBatch] = []
        for loaded in self.data.loader.stream():
            group.append(loaded)
            if len(group) == self.grad_accum:
                yield group
                group = []

    def _progress_bar(self):
        if not self.show_progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)

    def _sync(self) -> None:
        """Make phase timings honest on GPU, on log steps only (elsewhere they are not reported)."""
        if self.device.type == "cuda" and (self.step + 1) % self.cfg.log.every_steps == 0:
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.sink.close()


SHARDED_LAUNCHES = {  # accelerate launch's switches for modes whose state is not replicated on every rank
    "ACCELERATE_USE_FSDP": "FSDP",
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM",
}
MIXED_PRECISION = {"bf16": "bf16", "fp32": "no"}


def train_device(cfg: TrainConfig) -> str:
    """"cuda" or "cpu": `train.device` decides for training and evaluation alike."""
    cuda_ok = torch.cuda.is_available()
    if cfg.device == "cuda" and not cuda_ok:
        raise ConfigError("train.device=cuda but torch sees no CUDA device")
    return "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and cuda_ok) else "cpu"


def resolve_mixed_precision(cfg: TrainConfig, use_cuda: bool, launcher: str | None) -> str:
    """Accelerate's mixed_precision for this run. `accelerate launch` passes its config's choice in
    $ACCELERATE_MIXED_PRECISION: train.mixed_precision=auto follows it, an explicit setting that
    disagrees is refused naming both (never overridden in silence). fp16 is refused: it needs a loss
    scaler this trainer does not run, and bf16 is what DFlash drafters train in."""
    wanted = MIXED_PRECISION.get(cfg.mixed_precision, "bf16" if use_cuda else "no")
    if launcher in (None, "", wanted):
        return wanted
    if launcher == "fp16" or launcher not in ("bf16", "no"):
        raise ConfigError(
            f"accelerate launch is configured with mixed_precision={launcher}; this trainer runs bf16 or fp32 "
            f"(train.mixed_precision): set mixed_precision to bf16 or no in `accelerate config`"
        )
    if cfg.mixed_precision == "auto":
        return launcher
    raise ConfigError(
        f"train.mixed_precision={cfg.mixed_precision} but accelerate launch is configured with mixed_precision="
        f"{launcher}: set one of them to agree (train.mixed_precision=auto follows accelerate's)"
    )


def make_accelerator(cfg: TrainConfig) -> Any:
    """Accelerator on CUDA when there is one (or asked), else CPU (gloo under torchrun).

    Each rank's GPU is made current (`torch.cuda.set_device(LOCAL_RANK)`) before anything touches
    CUDA, so every default stream, event and allocation of this process is on its own device. FSDP,
    DeepSpeed and Megatron launches are refused by name: checkpoints here hold DDP-replicated state
    written once by rank 0, which sharded state would silently break."""
    from accelerate import Accelerator

    for var, name in SHARDED_LAUNCHES.items():
        if os.environ.get(var, "false").strip().lower() in ("1", "true", "yes", "y", "on"):
            raise ConfigError(
                f"accelerate launch is configured for {name} ({var}); this trainer keeps replicated DDP state "
                f"(its checkpoints write the model and optimizer once, from rank 0). The drafter fits every GPU "
                f"(`python -m stage2_train plan`): use distributed_type MULTI_GPU (`accelerate launch --multi_gpu`) "
                f"or torchrun"
            )
    use_cuda = train_device(cfg) == "cuda"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    mixed = resolve_mixed_precision(cfg, use_cuda, os.environ.get("ACCELERATE_MIXED_PRECISION"))
    # cpu=True matters under torchrun: a plain Accelerator() there trains each rank alone.
    accelerator = Accelerator(cpu=not use_cuda, mixed_precision=mixed)
    if accelerator.distributed_type.value in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        raise ConfigError(f"accelerate chose distributed_type {accelerator.distributed_type.value}; use MULTI_GPU or torchrun")
    if not use_cuda and cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    return accelerator


def project_init_weights(weights: dict[str, torch.Tensor], P_RF: torch.Tensor) -> dict[str, torch.Tensor]:
    """A full-feature drafter's weights (model.init_from) for a projected run: fc_r = W pinv(P),
    the least-squares fc on the basis (with P = U^T S^-1, pinv(P) = S U, so fc_r P = W on P's row
    space). A projected drafter has no full-feature form to start from but its own export."""
    if "projection_RF" in weights:
        return weights
    W_HF = weights["fc.weight"].double()
    if W_HF.shape[1] != P_RF.shape[1]:
        raise CheckpointError(
            f"model.init_from: its fc reads {W_HF.shape[1]} features, the projection expects {P_RF.shape[1]}"
        )
    return {**weights, "fc.weight": (W_HF @ torch.linalg.pinv(P_RF.double())).float(), "projection_RF": P_RF.float()}

