"""Run the target once over the data and store per-token features.

    python -m stage1_extract extract --config configs/default.yaml

Per token: the outputs of the chosen decoder layers (HF hidden_states[i + 1], captured by hooks
on those layers, so the other layers' states are never kept), the top-k log-probabilities of the
target's next-token distribution (final norm + LM head, log-softmax in fp32, computed in chunks
so the [tokens, vocab] logits never exist whole), the input ids and the loss mask.

Samples are planned into shards of `samples_per_shard` consecutive rows (pinned in plan.json).
Forward batches are built by token budget over length-sorted samples inside a window of shards,
so padding is small and nothing padded is stored. A background writer thread encodes and writes
each shard as soon as all its samples are back, through a bounded queue: the forward never waits
on disk unless the disk is slower than the target. Each finished shard leaves a part record;
a rerun skips those shards, so a killed run resumes and ends with the same store. With several
processes (torchrun / accelerate launch) rank r takes shards r, r + W, ...; rank 0 merges the
part records into manifest.json, written last.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from shared.config import Section
from shared.errors import DataError, StoreError, UserError
from shared.store import (
    SCHEMA_VERSION,
    SampleFeatures,
    StoreConfig,
    StoreFiles,
    bytes_per_token,
    shard_name,
    write_shard,
)
from shared.target import LayerCapture

log = logging.getLogger(__name__)


class ExtractConfig(Section):
    section: ClassVar[str] = "extract"
    top_k: int = 64
    token_budget: int = 8192
    """Tokens per forward batch (padding included on the padded path)."""
    max_batch_samples: int = 64
    window_shards: int = 4
    """Shards whose samples are length-sorted together."""
    queue_batches: int = 8
    """Writer queue bound, in forward batches."""
    lm_head_chunk: int = 2048
    """Tokens per LM-head + log-softmax chunk."""
    device: str = "auto"
    packed: Literal["auto", "on", "off"] = "auto"
    """Flash-attn varlen packing (GPU)."""

    def validate(self) -> None:
        self.require(1 <= self.top_k <= 1024, "top_k", "must be in 1..1024")
        self.require(self.token_budget >= 16, "token_budget", "must be >= 16")
        self.require(self.max_batch_samples >= 1, "max_batch_samples", "must be >= 1")
        self.require(self.window_shards >= 1, "window_shards", "must be >= 1")
        self.require(self.queue_batches >= 1, "queue_batches", "must be >= 1")
        self.require(self.lm_head_chunk >= 1, "lm_head_chunk", "must be >= 1")


@dataclass
class TokenizedRow:
    sample_id: int
    row_hash: str  # of the input row as read: an edited row changes its shard's identity
    input_ids: np.ndarray
    loss_mask: np.ndarray
    truncated: bool = False
    skipped: bool = False
    content_hash: str = ""  # of the tokens and loss mask: identical samples share it (duplicates)


def content_hash(input_ids: np.ndarray, loss_mask: np.ndarray) -> str:
    digest = hashlib.blake2b(np.asarray(input_ids, dtype=np.int32).tobytes(), digest_size=8)
    digest.update(np.asarray(loss_mask, dtype=bool).tobytes())
    return digest.hexdigest()


@dataclass
class ShardPlan:
    index: int
    rows: list[TokenizedRow]
    tag: str
    key: str  # header key of the settings that produce it

    @property
    def name(self) -> str:
        return shard_name(self.index, self.tag)

    @property
    def rows_sha256(self) -> str:
        return hashlib.sha256("".join(r.row_hash for r in self.rows).encode()).hexdigest()

    @property
    def kept(self) -> list[TokenizedRow]:
        return [r for r in self.rows if not r.skipped]


# ---------------------------------------------------------------------------------------------
# Planning


def settings_header(
    *,
    target_path: str,
    weights_sha256: str,
    arch: Any,
    tokenizer_hashes: dict[str, str],
    layer_ids: list[int],
    top_k: int,
    store: StoreConfig,
    max_length: int,
    on_long: str,
) -> dict[str, Any]:
    """Everything that determines the stored values: the manifest's identity section."""
    return {
        "schema_version": SCHEMA_VERSION,
        "target": {
            "path": target_path,
            "weights_sha256": weights_sha256,
            "model_type": arch.model_type,
            "num_hidden_layers": arch.num_hidden_layers,
            "hidden_size": arch.hidden_size,
            "vocab_size": arch.vocab_size,
        },
        "tokenizer_sha256": tokenizer_hashes["tokenizer_sha256"],
        "chat_template_sha256": tokenizer_hashes["chat_template_sha256"],
        "layer_ids": list(layer_ids),
        "top_k": top_k,
        "storage": {
            "dtype": store.dtype,
            "compression": store.compression,
            "zstd_level": store.zstd_level,
            "chunk_tokens": store.chunk_tokens,
        },
        "max_length": max_length,
        "on_long": on_long,
    }


def header_key(header: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()


def choose_samples_per_shard(rows: list[TokenizedRow], shard_mb: int, token_bytes: int) -> int:
    mean_tokens = max(1.0, float(np.mean([len(r.input_ids) for r in rows]))) if rows else 1.0
    return max(1, int(shard_mb * 2**20 / token_bytes / mean_tokens))


def plan_shards(rows: list[TokenizedRow], samples_per_shard: int, key: str) -> list[ShardPlan]:
    shards = []
    for index, start in enumerate(range(0, len(rows), samples_per_shard)):
        chunk = rows[start : start + samples_per_shard]
        tag = hashlib.sha256((key + "".join(r.row_hash for r in chunk)).encode()).hexdigest()[:10]
        shards.append(ShardPlan(index=index, rows=chunk, tag=tag, key=key))
    return shards


def header_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted names of the identity fields that differ ('target.weights_sha256', 'top_k', ...)."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{key}.{sub}" for sub in header_differences(a, b)]
        elif a != b:
            out.append(key)
    return out


def load_or_pin_plan(
    files: StoreFiles, header: dict[str, Any], samples_per_shard: int, num_rows: int, repin: bool = False
) -> int:
    """The first run pins samples_per_shard; later runs must agree on the header, or reprocess
    (repin=True), which adopts the new header and keeps the shard boundaries."""
    if files.exists("plan.json"):
        plan = files.read_json("plan.json")
        if repin and plan["header"] != header:
            plan.update({"header": header, "num_rows": num_rows})
            files.write_json("plan.json", plan)
        for field_name, value in header.items():
            if plan["header"].get(field_name) != value:
                raise StoreError(
                    f"{files.url}/plan.json: this store was started with {field_name}="
                    f"{plan['header'].get(field_name)!r}, the config now gives {value!r}. "
                    f"Run `python -m stage1_extract reprocess` to update the stale shards, or use another store.path"
                )
        return int(plan["samples_per_shard"])
    files.write_json("plan.json", {"header": header, "samples_per_shard": samples_per_shard, "num_rows": num_rows})
    return samples_per_shard


# ---------------------------------------------------------------------------------------------
# The forward


def topk_logprobs(final_hidden_NH: Any, lm_head: Any, k: int, chunk: int) -> tuple[Any, Any]:
    """Top-k of log_softmax(lm_head(h)) in fp32, chunked over tokens.

    log_softmax is monotone, so the top-k of the logits minus their logsumexp is the top-k of the
    log-probs; the logsumexp is then taken in place, so no second [chunk, vocab] fp32 tensor is
    made (at Qwen3's 152K vocab and 8K-token chunks that tensor is 5 GB)."""
    import torch

    values, indices = [], []
    for start in range(0, final_hidden_NH.shape[0], chunk):
        logits_CV = lm_head(final_hidden_NH[start : start + chunk]).float()
        top = torch.topk(logits_CV, k, dim=-1)
        max_C1 = logits_CV.amax(dim=-1, keepdim=True)
        logsumexp_C1 = max_C1 + logits_CV.sub_(max_C1).exp_().sum(dim=-1, keepdim=True).log_()
        values.append(top.values - logsumexp_C1)
        indices.append(top.indices.to(torch.int32))
    return torch.cat(values), torch.cat(indices)


def forward_batch(model: Any, capture: LayerCapture, rows: list[TokenizedRow], top_k: int, chunk: int, packed: bool) -> list[tuple[Any, Any, Any]]:
    """Per row: (hidden [T, L, H], topk_logprobs [T, K], topk_ids [T, K]) on the model's device."""
    import torch

    device = next(model.parameters()).device
    decoder = model.get_decoder()
    lengths = [len(r.input_ids) for r in rows]
    with torch.inference_mode():
        if packed:
            ids_1N = torch.from_numpy(np.concatenate([r.input_ids for r in rows]).astype(np.int64))[None].to(device)
            pos_1N = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
            final_1NH = decoder(input_ids=ids_1N, position_ids=pos_1N).last_hidden_state
            hidden_1NLH = capture.stacked()
            values_NK, ids_NK = topk_logprobs(final_1NH[0], model.lm_head, top_k, chunk)
            bounds = np.concatenate([[0], np.cumsum(lengths)])
            return [
                (hidden_1NLH[0, a:b], values_NK[a:b], ids_NK[a:b]) for a, b in zip(bounds[:-1], bounds[1:])
            ]
        width = max(lengths)
        ids_BT = torch.zeros((len(rows), width), dtype=torch.long)
        attn_BT = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            ids_BT[b, : lengths[b]] = torch.from_numpy(r.input_ids.astype(np.int64))
            attn_BT[b, : lengths[b]] = 1
        final_BTH = decoder(input_ids=ids_BT.to(device), attention_mask=attn_BT.to(device)).last_hidden_state
        hidden_BTLH = capture.stacked()
        # Only real tokens go through the LM head: padding is never computed twice nor stored.
        keep_BT = attn_BT.bool().to(device)
        values_NK, ids_NK = topk_logprobs(final_BTH[keep_BT], model.lm_head, top_k, chunk)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        return [
            (hidden_BTLH[b, : lengths[b]], values_NK[bounds[b] : bounds[b + 1]], ids_NK[bounds[b] : bounds[b + 1]])
            for b in range(len(rows))
        ]


def token_budget_batches(rows: list[TokenizedRow], budget: int, max_samples: int) -> Iterator[list[TokenizedRow]]:
    """Length-sorted rows cut into batches whose padded size (rows x longest) fits the budget."""
    batch: list[TokenizedRow] = []
    for row in sorted(rows, key=lambda r: len(r.input_ids)):
        longest = max([len(row.input_ids)] + [len(r.input_ids) for r in batch])
        if batch and (longest * (len(batch) + 1) > budget or len(batch) >= max_samples):
            yield batch
            batch = []
        batch.append(row)
    if batch:
        yield batch


# ---------------------------------------------------------------------------------------------
# The background writer


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
        self.files.write_json(f"parts/shard-{shard.index:06d}.json", record)
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


# ---------------------------------------------------------------------------------------------
# The extraction loop


@dataclass
class ExtractResult:
    shards_done: int = 0
    shards_skipped: int = 0  # already finished by an earlier run
    tokens: int = 0
    seconds: float = 0.0
    forward_seconds: float = 0.0
    writer: WriterStats = field(default_factory=WriterStats)


def windows_for_rank(shards: list[ShardPlan], window_shards: int, rank: int, world: int) -> list[list[ShardPlan]]:
    """Consecutive shards, `window_shards` at a time, dealt to ranks whole.

    The batches of a window depend only on the data and the config, never on the number of
    processes or on what an earlier run finished, so every sample goes through the target in the
    same batch (same padding, same kernels) and a resumed or multi-process store is bit-identical
    to a single uninterrupted run.
    """
    windows = [shards[i : i + window_shards] for i in range(0, len(shards), window_shards)]
    return [w for number, w in enumerate(windows) if number % world == rank]


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
            for batch in token_budget_batches(rows, cfg.token_budget, cfg.max_batch_samples):
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


def part_path(index: int) -> str:
    return f"parts/shard-{index:06d}.json"


def record_matches(record: dict[str, Any] | None, shard: ShardPlan) -> bool:
    """A shard is done when its part record matches both its input rows and the settings."""
    return record is not None and record.get("rows_sha256") == shard.rows_sha256 and record.get("header_key") == shard.key


PART_READ_THREADS = 32


def part_records(files: StoreFiles, shards: list[ShardPlan]) -> dict[int, dict[str, Any]]:
    """The part record of every shard that has one: one listing, then reads in parallel. On an
    object store each read is a latency-bound GET; 100K shards read one by one take minutes."""
    present = set(files.list("parts"))
    wanted = [s.index for s in shards if part_path(s.index).rsplit("/", 1)[1] in present]
    with ThreadPoolExecutor(PART_READ_THREADS, thread_name_prefix="dflash-parts") as pool:
        records = list(pool.map(lambda index: files.read_json(part_path(index)), wanted))
    return dict(zip(wanted, records))


def done_shards(files: StoreFiles, shards: list[ShardPlan]) -> set[int]:
    """Indices of the shards whose part record matches their rows and settings."""
    records = part_records(files, shards)
    return {s.index for s in shards if record_matches(records.get(s.index), s)}


def merge_manifest(files: StoreFiles, header: dict[str, Any], shards: list[ShardPlan], extra: dict[str, Any]) -> dict[str, Any]:
    """Build manifest.json from the part records (all ranks), then drop unlisted shard groups."""
    found = part_records(files, shards)
    records = []
    for shard in shards:
        if not record_matches(found.get(shard.index), shard):
            raise StoreError(
                f"{files.url}/{part_path(shard.index)} is missing or belongs to other rows or settings; "
                f"rerun `python -m stage1_extract extract`"
            )
        records.append(found[shard.index])
    manifest = dict(header)
    manifest.update(extra)
    manifest.update(
        {
            "num_samples": sum(r["num_samples"] for r in records),
            "num_tokens": sum(r["num_tokens"] for r in records),
            "num_bytes": sum(r["bytes"] for r in records),
            "num_truncated": sum(r["num_truncated"] for r in records),
            "num_skipped": sum(r["num_skipped"] for r in records),
            "num_duplicates": count_duplicates(records),
            "shards": records,
        }
    )
    files.write_json("manifest.json", manifest)
    for name in orphans(files, records):
        files.remove(name)  # leftovers of a crash, of a replaced shard, or of rows no longer in the data
    return manifest


def count_duplicates(records: list[dict[str, Any]]) -> int | None:
    """Samples whose tokens equal an earlier sample's (the held-out split keeps copies together);
    None for part records written before content hashes were recorded."""
    if not all("content_hashes" in r for r in records):
        return None
    hashes = [h for r in records for h in r["content_hashes"]]
    return len(hashes) - len(set(hashes))


def orphans(files: StoreFiles, records: list[dict[str, Any]]) -> list[str]:
    """Store paths that no manifest record refers to: unlisted shard groups and part records."""
    listed = {r["name"] for r in records if r["name"]}
    parts = {part_path(r["index"]).split("/")[1] for r in records}
    out = [f"shards/{n}" for n in files.list("shards") if n.startswith("shard-") and n not in listed]
    out += [f"parts/{n}" for n in files.list("parts") if n.startswith("shard-") and n not in parts]
    return out


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
