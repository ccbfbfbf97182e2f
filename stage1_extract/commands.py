"""Stage 1 commands: generate, plan, extract, status, reprocess, verify.

Each takes the composed RunConfig and returns a JSON-able dict; `__main__` only parses and prints.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from shared.config import RunConfig
from shared.errors import ConfigError, DataError, StoreError
from shared.files import human_bytes, write_atomic
from shared.identity import (
    AUTO_SETTINGS,
    generate_settings,
    generation_inputs,
    header_differences,
    prompts_path,
)
from shared.lock import exclusive
from shared.paths import RunPaths
from shared.store import StoreFiles, bytes_per_token, load_manifest
from shared.target import load_tokenizer, resolve_target_dir, stop_token_ids, weights_fingerprint
from shared.target_model import load_target_model, resolve_device, resolve_dtype, runnable_problem
from shared.token_cache import source_fingerprint
from stage1_extract.batching import ShardPlan, windows_for_rank
from stage1_extract.data import ReadStats, read_conversations
from stage1_extract.distributed import _barrier, distributed_context, rank_device, store_lock
from stage1_extract.extract import estimate, run_shards
from stage1_extract.generate import (
    generate_all,
    resolve_backend,
    transformers_backend,
    vllm_backend,
)
from stage1_extract.header import load_or_pin_plan
from stage1_extract.merge import done_shards, merge_manifest, part_path
from stage1_extract.prepare import (
    Prepared,
    discard_token_cache,
    planned_shards,
    prepare,
    shard_size,
)
from stage1_extract.verify import EXTRACT, REBUILD, deep_problems, verify_store

log = logging.getLogger(__name__)


def cmd_download(cfg: RunConfig) -> dict[str, Any]:
    """Fetch the Hub ids the config names, target.path and model.init_from, into the local Hugging
    Face cache: the one command that reaches the network (every other one reads the cache only)."""
    from shared.hub import download, is_hub_id

    fetched = {}
    for setting in ("target.path", "model.init_from"):
        value = cfg.value(setting)
        if isinstance(value, str) and is_hub_id(value):
            log.info("downloading %s=%s", setting, value)
            snapshot = download(value)
            fetched[setting] = {**snapshot.record(), "folder": str(snapshot.folder)}
    if not fetched:
        return {"downloaded": {}, "note": "target.path and model.init_from name no Hub id (org/name[@revision]): nothing to fetch"}
    return {"downloaded": fetched}


def default_prompts(cfg: RunConfig) -> Path:
    """The conversations `generate` reads (shared.identity.prompts_path), the embedded default prompt
    set written under run_dir the first time it is needed."""
    path = prompts_path(cfg)
    if cfg.data.path is None and not path.exists():
        from stage1_extract.corpus import write_default_prompts

        write_default_prompts(path, cfg.data.num_default_prompts, cfg.data.default_question_share)
    return path


def cmd_generate(cfg: RunConfig, progress: bool = True) -> dict[str, Any]:
    if not cfg.data.regenerate:  # `make extract` always asks; with answers given there is nothing to do
        return {"skipped": "data.regenerate=false: extraction reads data.path as it is", "input": cfg.data.path}
    source = default_prompts(cfg)
    stats = ReadStats()
    conversations = list(
        read_conversations(source, on_bad_row=cfg.data.on_bad_row, max_samples=cfg.data.max_samples, stats=stats)
    )
    paths = RunPaths.of(cfg)
    out = paths.generated
    rank, world, local_rank = distributed_context()
    if rank == 0:
        cfg.write_resolved(out.with_name("generate_config.yaml"))
    device = resolve_device(cfg.extract.device)
    backend_name = resolve_backend(cfg.generate.backend, device)
    tokenizer = load_tokenizer(cfg.target)
    model_dir = resolve_target_dir(cfg.target)
    weights_sha256 = weights_fingerprint(model_dir)
    settings = generate_settings(cfg, weights_sha256)

    def make_backend():
        if backend_name == "vllm":
            dtype = resolve_dtype(cfg.target.dtype, device)
            with vllm_process_view(local_rank, world, cfg.generate.tensor_parallel_size):
                return vllm_backend(str(model_dir), cfg.generate, cfg.seed, dtype, stop_token_ids(tokenizer, model_dir=model_dir))
        model = load_target_model(cfg.target, rank_device(cfg.extract.device, local_rank))
        return transformers_backend(model, tokenizer, cfg.generate, cfg.seed)

    # Rank 0 holds the data folder; every other rank its own slot, so a second job is refused on each.
    lock_dir = out.parent if rank == 0 else paths.generated_parts / "ranks" / str(rank)
    with exclusive(str(lock_dir), "stage1_extract generate"):
        if rank == 0:  # what the answers were made from goes with them: gone until they are rewritten
            paths.generated_provenance.unlink(missing_ok=True)
        result = generate_all(
            conversations, tokenizer, make_backend, out, cfg.generate, settings, cfg.seed,
            progress=progress and rank == 0, rank=rank, world=world,
        )
        if rank == 0:
            inputs = generation_inputs(cfg, weights_sha256, source_fingerprint(source))
            provenance = {"prompts": str(source), "inputs": inputs, "num_conversations": result.num_conversations}
            write_atomic(paths.generated_provenance, json.dumps(provenance, indent=1))
    return {
        "output": str(result.path),
        "conversations": result.num_conversations,
        "bad_rows_skipped": stats.bad_rows,
        "generated_tokens": result.num_generated_tokens,
        "seconds": round(result.seconds, 1),
        "parts_reused": result.parts_reused,
        "backend": backend_name,
        "rank": rank,
        "world_size": world,
    }


@contextmanager
def vllm_process_view(local_rank: int, world: int, tensor_parallel_size: int) -> Iterator[None]:
    """What a vLLM engine of one torchrun rank must see while it starts: only this rank's GPU(s)
    (local ranks x tensor_parallel_size consecutive devices), and no torchrun variables (with RANK or
    WORLD_SIZE set vLLM would join the launcher's world instead of building its own of one engine).
    The environment is restored afterwards; the engine's processes keep the view they started with."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ[k] for k in (*names, "CUDA_VISIBLE_DEVICES") if k in os.environ}
    try:
        if world > 1:
            visible = saved.get("CUDA_VISIBLE_DEVICES")
            devices = visible.split(",") if visible else [str(i) for i in range(local_device_count())]
            first = local_rank * tensor_parallel_size
            mine = devices[first : first + tensor_parallel_size]
            if len(mine) < tensor_parallel_size:
                raise ConfigError(
                    f"generate: local rank {local_rank} x generate.tensor_parallel_size={tensor_parallel_size} needs GPUs "
                    f"{first}..{first + tensor_parallel_size - 1}, this node has {len(devices)}; run "
                    f"--nproc_per_node {max(1, len(devices) // tensor_parallel_size)}"
                )
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
            for name in names:
                os.environ.pop(name, None)
        yield
    finally:
        for name in (*names, "CUDA_VISIBLE_DEVICES"):
            os.environ.pop(name, None)
        os.environ.update(saved)


def local_device_count() -> int:
    import torch

    return torch.cuda.device_count()



def cmd_plan(cfg: RunConfig, prepared: Prepared | None = None, *, gpu: str | None = None, gpus: int = 8) -> dict[str, Any]:
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


def _extract(
    cfg: RunConfig, force: bool, progress: bool, rank: int, world: int, local_rank: int, reprocess: bool
) -> dict[str, Any]:
    started = time.perf_counter()
    prepared = _prepare_all_ranks(cfg, rank, world, local_rank)
    if prepared.generated_problem is not None:  # every rank: each prepared the same inputs
        raise DataError(prepared.generated_problem)
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
                # Who limits extraction: the forward waits on the writer for writer_queue_wait_s; the
                # writer threads were busy writer_seconds (summed) against forward_seconds of target.
                "writer_queue_wait_s": round(result.writer.queue_wait_seconds, 3),
                "writer_seconds": round(result.writer.write_seconds, 2),
                "writer_threads": cfg.extract.writer_threads,
                "writer_absorb_s": round(result.writer.absorb_seconds, 2),
                "writer_peak_queue_mb": round(result.writer.peak_queue_bytes / 2**20, 1),
            }
        )
    if rank == 0:
        summary.update(_merge(cfg, prepared, shards))
    _barrier(world)
    return summary


def _run_windows(
    cfg: RunConfig, prepared: Prepared, windows: list[list[ShardPlan]], done: set[int], local_rank: int, progress: bool
) -> Any:
    device = rank_device(cfg.extract.device, local_rank)
    settings = prepared.header["extraction"]  # what the header promises is what runs
    problem = runnable_problem(settings, device)
    if problem is not None:
        chosen = [AUTO_SETTINGS[k] for k in ("attn_implementation", "compute_dtype", "packed")]
        raise ConfigError(
            f"{prepared.files.url} was extracted with {settings['attn_implementation']} attention, "
            f"{settings['compute_dtype']} compute, packed={settings['packed']} ({', '.join(chosen)} left auto read them "
            f"back from the store); {problem}. Run on a machine that can, or ask for other settings explicitly "
            f"(e.g. target.attn_implementation=sdpa extract.packed=off), which makes every shard stale: `reprocess` "
            f"re-extracts them all"
        )
    model = load_target_model(
        cfg.target, device, dtype=settings["compute_dtype"], attn_implementation=settings["attn_implementation"]
    )
    if model.config._attn_implementation != settings["attn_implementation"]:
        raise RuntimeError(
            f"the target loaded with attention {model.config._attn_implementation!r}, the store's header says "
            f"{settings['attn_implementation']!r}"
        )
    return run_shards(
        model, windows, done, prepared.files.url, cfg.store, cfg.extract, prepared.layer_ids, settings["packed"], progress
    )


def _merge(cfg: RunConfig, prepared: Prepared, shards: list[ShardPlan]) -> dict[str, Any]:
    """Rank 0: the manifest from every rank's part records, written last."""
    extra = {
        "data": {
            "source": str(prepared.source),
            "source_sha256": prepared.source_sha256,
            "num_rows": len(prepared.rows),
            "bad_rows_skipped": prepared.stats.bad_rows,
        },
        "target_source": {**prepared.target.source, "folder": str(prepared.target.target_dir)},  # provenance, not identity
        "samples_per_shard": shard_size(cfg, prepared),
        "created_unix": int(time.time()),
    }
    started = time.perf_counter()
    manifest = merge_manifest(prepared.files, prepared.header, shards, extra)
    out = {"merge_seconds": round(time.perf_counter() - started, 2)}
    out.update({k: manifest[k] for k in ("num_samples", "num_tokens", "num_bytes", "num_truncated", "num_skipped", "num_empty_turns")})
    if manifest["num_empty_turns"]:
        log.warning(
            "%d assistant turns are empty: only their end-of-turn tokens are supervised (counted in the manifest as "
            "num_empty_turns); drop or regenerate those rows if they are not meant to be empty", manifest["num_empty_turns"]
        )
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
        # The generated conversations the shards were cut from belong to other prompts, target or
        # sampling settings than the config gives (their provenance, `generate` writes it).
        "generated_data": prepared.generated_problem or "current",
        "complete": manifest is not None and counts["current"] == len(shards) and not orphaned
        and prepared.generated_problem is None,
    }
    return report, shards, done


def cmd_status(cfg: RunConfig, deep: bool = False) -> dict[str, Any]:
    """Every shard current, stale (and why), missing or orphaned, against the config and the data;
    `deep` rehashes the target's weights instead of trusting the fingerprint cache."""
    report, shards, done_indices = _shard_states(cfg, prepare(cfg, deep=deep), every_record=True)
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


def cmd_verify(cfg: RunConfig, repair: bool = False, progress: bool = True, deep: bool = False) -> dict[str, Any]:
    """Every shard against its manifest record, field by field (`verify.py`); with `deep`, also
    against the input data tokenized afresh. With repair, a shard whose record alone is wrong (its
    part record agrees with it) gets its record rebuilt from the part records, re-extracting
    nothing; every other bad shard is deleted with its part record and extracted again (after a deep
    mismatch the token cache is rebuilt first: it is what stood between the data and the store)."""
    url = cfg.store.url(cfg.run_dir)
    report = _verify(cfg, url, deep)
    if repair and report["bad_shards"]:
        bad = report["bad_shards"]
        with exclusive(url, "stage1_extract verify --repair"):
            if any(b.get("deep") for b in bad):
                discard_token_cache(cfg)
            files = StoreFiles(url)
            for b in bad:
                if b.get("fix") != REBUILD:
                    files.remove(f"shards/{b['shard']}")
                    files.remove(part_path(b["index"]))
            _extract(cfg, False, progress, 0, 1, 0, False)  # extracts what is gone, then merges the manifest
        after = _verify(cfg, url, deep)
        after["repaired"] = [b["shard"] for b in bad]
        after["records_rebuilt"] = [b["shard"] for b in bad if b.get("fix") == REBUILD]
        after["reextracted"] = [b["shard"] for b in bad if b.get("fix") != REBUILD]
        return after
    return report


def _verify(cfg: RunConfig, url: str, deep: bool) -> dict[str, Any]:
    report = verify_store(url)
    report["deep"] = deep
    if not deep:
        return report
    fresh = prepare(cfg, use_token_cache=False)
    manifest_index = {r["name"]: r["index"] for r in load_manifest(StoreFiles(url))["shards"] if r["name"]}
    known = {b["shard"] for b in report["bad_shards"]}
    for shard, why in deep_problems(url, {r.sample_id: r for r in fresh.rows}).items():
        if shard not in known:
            report["bad_shards"].append(
                {"shard": shard, "index": manifest_index[shard], "fields": ["input_ids"], "error": why, "fix": EXTRACT, "deep": True}
            )
    report["ok"] = not report["bad_shards"]
    return report
