"""The background shard writer: the forward loop hands it each batch's host copies; it writes a
shard (then its part record) as soon as all the shard's samples are back.

    writer = ShardWriter(url, store_cfg, shards, queue_mb=2048, threads=2)
    writer.put(HostBatch(samples, ready=event, nbytes=n))   # blocks while queue_mb is full
    stats = writer.finish()                                  # every shard written, or the first error

Memory, per rank, is bounded by design:
- the host copies of forward batches (pinned memory on GPU) waiting for the writer: at most
  `extract.writer_queue_mb` (one batch more when a single batch is larger). `put` blocks, and the
  loop's `writer_queue_wait_s` says so, when the writer falls behind;
- a batch is absorbed at once: its samples are encoded into arrays of their own (bf16 bits or fp8,
  float16 top-k), so its host buffers are free again for the next copies (the caching host
  allocator reuses them);
- encoded samples of shards not yet complete: at most the current window of shards
  (`extract.window_shards` x the shard size, `plan` reports it), since a window's batches hold all
  of its samples;
- complete shards being compressed, hashed and written: at most `extract.writer_threads` + 1; the
  writer threads (zstd and sha256 release the GIL) take shards in parallel when one is not enough.

A copy is read only after it has landed: each batch carries the CUDA event its producer recorded
on the stream of the copies' own device after issuing them (`ready`), and the absorbing thread
waits on that event before touching a byte; on CPU there is nothing to wait for (`ready` is None).
Finiteness is checked on the device: a batch carries the fp32 sum of its stored values
(`value_sum`, copied with it), and only a batch whose sum is not finite is checked sample by sample
on the host, to name the sample; a batch without one (a caller that computed none) is checked so.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from shared.codecs import EncodedSample, SampleFeatures, encode_sample
from shared.errors import DataError, StoreError, UserError
from shared.store import StoreConfig, StoreFiles, supervised_pairs, write_shard
from stage1_extract.batching import ShardPlan
from stage1_extract.merge import part_path


@dataclass
class HostBatch:
    """One forward batch's samples on the host; `ready` (a CUDA event, or None) says when the
    device-to-host copies into them have finished."""

    samples: list[SampleFeatures]
    ready: Any
    nbytes: int
    value_sum: Any = None  # host copy of the device's fp32 sum of the stored values (stage1_extract.extract)


@dataclass
class WriterStats:
    shards_written: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0  # summed over the writer threads (encode, compress, hash, write)
    absorb_seconds: float = 0.0  # waiting for copies to land + encoding each batch
    queue_wait_seconds: float = 0.0  # time the forward loop spent blocked on a full queue
    peak_queue_bytes: int = 0
    host_checked_batches: int = 0  # batches checked value by value on the host (a non-finite sum, or none given)


class ShardWriter:
    """Collects samples per shard; writes each complete shard, then its part record, in a pool."""

    def __init__(
        self, url: str, store_cfg: StoreConfig, shards: list[ShardPlan], queue_mb: int, threads: int = 1, outlier_channels: Any = None,
        provenance: dict[str, Any] | None = None,
    ):
        if queue_mb < 1 or threads < 1:
            raise ValueError(f"queue_mb and threads must be >= 1, got {queue_mb} and {threads}")
        self.url = url
        self.cfg = store_cfg
        self.outlier_channels = outlier_channels  # fp4: the store's, pinned in plan.json
        self.provenance = provenance or {}  # how this run computed its shards (the batch shape), in each part record
        self.files = StoreFiles(url)
        self.limit = queue_mb * 2**20
        self.pending = {s.index: s for s in shards}
        self.received: dict[int, dict[int, EncodedSample]] = {s.index: {} for s in shards}
        self.shard_of = {r.sample_id: s.index for s in shards for r in s.kept}
        self.stats = WriterStats()
        self.error: BaseException | None = None
        self._queue: deque[HostBatch | None] = deque()
        self._bytes = 0
        self._cond = threading.Condition()
        self._stats_lock = threading.Lock()
        self._slots = threading.Semaphore(threads + 1)  # complete shards in the pool (running or waiting)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dflash-shard-writer")
        self._futures: list[Future] = []
        self._thread = threading.Thread(target=self._run, name="dflash-shard-absorber", daemon=True)
        self._thread.start()

    # ---- the forward loop's side -----------------------------------------------------------------
    def put(self, batch: HostBatch) -> None:
        """Queue a batch; blocks while the bytes waiting would pass the bound (one batch always fits)."""
        started = time.perf_counter()
        with self._cond:
            while self._bytes > 0 and self._bytes + batch.nbytes > self.limit and self.error is None:
                self._cond.wait(0.5)
            self._raise_if_failed()
            self._queue.append(batch)
            self._bytes += batch.nbytes
            self.stats.peak_queue_bytes = max(self.stats.peak_queue_bytes, self._bytes)
            self._cond.notify_all()
        self.stats.queue_wait_seconds += time.perf_counter() - started

    def finish(self) -> WriterStats:
        """Wait until every shard is written; re-raise the first failure."""
        with self._cond:
            self._queue.append(None)
            self._cond.notify_all()
        while self._thread.is_alive():
            self._thread.join(timeout=0.5)
            self._raise_if_failed()
        self._pool.shutdown(wait=True)
        self._raise_if_failed()
        if self.pending:
            raise RuntimeError(f"shard writer stopped with {len(self.pending)} shards unwritten")
        return self.stats

    def abort(self) -> None:
        """Drop what is queued, stop taking shards, let the writes in flight end (their records are
        what a rerun trusts; a shard without its record is written again)."""
        with self._cond:
            self.pending.clear()
            self._queue.clear()
            self._queue.append(None)
            self._bytes = 0
            self._cond.notify_all()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            if isinstance(self.error, UserError):
                raise self.error  # a NaN sample, a full disk: the message names it already
            raise RuntimeError(f"shard writer failed: {type(self.error).__name__}: {self.error}") from self.error

    # ---- the absorbing thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            for shard in [s for s in self.pending.values() if not s.kept]:
                self._submit(self.pending.pop(shard.index))  # every sample skipped: a record, no data
            while self.pending and self.error is None:
                with self._cond:
                    while not self._queue:
                        self._cond.wait()
                    batch = self._queue.popleft()
                if batch is None:
                    return
                touched = self._absorb(batch)
                # Only the shards this batch touched can have completed (there may be 100Ks pending).
                for index in sorted(touched):
                    if index in self.pending and len(self.received[index]) == len(self.pending[index].kept):
                        self._submit(self.pending.pop(index))
        except BaseException as exc:  # noqa: BLE001 - handed to the forward loop, which re-raises
            self._fail(exc)

    def _absorb(self, batch: HostBatch) -> set[int]:
        """Wait for the batch's copies, check and encode its samples, and free its host bytes."""
        started = time.perf_counter()
        if batch.ready is not None:
            batch.ready.synchronize()  # the copies into these buffers (and their sum) have landed
        suspect = batch.value_sum is None or not math.isfinite(float(batch.value_sum))
        self.stats.host_checked_batches += suspect
        touched = set()
        for sample in batch.samples:
            if suspect:
                check_finite(sample)
            index = self.shard_of[sample.sample_id]
            self.received[index][sample.sample_id] = encode_sample(sample, self.cfg.dtype, self.outlier_channels)
            touched.add(index)
        with self._cond:
            self._bytes -= batch.nbytes
            self._cond.notify_all()
        self.stats.absorb_seconds += time.perf_counter() - started
        return touched

    def _submit(self, shard: ShardPlan) -> None:
        self._slots.acquire()  # at most threads + 1 complete shards held: backpressure, never a deadlock
        received = self.received.pop(shard.index, {})
        samples = [received[r.sample_id] for r in shard.kept]
        future = self._pool.submit(self._write, shard, samples)
        future.add_done_callback(self._done)
        self._futures.append(future)

    def _done(self, future: Future) -> None:
        self._slots.release()
        if not future.cancelled() and future.exception() is not None:
            self._fail(future.exception())

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self.error is None:
                self.error = exc
            self._cond.notify_all()

    # ---- a writer thread ------------------------------------------------------------------------
    def _write(self, shard: ShardPlan, samples: list[EncodedSample]) -> None:
        started = time.perf_counter()
        record: dict[str, Any] = {"index": shard.index, "name": None, "num_samples": 0, "num_tokens": 0, "bytes": 0, "checksum": None}
        if samples:
            try:
                record.update(write_shard(self.url, shard.name, samples, self.cfg))
            except OSError as exc:
                raise StoreError(
                    f"writing shard {shard.name} to {self.url} failed ({exc}); shards finished before it and "
                    f"their part records are intact, rerun `python -m stage1_extract extract` after freeing space"
                ) from exc
        record.update(
            {
                "sample_start": shard.rows[0].sample_id,
                "sample_end": shard.rows[-1].sample_id + 1,
                "rows_sha256": shard.rows_sha256,
                "header_key": shard.key,
                "sample_ids": [r.sample_id for r in shard.kept],
                "lengths": [len(r.input_ids) for r in shard.kept],
                "supervised_pairs": [supervised_pairs(r.loss_mask) for r in shard.kept],
                "content_hashes": [r.content_hash for r in shard.kept],
                # a regenerated row's prompt, its split key (`prepare.split_keys` gives every row one, or none)
                # 16 hex digits, as content_hashes: the split reads 15; the manifest holds one per sample
                **({"prompt_hashes": [r.prompt_hash[:16] for r in shard.kept]} if all(r.prompt_hash for r in shard.rows) else {}),
                # every row's opening, the split key from identity version 6 (`prepare.split_keys`: all rows or none)
                **({"opening_hashes": [r.opening_hash[:16] for r in shard.kept]} if all(r.opening_hash for r in shard.rows) else {}),
                "num_truncated": sum(r.truncated for r in shard.rows),
                "num_skipped": sum(r.skipped for r in shard.rows),
                "num_empty_turns": sum(r.empty_turns for r in shard.kept),  # a skipped row stores none
                **self.provenance,
            }
        )
        # The part record is written only after the shard's data: it is what marks the shard done.
        self.files.write_json(part_path(shard.index), record)
        with self._stats_lock:
            self.stats.shards_written += 1
            self.stats.bytes_written += record["bytes"]
            self.stats.write_seconds += time.perf_counter() - started


def host_bytes(samples: list[SampleFeatures]) -> int:
    """Bytes of host memory a batch's copies hold (what the writer queue is bounded by)."""
    return sum(
        t.numel() * t.element_size() for s in samples for t in (s.hidden_TLH, s.topk_logprobs_TK, s.topk_ids_TK)
    )


def check_finite(sample: SampleFeatures) -> None:
    import torch

    for name, tensor in (("hidden", sample.hidden_TLH), ("topk_logprobs", sample.topk_logprobs_TK)):
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise DataError(
                f"sample {sample.sample_id}: {bad} non-finite values (NaN/inf) in {name}: the target overflowed "
                f"on this row (try target.dtype=fp32, or drop the row)"
            )
