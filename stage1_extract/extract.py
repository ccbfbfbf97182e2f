"""Run the target once over the data and store per-token features.

    python -m stage1_extract extract --config configs/default.yaml

The loop (`run_shards`) walks this rank's windows of shards (`batching.py`), runs the target over
each forward batch (`forward.py`), and hands the host copies to the background shard writer
(`writer.py`), which encodes and writes each shard as soon as all its samples are back, through a
queue bounded in bytes: the forward never waits on disk unless the disk is slower than the target.
Each finished shard leaves a part record; a rerun skips those shards (those whose group is still in
the store), so a killed run resumes and ends with the same store. With several processes (torchrun / accelerate launch) rank r takes
windows r, r + W, ...; rank 0 merges the part records into manifest.json, written last
(`merge.py`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from shared.codecs import SampleFeatures
from shared.config import Section
from shared.identity import BATCH_SETTINGS
from shared.store import StoreConfig
from shared.target_model import LayerCapture
from stage1_extract.batching import ShardPlan, TokenizedRow, token_budget_batches
from stage1_extract.forward import forward_batch
from stage1_extract.writer import HostBatch, ShardWriter, WriterStats, host_bytes

log = logging.getLogger(__name__)


class ExtractConfig(Section):
    section: ClassVar[str] = "extract"
    renamed: ClassVar[dict[str, str]] = {
        "token_budget": "batch_tokens",
        "queue_batches": "writer_queue_mb",
        "max_batch_samples": "max_samples_per_batch",  # one spelling with sampler.max_samples_per_batch
        "lm_head_chunk": "lm_head_chunk_tokens",
    }
    top_k: int = 64
    """Log-probabilities of the target's k most likely next tokens stored per token (the KL term reads them)."""
    batch_tokens: int = 8192
    """Tokens per target forward batch (padding included on the padded path)."""
    max_samples_per_batch: int = 64
    """At most this many samples per target forward batch."""
    window_shards: int = 4
    """Shards whose samples are length-sorted together."""
    writer_queue_mb: int | None = None
    """Host memory (pinned on GPU) of forward batches waiting for the shard writer, per rank: the loop
    blocks rather than exceed it. null: two forward batches of this target's host copies (2 x
    batch_tokens x (layers x hidden x compute dtype + top_k x 8) bytes: 5.1 GiB at the 8B presets,
    40.5 GiB per node of 8 ranks), so a batch lands while the writer absorbs the one before. See
    stage1_extract/writer.py."""
    writer_threads: int | None = None
    """Shards compressed, hashed and written in parallel, per rank (zstd and sha256 release the GIL).
    null: 2 on CPU (the target's forward needs the cores); on a GPU the CPUs this rank may use (its
    affinity over LOCAL_WORLD_SIZE) less two for the forward loop and the absorbing thread, from 2 to 8.
    One thread writes an 8B-shaped uncompressed bf16 store at ~64 MB/s (BENCHMARKS.md "store8b"), and a
    65K-token batch at 8B is ~2.7 GB against an H100 forward of ~2.7 s: two threads cannot keep up.
    Each thread holds up to one complete shard (store.shard_mb) while it writes."""
    lm_head_chunk_tokens: int = 2048
    """Tokens per LM-head + log-softmax chunk."""
    device: str = "auto"
    """Where stage 1 runs the target (generate and extract): auto = the GPU of this rank when there is one, else CPU."""
    tensor_parallel_size: int = 1
    """GPUs per copy of the target (a target larger than one GPU): ranks form groups of this many
    consecutive ranks, each group loads the target split by its own TP plan and extracts its share
    of the windows, its first rank writing (stage1_extract/tensor_parallel.py). Must divide the
    processes per node; `plan` gives the weights per GPU at this size. Not part of the store's
    identity (a TP forward sums in another order: the bytes differ in their last bits, as with another
    batch shape); each shard's part record says which size made it."""
    packed: Literal["auto", "on", "off"] = "auto"
    """A forward batch as one row of samples, no padding: auto = with flash-attn (varlen, GPU); on = also
    with sdpa/eager, which keep the samples apart with a [tokens, tokens] mask; an attention that cannot is refused."""

    def validate(self) -> None:
        self.require(1 <= self.top_k <= 1024, "top_k", "must be in 1..1024")
        self.require(self.batch_tokens >= 16, "batch_tokens", "must be >= 16")
        self.require(self.max_samples_per_batch >= 1, "max_samples_per_batch", "must be >= 1")
        self.require(self.window_shards >= 1, "window_shards", "must be >= 1")
        self.require(self.writer_queue_mb is None or self.writer_queue_mb >= 1, "writer_queue_mb", "must be >= 1 (or null)")
        self.require(self.writer_threads is None or self.writer_threads >= 1, "writer_threads", "must be >= 1 or null")
        self.require(self.lm_head_chunk_tokens >= 1, "lm_head_chunk_tokens", "must be >= 1")
        self.require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")

    def recipe_warnings(self) -> list[str]:
        """Departures in what is stored; batch_tokens, lm_head_chunk_tokens and window_shards set only
        the speed and the memory of extraction."""
        if self.top_k != 64:
            return [f"extract.top_k={self.top_k} departs from the recipe (64): the target's top-k the KL term and "
                    f"candidate slots read"]
        return []


def host_token_bytes(num_layers: int, hidden_size: int, dtype_bytes: int, top_k: int) -> int:
    """Host bytes of one token's copies: its layers' states in the compute dtype, top_k fp32
    log-probs and int32 ids."""
    return num_layers * hidden_size * dtype_bytes + top_k * 8


def writer_threads(cfg: ExtractConfig, device_type: str) -> int:
    """`extract.writer_threads`, or, when unset, 2 on CPU and the rank's share of the node's CPUs
    less two (the forward loop, the absorbing thread), 2..8, on a GPU."""
    if cfg.writer_threads is not None:
        return cfg.writer_threads
    if device_type != "cuda":
        return 2
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return max(2, min(8, cpus // ranks - 2))


def writer_queue_mb(cfg: ExtractConfig, token_bytes: int) -> int:
    """`extract.writer_queue_mb`, or two forward batches of `token_bytes` per token when unset."""
    if cfg.writer_queue_mb is not None:
        return cfg.writer_queue_mb
    return math.ceil(2 * cfg.batch_tokens * token_bytes / 2**20)


@dataclass
class ExtractResult:
    shards_done: int = 0
    shards_skipped: int = 0  # already finished by an earlier run
    tokens: int = 0
    seconds: float = 0.0
    forward_seconds: float = 0.0
    writer: WriterStats = field(default_factory=WriterStats)
    writer_threads: int = 0  # as resolved (extract.writer_threads null: from the device and the CPUs)


def stored_value_sum(outputs: list[tuple[Any, Any, Any]]) -> Any:
    """The fp32 sum of every value a batch stores (hidden states, top-k log-probs), on the device:
    finite iff every value is, so the writer checks one number per batch, read after the batch's
    event, instead of scanning every value on the host (~2.7 GB per 65K-token batch at 8B). A sum that
    overflowed fp32 (values near 1e30) only sends the batch to the host's sample-by-sample check."""
    import torch

    return torch.stack([t.sum(dtype=torch.float32) for hidden, values, _ in outputs for t in (hidden, values)]).sum()


def to_host(outputs: list[tuple[Any, Any, Any]], device: Any, value_sum: Any = None) -> tuple[list[tuple[Any, Any, Any]], Any, Any]:
    """Issue the device-to-host copies of a batch's outputs (and of its `value_sum`); returns the
    host tensors, the event that says when they have landed (None on CPU, where a copy is done when
    it returns) and the host copy of `value_sum`.

    On CUDA the copies go to pinned memory (`non_blocking=True` allocates it from torch's caching
    host allocator, which reuses freed blocks), so they overlap the next forward; the event is
    recorded on the current stream of the tensors' own device, after the copies, and the writer
    waits on it before reading a byte (the sum included: reading it is never a sync in the loop)."""
    import torch

    if device.type != "cuda":
        return [(h.cpu(), v.cpu(), i.cpu()) for h, v, i in outputs], None, value_sum
    host = [tuple(t.to("cpu", non_blocking=True) for t in triple) for triple in outputs]
    value_sum_host = None if value_sum is None else value_sum.to("cpu", non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(device))
    return host, ready, value_sum_host


class ForwardTimer:
    """Forward time without a host sync per batch: CUDA events read once at the end, after waiting
    for the last (a tensor-parallel rank that does not write has no writer that waited on its
    batches, and an event still pending makes `elapsed_time` raise); wall time on CPU."""

    def __init__(self, device: Any):
        self.cuda = device.type == "cuda"
        self.device = device
        self.pairs: list[tuple[Any, Any]] = []
        self.cpu_seconds = 0.0

    def start(self) -> Any:
        import torch

        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def stop(self, started: Any) -> None:
        import torch

        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self.pairs.append((started, event))
        else:
            self.cpu_seconds += time.perf_counter() - started

    def seconds(self) -> float:
        if self.cuda:
            for _, end in self.pairs[-1:]:
                end.synchronize()  # one stream: every earlier event is done once the last one is
            return sum(a.elapsed_time(b) for a, b in self.pairs) / 1000.0  # milliseconds
        return self.cpu_seconds


def forward_batches(
    model: Any,
    windows: list[list[ShardPlan]],
    cfg: ExtractConfig,
    layer_ids: list[int],
    packed: bool,
    wanted: set[int] | None = None,
    timer: ForwardTimer | None = None,
) -> Iterator[tuple[list[TokenizedRow], list[tuple[Any, Any, Any]]]]:
    """The target's forward over a rank's windows of shards, one token-budget batch of a window's rows
    at a time (`batching.py`): each batch with its outputs left on the device, (hidden_TLH, top-k
    log-probs, top-k ids) per row. A batch holding no sample of `wanted` is skipped (an earlier run
    finished it). What `run_shards` writes, and what the benchmarks time as the pure forward."""
    capture = LayerCapture(model, layer_ids)
    try:
        for window in windows:
            rows = [r for s in window for r in s.kept]
            for batch in token_budget_batches(rows, cfg.batch_tokens, cfg.max_samples_per_batch):
                if wanted is not None and not any(r.sample_id in wanted for r in batch):
                    continue
                started = timer.start() if timer is not None else None
                outputs = forward_batch(model, capture, batch, cfg.top_k, cfg.lm_head_chunk_tokens, packed)
                if timer is not None:
                    timer.stop(started)
                yield batch, outputs
    finally:
        capture.close()


def run_shards(
    model: Any,
    windows: list[list[ShardPlan]],
    done: set[int],
    url: str,
    store_cfg: StoreConfig,
    cfg: ExtractConfig,
    layer_ids: list[int],
    packed: bool,
    progress: bool = True,
    outlier_channels: Any = None,
    write: bool = True,
) -> ExtractResult:
    """Extract this rank's unfinished shards, window by window, and write them (`write` False: a
    tensor-parallel rank that only computes its share of each forward; its group's first rank writes)."""
    from tqdm import tqdm

    result = ExtractResult()
    todo = [s for w in windows for s in w if s.index not in done]
    todo_ids = {r.sample_id for s in todo for r in s.kept}
    total_tokens = sum(len(r.input_ids) for s in todo for r in s.kept)
    started = time.perf_counter()
    parameter = next(model.parameters())
    device = parameter.device
    token_bytes = host_token_bytes(len(layer_ids), model.config.get_text_config().hidden_size, parameter.element_size(), cfg.top_k)
    # The batch shape is not part of the store's identity (an out-of-memory run continues with a
    # smaller batch), so each shard's part record says which one made it.
    batching = {"batching": {**{k: getattr(cfg, k) for k in BATCH_SETTINGS}, "tensor_parallel_size": cfg.tensor_parallel_size}}
    result.writer_threads = writer_threads(cfg, device.type) if write else 0
    writer = (
        ShardWriter(url, store_cfg, todo, writer_queue_mb(cfg, token_bytes), result.writer_threads, outlier_channels, batching)
        if write else None
    )
    timer = ForwardTimer(device)
    bar = tqdm(total=total_tokens, desc="extract", unit="tok", unit_scale=True, disable=not progress)
    try:
        for batch, outputs in forward_batches(model, windows, cfg, layer_ids, packed, wanted=todo_ids, timer=timer):
            if writer is None:
                continue
            wanted = [(row, out) for row, out in zip(batch, outputs) if row.sample_id in todo_ids]
            stored = [out for _, out in wanted]
            host, ready, value_sum = to_host(stored, device, stored_value_sum(stored))
            samples = [
                SampleFeatures(row.sample_id, row.input_ids, row.loss_mask, hidden, values, ids)
                for (row, _), (hidden, values, ids) in zip(wanted, host)
            ]
            writer.put(HostBatch(samples, ready, host_bytes(samples), value_sum))
            tokens = sum(len(s.input_ids_T) for s in samples)
            result.tokens += tokens
            bar.update(tokens)
        if writer is not None:
            result.writer = writer.finish()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        bar.close()
    result.forward_seconds = timer.seconds()
    result.shards_done = len(todo)
    result.seconds = time.perf_counter() - started
    return result
