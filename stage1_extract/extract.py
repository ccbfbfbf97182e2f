"""Run the target once over the data and store per-token features.

    python -m stage1_extract extract --config configs/default.yaml

The loop (`run_shards`) walks this rank's windows of shards (`batching.py`), runs the target over
each forward batch (`forward.py`), and hands the host copies to the background shard writer
(`writer.py`), which encodes and writes each shard as soon as all its samples are back, through a
queue bounded in bytes: the forward never waits on disk unless the disk is slower than the target.
Each finished shard leaves a part record; a rerun skips those shards, so a killed run resumes and
ends with the same store. With several processes (torchrun / accelerate launch) rank r takes
windows r, r + W, ...; rank 0 merges the part records into manifest.json, written last
(`merge.py`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from shared.config import Section
from shared.store import SampleFeatures, StoreConfig, bytes_per_token
from shared.target import LayerCapture
from stage1_extract.batching import ShardPlan, TokenizedRow, token_budget_batches
from stage1_extract.forward import forward_batch
from stage1_extract.writer import ShardWriterThread, WriterStats

log = logging.getLogger(__name__)


class ExtractConfig(Section):
    section: ClassVar[str] = "extract"
    renamed: ClassVar[dict[str, str]] = {"token_budget": "batch_tokens"}
    top_k: int = 64
    """Log-probabilities of the target's k most likely next tokens stored per token (the KL term reads them)."""
    batch_tokens: int = 8192
    """Tokens per target forward batch (padding included on the padded path)."""
    max_batch_samples: int = 64
    """At most this many samples per target forward batch."""
    window_shards: int = 4
    """Shards whose samples are length-sorted together."""
    queue_batches: int = 8
    """Writer queue bound, in forward batches."""
    lm_head_chunk: int = 2048
    """Tokens per LM-head + log-softmax chunk."""
    device: str = "auto"
    """Where stage 1 runs the target (generate and extract): auto = the GPU of this rank when there is one, else CPU."""
    packed: Literal["auto", "on", "off"] = "auto"
    """Flash-attn varlen packing (GPU)."""

    def validate(self) -> None:
        self.require(1 <= self.top_k <= 1024, "top_k", "must be in 1..1024")
        self.require(self.batch_tokens >= 16, "batch_tokens", "must be >= 16")
        self.require(self.max_batch_samples >= 1, "max_batch_samples", "must be >= 1")
        self.require(self.window_shards >= 1, "window_shards", "must be >= 1")
        self.require(self.queue_batches >= 1, "queue_batches", "must be >= 1")
        self.require(self.lm_head_chunk >= 1, "lm_head_chunk", "must be >= 1")


@dataclass
class ExtractResult:
    shards_done: int = 0
    shards_skipped: int = 0  # already finished by an earlier run
    tokens: int = 0
    seconds: float = 0.0
    forward_seconds: float = 0.0
    writer: WriterStats = field(default_factory=WriterStats)


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
) -> ExtractResult:
    """Extract this rank's unfinished shards, window by window, and write them."""
    import torch
    from tqdm import tqdm

    result = ExtractResult()
    todo = [s for w in windows for s in w if s.index not in done]
    todo_ids = {r.sample_id for s in todo for r in s.kept}
    total_tokens = sum(len(r.input_ids) for s in todo for r in s.kept)
    started = time.perf_counter()
    capture = LayerCapture(model, layer_ids)
    writer = ShardWriterThread(url, store_cfg, todo, cfg.queue_batches)
    bar = tqdm(total=total_tokens, desc="extract", unit="tok", unit_scale=True, disable=not progress)
    try:
        for window in windows:
            rows = [r for s in window for r in s.kept]
            for batch in token_budget_batches(rows, cfg.batch_tokens, cfg.max_batch_samples):
                if not any(r.sample_id in todo_ids for r in batch):
                    continue  # finished by an earlier run
                forward_started = time.perf_counter()
                outputs = forward_batch(model, capture, batch, cfg.top_k, cfg.lm_head_chunk, packed)
                samples = [
                    SampleFeatures(
                        sample_id=row.sample_id,
                        input_ids_T=row.input_ids,
                        loss_mask_T=row.loss_mask,
                        hidden_TLH=hidden.to("cpu", non_blocking=True),
                        topk_logprobs_TK=values.to("cpu", non_blocking=True),
                        topk_ids_TK=ids.to("cpu", non_blocking=True),
                    )
                    for row, (hidden, values, ids) in zip(batch, outputs)
                    if row.sample_id in todo_ids
                ]
                if next(model.parameters()).is_cuda:
                    torch.cuda.current_stream().synchronize()  # the non-blocking copies must land first
                result.forward_seconds += time.perf_counter() - forward_started
                writer.put(samples)
                tokens = sum(len(s.input_ids_T) for s in samples)
                result.tokens += tokens
                bar.update(tokens)
        result.writer = writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        capture.close()
        bar.close()
    result.shards_done = len(todo)
    result.seconds = time.perf_counter() - started
    return result


def estimate(rows: list[TokenizedRow], header: dict[str, Any], store_cfg: StoreConfig) -> dict[str, Any]:
    kept = [r for r in rows if not r.skipped]
    tokens = int(sum(len(r.input_ids) for r in kept))
    per_token = bytes_per_token(
        store_cfg.dtype, len(header["layer_ids"]), header["target"]["hidden_size"], header["top_k"]
    )
    return {
        "samples": len(kept),
        "samples_truncated": sum(r.truncated for r in rows),
        "samples_skipped": sum(r.skipped for r in rows),
        "tokens": tokens,
        "bytes_per_token": per_token,
        "total_bytes": tokens * per_token,
        "total_gib": round(tokens * per_token / 2**30, 3),
        "compression_note": "zstd typically saves 1.2-1.3x on hidden states (not counted)"
        if store_cfg.compression == "zstd"
        else "uncompressed",
        "num_shards_estimate": math.ceil(tokens * per_token / (store_cfg.shard_mb * 2**20)) if tokens else 0,
    }
