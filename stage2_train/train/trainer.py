"""The stage-2 trainer: AdamW + warmup/cosine on Accelerate, exact per-token loss over ranks.

    .venv/bin/python -m stage2_train train --config configs/default.yaml train.max_steps=20
    torchrun --standalone --nproc_per_node 2 -m stage2_train train --config configs/default.yaml

`Trainer(cfg, accelerator)` builds every component from the run config (data, drafter, optimizer,
schedules, metrics sink, detectors, checkpointer) and hands the stateful ones to the checkpointer,
which owns their registry: a checkpoint is their `state_dict()`s, a resume their `load_state_dict()`s.
`fit()` is the whole loop; each optimizer step is `train_step()`: take this rank's grad_accum
micro-batches, all_reduce their label weight sum, `forward_backward()` each, `optimizer_step()`.
Logging (every log.every_steps, all ranks reduce the counts, rank 0 writes), the held-out offline
eval (`train/evaluate.py`, spread over the ranks) and checkpointing (every rank, the Checkpointer's
contract) are called at fixed points in `fit()`, never inside a step.

The loss of a step is sum(w * CE) over every scored slot of every micro-batch on every rank,
divided by the step's global weight sum W, so 2 ranks x 1 micro-batch and 1 rank x 2 micro-batches
of the same global batch give the same loss and gradients: each rank backpropagates
sum_rank(w * CE) / (W / world_size) and DDP averages the ranks. The noise generator of micro-batch
j of the step (global index rank * grad_accum + micro) is seeded by (seed, step, j), so the layout
does not change the noise either. A micro-batch whose samples yield no block gets one unscored
block (`with_a_block`), so every rank still runs forward and backward. Micro-batches go to the GPU
one at a time (only the one in flight is on the device), and the context is noised in place.

A step whose loss or gradient norm is not finite changes no weight (the update is skipped and
logged); `train.max_nonfinite_steps` such steps in a row stop the run with DivergedError (exit 3),
and the checkpointer refuses non-finite weights, so the last good checkpoints survive.

The frozen embedding and LM head come from the target's safetensors, in the compute dtype; they are
non-persistent buffers, never trained, never in a checkpoint. Mixed precision: bf16 autocast on
GPU, fp32 on CPU (auto); the trained weights and the optimizer state stay fp32 (master weights).
Shape legend: N blocks, B block size, P = B - 1 scored positions.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch

from shared.config import RunConfig
from shared.errors import DataError, DivergedError, StoreError
from shared.files import write_atomic
from shared.freshness import Staleness, agreed_staleness
from shared.paths import RunPaths
from shared.target_parts import load_embed_and_head, load_target_layers
from stage2_train.data.batch import DrafterBatch
from stage2_train.data.loader import LoadedBatch
from stage2_train.data.projection import fit_distributed, project_init_weights
from stage2_train.data.run_data import open_run_data, with_a_block
from stage2_train.model.description import describe
from stage2_train.model.drafter import DFlashDrafter, build_drafter, init_from_target_layers
from stage2_train.model.loss import (
    count_keys,
    dflash_loss,
    logged_metrics,
    objective_normalizer,
    sum_counts,
)
from stage2_train.observe.detectors import LiveDetectors, as_warning
from stage2_train.observe.metrics import MetricsSink
from stage2_train.train.checkpoint.saver import Checkpointer
from stage2_train.train.evaluate import HeldoutEvaluator
from stage2_train.train.preemption import EXIT_PREEMPTED, Preempted, Preemption
from stage2_train.train.resume import find_resume_point
from stage2_train.train.schedules import NoiseSchedule, Optimizers, noise_generator
from stage2_train.train.state import Description, Progress, RngState, RunRecord, StepStats, run_info


class Trainer:
    def __init__(
        self, cfg: RunConfig, accelerator: Any, *, init_weights: dict[str, torch.Tensor] | None = None, progress: bool = True,
        initialised: bool | None = None,
    ):
        self.cfg, self.accelerator, self.device = cfg, accelerator, accelerator.device
        self.rank, self.world_size = accelerator.process_index, accelerator.num_processes
        self.compute_dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
        self.show_progress = progress and self.rank == 0
        self.paths = RunPaths.of(cfg)
        # The store is opened and checked against the config before anything is written: a store
        # that is missing, damaged or stale leaves no log, no wandb run and no checkpoint behind.
        self.data = open_run_data(cfg, rank=self.rank, world_size=self.world_size, pin_memory=self.device.type == "cuda")
        self.staleness = self._check_store()
        self.sink = MetricsSink(cfg.log, self.paths.run_dir, rank=self.rank, run_config=cfg.to_dict())
        self.description = describe(cfg.model, self.data.target)
        self.model = self._build_model(init_weights)
        self.grad_accum = cfg.train.grad_accum
        self.progress = Progress()
        # The schedule's length: epochs x epoch 0's steps (later epochs differ by a step or so and are
        # planned in the background as training reaches them), or train.max_steps when smaller.
        full_steps = self.data.sampler.estimated_total_steps(cfg.train.epochs)
        self.total_steps = min(full_steps, cfg.train.max_steps or full_steps)
        self.progress.total_steps, self.progress.world_size = self.total_steps, self.world_size
        self.optimizers = Optimizers(self.model, cfg.optim, self.total_steps)
        self.ddp_model, *prepared = accelerator.prepare(self.model, *self.optimizers.all())
        self.optimizers.replace(prepared)
        # prepare() wraps forward to cast its output to fp32 under mixed precision: a copy of the
        # [N, B, H] hidden states (1 GiB at the 8B preset) the loss never needs. fit() runs the
        # forward inside accelerator.autocast() itself, so the plain forward is what it calls.
        if "forward" in vars(self.model):
            del self.model.forward
        self.noise = NoiseSchedule(cfg.noise)
        # The doctor's detectors, live: a spike, stall or cliff is a warning event the moment it shows.
        self.detectors = LiveDetectors(cfg.detectors)
        self.heldout = HeldoutEvaluator(
            self.data.reader, self.data.heldout_indices, cfg.eval, seed=cfg.seed, gamma=cfg.loss.gamma,
            rank=self.rank, world_size=self.world_size, reduce_sum=self._reduce_sum, autocast=accelerator.autocast,
        )
        self.info = run_info(
            cfg, self.data, self.model, self.description, total_steps=self.total_steps, world_size=self.world_size,
            mixed_precision=accelerator.mixed_precision, device=self.device, initialised=init_weights is not None if initialised is None else initialised,
        )
        self.checkpointer = Checkpointer(cfg.checkpoint, self.paths.checkpoints, self.sink, self.rank, self.world_size)
        self.checkpointer.register({
            "model": self.model,
            "optimizer": self.optimizers,
            "scheduler": self.optimizers.schedule,
            "loader": self.data.loader,  # the sampler's position, which the loader serves from
            "anchors": self.data.anchors,
            "noise": self.noise,
            "detectors": self.detectors,
            "rng": RngState(),  # this rank's: one file per rank
            "trainer": self.progress,
            "config": RunRecord(self.info["config"]),  # compared before anything loads
            "drafter": Description(self.description),
        })
        self._last_log = (0, 0, time.perf_counter())  # (step, tokens_seen, time) at the previous train row
        self._eval_s_unlogged = 0.0  # evals since: not training time, or tok_per_s dips every eval.every_steps
        self._batches: Iterator[list[LoadedBatch]] | None = None
        self._bar = None
        self.preemption = Preemption()

    @property
    def step(self) -> int:
        return self.progress.step

    # ---- building -------------------------------------------------------------------------------
    def _check_store(self) -> Staleness:
        """`status`'s verdict on the store (shared/freshness.py), refused when stale unless
        train.allow_stale_store (then a `stale_store` event at the start says what differs). Rank 0
        computes it and broadcasts it, so all ranks raise or none do."""
        report = agreed_staleness(self.cfg, self.data.target, self.data.reader.manifest, self.rank, self.world_size)
        if not report.current and not self.cfg.train.allow_stale_store:
            raise StoreError(report.describe(self.data.reader.url))
        return report

    def _build_model(self, init_weights: dict[str, torch.Tensor] | None) -> DFlashDrafter:
        """The drafter this run's description says, from cfg.seed (identical on every rank) or from
        `init_weights`, with the target's frozen embedding and LM head in the compute dtype."""
        target = self.data.target
        embed_VH, lm_head_VH = load_embed_and_head(target.target_dir)
        weights = None if init_weights is None else {k: v.float() for k, v in init_weights.items()}
        projection = None
        if self.cfg.model.feature_projection == "pca":  # data/projection.py: the same bytes on every rank
            dim = self.cfg.model.projection_dim or target.arch.hidden_size
            projection = fit_distributed(
                self.data.train_reader, self.rank, self.world_size, dim, self.cfg.model.projection_scale,
                self._reduce_sum, self._broadcast, self.cfg.model.projection_fit_tokens, self.cfg.seed, self.device,
            )
        if weights is not None and projection is not None:
            weights = project_init_weights(weights, projection)
        drafter = build_drafter(
            self.description, embed_VH, lm_head_VH, runtime=self.cfg.model, weights=weights, seed=self.cfg.seed,
            frozen_dtype=self.compute_dtype,
        )
        if projection is not None and weights is None:
            drafter.set_projection(projection)
        if weights is None and self.cfg.model.init == "target_layers":
            L, n = target.arch.num_hidden_layers, self.cfg.model.num_layers
            init_from_target_layers(drafter, load_target_layers(target.target_dir, list(range(L - n, L))))
        return drafter.train()

    # ---- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        try:
            resumed_from = self.resume()
            if self.rank == 0:  # only once the config has passed the store and checkpoint checks
                self.cfg.write_resolved(self.paths.train_config)
                self.paths.preempted.unlink(missing_ok=True)  # this run continues what a preemption stopped
            # Done only after its final eval: a schedule shortened to a periodic save's step still owes it.
            if self.finished() and resumed_from is not None and (self.progress.last_eval or {}).get("final"):
                return self._already_done(resumed_from)
            self.sink.event("run_start", self.step, **self.info, resumed_from=resumed_from)
            self.detectors.run_started(self.info["hyperparameters"])  # as the doctor reads that event
            if not self.staleness.current:  # train.allow_stale_store: trained on it, on the record
                self.sink.event("stale_store", self.step, store=self.data.reader.url, **self.staleness.to_dict())
            if self.rank == 0:
                for warning in self.info["hyperparameters"]["recipe_warnings"]:
                    print(f"note: {warning}", file=sys.stderr)
            self.progress.restart_clock()
            self._last_log = (self.step, self.progress.tokens_seen, time.perf_counter())
            self._batches = self._step_batches()
            self._bar = self._progress_bar()
            if self.progress.eval_owed:  # the eval a preemption left at this step
                self.progress.eval_owed = False
                self.evaluate()
            with self.preemption:
                while not self.finished():
                    self.mark_epoch_start()
                    stats = self.train_step()
                    if self.step % self.cfg.log.every_steps == 0 or self.finished() or stats.stop:
                        self.log_step(stats)
                    if stats.stop and not self.finished():  # its epoch_end (a collective: every rank is here) first
                        self.mark_epoch_end(stats)
                        self.stop_preempted(stats.stop)
                    # A stop at the last step ends as a finished run does: its final eval and save below.
                    if self._eval_due():
                        self.evaluate()
                    self.mark_epoch_end(stats)
                    # The last step is saved once, after its final eval: a run lost in that eval is not done on disk.
                    if not self.finished():
                        self.checkpointer.maybe_save(self.step)
            self.evaluate(final=True)
            self.checkpointer.save(self.step, blocking=True)  # skipped if just saved (keep_best's new best)
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
        hosts = [with_a_block(lb.batch, mask_id) for lb in loaded]
        data_s = time.perf_counter() - start  # waiting on the loader
        # The step's global label weight sum, before any backward (from the host batches' labels):
        # the exact per-token normaliser. A preemption flag rides in the same all_reduce: ranks agree
        # on the step to stop after without a collective of their own (read after the optimizer's sync).
        weight_sum = sum(objective_normalizer(b, self.cfg.loss) for b in hosts).float().to(self.device)
        signalled = torch.ones((), device=self.device) if self.preemption.requested else torch.zeros((), device=self.device)
        reduced = self.accelerator.reduce(torch.stack([weight_sum, signalled]), reduction="sum")
        normalizer = reduced[0].clamp_min(1e-12) / self.world_size
        parts, forward_s, backward_s = [], 0.0, 0.0
        for micro, (lb, host) in enumerate(zip(loaded, hosts)):
            moved = time.perf_counter()
            batch = host.to(self.device, self.compute_dtype)  # one micro-batch on the device at a time
            copied = None
            if self.device.type == "cuda":  # the pinned host buffer may be refilled once this copy ran
                copied = torch.cuda.Event()
                copied.record(torch.cuda.current_stream(self.device))
            data_s += time.perf_counter() - moved
            counts, f_s, b_s = self.forward_backward(batch, micro, normalizer)
            del batch
            self.data.loader.release(lb, copied)  # on CPU the batch aliased the buffer until here
            parts.append(counts)
            forward_s, backward_s = forward_s + f_s, backward_s + b_s
        counts = sum_counts(parts)
        self.progress.add_blocks(counts["num_blocks"].long(), loaded[0].ref.epoch)
        lr, grad_norm, skipped, optim_s = self.optimizer_step(counts)
        first = loaded[0].ref
        stats = StepStats(
            epoch=first.epoch, step_in_epoch=first.step_in_epoch, steps_in_epoch=first.steps_in_epoch,
            counts=counts, num_tokens=first.step_tokens, num_samples=first.step_samples, grad_norm=grad_norm,
            lr=lr, noise_std=self.noise.std_at(self.step), skipped=skipped,
            times={"data_s": data_s, "forward_s": forward_s, "backward_s": backward_s, "optim_s": optim_s},
            stop=(self.preemption.requested or "a signal on another rank") if float(reduced[1]) > 0 else None,
        )
        self.progress.step += 1
        self.progress.tokens_seen += stats.num_tokens
        self.progress.epoch, self.progress.step_in_epoch = self.data.sampler.epoch, self.data.sampler.step_in_epoch
        return stats

    def forward_backward(
        self, batch: DrafterBatch, micro: int, normalizer: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], float, float]:
        """Noise, forward, loss, backward of one micro-batch; gradients sync on the last one only."""
        start = time.perf_counter()
        generator = noise_generator(self.cfg.seed, self.step, self.rank * self.grad_accum + micro, self.device)
        self.noise.apply_(batch.context_TF, self.step, generator)
        last = micro == self.grad_accum - 1
        with nullcontext() if last else self.accelerator.no_sync(self.ddp_model):
            with self.accelerator.autocast():
                hidden_NBH = self.ddp_model(batch)
                loss, metrics = dflash_loss(hidden_NBH, self.model.lm_head_VH, batch, self.cfg.loss, normalizer, variant=self.model)
            self._sync()
            mid = time.perf_counter()
            self.accelerator.backward(loss)
            self._sync()
        return {k: metrics[k] for k in count_keys(metrics)}, mid - start, time.perf_counter() - mid

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
            self.progress.nonfinite_in_a_row = 0
        else:
            self.progress.nonfinite_in_a_row += 1
            self.sink.event("nonfinite_step", self.step + 1, grad_norm=grad_norm, loss_sum=loss_sum, in_a_row=self.progress.nonfinite_in_a_row)
            if self.progress.nonfinite_in_a_row > self.cfg.train.max_nonfinite_steps:
                raise DivergedError(
                    f"training diverged: {self.progress.nonfinite_in_a_row} optimizer steps in a row (up to step {self.step + 1}) "
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
        ratios = logged_metrics(counts, self.cfg.loss)
        now = time.perf_counter()
        _, last_tokens, last_time = self._last_log
        step_s = sum(stats.times.values())
        row = {
            "epoch": stats.epoch, "step_in_epoch": stats.step_in_epoch, "steps_in_epoch": stats.steps_in_epoch,
            **ratios,
            # Drafts past the first N are scored among the label and the target's top-k only: this row's
            # accuracy and loss are then not the held-out rows' full-vocabulary ones (the doctor reads it).
            "full_vocab_slots": self.cfg.loss.full_vocab_slots,
            "lr": stats.lr, "noise_std": stats.noise_std, "grad_norm": float(stats.grad_norm),
            "skipped_update": stats.skipped, "tokens": stats.num_tokens, "samples": stats.num_samples,
            "blocks": int(counts["num_blocks"]),
            "tok_per_s": (self.progress.tokens_seen - last_tokens) / max(now - last_time - self._eval_s_unlogged, 1e-9),
            "data_wait_frac": stats.times["data_s"] / max(step_s, 1e-9),
            **{k: round(v, 6) for k, v in stats.times.items()},
            "step_s": round(step_s, 6), "elapsed_s": round(self.progress.elapsed_s(), 3), "cpu_s": round(self.progress.cpu_s(), 3),
        }
        self.sink.log(self.step, row)
        for event in self.detectors.update({"kind": "train", "step": self.step, **row}):
            self.sink.event("warning", event["step"], **as_warning(event))
        self._last_log, self._eval_s_unlogged = (self.step, self.progress.tokens_seen, now), 0.0
        self.progress.last_row = {k: row[k] for k in ("loss", "accuracy", "accept_len", "tok_per_s")}
        if self._bar is not None:
            if row["loss"] is not None:
                self._bar.set_postfix(loss=f"{row['loss']:.3f}", acc_len=f"{row['accept_len']:.2f}", tok_s=f"{row['tok_per_s']:.0f}")
            self._bar.update(self.step - self._bar.n)
        return row

    def stop_preempted(self, why: str) -> None:
        """Every rank agreed to stop after this step: save it synchronously, say so, and leave. An eval
        due at this step is owed (the grace period is for the save): the resumed run runs it first."""
        self.progress.eval_owed = self._eval_due()
        if self.progress.eval_owed:
            self.sink.event("eval_skipped", self.step, reason="preempted: the resumed run evaluates this step first")
        self.checkpointer.save(self.step, blocking=True)
        path = self.paths.step(self.step)
        self.sink.event("preempted", self.step, signal=why, checkpoint=str(path), exit_code=EXIT_PREEMPTED)
        if self.rank == 0:
            write_atomic(self.paths.preempted, json.dumps({"step": self.step, "signal": why, "checkpoint": str(path)}))
        raise Preempted(
            f"stopped by {why} after step {self.step}, saved {path}; run the same command again to resume from it "
            f"(exit {EXIT_PREEMPTED}; {self.paths.preempted} says so to a job script)"
        )

    def mark_epoch_start(self) -> None:
        sampler = self.data.sampler
        if sampler.step_in_epoch == 0 and sampler.micro_step == 0:
            self.sink.event("epoch_start", self.step, epoch=sampler.epoch, steps_in_epoch=sampler.steps_per_epoch)

    def mark_epoch_end(self, stats: StepStats) -> None:
        """The epoch_end event; and a run whose epoch scored no block at all stops here (nothing to learn)."""
        if stats.step_in_epoch != stats.steps_in_epoch - 1:
            return
        blocks = int(self.accelerator.reduce(torch.as_tensor(self.progress.epoch_blocks, device=self.device), reduction="sum"))
        self.progress.epoch_blocks = 0
        self.sink.event("epoch_end", self.step, epoch=stats.epoch, blocks=blocks, elapsed_s=round(self.progress.elapsed_s(), 3))
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
        """The held-out row (`HeldoutEvaluator`: accuracy per position, accept_len, walk_tau and their
        standard errors). Evals during training score `eval.offline_max_anchors_per_seq` anchors per
        sample (null: every anchor, which adds walk_tau); the final one always scores every anchor."""
        sampled = self.cfg.eval.offline_max_anchors_per_seq
        start = time.perf_counter()
        row = self.heldout.row(self.model, None if final else sampled)
        if isinstance(row, str):
            self.sink.event("eval_skipped", self.step, reason=row)
        if not isinstance(row, dict):
            return None
        row["eval_s"] = round(time.perf_counter() - start, 3)
        self._eval_s_unlogged += row["eval_s"]
        self.sink.log(self.step, row, kind="eval")
        # Eval time is not a stall; a held-out curve turning while training improves is a warning.
        for event in self.detectors.update({"kind": "eval", "step": self.step, **row}):
            self.sink.event("warning", event["step"], **as_warning(event))
        self.progress.last_eval = {**{k: row.get(k) for k in ("ce", "accuracy", "accept_len", "walk_tau")}, "final": final}
        # checkpoint.keep_best compares the evals' common metric with the evals' own estimator:
        # walk_tau when they score every anchor, else accept_len over the same sampled anchors
        # (the final, dense eval's accept_len weighs blocks differently, so it is not compared), on the
        # same held-out samples (`basis`: a resume that changed them starts the comparison anew).
        metric = "walk_tau" if sampled is None else "accept_len"
        value = row.get(metric)
        if final and metric == "accept_len" and self.cfg.checkpoint.keep_best:
            again = self.heldout.row(self.model, sampled)
            value = again["accept_len"] if isinstance(again, dict) else None
        basis = {"offline_max_samples": self.cfg.eval.offline_max_samples, "offline_max_anchors_per_seq": sampled}
        self.checkpointer.note_eval(self.step, value, metric=metric, basis=basis)
        return row

    def summary(self) -> dict[str, Any]:
        return {
            "steps": self.step, "total_steps": self.total_steps, "tokens_seen": self.progress.tokens_seen,
            "elapsed_s": round(self.progress.elapsed_s(), 2), "final_train": self.progress.last_row,
            "final_eval": self.progress.last_eval, "log": str(self.sink.path),
        }

    def _already_done(self, resumed_from: str) -> dict[str, Any]:
        """A finished training run again: nothing to train, nothing to save; the saved summary."""
        self.checkpointer.mark_saved(self.step)
        summary = {**self.summary(), "already_complete": True, "checkpoint": resumed_from}
        self.sink.event("run_already_complete", self.step, checkpoint=resumed_from)
        return summary

    # ---- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs (the checkpoint's schema): the checkpointer's registry."""
        return self.checkpointer.state_dict()

    def resume(self) -> str | None:
        """Continue from the checkpoint `train.resume` chooses (`train/resume.py`: the one policy)."""
        point = find_resume_point(
            self.cfg.train.resume, self.cfg.train.resume_force, self.checkpointer, self.info, self.rank,
            plan_difference=self.data.loader.sampler.plan_difference,
        )
        if point.state is not None:
            self.checkpointer.load_state_dict(point.state)
            # On disk already: an eval at this step that is a new best points `best` at it, never
            # rewrites the checkpoint it was resumed from.
            self.checkpointer.resumed_at(self.step, point.path)
        if point.event is not None:
            self.sink.event("resume", self.step, **point.event)
        return None if point.path is None else str(point.path)

    # ---- helpers -------------------------------------------------------------------------------
    def _reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor.to(self.device), reduction="sum")

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor on every rank (a collective: every rank calls it)."""
        on_device = tensor.to(self.device)
        torch.distributed.broadcast(on_device, src=0)
        return on_device.cpu()

    def _reduce_counts(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sum the count tensors (the loss's COUNT_KEYS and its variant's) over ranks in one all_reduce;
        returns CPU tensors. Every rank runs the same variant, so every rank has the same keys."""
        flat = self._reduce_sum(torch.cat([local[k].reshape(-1).float() for k in count_keys(local)])).cpu()
        out, offset = {}, 0
        for k in count_keys(local):
            size = local[k].numel()
            out[k] = flat[offset : offset + size].reshape(local[k].shape)
            offset += size
        return out

    def _step_batches(self) -> Iterator[list[LoadedBatch]]:
        """Groups of grad_accum micro-batches, crossing epochs (the sampler rolls over by itself)."""
        group: list[LoadedBatch] = []
        for loaded in self.data.loader.stream():
            group.append(loaded)
            if len(group) == self.grad_accum:
                yield group
                group = []

    def _progress_bar(self):
        from tqdm.auto import tqdm

        return tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True) if self.show_progress else None

    def _sync(self) -> None:
        """Make phase timings honest on GPU, on log steps only (elsewhere they are not reported)."""
        if self.device.type == "cuda" and (self.step + 1) % self.cfg.log.every_steps == 0:
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.sink.close()
