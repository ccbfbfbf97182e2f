"""Length-mixed, padding-free batching under a token and a block budget, balanced across ranks,
resumable exactly.

    .venv/bin/python -m stage2_train batches --steps 20 --json   # data/steps.py describe_steps() of the plan

Memory is spent per block (anchors x block size rows through the drafter and its LM head), not per
token: short, fully supervised answers give about one block per token, long prompts with short
answers few. So a micro-batch has two budgets, `micro_batch_tokens` (the context) and
`micro_batch_blocks` (the blocks its samples yield, `AnchorSampler.block_counts`, known from the
store's per-sample counts without reading a feature), and no micro-batch exceeds either.

An epoch is planned globally (identically on every rank) from (seed, epoch, lengths, blocks):

1. Shuffle all sample indices, stratified by length so that every stretch of the order holds
   each length range in its data-set share.
2. One optimizer step is M = world_size * grad_accum micro-batches ("bins") within both budgets
   (and `max_samples_per_batch` samples). For each step, pull the next samples of the shuffled
   order until the window holds (1 + window_slack) * M times either budget (whichever fills first),
   then place them longest first, each into the least-loaded bin (load: the larger of its token and
   block shares of the budgets, so the ranks' work, which blocks dominate, is balanced too) when it
   fits there. Samples carried over from the previous step are placed first, so no sample waits
   more than a step or two. What does not fit (mostly the shortest samples of the window) carries
   to the next step. Every step is thus a random draw of the whole data set: lengths mix within
   each micro-batch, each step and each rank, and no run of steps (nor the epoch end) collects the
   long samples.
3. The samples of the last two steps are dealt alternately (longest first) into two steps when
   they fit, so the epoch's tail is not a near-empty step with idle ranks. A final micro-batch
   still empty takes the shortest sample of a crowded one before it. A data set too small to
   give every micro-batch a sample is a ValueError.

Every sample appears exactly once per epoch on exactly one rank, nothing is dropped or repeated,
and every rank runs the same number of steps (DDP needs it). Bin j of a step goes to rank
j // grad_accum as its micro-batch j % grad_accum. Resume state is (epoch, step_in_epoch,
micro_step, seed) plus the settings that shape the plan (both budgets among them), checked on load.

Cost at scale (902K samples, 32 micro-batches per step: ~1 s per plan, `bench/sampler.py`): each
rank builds each epoch's plan exactly once (`plan_builds` counts them), kept compactly (one index
array plus offsets, ~8 bytes per sample) for the current and the next epoch only. The next epoch is
planned in a background thread as soon as an epoch's micro-batches start flowing (`upcoming`), so
no epoch boundary waits for planning; start-up plans epoch 0 alone, and the run's length is
`estimated_total_steps` (epochs x epoch 0's steps; later epochs differ by a step or so).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from shared.errors import CheckpointError, DataError
from stage2_train.data.config import SamplerConfig
from stage2_train.data.packing import Budgets, fill_empty_bins, lpt, stratified_order


class EpochPlan:
    """A global epoch plan: steps x (world_size * grad_accum) micro-batches x sample indices, kept as
    one index array and offsets (a list of lists of Python ints costs ~5x the memory at 900K
    samples). `plan[step]` is that step's micro-batches as lists."""

    def __init__(self, steps: list[list[list[int]]], num_bins: int, lengths: np.ndarray, blocks: np.ndarray):
        self.num_bins = num_bins
        flat = [i for step in steps for b in step for i in b]
        self.indices = np.asarray(flat, dtype=np.int64)
        sizes = [len(b) for step in steps for b in step]
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        per_step = self.offsets[::num_bins]
        token_cum = np.concatenate([[0], np.cumsum(lengths[self.indices])])
        block_cum = np.concatenate([[0], np.cumsum(blocks[self.indices])])
        self.step_tokens = np.diff(token_cum[per_step])
        self.step_blocks = np.diff(block_cum[per_step])
        self.step_samples = np.diff(per_step)

    def __len__(self) -> int:
        return len(self.step_tokens)

    def __getitem__(self, step: int) -> list[list[int]]:
        if not 0 <= step < len(self):
            raise IndexError(f"step {step} outside the epoch's {len(self)} steps")
        return [self.bin(step, b) for b in range(self.num_bins)]

    def __iter__(self) -> Iterator[list[list[int]]]:
        return (self[s] for s in range(len(self)))

    def bin(self, step: int, b: int) -> list[int]:
        j = step * self.num_bins + b
        return self.indices[self.offsets[j] : self.offsets[j + 1]].tolist()

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, EpochPlan)
            and np.array_equal(self.indices, other.indices)
            and np.array_equal(self.offsets, other.offsets)
        )




class MicroBatchRef(NamedTuple):
    """One micro-batch of this rank and where it sits in the run."""

    epoch: int
    step_in_epoch: int
    micro_step: int  # 0 .. grad_accum-1 inside the optimizer step
    indices: list[int]
    steps_in_epoch: int = 0
    step_tokens: int = 0  # context tokens of the whole optimizer step, all ranks
    step_samples: int = 0  # samples of the whole optimizer step, all ranks
    step_blocks: int = 0  # blocks of the whole optimizer step, all ranks


# Settings that change the plan: a resume under different values would not replay the same batches.
_PLAN_KEYS = (
    "seed", "world_size", "grad_accum", "micro_batch_tokens", "micro_batch_blocks", "max_samples_per_batch", "window_slack",
)
# The settings behind each planned quantity, for a refused resume.
_CAUSES = {
    "seed": "seed",
    "world_size": "the number of ranks",
    "grad_accum": "train.grad_accum",
    "micro_batch_tokens": "sampler.micro_batch_tokens",
    "micro_batch_blocks": "sampler.micro_batch_blocks (null: derived from micro_batch_tokens); absent: a checkpoint "
    "saved before micro-batches had a block budget",
    "max_samples_per_batch": "sampler.max_samples_per_batch",
    "window_slack": "sampler.window_slack",
    "num_samples": "the training split (eval.holdout_fraction, eval.split_seed) or the store's samples",
    "lengths_digest": "the training split (eval.holdout_fraction, eval.split_seed) or the store's samples",
    "blocks_digest": "the samples' blocks (sampler.max_anchors_per_seq, loss.distill_positions, the store's loss masks)",
}


def start_anew(checkpoint: str = "<its step folder>", weights_fit: bool = True) -> str:
    """The ways to train on when a checkpoint cannot be resumed: the fix of every refused resume
    (here, the lowest place that refuses one; train/resume.py names the checkpoint). Its weights are
    a start only when they fit this run's drafter (`weights_fit`)."""
    fresh = "To start anew: train.resume=never starts over in this run_dir, run_dir=<another folder> starts a new run"
    if not weights_fit:
        return fresh
    return f"{fresh}, and model.init_from={checkpoint} with either starts from that checkpoint's weights"


def refuse_over_budget(counts: np.ndarray, budget: int, what: str, fix: str) -> None:
    """A sample larger than a micro-batch's budget can never be placed: name the first and how many."""
    over = np.flatnonzero(counts > budget)
    if len(over):
        i = int(over[0])
        raise DataError(f"sample {i} {what.format(int(counts[i]))}={budget} ({len(over)} samples); {fix}")

class LengthMixedSampler:
    """Yields this rank's micro-batches (lists of sample indices) for the rest of the current epoch.

    Position advances as micro-batches are handed out; after the last micro-batch of epoch e the
    sampler is at (e + 1, 0), so `for epoch in ...: for batch in sampler:` walks epochs in turn.
    """

    def __init__(
        self,
        cfg: SamplerConfig,
        lengths: np.ndarray,
        *,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        grad_accum: int = 1,
        blocks: np.ndarray | None = None,
    ):
        """`grad_accum` (train.grad_accum): micro-batches per optimizer step on each rank. `blocks`:
        each sample's blocks per epoch (`AnchorSampler.block_counts`); None counts every sample at the
        most it can yield, min(length - 1, max_anchors_per_seq), which keeps the block budget but
        packs samples with short answers loosely."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        self.cfg = cfg
        if grad_accum < 1:
            raise ValueError(f"train.grad_accum must be >= 1, got {grad_accum}")
        self.grad_accum = grad_accum
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1 or len(self.lengths) == 0:
            raise ValueError(f"lengths must be a non-empty 1-D array, got shape {self.lengths.shape}")
        refuse_over_budget(self.lengths, cfg.micro_batch_tokens, "has {} tokens, more than sampler.micro_batch_tokens",
                           "raise the budget or re-extract with a shorter data.max_length")
        empty = np.flatnonzero(self.lengths < 1)
        if len(empty):
            raise ValueError(f"sample {int(empty[0])} has {int(self.lengths[empty[0]])} tokens; must be >= 1")
        self.micro_batch_blocks = cfg.blocks_budget()
        self.blocks_exact = blocks is not None  # counted from the store (the loader holds each sample to it), else a bound
        if blocks is None:
            blocks = np.minimum(self.lengths - 1, cfg.max_anchors_per_seq)
        self.blocks = np.asarray(blocks, dtype=np.int64)
        if self.blocks.shape != self.lengths.shape or (self.blocks < 0).any():
            raise ValueError(f"blocks must be {len(self.lengths)} counts >= 0, one per sample, got shape {self.blocks.shape}")
        refuse_over_budget(self.blocks, self.micro_batch_blocks, "yields {} blocks, more than sampler.micro_batch_blocks",
                           "raise it to at least sampler.max_anchors_per_seq")
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.num_bins = world_size * grad_accum
        if len(self.lengths) < self.num_bins:
            raise DataError(
                f"{len(self.lengths)} samples cannot fill world_size * grad_accum = {self.num_bins} "
                f"micro-batches per step"
            )
        self._lengths_digest = hashlib.sha1(self.lengths.tobytes()).hexdigest()[:16]
        self._blocks_digest = hashlib.sha1(self.blocks.tobytes()).hexdigest()[:16]
        self._lens = self.lengths.tolist()  # the planner's inner loops index Python ints, not numpy
        self._blks = self.blocks.tolist()
        self._plans: dict[int, EpochPlan] = {}
        self._planning: dict[int, threading.Thread] = {}
        self._plan_errors: dict[int, BaseException] = {}
        self._lock = threading.Lock()
        self.plan_builds = 0  # plans built since construction (one per epoch is the design)
        self.epoch = 0
        self.step_in_epoch = 0
        self.micro_step = 0
        # Fail at construction, not at the first step, if the data cannot be planned.
        self._steps_epoch0 = len(self.plan_epoch(0))

    # ---- planning -------------------------------------------------------------------------
    def plan_epoch(self, epoch: int) -> EpochPlan:
        """The global plan of `epoch`, identical on every rank; built once, waiting for a background
        build of it if one is under way. Plans of epochs before the current one are dropped."""
        with self._lock:
            plan = self._plans.get(epoch)
            thread = self._planning.get(epoch)
        if plan is not None:
            return plan
        if thread is None:
            self._build_into_cache(epoch)
        else:
            thread.join()
        with self._lock:
            if epoch in self._plan_errors:
                raise self._plan_errors.pop(epoch)
            return self._plans[epoch]

    def prepare(self, epoch: int) -> None:
        """Start building `epoch`'s plan in a background thread, unless it exists or is under way."""
        with self._lock:
            if epoch in self._plans or epoch in self._planning:
                return
            thread = threading.Thread(target=self._build_into_cache, args=(epoch,), name="dflash-plan", daemon=True)
            self._planning[epoch] = thread
        thread.start()

    def _build_into_cache(self, epoch: int) -> None:
        try:
            plan = self._build_plan(epoch)
        except BaseException as exc:  # noqa: BLE001 - raised by plan_epoch on the consumer's thread
            with self._lock:
                self._plan_errors[epoch] = exc
                self._planning.pop(epoch, None)
            return
        with self._lock:
            self.plan_builds += 1
            self._plans[epoch] = plan
            self._planning.pop(epoch, None)
            for old in [e for e in self._plans if e < min(self.epoch, epoch)]:
                del self._plans[old]

    def _build_plan(self, epoch: int) -> EpochPlan:
        cfg, lens, blks, num_bins = self.cfg, self._lens, self._blks, self.num_bins
        budgets = Budgets(cfg.micro_batch_tokens, self.micro_batch_blocks, cfg.max_samples_per_batch or len(lens))
        order_arr = stratified_order(self.lengths, np.random.default_rng([self.seed, epoch]))
        order = order_arr.tolist()
        cum_tokens = np.cumsum(self.lengths[order_arr]).tolist()
        cum_blocks = np.cumsum(self.blocks[order_arr]).tolist()
        # Integer targets: a float key would make bisect compare 900K ints with a float each call.
        window_tokens = int((1.0 + cfg.window_slack) * num_bins * budgets.tokens)
        window_blocks = int((1.0 + cfg.window_slack) * num_bins * budgets.blocks)
        window_count = int((1.0 + cfg.window_slack) * num_bins * budgets.samples)
        longest_first = lens.__getitem__
        steps: list[list[list[int]]] = []
        carry: list[int] = []
        pos = 0
        while pos < len(order) or carry:
            carry_tokens, carry_blocks = sum(lens[i] for i in carry), sum(blks[i] for i in carry)
            before_tokens = cum_tokens[pos - 1] if pos else 0
            before_blocks = cum_blocks[pos - 1] if pos else 0
            # Smallest end such that carry + order[pos:end] reaches the window's token or block target.
            end = 1 + min(
                bisect.bisect_left(cum_tokens, before_tokens + window_tokens - carry_tokens),
                bisect.bisect_left(cum_blocks, before_blocks + window_blocks - carry_blocks),
            )
            end = max(pos, min(end, len(order), pos + window_count - len(carry)))
            window = order_arr[pos:end]
            fresh = window[np.argsort(-self.lengths[window], kind="stable")].tolist()  # ties keep order
            pos = end
            carried = sorted(carry, key=longest_first, reverse=True)
            bins, carry = lpt(carried + fresh, lens, blks, num_bins, budgets)
            steps.append(bins)
        if len(steps) >= 2:
            # Deal the last two steps' samples, longest first, alternately into two steps of equal mix.
            pool = sorted((i for b in steps[-2] + steps[-1] for i in b), key=lambda i: (-lens[i], i))
            first, left_first = lpt(pool[0::2], lens, blks, num_bins, budgets)
            second, left_second = lpt(pool[1::2], lens, blks, num_bins, budgets)
            if not left_first and not left_second and all(first) and all(second):
                steps[-2:] = [first, second]
        fill_empty_bins(steps, lens, blks, budgets, epoch)
        return EpochPlan(steps, num_bins, self.lengths, self.blocks)

    # ---- this rank's view -----------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in the current epoch (it varies by a step or so between epochs)."""
        return len(self.plan_epoch(self.epoch))

    def estimated_total_steps(self, num_epochs: int) -> int:
        """num_epochs x the steps of epoch 0 (already planned): the LR schedule's length. Planning
        every epoch up front would cost each rank ~1 s per epoch at 900K samples; later epochs
        differ from epoch 0 by a step or so, and the schedule holds its final value past its end."""
        return num_epochs * self._steps_epoch0

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of `epoch`. Not needed between epochs: iteration rolls over by itself."""
        self.epoch, self.step_in_epoch, self.micro_step = epoch, 0, 0

    def remaining(self) -> list[MicroBatchRef]:
        """This rank's micro-batches from the current position to the end of the epoch; moves nothing."""
        return list(self._epoch_refs(self.epoch, self.step_in_epoch, self.micro_step))

    def upcoming(self) -> Iterator[MicroBatchRef]:
        """This rank's micro-batches from the current position on, through every later epoch, without
        end; moves nothing. The position is read now, not when the iterator is first advanced. As
        soon as an epoch's first micro-batch is handed out, the next epoch's plan is started in the
        background, so crossing the boundary finds it ready."""
        epoch, step, micro = self.epoch, self.step_in_epoch, self.micro_step

        def refs() -> Iterator[MicroBatchRef]:
            for e in itertools.count(epoch):
                self.prepare(e + 1)
                yield from self._epoch_refs(e, step if e == epoch else 0, micro if e == epoch else 0)

        return refs()

    def _epoch_refs(self, epoch: int, from_step: int, from_micro: int) -> Iterator[MicroBatchRef]:
        plan = self.plan_epoch(epoch)
        ga = self.grad_accum
        num_steps = len(plan)
        for step in range(from_step, num_steps):
            tokens, samples, blocks = int(plan.step_tokens[step]), int(plan.step_samples[step]), int(plan.step_blocks[step])
            for micro in range(from_micro if step == from_step else 0, ga):
                indices = plan.bin(step, self.rank * ga + micro)
                yield MicroBatchRef(epoch, step, micro, indices, num_steps, tokens, samples, blocks)

    def mark_consumed(self, ref: MicroBatchRef) -> None:
        """Advance past `ref`, which must be the micro-batch at the current position."""
        here = (self.epoch, self.step_in_epoch, self.micro_step)
        if (ref.epoch, ref.step_in_epoch, ref.micro_step) != here:
            raise RuntimeError(f"micro-batch {ref[:3]} consumed out of order; sampler is at {here}")
        self.micro_step += 1
        if self.micro_step == self.grad_accum:
            self.step_in_epoch, self.micro_step = self.step_in_epoch + 1, 0
            if self.step_in_epoch == len(self.plan_epoch(self.epoch)):
                self.set_epoch(self.epoch + 1)

    def __iter__(self) -> Iterator[list[int]]:
        for ref in self.remaining():
            self.mark_consumed(ref)
            yield ref.indices

    # ---- resume ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "micro_step": self.micro_step,
            **self._plan_settings(),
            "num_samples": len(self.lengths),
            "lengths_digest": self._lengths_digest,
            "blocks_digest": self._blocks_digest,
        }

    def plan_difference(self, state: dict[str, Any]) -> str | None:
        """What of a saved sampler `state` differs from this sampler's plan (its settings, or the
        samples it plans: then no resume, forced or not, can continue it), or None."""
        mine = self.state_dict()
        # `replan`: a forced resume of a checkpoint saved before the block budget, moved to its epoch's
        # start (train/resume.py); that epoch is planned under today's budget.
        exempt = ("micro_batch_blocks", "blocks_digest") if state.get("replan") else ()
        for key in (*_PLAN_KEYS, "num_samples", "lengths_digest", "blocks_digest"):
            if key not in exempt and state.get(key) != mine[key]:
                return f"{key} was {state.get(key)!r} when saved, is {mine[key]!r} now ({_CAUSES.get(key, key)} changed)"
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        difference = self.plan_difference(state)
        if difference is not None:  # train/resume.py refuses it first, naming the checkpoint
            raise CheckpointError(
                f"sampler state: {difference}; the batch plan would differ, so resuming exactly is impossible, "
                f"train.resume_force included. {start_anew()}"
            )
        epoch, step, micro = int(state["epoch"]), int(state["step_in_epoch"]), int(state["micro_step"])
        if not (0 <= step < len(self.plan_epoch(epoch)) and 0 <= micro < self.grad_accum):
            raise CheckpointError(
                f"sampler state: position (epoch {epoch}, step {step}, micro {micro}) is outside the plan"
            )
        self.epoch, self.step_in_epoch, self.micro_step = epoch, step, micro

    def _plan_settings(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "seed": self.seed,
            "world_size": self.world_size,
            "grad_accum": self.grad_accum,
            "micro_batch_tokens": cfg.micro_batch_tokens,
            "micro_batch_blocks": self.micro_batch_blocks,
            "max_samples_per_batch": cfg.max_samples_per_batch,
            "window_slack": cfg.window_slack,
        }
