"""What every stage-1 command needs before the target runs: the rows, tokenized (or read from the
token cache), and the store's identity header; no model weights are loaded.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.config import RunConfig
from shared.errors import ConfigError, DataError, InputFileError
from shared.store import StoreFiles
from shared.target import (
    TargetArch,
    load_tokenizer,
    resolve_layer_ids,
    resolve_target_dir,
    tokenizer_fingerprints,
    weights_fingerprint,
)
from stage1_extract.batching import (
    ShardPlan,
    TokenizedRow,
    choose_samples_per_shard,
    content_hash,
    plan_shards,
)
from stage1_extract.data import ReadStats, read_conversations
from stage1_extract.header import extraction_settings, header_key, settings_header
from stage1_extract.tokens import DamagedCache, TokenCache, cache_key, resolve_workers, tokenize_all

log = logging.getLogger(__name__)


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


@dataclass
class Prepared:
    header: dict[str, Any]
    rows: list[TokenizedRow]
    files: StoreFiles
    layer_ids: list[int]
    stats: ReadStats
    source: Path


def prepare(cfg: RunConfig, use_token_cache: bool = True) -> Prepared:
    """Tokenize the input (or read the token cache) and compute the identity header of the store
    (no model weights loaded)."""
    model_dir = resolve_target_dir(cfg.target)
    arch = TargetArch.from_dir(model_dir)
    layer_ids = resolve_layer_ids(cfg.target, arch)
    tokenizer = load_tokenizer(cfg.target)
    tokenizer_hashes = tokenizer_fingerprints(tokenizer)
    source = extraction_input(cfg)
    rows, stats = tokenized_rows(cfg, tokenizer, tokenizer_hashes, source, use_cache=use_token_cache)
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
        extraction=extraction_settings(cfg.target, cfg.extract),
    )
    return Prepared(header, rows, StoreFiles(cfg.store.url(cfg.run_dir)), layer_ids, stats, source)


def token_cache_dir(cfg: RunConfig) -> Path:
    return Path(os.path.expandvars(cfg.data.cache_dir)) if cfg.data.cache_dir else Path(cfg.run_dir) / "cache"


def tokenized_rows(
    cfg: RunConfig, tokenizer: Any, tokenizer_hashes: dict[str, str], source: Path, use_cache: bool = True
) -> tuple[list[TokenizedRow], ReadStats]:
    """Every row of `source`, templated and tokenized: from the token cache when it matches, else
    by `data.tokenize_workers` processes (then cached). Bad rows raise naming the file and row."""
    data = cfg.data
    cache = None
    if data.token_cache and use_cache:
        settings = {"max_length": data.max_length, "on_long": data.on_long, "on_bad_row": data.on_bad_row, "max_samples": data.max_samples}
        key, inputs = cache_key(source, tokenizer_hashes, settings)
        cache = TokenCache(token_cache_dir(cfg), key, inputs)
        if cache.exists():
            try:
                cached, stats = cache.load()
                return [TokenizedRow(**r) for r in cached], stats
            except DamagedCache as exc:  # a cache, not a record: rebuild it from the data and go on
                log.warning("%s; tokenizing %s again and rebuilding the cache", exc, source)
                cache.discard()
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
                empty_turns=sample.empty_turns,
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


def shard_size(cfg: RunConfig, prepared: Prepared) -> int:
    """samples_per_shard: pinned in plan.json by the first run, else computed from store.shard_mb."""
    files = prepared.files
    if files.exists("plan.json"):
        return int(files.read_json("plan.json")["samples_per_shard"])
    token_bytes = cfg.store.bytes_per_token(len(prepared.layer_ids), prepared.header["target"]["hidden_size"], cfg.extract.top_k)
    return choose_samples_per_shard(prepared.rows, cfg.store.shard_mb, token_bytes)


def planned_shards(cfg: RunConfig, prepared: Prepared) -> list[ShardPlan]:
    """The shards of the current config and data, with the boundaries pinned in plan.json."""
    return plan_shards(prepared.rows, shard_size(cfg, prepared), header_key(prepared.header))


def discard_token_cache(cfg: RunConfig) -> None:
    """Remove every token cache of this run (the next command tokenizes again)."""
    import shutil

    for folder in token_cache_dir(cfg).glob("tokens-*"):
        shutil.rmtree(folder, ignore_errors=True)
