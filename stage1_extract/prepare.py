"""What every stage-1 command needs before the target runs: the rows, tokenized (or read from the
token cache), and the store's identity header; no model weights are loaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.config import RunConfig
from shared.errors import ConfigError, DataError
from shared.identity import extraction_source, generated_problem, header_key, store_header
from shared.paths import RunPaths
from shared.store import StoreFiles, bytes_per_token
from shared.target import TargetInfo, cached_tokenizer, resolve_target
from shared.token_cache import DamagedCache, TokenCache, token_cache_key
from stage1_extract.batching import (
    ShardPlan,
    TokenizedRow,
    choose_samples_per_shard,
    content_hash,
    plan_shards,
)
from stage1_extract.data import ReadStats, RowLimits, read_conversations
from stage1_extract.forward import check_packing
from stage1_extract.tokens import resolve_workers, tokenize_all

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    header: dict[str, Any]
    rows: list[TokenizedRow]
    files: StoreFiles
    target: TargetInfo
    stats: ReadStats
    source: Path
    source_sha256: str
    generated_problem: str | None = None  # the generated conversations belong to other inputs

    @property
    def layer_ids(self) -> list[int]:
        return self.target.layer_ids


def pinned_extraction(files: StoreFiles) -> dict[str, Any] | None:
    """The extraction settings an existing store was made with (plan.json, pinned by its first run):
    `auto` settings are read back from it, never resolved again on another machine."""
    if not files.exists("plan.json"):
        return None
    return files.read_json("plan.json").get("header", {}).get("extraction")


def prepare(cfg: RunConfig, use_token_cache: bool = True, *, deep: bool = False) -> Prepared:
    """Tokenize the input (or read the token cache) and compute the identity header of the store
    (no model weights loaded). `deep`: rehash the target's weights whatever the fingerprint cache says."""
    target = resolve_target(cfg.target, deep=deep)
    files = StoreFiles(RunPaths.of(cfg).store)
    header = store_header(cfg, target, pinned_extraction(files))
    if header["extraction"]["packed"]:  # before any row is read: a refused setting costs nothing
        check_packing(header["extraction"]["attn_implementation"], target.arch.model_type)
    tokenizer, tokenizer_hashes = cached_tokenizer(str(target.target_dir))
    source = extraction_source(cfg)
    rows, stats, source_sha256 = tokenized_rows(cfg, tokenizer, tokenizer_hashes, source, use_cache=use_token_cache)
    rows = in_vocabulary(rows, stats, target.arch.vocab_size, tokenizer, source, cfg.data.on_bad_row)
    if not rows:
        raise DataError(f"{source}: no usable rows")
    return Prepared(header, rows, files, target, stats, source, source_sha256, generated_problem(cfg, target.weights_sha256))


def token_cache_settings(cfg: RunConfig) -> dict[str, Any]:
    data = cfg.data
    return {"max_length": data.max_length, "on_long": data.on_long, "on_bad_row": data.on_bad_row, "max_samples": data.max_samples}


def tokenized_rows(
    cfg: RunConfig, tokenizer: Any, tokenizer_hashes: dict[str, str], source: Path, use_cache: bool = True
) -> tuple[list[TokenizedRow], ReadStats, str]:
    """Every row of `source`, templated and tokenized, and the source's sha256: from the token cache
    when it matches, else by `data.tokenize_workers` processes (then cached). Bad rows raise naming
    the file and row."""
    data = cfg.data
    key, inputs = token_cache_key(source, tokenizer_hashes, token_cache_settings(cfg))
    cache = None
    if data.token_cache and use_cache:
        cache = TokenCache(RunPaths.of(cfg).token_cache, key, inputs)
        if cache.exists():
            try:
                cached, stats = cache.load()
                return [TokenizedRow(**r) for r in cached], ReadStats(**stats), inputs["source_sha256"]
            except DamagedCache as exc:  # a cache, not a record: rebuild it from the data and go on
                log.warning("%s; tokenizing %s again and rebuilding the cache", exc, source)
                cache.discard()
    stats = ReadStats()
    limits = row_limits(tokenizer, data.max_length)
    conversations = list(
        read_conversations(source, on_bad_row=data.on_bad_row, max_samples=data.max_samples, stats=stats, limits=limits)
    )
    workers = resolve_workers(data.tokenize_workers)
    rows = []
    for conv, (row, sample) in zip(conversations, tokenize_all(tokenizer, conversations, data.max_length, workers)):
        if conv.cut and not isinstance(sample, str) and not sample.truncated:
            sample = (
                f"a message longer than {limits.max_chars} characters was cut there before tokenizing, yet gave fewer "
                f"than data.max_length={data.max_length} tokens (this tokenizer packs more characters per token than "
                f"its vocabulary spells); shorten the row"
            )
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
    return rows, stats, inputs["source_sha256"]


def row_limits(tokenizer: Any, max_length: int) -> RowLimits:
    """Each message cut to 2 x max_length x the longest token's characters before tokenizing: no
    token covers more characters than its vocabulary entry spells (byte-level entries spell bytes,
    at least as many as the characters they cover), so the cut text still gives 2 x max_length
    tokens, and the first max_length, all that is kept, lie far from the cut. A tokenizer that packs
    more (a normalizer collapsing whitespace) is caught where the cut row comes out untruncated."""
    longest = max(len(token) for token in tokenizer.get_vocab())
    return RowLimits(max_chars=2 * max_length * longest, max_ids=max_length)


def in_vocabulary(
    rows: list[TokenizedRow], stats: ReadStats, vocab_size: int, tokenizer: Any, source: Path, on_bad_row: str
) -> list[TokenizedRow]:
    """The rows whose every token id has a row in the target's embedding (an id beyond it would
    crash extraction: on a GPU a device-side assert that kills the rank). Checked on every command,
    cached rows included (the token cache is keyed on the tokenizer, not on the target). An id the
    tokenizer can make means the tokenizer is larger than the embedding: refused, whatever
    data.on_bad_row says. An id beyond both came with the row (regenerated answers' token_ids): a
    bad row, named, skipped and counted with data.on_bad_row=skip."""
    import numpy as np

    kept = []
    for row in rows:
        ids = row.input_ids
        if not len(ids) or int(ids.max()) < vocab_size:
            kept.append(row)
            continue
        first = int(np.flatnonzero(np.asarray(ids) >= vocab_size)[0])
        token = int(ids[first])
        where = f"{source}: row {row.sample_id}: token id {token} at token {first}"
        if token < len(tokenizer):
            raise ConfigError(
                f"{where} ({tokenizer.convert_ids_to_tokens(token)!r}) is beyond the target's embedding of {vocab_size} "
                f"ids (config.json vocab_size): the tokenizer of target.path ({len(tokenizer)} ids) does not belong to its "
                f"weights; use the tokenizer the target was trained with"
            )
        message = (
            f"{where} is beyond the target's vocabulary of {vocab_size} ids: it came with the row's token_ids "
            f"(answers generated by another model? regenerate them)"
        )
        if on_bad_row == "raise":
            raise DataError(message + " (set data.on_bad_row=skip to skip and count bad rows)")
        stats.bad_rows += 1
        if len(stats.bad_examples) < 5:
            stats.bad_examples.append(message)
        log.warning("skipping %s", message)
    return kept


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
    token_bytes = bytes_per_token(
        cfg.store.dtype, len(prepared.layer_ids), prepared.header["target"]["hidden_size"], cfg.extract.top_k
    )
    return choose_samples_per_shard(prepared.rows, cfg.store.shard_mb, token_bytes)


def planned_shards(cfg: RunConfig, prepared: Prepared) -> list[ShardPlan]:
    """The shards of the current config and data, with the boundaries pinned in plan.json."""
    return plan_shards(prepared.rows, shard_size(cfg, prepared), header_key(prepared.header))


def discard_token_cache(cfg: RunConfig) -> None:
    """Remove every token cache of this run (the next command tokenizes again)."""
    import shutil

    for folder in RunPaths.of(cfg).token_cache.glob("tokens-*"):
        shutil.rmtree(folder, ignore_errors=True)
