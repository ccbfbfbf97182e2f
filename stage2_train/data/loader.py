"""From the feature store to packed DrafterBatches, prepared in background threads.

Shape legend: T = tokens of a sample (or of a packed micro-batch), L = stored layers, H = hidden,
F = L * H, K = stored top-k, N = blocks (anchors), B = block size.

    loader = PrefetchLoader(reader, sampler, anchor_sampler, mask_token_id=151669)
    for loaded in loader:             # the rest of the current epoch, in the sampler's exact order
        train_on(loaded.batch)        # a DrafterBatch; loaded.epoch / step_in_epoch say where we are
    for loaded in loader.stream():    # from the current position on, across epochs, without end
        ...                           # (the next epoch's first batches load while this one ends)
    loader.data_wait_s                # seconds the consumer spent blocked on data

Threads read samples and collate whole micro-batches ahead of the consumer (at most `prefetch`
in flight). The sampler only advances when a micro-batch is handed to the consumer, so
`sampler.state_dict()` (also `loader.state_dict()`) never counts prefetched batches. A failure in
a worker reaches the consumer as DataLoadError naming the sample index; breaking out of the loop,
an exception, or `close()` cancels what is queued and joins the threads.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from shared.errors import DataError, UserError
from stage2_train.data.anchors import AnchorSampler
from stage2_train.data.batch import DrafterBatch, check_sample, collate
from stage2_train.data.sampler import LengthMixedSampler, MicroBatchRef


class SampleReader(Protocol):
    """What the loader needs from the feature store reader (shared/store.py)."""

    lengths: np.ndarray

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, Any]: ...

    # Optional (the store reader has both): `feature_shape` -> (layers, hidden), and
    # `read(index, hidden_out=...)` filling a slice of the packed micro-batch. Without them the
    # loader packs the samples' own tensors (one more copy of the features).


class DataLoadError(DataError):
    """A sample that could not be read or collated; the message names it and its shard."""

    def __init__(self, message: str, sample_index: int | None):
        super().__init__(message)
        self.sample_index = sample_index


class BufferPool:
    """Host buffers for the packed features of micro-batches, allocated once and reused.

    On a CUDA trainer the buffers are pinned, so `batch.to(device, non_blocking=True)` is a real
    asynchronous copy (from pageable memory it is synchronous, ~640 MB per 8B micro-batch), and
    pinning is slow (cudaHostAlloc), so it must not happen per step. Each buffer holds the largest
    micro-batch (`sampler.micro_batch_tokens` tokens). The consumer gives a buffer back with the
    event its host-to-device copy recorded (`PrefetchLoader.release`); the next taker waits on that
    event first. Taking never blocks: with none free a new buffer is made (a consumer that never
    gives back simply gets fresh ones); at most `keep` free buffers are kept."""

    def __init__(self, max_tokens: int, feature_shape: tuple[int, ...], dtype: torch.dtype, keep: int, pin: bool):
        self.max_tokens, self.feature_shape, self.dtype = max_tokens, tuple(feature_shape), dtype
        self.keep, self.pin = keep, pin
        self._free: list[tuple[torch.Tensor, Any]] = []
        self._lock = threading.Lock()
        self.allocated = 0  # buffers made since construction (reuse keeps this at about `keep`)

    def take(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(a [tokens, *feature_shape] view, the buffer it belongs to)."""
        with self._lock:
            entry = self._free.pop() if self._free and tokens <= self.max_tokens else None
        if entry is not None:
            buffer, ready = entry
            if ready is not None:
                ready.synchronize()  # the last copy out of this buffer has finished
        else:
            buffer = torch.empty((max(tokens, self.max_tokens), *self.feature_shape), dtype=self.dtype, pin_memory=self.pin)
            self.allocated += 1
        return buffer[:tokens], buffer

    def give_back(self, buffer: torch.Tensor, ready: Any = None) -> None:
        with self._lock:
            if len(self._free) < self.keep and buffer.shape[0] == self.max_tokens:
                self._free.append((buffer, ready))


@dataclass
class LoadedBatch:
    batch: DrafterBatch
    ref: MicroBatchRef  # where it sits: epoch, step, micro-step, and its step's global totals
    num_samples_without_anchor: int  # samples of this micro-batch that yield no block this epoch
    data_wait_s: float  # time the consumer was blocked waiting for this micro-batch
    buffer: torch.Tensor | None = None  # the pooled host buffer behind batch.context_TF (give it back)

    @property
    def epoch(self) -> int:
        return self.ref.epoch

    @property
    def step_in_epoch(self) -> int:
        return self.ref.step_in_epoch

    @property
    def micro_step(self) -> int:
        return self.ref.micro_step

    @property
    def sample_indices(self) -> list[int]:
        return self.ref.indices


class PrefetchLoader:
    def __init__(
        self,
        reader: SampleReader,
        sampler: LengthMixedSampler,
        anchor_sampler: AnchorSampler,
        *,
        mask_token_id: int,
        num_threads: int = 2,
        prefetch: int = 4,
        gather_topk: bool = True,
        pin_memory: bool = False,
        held_by_consumer: int = 1,
        distill_all: bool = False,
        label_shift: int = 0,
    ):
        if num_threads < 1 or prefetch < 1:
            raise ValueError(f"num_threads and prefetch must be >= 1, got {num_threads} and {prefetch}")
        if len(reader) != len(sampler.lengths):
            raise ValueError(
                f"reader has {len(reader)} samples but the sampler was built for {len(sampler.lengths)}"
            )
        self.reader = reader
        self.sampler = sampler
        self.anchor_sampler = anchor_sampler
        self.mask_token_id = mask_token_id
        self.num_threads = num_threads
        self.prefetch = prefetch
        self.gather_topk = gather_topk
        self.pin_memory = pin_memory
        self.distill_all = distill_all
        self.label_shift = label_shift
        # Buffers in use at once: the queue, the threads filling, and what the consumer holds.
        self.held_by_consumer = held_by_consumer
        self._pool: BufferPool | None = None
        self.data_wait_s = 0.0  # total time the consumer spent blocked on data
        self.num_batches = 0
        self.num_samples = 0
        self.num_samples_without_anchor = 0
        # A weak reference: a pass the consumer dropped (break) is finalized at once, joining its threads.
        self._active: weakref.ref | None = None

    def __iter__(self) -> Iterator[LoadedBatch]:
        """The rest of the current epoch."""
        return self._start(self.sampler.remaining())

    def stream(self) -> Iterator[LoadedBatch]:
        """Every micro-batch from the current position on, across epoch boundaries, without end. A
        training loop uses this: a pass per epoch would start each epoch with an empty queue."""
        return self._start(self.sampler.upcoming())

    def _start(self, refs: Iterable[MicroBatchRef]) -> Iterator[LoadedBatch]:
        self.close()  # one pass at a time: a new pass starts from the sampler's consumed position
        run = self._run(iter(refs))
        self._active = weakref.ref(run)
        return run

    def close(self) -> None:
        """Cancel queued work and join the threads of the current pass, if any."""
        run = self._active() if self._active is not None else None
        if run is not None:
            run.close()
        self._active = None

    def __enter__(self) -> PrefetchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def release(self, loaded: LoadedBatch, ready: Any = None) -> None:
        """The consumer is done with `loaded`'s host memory once `ready` (the event recorded after
        its host-to-device copy, or None when nothing is in flight) has passed."""
        if loaded.buffer is not None and self._pool is not None:
            self._pool.give_back(loaded.buffer, ready)
            loaded.buffer = None

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()
        self.sampler.load_state_dict(state)

    def _run(self, refs: Iterator[MicroBatchRef]) -> Iterator[LoadedBatch]:
        pending: deque[tuple[MicroBatchRef, Future]] = deque()
        executor = ThreadPoolExecutor(self.num_threads, thread_name_prefix="dflash-data")

        def top_up() -> None:
            while len(pending) < self.prefetch:
                ref = next(refs, None)
                if ref is None:
                    return
                pending.append((ref, executor.submit(self._load, ref)))

        try:
            top_up()
            while pending:
                ref, future = pending.popleft()
                start = time.perf_counter()
                loaded = future.result()
                loaded.data_wait_s = time.perf_counter() - start
                top_up()
                self.sampler.mark_consumed(ref)
                self.data_wait_s += loaded.data_wait_s
                self.num_batches += 1
                self.num_samples += len(ref.indices)
                self.num_samples_without_anchor += loaded.num_samples_without_anchor
                yield loaded
        finally:
            for _, future in pending:
                future.cancel()
            executor.shutdown(wait=True, cancel_futures=True)

    def _load(self, ref: MicroBatchRef) -> LoadedBatch:
        where = f"epoch {ref.epoch}, step {ref.step_in_epoch}, micro-batch {ref.micro_step}"
        # Read in store order (shard, position): neighbours share decoded chunks and file pages.
        order_key = getattr(self.reader, "order_key", None)
        reads = sorted(ref.indices, key=order_key) if order_key is not None else ref.indices
        context_TLH, buffer, slices = self._packed_context(ref.indices)
        loaded = {index: self._read(index, ref.epoch, where, slices.get(index)) for index in reads}
        samples = [loaded[i][0] for i in ref.indices]
        anchors = [loaded[i][1] for i in ref.indices]
        try:
            batch = collate(
                samples,
                anchors,
                block_size=self.anchor_sampler.block_size,
                mask_token_id=self.mask_token_id,
                gather_topk=self.gather_topk,
                context_TF=None if context_TLH is None else context_TLH.flatten(1),
                distill_all=self.distill_all,
                label_shift=self.label_shift,
            )
        except Exception as exc:
            raise DataLoadError(
                f"data loader: collating samples {ref.indices} ({where}) failed: {type(exc).__name__}: {exc}",
                None,
            ) from exc
        return LoadedBatch(
            batch=batch,
            ref=ref,
            num_samples_without_anchor=sum(1 for a in anchors if len(a) == 0),
            data_wait_s=0.0,
            buffer=buffer,
        )

    def _packed_context(self, indices: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[int, torch.Tensor]]:
        """The micro-batch's features [T, L, H] (bf16, samples in order, sized from the store's
        lengths) in a pooled buffer, the buffer, and each sample's slice of it, for a reader that
        reads into one; else (None, None, {})."""
        feature_shape = getattr(self.reader, "feature_shape", None)
        if feature_shape is None:
            return None, None, {}
        if self._pool is None:
            keep = self.prefetch + self.num_threads + self.held_by_consumer
            self._pool = BufferPool(self.sampler.cfg.micro_batch_tokens, feature_shape, torch.bfloat16, keep, self.pin_memory)
        lengths = [int(self.sampler.lengths[i]) for i in indices]
        context_TLH, buffer = self._pool.take(sum(lengths))
        starts = np.cumsum([0, *lengths[:-1]])
        return context_TLH, buffer, {i: context_TLH[s : s + n] for i, s, n in zip(indices, starts.tolist(), lengths)}

    def _read(
        self, index: int, epoch: int, where: str, hidden_out: torch.Tensor | None = None
    ) -> tuple[dict[str, Any], torch.Tensor]:
        """One sample and its anchors for `epoch`, checked (tensors, length, and as many anchors as the
        sampler planned blocks for it); DataLoadError naming it and its shard."""
        try:
            sample = self.reader[index] if hidden_out is None else self.reader.read(index, hidden_out=hidden_out)
            anchors_A = self.anchor_sampler.anchors(sample["loss_mask_T"], sample_id=int(sample["sample_id"]), epoch=epoch)
            check_sample(sample, anchors_A, int(self.sampler.lengths[index]))
            planned = int(self.sampler.blocks[index])  # min(the manifest's supervised_pairs, max_anchors_per_seq)
            if len(anchors_A) > planned or (self.sampler.blocks_exact and len(anchors_A) != planned):
                raise ValueError(
                    f"draws {len(anchors_A)} anchors from its loss mask, but the manifest's supervised_pairs plan "
                    f"{planned} blocks (the micro-batch block budget counts them)"
                )
        except Exception as exc:
            if isinstance(exc, UserError):  # the reader named the file already
                raise DataLoadError(f"data loader ({where}): {exc}", index) from exc
            what = self.reader.describe(index) if hasattr(self.reader, "describe") else f"sample {index}"
            raise DataLoadError(
                f"data loader: {what} ({where}) failed: {type(exc).__name__}: {exc}; "
                f"check the store with `python -m stage1_extract verify`",
                index,
            ) from exc
        return sample, anchors_A
