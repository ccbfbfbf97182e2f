"""Length-mixed, padding-free token-budget batching, balanced across ranks, resumable exactly.

    .venv/bin/python -m stage2_train batches --steps 20 --json   # describe_steps() of the plan

An epoch is planned globally (identically on every rank) from (seed, epoch, lengths):

1. Shuffle all sample indices, stratified by length so that every stretch of the order holds
   each length range in its data-set share.
2. One optimizer step is M = world_size * grad_accum micro-batches ("bins") of at most
   `micro_batch_tokens` tokens (and `max_samples_per_batch` samples). For each step, pull the next
   samples of the shuffled order until the window holds (1 + window_slack) * M * micro_batch_tokens
   tokens, then place them longest first, each into the least-loaded bin it fits (LPT). Samples
   carried over from the previous step are placed first, so no sample waits more than a step or
   two. What does not fit (mostly the shortest samples of the window) carries to the next step.
   Every step is thus a random draw of the whole data set: lengths mix within each micro-batch,
   each step and each rank, and no run of steps (nor the epoch end) collects the long samples.
3. The samples of the last two steps are dealt alternately (longest first) into two steps when
   they fit, so the epoch's tail is not a near-empty step with idle ranks. A final micro-batch
   still empty takes the shortest sample of a crowded one before it. A data set too small to
   give every micro-batch a sample is a ValueError.

Every sample appears exactly once per epoch on exactly one rank, nothing is dropped or repeated,
and every rank runs the same number of steps (DDP needs it). Bin j of a step goes to rank
j // grad_accum as its micro-batch j % grad_accum. Resume state is (epoch, step_in_epoch,
micro_step, seed) plus the settings that shape the plan, checked on load.

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
import heapq
import itertools
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from shared.errors import CheckpointError, DataError
from stage2_train.data.config import SamplerConfig


class EpochPlan:
    """A global epoch plan: steps x (world_size * grad_accum) micro-batches x sample indices, kept as
    one index array and offsets (a list of lists of Python ints costs ~5x the memory at 900K
    samples). `plan[step]` is that step's micro-batches as lists."""

    def __init__(self, steps: list[list[list[int]]], num_bins: int, lengths: np.ndarray):
        self.num_bins = num_bins
        flat = [i for step in steps for b in step for i in b]
        self.indices = np.asarray(flat, dtype=np.int64)
        sizes = [len(b) for step in steps for b in step]
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        per_step = self.offsets[::num_bins]
        token_cum = np.concatenate([[0], np.cumsum(lengths[self.indices])])
        self.step_tokens = np.diff(token_cum[per_step])
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


# Length strata of the shuffled order (see _stratified_order).
NUM_LENGTH_STRATA = 16
BIN_BITS = 20  # _lpt's heap keys hold the bin in their low bits: up to 1M micro-batches per step

# Settings that change the plan: a resume under different values would not replay the same batches.
_PLAN_KEYS = ("seed", "world_size", "grad_accum", "micro_batch_tokens", "max_samples_per_batch", "window_slack")
# The settings behind each planned quantity, for a refused resume.
_CAUSES = {
    "seed": "seed",
    "world_size": "the number of ranks",
    "grad_accum": "train.grad_accum",
    "micro_batch_tokens": "sampler.micro_batch_tokens",
    "max_samples_per_batch": "sampler.max_samples_per_batch",
    "window_slack": "sampler.window_slack",
    "num_samples": "the training split (eval.holdout_fraction, eval.split_seed) or the store's samples",
    "lengths_digest": "the training split (eval.holdout_fraction, eval.split_seed) or the store's samples",
}


class LengthMixedSampler:
    """Yields this rank's micro-batches (lists of sample indices) for the rest of the current epoch.

    Position advances as micro-batches are handed out; after the last micro-batch of epoch e the
    sampler is at (e + 1, 0), so `for epoch in ...: for batch in sampler:` walks epochs in turn.
    """

    def __init__(
        self, cfg: SamplerConfig, lengths: np.ndarray, *, seed: int, rank: int = 0, world_size: int = 1, grad_accum: int = 1
    ):
        """`grad_accum` (train.grad_accum): micro-batches per optimizer step on each rank."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        self.cfg = cfg
        if grad_accum < 1:
            raise ValueError(f"train.grad_accum must be >= 1, got {grad_accum}")
        self.grad_accum = grad_accum
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1 or len(self.lengths) == 0:
            raise ValueError(f"lengths must be a non-empty 1-D array, got shape {self.lengths.shape}")
        too_long = np.flatnonzero(self.lengths > cfg.micro_batch_tokens)
        if len(too_long):
            i = int(too_long[0])
            raise DataError(
                f"sample {i} has {int(self.lengths[i])} tokens, more than sampler.micro_batch_tokens="
                f"{cfg.micro_batch_tokens} ({len(too_long)} samples too long); raise the budget or re-extract "
                f"with a shorter data.max_length"
            )
        empty = np.flatnonzero(self.lengths < 1)
        if len(empty):
            raise ValueError(f"sample {int(empty[0])} has {int(self.lengths[empty[0]])} tokens; must be >= 1")
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
        self._lens = self.lengths.tolist()  # the planner's inner loops index Python ints, not numpy
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
        cfg, lens, num_bins = self.cfg, self._lens, self.num_bins
        max_per_bin = cfg.max_samples_per_batch or len(lens)
        order_arr = _stratified_order(self.lengths, np.random.default_rng([self.seed, epoch]))
        order = order_arr.tolist()
        cum_tokens = np.cumsum(self.lengths[order_arr]).tolist()
        # Integer targets: a float key would make bisect compare 900K ints with a float each call.
        window_tokens = int((1.0 + cfg.window_slack) * num_bins * cfg.micro_batch_tokens)
        window_count = int((1.0 + cfg.window_slack) * num_bins * max_per_bin)
        longest_first = lens.__getitem__
        steps: list[list[list[int]]] = []
        carry: list[int] = []
        pos = 0
        while pos < len(order) or carry:
            carry_tokens = sum(lens[i] for i in carry)
            before = cum_tokens[pos - 1] if pos else 0
            # Smallest end such that carry + order[pos:end] reaches the window's token target.
            end = bisect.bisect_left(cum_tokens, before + window_tokens - carry_tokens) + 1
            end = max(pos, min(end, len(order), pos + window_count - len(carry)))
            window = order_arr[pos:end]
            fresh = window[np.argsort(-self.lengths[window], kind="stable")].tolist()  # ties keep order
            pos = end
            carried = sorted(carry, key=longest_first, reverse=True)
            bins, carry = _lpt(carried + fresh, lens, num_bins, cfg.micro_batch_tokens, max_per_bin)
            steps.append(bins)
        if len(steps) >= 2:
            # Deal the last two steps' samples, longest first, alternately into two steps of equal mix.
            pool = sorted((i for b in steps[-2] + steps[-1] for i in b), key=lambda i: (-lens[i], i))
            first, left_first = _lpt(pool[0::2], lens, num_bins, cfg.micro_batch_tokens, max_per_bin)
            second, left_second = _lpt(pool[1::2], lens, num_bins, cfg.micro_batch_tokens, max_per_bin)
            if not left_first and not left_second and all(first) and all(second):
                steps[-2:] = [first, second]
        _fill_empty_bins(steps, lens, epoch)
        return EpochPlan(steps, num_bins, self.lengths)

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
            tokens, samples = int(plan.step_tokens[step]), int(plan.step_samples[step])
            for micro in range(from_micro if step == from_step else 0, ga):
                indices = plan.bin(step, self.rank * ga + micro)
                yield MicroBatchRef(epoch, step, micro, indices, num_steps, tokens, samples)

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
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in (*_PLAN_KEYS, "num_samples", "lengths_digest"):
            if state.get(key) != mine[key]:
                raise CheckpointError(
                    f"sampler state: {key} was {state.get(key)!r} when saved, is {mine[key]!r} now ({_CAUSES.get(key, key)} "
                    f"changed); the batch plan would differ, so resuming exactly is impossible"
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
            "max_samples_per_batch": cfg.max_samples_per_batch,
            "window_slack": cfg.window_slack,
        }


def _stratified_order(lengths: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A random order in which every stretch holds each length range in its data-set share.

    Samples are split by length rank into NUM_LENGTH_STRATA equal-count strata; each stratum is
    shuffled and spread evenly over the epoch (systematic sampling with a random offset per sample).
    A plain permutation mixes too, but its windows deviate from the data set by sampling noise
    (about +-0.07 in long-token share for a 32k-token step); this removes most of it. Vectorised:
    two sorts, no loop over strata (~0.1 s at 900K samples).
    """
    n = len(lengths)
    by_length = np.argsort(lengths + rng.random(n))  # integer lengths: the fraction breaks ties at random
    stratum = np.empty(n, dtype=np.int64)
    stratum[by_length] = np.arange(n) * NUM_LENGTH_STRATA // n
    shuffled = np.argsort(stratum + rng.random(n))  # stratum by stratum, each in a random order
    counts = np.bincount(stratum, minlength=NUM_LENGTH_STRATA)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank_in_stratum = np.empty(n, dtype=np.int64)
    rank_in_stratum[shuffled] = np.arange(n) - starts[stratum[shuffled]]
    key = (rank_in_stratum + rng.random(n)) / np.maximum(counts[stratum], 1)
    return np.argsort(key, kind="stable")


def _lpt(
    items: list[int], lengths: list[int], num_bins: int, budget: int, max_per_bin: int
) -> tuple[list[list[int]], list[int]]:
    """Place `items` in order, each into the least-loaded bin with room; return (bins, left over).

    This loop runs once per sample of the epoch (900K at the users' scale), so it is kept tight: a
    heap of plain ints `load << BIN_BITS | bin` (int comparisons, not tuples), locals only."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    heap = list(range(num_bins))  # load 0 for every bin
    left: list[int] = []
    shift, mask = BIN_BITS, (1 << BIN_BITS) - 1
    limit = (budget + 1) << shift  # a key >= limit means the bin would exceed the budget
    replace, pop = heapq.heapreplace, heapq.heappop
    if max_per_bin >= len(lengths):  # no cap on samples: the heap never shrinks
        for i in items:
            key = heap[0] + (lengths[i] << shift)
            if key >= limit:
                left.append(i)
                continue
            bins[key & mask].append(i)
            replace(heap, key)
        return bins, left
    for i in items:
        if not heap:
            left.append(i)
            continue
        key = heap[0] + (lengths[i] << shift)
        if key >= limit:
            left.append(i)
            continue
        b = key & mask
        bins[b].append(i)
        if len(bins[b]) == max_per_bin:
            pop(heap)
        else:
            replace(heap, key)
    return bins, left


def _fill_empty_bins(steps: list[list[list[int]]], lengths: list[int], epoch: int) -> None:
    """Give every empty micro-batch of the last step the shortest sample of a crowded earlier bin."""
    for b, items in enumerate(steps[-1]):
        if items:
            continue
        donors = [d for step in reversed(steps[:-1]) for d in step if len(d) >= 2]
        if not donors:
            donors = [d for d in steps[-1] if len(d) >= 2]
        if not donors:
            raise DataError(
                f"epoch {epoch}: too few samples to give each of the {len(steps[-1])} micro-batches of "
                f"the last step a sample; lower world_size * grad_accum or the token budget"
            )
        donor = donors[0]
        shortest = min(range(len(donor)), key=lambda k: lengths[donor[k]])
        steps[-1][b].append(donor.pop(shortest))


def describe_steps(sampler: LengthMixedSampler, num_steps: int) -> list[dict[str, Any]]:
    """The next `num_steps` optimizer steps from the sampler's position (crossing epochs), all ranks.

    For the dry run `python -m stage2_train batches`. Moves nothing.
    """
    cfg, lengths = sampler.cfg, sampler.lengths
    ga = sampler.grad_accum
    out: list[dict[str, Any]] = []
    epoch, step = sampler.epoch, sampler.step_in_epoch
    while len(out) < num_steps:
        plan = sampler.plan_epoch(epoch)
        if step >= len(plan):
            epoch, step = epoch + 1, 0
            continue
        bins = plan[step]
        step_lengths = np.concatenate([lengths[b] for b in bins])
        tokens = int(step_lengths.sum())
        p10, p50, p90 = np.percentile(step_lengths, [10, 50, 90])
        out.append(
            {
                "epoch": epoch,
                "step_in_epoch": step,
                "tokens": tokens,
                "num_samples": len(step_lengths),
                "length_p10": float(p10),
                "length_p50": float(p50),
                "length_p90": float(p90),
                "length_max": int(step_lengths.max()),
                "padding_fraction": 1.0 - tokens / (cfg.micro_batch_tokens * len(bins)),
                "rank_tokens": [
                    int(sum(lengths[b].sum() for b in bins[r * ga : (r + 1) * ga]))
                    for r in range(sampler.world_size)
                ],
            }
        )
        step += 1
    return out
