"""What every stage-1 command needs before the target runs: the rows, tokenized (or read from the
token cache), beside the store's identity header; no model weights are loaded.

    prepared = prepare(data_cfg, target, header, files, source, data_format, cache_root)

It receives what the verb resolved from the run config once (`stage1_extract/resolve.py`): the data
section, the target's record, the store's header and files, the conversations to read.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shared.conversation_files import read_conversations
from shared.conversations import ReadStats, RowLimits, answer_cuts
from shared.errors import ConfigError, DataError, StoreError
from shared.files import human_bytes
from shared.identity import OPENING_KEYS_VERSION, PROMPT_KEYS_VERSION, header_key
from shared.reader import FIXED_GENERIC_VERSION, GENERIC_OPENING_MIN, GENERIC_OPENING_SHARE
from shared.store import StoreConfig, StoreFiles
from shared.target import TargetInfo, cached_tokenizer
from shared.token_cache import ROW_SETTINGS, SELECTION_SETTINGS, DamagedCache, TokenCache, token_cache_key
from stage1_extract.batching import (
    ShardPlan,
    TokenizedRow,
    choose_samples_per_shard,
    content_hash,
    plan_shards,
)
from stage1_extract.data import DataConfig, generate_record
from stage1_extract.template import check_template_variables
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
    data_format: str = "auto"  # how `source` was read: the manifest records it for the export doctor
    generated_problem: str | None = None  # the generated conversations belong to other inputs
    regenerated: bool = False  # data.regenerate: `source` is generated.parquet
    generate: dict[str, Any] | None = None  # what `generate` counted from the user's file (data.generate_record)
    selection: dict[str, Any] = field(default_factory=dict)  # the row settings beyond the header (SELECTION_SETTINGS)

    @property
    def layer_ids(self) -> list[int]:
        return self.target.layer_ids


def pinned_header(files: StoreFiles) -> dict[str, Any]:
    """The identity header an existing store was made with (plan.json, pinned by its first run; {}
    for a new store): its `auto` settings are read back, never resolved again on another machine,
    and its identity version kept."""
    return files.read_json("plan.json").get("header", {}) if files.exists("plan.json") else {}


def prepare(
    data: DataConfig,
    target: TargetInfo,
    header: dict[str, Any],
    files: StoreFiles,
    source: Path,
    data_format: str,
    cache_root: Path | None,
) -> Prepared:
    """Tokenize `source` (or read the token cache under `cache_root`; None = no cache) beside the
    store's identity header (its settings already checked: `resolve.resolve_store`). No model weights
    are loaded."""
    tokenizer, tokenizer_hashes = cached_tokenizer(str(target.target_dir))
    check_template_variables(tokenizer, data.chat_template_kwargs, target.path)
    cache_root = cache_root if data.token_cache else None
    generated = generate_record(source) if data.regenerate else None
    origin = generated.get("prompts") if generated else None
    rows, stats, source_sha256 = tokenized_rows(data, tokenizer, tokenizer_hashes, source, data_format, cache_root, origin)
    rows = in_vocabulary(rows, stats, target.arch.vocab_size, tokenizer, source, data.on_bad_row, origin)
    check_context(rows, data.max_length, target.arch.max_position_embeddings, source)
    if not rows:
        raise DataError(f"{source}: no usable rows")
    rows = split_keys(rows, header, source, data.regenerate, files.url)
    selection = {k: getattr(data, k) for k in SELECTION_SETTINGS}
    return Prepared(header, rows, files, target, stats, source, source_sha256, data_format, selection=selection,
                    regenerated=data.regenerate, generate=generated)


def split_keys(
    rows: list[TokenizedRow], header: dict[str, Any], source: Path, regenerate: bool, store: str
) -> list[TokenizedRow]:
    """The rows with the split keys the store's identity version records, so a store is keyed one way
    and resuming or re-extracting it never moves a sample across its split. From version 6 every row
    keys on its opening (`Conversation.opening_hash`); a regenerated row also carries its prompt
    (which groups its copies, and counts them as duplicates). A store made before 6 keeps its keys
    (opening hashes dropped: rows that share a first question may straddle its split, a warning says;
    one made at 6 judges generic openings by their share of the store, which appended rows can change),
    one made before 5 keys on tokens (prompt hashes dropped too: copies of a prompt may straddle it).
    From version 5 regenerated rows must carry a prompt hash; a generated.parquet merged before
    generate wrote them is refused, naming the cheap fix."""
    version = header["identity_version"]
    shared_openings = Counter(r.opening_hash for r in rows if r.opening_hash)
    if OPENING_KEYS_VERSION <= version < FIXED_GENERIC_VERSION and max(shared_openings.values(), default=0) > GENERIC_OPENING_MIN:
        log.warning(
            "%s was made at identity version %d: an opening shared by more than %d rows counts as generic (its rows "
            "split on their own keys) only past %.0f%% of the store, so rows added to it can move the rows of such an "
            "opening between train and held-out; it keeps that rule. Extract into a new store (store.path) for a fixed "
            "count", store, version, GENERIC_OPENING_MIN, 100 * GENERIC_OPENING_SHARE,
        )
    if version < OPENING_KEYS_VERSION and any(r.opening_hash for r in rows):
        log.warning(
            "%s was made at identity version %d: its held-out split keeps rows that open with the same turns "
            "(a first question asked again with other later turns) together only when they are copies, so some "
            "held-out prompts may have been trained on from another row; it keeps that split. Extract into a new "
            "store (store.path) to key every row on its opening", store, version,
        )
        rows = [replace(r, opening_hash="") for r in rows]
    if version < PROMPT_KEYS_VERSION:
        if regenerate:
            log.warning(
                "%s was made at identity version %d: its held-out split keys each sample on its tokens, so copies of a "
                "prompt given different answers by generate may fall on both sides (and num_duplicates does not count "
                "them); it keeps that split. Extract into a new store (store.path) to key regenerated rows on their prompt",
                store, version,
            )
        return [replace(r, prompt_hash="") for r in rows] if any(r.prompt_hash for r in rows) else rows
    if all(r.prompt_hash for r in rows):
        return rows
    if regenerate:
        raise DataError(
            f"{source} was merged before generate recorded each row's prompt (its prompt_hash column), which keeps "
            f"copies of a prompt on one side of the held-out split: rerun `python -m stage1_extract generate` (it "
            f"reuses every finished part and only rewrites {source.name}), then extract"
        )
    return [replace(r, prompt_hash="") for r in rows] if any(r.prompt_hash for r in rows) else rows


def token_cache_settings(data: DataConfig) -> dict[str, Any]:
    return {k: getattr(data, k) for k in ROW_SETTINGS}


def tokenized_rows(
    data: DataConfig, tokenizer: Any, tokenizer_hashes: dict[str, str], source: Path, data_format: str,
    cache_root: Path | None, origin: str | None = None,
) -> tuple[list[TokenizedRow], ReadStats, str]:
    """Every row of `source`, templated and tokenized, and the source's sha256: from the token cache
    when it matches, else by `data.tokenize_workers` processes (then cached). Bad rows raise naming
    the file and row (and, in generated.parquet, the row of the user's file `origin` it came from)."""
    key, inputs = token_cache_key(source, tokenizer_hashes, token_cache_settings(data))
    cache = None
    if cache_root is not None:
        cache = TokenCache(cache_root, key, inputs)
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
        read_conversations(
            source, data_format=data_format, on_bad_row=data.on_bad_row, max_samples=data.max_samples, stats=stats,
            limits=limits,
        )
    )
    workers = resolve_workers(data.tokenize_workers)
    stats.answers_cut = stats.answers_cut_unknown = 0  # as read; counted again below over the rows stored
    rows = []
    for conv, (row, sample) in zip(conversations, tokenize_all(tokenizer, conversations, data.max_length, workers, data.chat_template_kwargs)):
        if conv.cut and not isinstance(sample, str) and not sample.truncated:
            sample = (
                f"a message longer than {limits.max_chars} characters was cut there before tokenizing, yet gave fewer "
                f"than data.max_length={data.max_length} tokens (this tokenizer packs more characters per token than "
                f"its vocabulary spells); shorten the row"
            )
        skipped = not isinstance(sample, str) and sample.truncated and data.on_long == "skip"
        problem = unusable(sample, data.max_length) if not skipped else None
        if problem is not None:
            message = f"{row_name(source, row, conv.source_row, origin)}: {problem}"
            if data.on_bad_row == "raise":
                raise DataError(message + " (set data.on_bad_row=skip to skip and count bad rows)")
            stats.bad_rows += 1
            if len(stats.bad_examples) < 5:
                stats.bad_examples.append(message)
            log.warning("skipping %s", message)
            continue
        if not skipped:  # counts of what the store holds: a skipped row holds nothing
            stats.context_turns += sample.context_turns
            stats.ids_fallbacks += sample.ids_fallbacks
            cut_answers, unknown = answer_cuts(conv.messages)
            stats.answers_cut += cut_answers
            stats.answers_cut_unknown += unknown
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
                prompt_hash=conv.prompt_hash or "",
                source_row=-1 if conv.source_row is None else conv.source_row,
                opening_hash=conv.opening_hash() or content_hash(sample.input_ids, sample.loss_mask),
            )
        )
    if cache is not None and rows:
        try:
            cache.save(rows, stats)
        except OSError as exc:  # a read-only or full run_dir costs the next command a re-tokenize, not this one
            log.warning("could not write the token cache under %s (%s): later commands tokenize again", cache.root, exc)
    return rows, stats, inputs["source_sha256"]


def row_name(source: Path, row: int, source_row: int | None, origin: str | None) -> str:
    """'<file>: row 12', and for a row of generated.parquet the row of the user's file it was made
    from: '<generated.parquet>: row 12 (row 15 of <data.path>)'. Rows count from 0."""
    name = f"{source}: row {row}"
    if origin is not None and source_row is not None and source_row >= 0:
        name += f" (row {source_row} of {origin})"
    return name


def row_limits(tokenizer: Any, max_length: int) -> RowLimits:
    """Each message cut to 2 x max_length x the longest token's characters before tokenizing: no
    token covers more characters than its vocabulary entry spells (byte-level entries spell bytes,
    at least as many as the characters they cover), so the cut text still gives 2 x max_length
    tokens, and the first max_length, all that is kept, lie far from the cut. A tokenizer that packs
    more (a normalizer collapsing whitespace) is caught where the cut row comes out untruncated."""
    longest = max(len(token) for token in tokenizer.get_vocab())
    return RowLimits(max_chars=2 * max_length * longest, max_ids=max_length)


def in_vocabulary(
    rows: list[TokenizedRow], stats: ReadStats, vocab_size: int, tokenizer: Any, source: Path, on_bad_row: str,
    origin: str | None = None,
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
        where = f"{row_name(source, row.sample_id, row.source_row, origin)}: token id {token} at token {first}"
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


def check_context(rows: list[TokenizedRow], max_length: int, positions: int, source: Path) -> None:
    """Refuse rows longer than the target's context (config.json max_position_embeddings), the tokens
    a sample may hold as `generate` counts them: the target never ran past it when trained and a
    serving engine refuses it (vLLM's max_model_len), so features there are no drafter's input."""
    longer = [r for r in rows if not r.skipped and len(r.input_ids) > positions]
    if longer:
        raise ConfigError(
            f"data.max_length={max_length} is past the target's max_position_embeddings={positions} (its config.json), and "
            f"{len(longer)} row(s) of {source} are longer than that (row {longer[0].sample_id}: {len(longer[0].input_ids)} "
            f"tokens): their features past position {positions} would be positions the target is never served at; set "
            f"data.max_length={positions} (longer rows are then cut, or skipped with data.on_long=skip)"
        )


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


def token_bytes(header: dict[str, Any], store: StoreConfig) -> int:
    """Bytes per stored token of the store this header and storage section describe."""
    return store.bytes_per_token(len(header["layer_ids"]), header["target"]["hidden_size"], header["top_k"])


def shard_size(prepared: Prepared, store: StoreConfig) -> int:
    """samples_per_shard: pinned in plan.json by the first run, else computed from store.shard_mb."""
    files = prepared.files
    if files.exists("plan.json"):
        return int(files.read_json("plan.json")["samples_per_shard"])
    return choose_samples_per_shard(prepared.rows, store.shard_mb, token_bytes(prepared.header, store))


def planned_shards(prepared: Prepared, store: StoreConfig) -> list[ShardPlan]:
    """The shards of the current config and data, with the boundaries pinned in plan.json."""
    return plan_shards(prepared.rows, shard_size(prepared, store), header_key(prepared.header))


def discard_token_cache(cache_root: Path) -> None:
    """Remove every token cache under `cache_root` (the next command tokenizes again)."""
    import shutil

    for folder in cache_root.glob("tokens-*"):
        shutil.rmtree(folder, ignore_errors=True)


def check_space(prepared: Prepared, store: StoreConfig, shards: list[ShardPlan], done: set[int], force: bool) -> None:
    """Refuse to start when the shards still to write will not fit (`--force` overrides). Only the
    shards left count: after a full disk and some space freed, the rest of the job may well fit."""
    files = prepared.files
    free = files.free_bytes()
    if free is None or force:
        return
    left = sum(len(r.input_ids) for s in shards if s.index not in done for r in s.kept) * token_bytes(prepared.header, store)
    if left > free:
        raise StoreError(
            f"extraction still needs about {human_bytes(left)} ({len(shards) - len(done)} of {len(shards)} shards "
            f"left) but {files.url} has {human_bytes(free)} free; free space, change store.dtype/compression, "
            f"or pass --force"
        )
