"""The background shard writer: collects each shard's samples and writes the shard, then its part
record, once all its samples are back.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from shared.errors import DataError, StoreError, UserError
from shared.store import SampleFeatures, StoreConfig, StoreFiles, write_shard
from stage1_extract.batching import ShardPlan
from stage1_extract.merge import part_path


@dataclass
class WriterStats:
    shards_written: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    queue_wait_seconds: float = 0.0  # time the forward loop spent blocked on a full queue


class ShardWriterThread:
    """Collects samples per shard; writes a shard (and then its part record) once it is complete."""

    def __init__(self, url: str, store_cfg: StoreConfig, shards: list[ShardPlan], queue_batches: int):
        self.url = url
        self.cfg = store_cfg
        self.files = StoreFiles(url)
        self.pending = {s.index: s for s in shards}
        self.received: dict[int, dict[int, SampleFeatures]] = {s.index: {} for s in shards}
        self.shard_of = {r.sample_id: s.index for s in shards for r in s.kept}
        self.queue: queue.Queue = queue.Queue(maxsize=queue_batches)
        self.error: BaseException | None = None
        self.stats = WriterStats()
        self.thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self.thread.start()

    def put(self, samples: list[SampleFeatures]) -> None:
        self._raise_if_failed()
        started = time.perf_counter()
        while True:
            try:
                self.queue.put(samples, timeout=0.5)
                break
            except queue.Full:
                self._raise_if_failed()
        self.stats.queue_wait_seconds += time.perf_counter() - started

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            if isinstance(self.error, UserError):
                raise self.error  # a NaN sample, a full disk: the message names it already
            raise RuntimeError(f"shard writer failed: {type(self.error).__name__}: {self.error}") from self.error

    def _run(self) -> None:
        try:
            for shard in [s for s in self.pending.values() if not s.kept]:
                self._write(self.pending.pop(shard.index))  # every sample skipped: a record, no data
            while self.pending:
                samples = self.queue.get()
                if samples is None:
                    return
                touched = set()
                for sample in samples:
                    check_finite(sample)
                    index = self.shard_of[sample.sample_id]
                    self.received[index][sample.sample_id] = sample
                    touched.add(index)
                # Only the shards this batch touched can have completed (there may be 100Ks pending).
                for index in sorted(touched):
                    if len(self.received[index]) == len(self.pending[index].kept):
                        self._write(self.pending.pop(index))
        except BaseException as exc:  # noqa: BLE001 - handed to the forward loop, which re-raises
            self.error = exc

    def _write(self, shard: ShardPlan) -> None:
        started = time.perf_counter()
        received = self.received.pop(shard.index)
        samples = [received[r.sample_id] for r in shard.kept]
        record: dict[str, Any] = {
            "index": shard.index,
            "name": None,
            "num_samples": 0,
            "num_tokens": 0,
            "bytes": 0,
            "checksum": None,
        }
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
                "content_hashes": [r.content_hash for r in shard.kept],
                "num_truncated": sum(r.truncated for r in shard.rows),
                "num_skipped": sum(r.skipped for r in shard.rows),
            }
        )
        # The part record is written only after the shard's data: it is what marks the shard done.
        self.files.write_json(part_path(shard.index), record)
        self.stats.shards_written += 1
        self.stats.bytes_written += record["bytes"]
        self.stats.write_seconds += time.perf_counter() - started

    def finish(self) -> WriterStats:
        while self.thread.is_alive():
            self.thread.join(timeout=0.5)
            self._raise_if_failed()
        self._raise_if_failed()
        if self.pending:
            raise RuntimeError(f"shard writer stopped with {len(self.pending)} shards unwritten")
        return self.stats

    def abort(self) -> None:
        self.pending.clear()
        try:
            self.queue.put_nowait(None)
        except queue.Full:
            pass


def check_finite(sample: SampleFeatures) -> None:
    import torch

    for name, tensor in (("hidden", sample.hidden_TLH), ("topk_logprobs", sample.topk_logprobs_TK)):
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise DataError(
                f"sample {sample.sample_id}: {bad} non-finite values (NaN/inf) in {name}: the target overflowed "
                f"on this row (try target.dtype=fp32, or drop the row)"
            )
