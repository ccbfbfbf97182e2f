"""Stage 1 commands: generate, plan, extract, status, verify.

Each takes the composed RunConfig and returns a JSON-able dict; `__main__` only parses and prints.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from shared.config import RunConfig
from shared.errors import BusyError, ConfigError, DataError, InputFileError, StoreError
from shared.lock import exclusive
from shared.store import (
    StoreFiles,
    bytes_per_token,
    content_checksum,
    load_manifest,
    read_manifest,
    read_shard_arrays,
)
from shared.target import (
    TargetArch,
    load_target_model,
    load_tokenizer,
    resolve_dtype,
    resolve_layer_ids,
    resolve_target_dir,
    tokenizer_fingerprints,
    weights_fingerprint,
)
from stage1_extract.data import ReadStats, read_conversations
from stage1_extract.extract import (
    ShardPlan,
    TokenizedRow,
    choose_samples_per_shard,
    content_hash,
    done_shards,
    estimate,
    header_differences,
    header_key,
    load_or_pin_plan,
    merge_manifest,
    part_path,
    plan_shards,
    run_shards,
    settings_header,
    windows_for_rank,
)
from stage1_extract.generate import (
    generate_all,
    resolve_backend,
    resolve_device,
    settings_key,
    transformers_backend,
    vllm_backend,
)
from stage1_extract.tokens import TokenCache, cache_key, resolve_workers, tokenize_all

log = logging.getLogger(__name__)

def prompts_path(cfg: RunConfig) -> Path:
    """The conversations `generate` reads: data.path, or the embedded default prompt set."""
    if cfg.data.path is not None:
        return Path(cfg.data.path)
    from stage1_extract.corpus import write_default_prompts

    path = Path(cfg.run_dir) / "data" / f"default_prompts_{cfg.data.num_default_prompts}.parquet"
    if not path.exists():
        write_default_prompts(path, cfg.data.num_default_prompts)
    return path


def generated_path(cfg: RunConfig) -> Path:
    return Path(cfg.run_dir) / "data" / "generated.parquet"


def extraction_input(cfg: RunConfig) -> Path:
    """Extraction reads the target's regenerated conversations (the recipe), or data.path as is."""
    if cfg.data.regenerate:
        path = generated_path(cfg)
        if not path.exists():
            raise InputFileError(
                f"{path} does not exist: run `python -m stage1_extract generate` first "
                f"(or set data.regenerate=false to extract data.path as it is)"
            )
        return path
    if cfg.data.path is None:
        raise ConfigError("data.regenerate=false needs data.path: the default prompts have no answers")
    path = Path(cfg.data.path)
    if not path.exists():
        raise InputFileError(
            f"data.path={path} does not exist (data.regenerate=false reads it as it is): "
            f"check the path, or build it first (`make generate CONFIG=...` writes a preset's answers to run_dir/data)"
        )
    return path


# ---------------------------------------------------------------------------------------------


def cmd_generate(cfg: RunConfig, progress: bool = True) -> dict[str, Any]:
    if not cfg.data.regenerate:  # `make extract` always asks; with answers given there is nothing to do
        return {"skipped": "data.regenerate=false: extraction reads data.path as it is", "input": cfg.data.path}
    source = prompts_path(cfg)
    stats = ReadStats()
    conversations = list(
        read_conversations(source, on_bad_row=cfg.data.on_bad_row, max_samples=cfg.data.max_samples, stats=stats)
    )
    out = generated_path(cfg)
    cfg.write_resolved(out.with_name("generate_config.yaml"))
    device = resolve_device(cfg.generate.device)
    backend_name = resolve_backend(cfg.generate.backend, device)
    tokenizer = load_tokenizer(cfg.target)
    model_dir = resolve_target_dir(cfg.target)
    key = settings_key(cfg.generate, weights_fingerprint(model_dir), cfg.seed)

    def make_backend():
        if backend_name == "vllm":
            return vllm_backend(str(model_dir), cfg.generate, cfg.seed, resolve_dtype(cfg.target.dtype, device))
        return transformers_backend(load_target_model(cfg.target, device), tokenizer, cfg.generate, cfg.seed)

    with exclusive(str(out.parent), "stage1_extract generate"):
        result = generate_all(conversations, tokenizer, make_backend, out, cfg.generate, key, progress=progress)
    return {
        "output": str(result.path),
        "conversations": result.num_conversations,
        "bad_rows_skipped": stats.bad_rows,
        "generated_tokens": result.num_generated_tokens,
        "seconds": round(result.seconds, 1),
        "parts_reused": result.parts_reused,
        "backend": backend_name,
    }


@dataclass
class Prepared:
    header: dict[str, Any]
    rows: list[TokenizedRow]
    files: StoreFiles
    layer_ids: list[int]
    stats: ReadStats
    source: Path


def prepare(cfg: RunConfig) -> Prepared:
    """Tokenize the input (or read the token cache) and compute the identity header of the store
    (no model weights loaded)."""
    model_dir = resolve_target_dir(cfg.target)
    arch = TargetArch.from_dir(model_dir)
    layer_ids = resolve_layer_ids(cfg.target, arch)
    tokenizer = load_tokenizer(cfg.target)
    tokenizer_hashes = tokenizer_fingerprints(tokenizer)
    source = extraction_input(cfg)
    rows, stats = tokenized_rows(cfg, tokenizer, tokenizer_hashes, source)
    if not rows:
        raise DataError(f"{source}: no usable rows")
    header = settings_header(
        target_path=cfg.target.path,
        weights_sha256=weights_fingerprint(model_dir),
        arch=arch,
        tokenizer_hashes=tokenizer_hashes,
        layer_ids=layer_ids,
        top_k=cfg.extract.top_k,
        store=cfg.store,
        max_length=cfg.data.max_length,
        on_long=cfg.data.on_long,
    )
    return Prepared(header, rows, StoreFiles(cfg.store.url(cfg.run_dir)), layer_ids, stats, source)


def cmd_plan(cfg: RunConfig, prepared: Prepared | None = None) -> dict[str, Any]:
    prepared = prepared or prepare(cfg)
    plan = estimate(prepared.rows, prepared.header, cfg.store)
    free = prepared.files.free_bytes()
    plan.update(
        {
            "store": prepared.files.url,
            "storage": f"{cfg.store.dtype}+{cfg.store.compression}",
            "free_bytes": free,
            "fits": None if free is None else plan["total_bytes"] <= free,
            "bad_rows_skipped": prepared.stats.bad_rows,
        }
    )
    return plan


def token_cache_dir(cfg: RunConfig) -> Path:
    return Path(os.path.expandvars(cfg.data.cache_dir)) if cfg.data.cache_dir else Path(cfg.run_dir) / "cache"


def distributed_context() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun / accelerate launch variables."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def tokenized_rows(
    cfg: RunConfig, tokenizer: Any, tokenizer_hashes: dict[str, str], source: Path
) -> tuple[list[TokenizedRow], ReadStats]:
    """Every row of `source`, templated and tokenized: from the token cache when it matches, else
    by `data.tokenize_workers` processes (then cached). Bad rows raise naming the file and row."""
    data = cfg.data
    cache = None
    if data.token_cache:
        settings = {"max_length": data.max_length, "on_long": data.on_long, "on_bad_row": data.on_bad_row, "max_samples": data.max_samples}
        key, inputs = cache_key(source, tokenizer_hashes, settings)
        cache = TokenCache(token_cache_dir(cfg), key, inputs)
        if cache.exists():
            cached, stats = cache.load()
            return [TokenizedRow(**r) for r in cached], stats
    stats = ReadStats()
    conversations = list(read_conversations(source, on_bad_row=data.on_bad_row, max_samples=data.max_samples, stats=stats))
    workers = resolve_workers(data.tokenize_workers)
    rows = []
    for conv, (row, sample) in zip(conversations, tokenize_all(tokenizer, conversations, data.max_length, workers)):
        skipped = not isinstance(sample, str) and sample.truncated and data.on_long == "skip"
        problem = unusable(sample, data.max_length) if not skipped else None
        if problem is not None:
            message = f"{source}: row {row}: {problem}"
            if data.on_bad_row == "raise":
                raise DataError(message + " (set data.on_bad_row=skip to skip and count bad rows)")
            stats.bad_rows += 1
            if len(stats.bad_examples) < 5:
                stats.bad_examples.append(message)
            log.warning("skipping %s", message)
            continue
        rows.append(
            TokenizedRow(
                sample_id=conv.row,
                row_hash=conv.row_hash(),
                input_ids=sample.input_ids,
                loss_mask=sample.loss_mask,
                truncated=sample.truncated and not skipped,
                skipped=skipped,
                content_hash=content_hash(sample.input_ids, sample.loss_mask),
            )
        )
    if cache is not None and rows:
        try:
            cache.save(rows, stats)
        except OSError as exc:  # a read-only or full run_dir costs the next command a re-tokenize, not this one
            log.warning("could not write the token cache under %s (%s): later commands tokenize again", cache.root, exc)
    return rows, stats


def unusable(sample: Any, max_length: int) -> str | None:
    """Why a tokenized row cannot be trained on, or None: the template failed (the message), or no
    assistant token is left to supervise (saying when truncation to data.max_length caused it)."""
    if isinstance(sample, str):
        return sample
    if sample.loss_mask.any():
        return None
    if sample.truncated:
        return (
            f"no assistant tokens left to supervise after truncating to data.max_length={max_length} "
            f"(the prompt alone fills it); raise data.max_length or set data.on_long=skip"
        )
    return "no assistant tokens to supervise after templating"


def cmd_extract(cfg: RunConfig, force: bool = False, progress: bool = True, reprocess: bool = False) -> dict[str, Any]:
    rank, world, local_rank = distributed_context()
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            # Only barriers travel; gloo works on CPU and GPU nodes. They wait for the slowest rank's
            # tokenizing or last window, so the default 30-minute timeout would kill healthy runs.
            dist.init_process_group("gloo", timeout=timedelta(hours=6))
    try:
        with store_lock(cfg.store.url(cfg.run_dir), rank, world, "reprocess" if reprocess else "extract"):
            return _extract(cfg, force, progress and rank == 0, rank, world, local_rank, reprocess)
    finally:
        if world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


@contextmanager
def store_lock(url: str, rank: int, world: int, command: str) -> Iterator[None]:
    """Rank 0 holds the store's lock for the whole job; every rank learns at once if it could not
    (a second `extract` on the same store is refused before it touches a file)."""
    with ExitStack() as stack:
        error: BusyError | None = None
        if rank == 0:
            try:
                stack.enter_context(exclusive(url, f"stage1_extract {command}"))
            except BusyError as exc:
                error = exc
        if not _all_ok(world, error is None):
            raise error or BusyError(f"{url}: another command holds the store (rank 0 could not lock it)")
        yield


def _all_ok(world: int, ok: bool) -> bool:
    if world == 1:
        return ok
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def shard_size(cfg: RunConfig, prepared: Prepared) -> int:
    """samples_per_shard: pinned in plan.json by the first run, else computed from store.shard_mb."""
    files = prepared.files
    if files.exists("plan.json"):
        return int(files.read_json("plan.json")["samples_per_shard"])
    token_bytes = bytes_per_token(
        cfg.store.dtype, len(prepared.layer_ids), prepared.header["target"]["hidden_size"], cfg.extract.top_k
    )
    return choose_samples_per_shard(prepared.rows, cfg.store.shard_mb, token_bytes)


def planned_shards(cfg: RunConfig, prepared: Prepared) -> list[ShardPlan]:
    """The shards of the current config and data, with the boundaries pinned in plan.json."""
    return plan_shards(prepared.rows, shard_size(cfg, prepared), header_key(prepared.header))


def _prepare_all_ranks(cfg: RunConfig, rank: int, world: int, local_rank: int) -> Prepared:
    """Tokenize each row once per cache folder: global rank 0 first (in parallel processes) and
    caches; then each other node's local rank 0, which finds that cache if the folder is shared
    or builds its node's own if data.cache_dir is node-local; then everyone else reads it. Every
    rank reaches every barrier, also on bad input: the others then meet the same error themselves."""
    phase = 0 if rank == 0 else 1 if local_rank == 0 else 2
    prepared, error = None, None
    for turn in range(3):
        if turn == phase:
            try:
                prepared = prepare(cfg)
            except BaseException as exc:  # noqa: BLE001 - raised after the last barrier
                error = exc
        _barrier(world)
    if error is not None:
        raise error
    return prepared


def _pin_plan(cfg: RunConfig, prepared: Prepared, rank: int, world: int, reprocess: bool) -> list[ShardPlan]:
    """Rank 0 pins samples_per_shard (the computed size, not the first shard's, which a short first
    run would make small forever); every rank then checks the pinned header and plans the shards."""
    files = prepared.files
    if rank == 0:
        load_or_pin_plan(files, prepared.header, shard_size(cfg, prepared), len(prepared.rows), repin=reprocess)
        if "://" not in files.url:
            cfg.write_resolved(Path(files.url) / "extract_config.yaml")
    _barrier(world)
    load_or_pin_plan(files, prepared.header, 0, len(prepared.rows))
    return planned_shards(cfg, prepared)


def check_space(cfg: RunConfig, prepared: Prepared, shards: list[ShardPlan], done: set[int], force: bool) -> None:
    """Refuse to start when the shards still to write will not fit (`--force` overrides). Only the
    shards left count: after a full disk and some space freed, the rest of the job may well fit."""
    files = prepared.files
    free = files.free_bytes()
    if free is None or force:
        return
    per_token = bytes_per_token(
        cfg.store.dtype, len(prepared.layer_ids), prepared.header["target"]["hidden_size"], cfg.extract.top_k
    )
    left = sum(len(r.input_ids) for s in shards if s.index not in done for r in s.kept) * per_token
    if left > free:
        raise StoreError(
            f"extraction still needs about {human_bytes(left)} ({len(shards) - len(done)} of {len(shards)} shards "
            f"left) but {files.url} has {human_bytes(free)} free; free space, change store.dtype/compression, "
            f"or pass --force"
        )


def human_bytes(n: float) -> str:
    """3 significant figures in the largest unit that keeps the number >= 1 (0.00 GiB hides 500 MB)."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            break
    return f"{n:.3g} {unit}"


def _extract(
    cfg: RunConfig, force: bool, progress: bool, rank: int, world: int, local_rank: int, reprocess: bool
) -> dict[str, Any]:
    started = time.perf_counter()
    prepared = _prepare_all_ranks(cfg, rank, world, local_rank)
    prepare_seconds = time.perf_counter() - started
    shards = _pin_plan(cfg, prepared, rank, world, reprocess)
    files = prepared.files
    done = done_shards(files, shards)
    check_space(cfg, prepared, shards, done, force)
    windows = windows_for_rank(shards, cfg.extract.window_shards, rank, world)
    mine = [s for w in windows for s in w if s.index not in done]
    result = _run_windows(cfg, prepared, windows, done, local_rank, progress) if mine else None
    _barrier(world)
    summary: dict[str, Any] = {
        "store": files.url,
        "rank": rank,
        "world_size": world,
        "shards_total": len(shards),
        "shards_already_done": len(done),
        "shards_extracted_here": len(mine),
        "prepare_seconds": round(prepare_seconds, 2),  # read + tokenize every row (on every rank)
    }
    if result is not None:
        summary.update(
            {
                "tokens": result.tokens,
                "seconds": round(result.seconds, 2),
                "forward_seconds": round(result.forward_seconds, 2),
                "tok_per_s": round(result.tokens / max(result.seconds, 1e-9), 1),
                "writer_queue_wait_s": round(result.writer.queue_wait_seconds, 3),
                "writer_seconds": round(result.writer.write_seconds, 2),
            }
        )
    if rank == 0:
        summary.update(_merge(cfg, prepared, shards))
    _barrier(world)
    return summary


def _run_windows(
    cfg: RunConfig, prepared: Prepared, windows: list[list[ShardPlan]], done: set[int], local_rank: int, progress: bool
) -> Any:
    device = resolve_device(cfg.extract.device)
    if device == "cuda":
        device = f"cuda:{local_rank}"
    model = load_target_model(cfg.target, device)
    packed = cfg.extract.packed == "on" or (
        cfg.extract.packed == "auto" and model.config._attn_implementation == "flash_attention_2"
    )
    return run_shards(
        model, windows, done, prepared.files.url, cfg.store, cfg.extract, prepared.layer_ids, packed, progress
    )


def _merge(cfg: RunConfig, prepared: Prepared, shards: list[ShardPlan]) -> dict[str, Any]:
    """Rank 0: the manifest from every rank's part records, written last."""
    extra = {
        "data": {"source": str(prepared.source), "num_rows": len(prepared.rows), "bad_rows_skipped": prepared.stats.bad_rows},
        "samples_per_shard": shard_size(cfg, prepared),
        "created_unix": int(time.time()),
    }
    started = time.perf_counter()
    manifest = merge_manifest(prepared.files, prepared.header, shards, extra)
    out = {"merge_seconds": round(time.perf_counter() - started, 2)}
    out.update({k: manifest[k] for k in ("num_samples", "num_tokens", "num_bytes", "num_truncated", "num_skipped")})
    return out


def shard_report(cfg: RunConfig, prepared: Prepared | None = None) -> dict[str, Any]:
    """Per shard of the current config and data: current, stale (and why), missing; plus orphans."""
    return _shard_states(cfg, prepared or prepare(cfg), every_record=False)[0]


def _shard_states(cfg: RunConfig, prepared: Prepared, every_record: bool) -> tuple[dict[str, Any], list[ShardPlan], set[int]]:
    """(the report, the planned shards, the done ones among those whose part record was read: every
    shard's, or only the shards the manifest does not list). Part records are read once."""
    files = prepared.files
    shards = planned_shards(cfg, prepared)
    manifest, damaged = None, None
    if files.exists("manifest.json"):
        try:
            manifest = load_manifest(files)
        except StoreError as exc:  # reprocess rebuilds it from the part records
            damaged = str(exc)
    listed = {r["index"]: r for r in manifest["shards"]} if manifest else {}
    header_changes = header_differences({k: manifest.get(k) for k in prepared.header}, prepared.header) if manifest else []
    rows: list[dict[str, Any]] = []
    done = done_shards(files, shards if every_record else [s for s in shards if s.index not in listed])
    for shard in shards:
        record = listed.get(shard.index)
        if record is None:
            state, why = "missing", ("extracted, manifest not yet merged" if shard.index in done else "not extracted")
        elif record.get("header_key") != shard.key:
            state, why = "stale", "settings changed: " + ", ".join(header_changes or ["schema"])
        elif record["rows_sha256"] != shard.rows_sha256:
            state, why = "stale", "input rows changed"
        else:
            state, why = "current", ""
        rows.append({"index": shard.index, "state": state, "why": why, "samples": len(shard.rows)})
    orphaned = [r["name"] or f"index {r['index']}" for i, r in listed.items() if i >= len(shards)]
    counts = {state: sum(r["state"] == state for r in rows) for state in ("current", "stale", "missing")}
    report = {
        "store": files.url,
        "manifest": manifest is not None,
        "manifest_damaged": damaged,
        "settings_changed": header_changes,
        "counts": {**counts, "orphaned": len(orphaned)},
        "orphaned": orphaned,
        "shards": rows,
        "complete": manifest is not None and counts["current"] == len(shards) and not orphaned,
    }
    return report, shards, done


def cmd_status(cfg: RunConfig) -> dict[str, Any]:
    report, shards, done_indices = _shard_states(cfg, prepare(cfg), every_record=True)
    done = [s for s in shards if s.index in done_indices]
    report.update(
        {
            "shards_done": len(done),
            "shards_total": len(shards),
            "tokens_done": sum(len(r.input_ids) for s in done for r in s.kept),
            "tokens_total": sum(len(r.input_ids) for s in shards for r in s.kept),
        }
    )
    return report


def cmd_reprocess(cfg: RunConfig, force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Re-extract only stale and missing shards, drop orphans, rewrite the manifest last."""
    rank, _, _ = distributed_context()
    before = shard_report(cfg) if rank == 0 else None
    summary = cmd_extract(cfg, force=force, progress=progress, reprocess=True)
    if rank == 0:
        summary["before"] = before["counts"]
        summary["settings_changed"] = before["settings_changed"]
        summary["reextracted"] = [r["index"] for r in before["shards"] if r["state"] != "current"]
        summary["orphans_removed"] = before["orphaned"]
    return summary


def cmd_verify(cfg: RunConfig, repair: bool = False, progress: bool = True) -> dict[str, Any]:
    """Every shard against the manifest: readable, counts, shapes, dtypes, finite values, checksum.
    With repair, bad shards are deleted with their part records and extracted again."""
    url = cfg.store.url(cfg.run_dir)
    report = verify_store(url)
    if repair and report["bad_shards"]:
        with exclusive(url, "stage1_extract verify --repair"):
            files = StoreFiles(url)
            for bad in report["bad_shards"]:
                files.remove(f"shards/{bad['shard']}")
                files.remove(part_path(bad["index"]))
            _extract(cfg, False, progress, 0, 1, 0, False)
        after = verify_store(url)
        after["repaired"] = [b["shard"] for b in report["bad_shards"]]
        return after
    return report


def verify_store(url: str) -> dict[str, Any]:
    import numpy as np

    manifest = read_manifest(url)
    layers, hidden, top_k = len(manifest["layer_ids"]), manifest["target"]["hidden_size"], manifest["top_k"]
    files = StoreFiles(url)
    present = set(files.list("shards"))
    bad: list[dict[str, Any]] = []
    for record in manifest["shards"]:
        if not record["name"]:
            continue
        try:
            if record["name"] not in present:
                raise ValueError("shard group is missing")
            arrays = read_shard_arrays(url, record["name"])
            tokens = record["num_tokens"]
            expect = {
                "hidden": ((tokens, layers, hidden), np.uint16 if manifest["storage"]["dtype"] == "bf16" else np.uint8),
                "topk_logprobs": ((tokens, top_k), np.float16),
                "topk_ids": ((tokens, top_k), np.int32),
                "input_ids": ((tokens,), np.int32),
                "loss_mask": ((tokens,), np.bool_),
                "offsets": ((record["num_samples"] + 1,), np.int64),
                "sample_ids": ((record["num_samples"],), np.int64),
            }
            for name, (shape, dtype) in expect.items():
                if name not in arrays:
                    raise ValueError(f"array {name} missing")
                if arrays[name].shape != shape or arrays[name].dtype != dtype:
                    raise ValueError(f"{name} is {arrays[name].dtype}{arrays[name].shape}, expected {np.dtype(dtype)}{shape}")
            if arrays["sample_ids"].tolist() != record["sample_ids"]:
                raise ValueError("sample ids differ from the manifest")
            bits = arrays["hidden"]
            nonfinite = ((bits & 0x7F80) == 0x7F80) if bits.dtype == np.uint16 else ((bits & 0x7F) == 0x7F)
            if nonfinite.any():
                raise ValueError(f"{int(nonfinite.sum())} non-finite hidden values")
            if not np.isfinite(arrays["topk_logprobs"]).all():
                raise ValueError("non-finite top-k log-probs")
            if content_checksum(arrays) != record["checksum"]:
                raise ValueError("checksum mismatch")
        except Exception as exc:  # noqa: BLE001 - every failure is reported per shard
            bad.append({"shard": record["name"], "index": record["index"], "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    return {"store": url, "shards_checked": len(manifest["shards"]), "bad_shards": bad, "ok": not bad}
