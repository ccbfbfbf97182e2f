"""Is a store still what its config makes? The check `stage2_train train` runs before it builds anything.

    report = agreed_staleness(cfg, target, reader.manifest, rank, world_size)   # rank 0's verdict, on every rank
    if not report.current:
        raise StoreError(report.describe(store_url))      # unless train.allow_stale_store=true

It asks what `python -m stage1_extract status` asks, with the same fingerprints (shared/identity.py):
every shard record's header key against the header this config gives (target content, tokenizer and
chat template, layer ids, top_k, storage, max_length, on_long, how the target ran), and its input rows
against the data the config names. Rows are compared cheaply: through the token cache when one holds
the current data (its key hashes the data's bytes, the tokenizer and the row settings; it keeps every
row's hash), else by the data file's sha256 against the one the manifest recorded, with the row
settings it recorded (data.max_samples, on_bad_row, format) and a shard list that covers its rows
(unchanged bytes under unchanged settings, every shard present: unchanged rows). No target is loaded and nothing is tokenized. The generated conversations are checked
against the prompts, target and sampling settings they must come from (their provenance).

Data that is absent here (training on another cluster, a new run_dir pointing store.path at an existing
store) is not a reason to refuse: the manifest's record of its source stands, with a warning that the
rows were not re-checked. Under torchrun only rank 0 reads and hashes the files (multi-GB at 800K
samples; ranks on other nodes may not even see the same cache) and broadcasts its verdict, so every
rank trains or every rank raises (`agreed_staleness`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from shared.config import RunConfig
from shared.conversation_files import input_exists
from shared.errors import ConfigError, StoreError, UserError
from shared.identity import (
    generated_problem,
    header_differences,
    header_key,
    prompt_template,
    rows_sha256,
    source_path,
    stage1_value,
    store_header,
)
from shared.paths import RunPaths
from shared.target import TargetInfo
from shared.token_cache import (
    ROW_SETTINGS,
    SAME_TOKENS_SINCE,
    SELECTION_SETTINGS,
    TOKENS_VERSION,
    DamagedCache,
    TokenCache,
    token_cache_key,
)

log = logging.getLogger(__name__)

FIX = "run `python -m stage1_extract reprocess` with this config (it re-extracts only those)"


@dataclass
class Staleness:
    """What differs between a store and its config: shards (index, why) and store-wide problems."""

    stale: list[tuple[int, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    rows_checked_by: str = ""  # "token cache", "data sha256", or why the rows could not be checked
    warnings: list[str] = field(default_factory=list)  # what was trusted rather than checked

    @property
    def current(self) -> bool:
        return not self.stale and not self.problems

    def describe(self, url: str) -> str:
        """One line for the refusal: the first reasons, the shards, the fix and the override."""
        parts = list(self.problems)
        if self.stale:
            whys: dict[str, list[int]] = {}
            for index, why in self.stale:
                whys.setdefault(why, []).append(index)
            for why, indices in whys.items():
                shown = ", ".join(str(i) for i in indices[:8]) + (f" and {len(indices) - 8} more" if len(indices) > 8 else "")
                parts.append(f"shard(s) {shown} stale ({why})")
        return (
            f"{url} is stale against this config, as `python -m stage1_extract status` would say: "
            + "; ".join(parts)
            + f". {FIX}, or set train.allow_stale_store=true to train on it as it is (logged as an event)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"stale_shards": [{"index": i, "why": w} for i, w in self.stale], "problems": self.problems,
                "rows_checked_by": self.rows_checked_by, "warnings": self.warnings}


def store_staleness(cfg: RunConfig, target: TargetInfo, manifest: dict[str, Any]) -> Staleness:
    report = Staleness()
    header = store_header(cfg, target, manifest.get("extraction"), manifest.get("identity_version"))
    key = header_key(header)
    changed = header_differences(manifest, header)
    for record in manifest["shards"]:
        if record.get("header_key") != key:
            report.stale.append((record["index"], "settings changed: " + ", ".join(changed or ["schema"])))
    problem = generated_problem(cfg, target.weights_sha256, prompt_template(target.tokenizer_hashes()), target.config_sha256)
    if problem is not None:
        report.problems.append(problem)
    try:
        source = source_path(cfg)
    except ConfigError as exc:
        report.rows_checked_by = "not checked: the config names no data"
        report.problems.append(f"the data this config names cannot be read ({exc}), so the store cannot be checked against it")
        return report
    if not input_exists(source):  # e.g. training on another cluster: the store stands as its manifest records it
        made = manifest.get("data") or {}
        report.rows_checked_by = f"not checked: {source} absent"
        report.warnings.append(
            f"rows not re-checked: {source} absent; training on {made.get('source', 'the store')} as the manifest "
            f"records it (sha256 {str(made.get('source_sha256'))[:12]})"
        )
        return report
    _check_rows(cfg, target, manifest, source, report)
    return report


def _check_rows(cfg: RunConfig, target: TargetInfo, manifest: dict[str, Any], source: Any, report: Staleness) -> None:
    settings = {k: stage1_value(cfg, f"data.{k}") for k in ROW_SETTINGS}
    key, inputs = token_cache_key(source, target.tokenizer_hashes(), settings)
    cache = TokenCache(RunPaths.of(cfg).token_cache, key, inputs)
    if stage1_value(cfg, "data.token_cache") and cache.exists():
        try:
            rows = cache.row_identity()
        except DamagedCache:
            rows = None  # the data's own hash still answers
        if rows is not None:
            report.rows_checked_by = "token cache"
            _compare_rows(manifest, rows, report)
            return
    made = manifest.get("data") or {}
    report.rows_checked_by = "data sha256"
    if made.get("source_sha256") != inputs["source_sha256"]:
        report.problems.append(
            f"{source} changed since extraction (sha256 {str(made.get('source_sha256'))[:12]} -> {inputs['source_sha256'][:12]}); "
            f"`python -m stage1_extract status` names the shards whose rows changed"
        )
        return
    if not SAME_TOKENS_SINCE <= (made.get("tokens_version") or 0) <= TOKENS_VERSION:  # maybe other tokens: only a tokenization tells
        report.warnings.append(
            f"the store's rows were tokenized by stage 1's tokenization version {made.get('tokens_version', 'before 10')}, "
            f"this code's is {TOKENS_VERSION}, and no token cache of this version is here to compare their tokens: "
            f"`python -m stage1_extract status` tokenizes them and names any shard whose tokens changed"
        )
    # Unchanged bytes make unchanged rows only under the same row settings, and only a complete shard
    # list holds them all: a quick run's data.max_samples, or a record removed by hand, would pass.
    recorded = made.get("row_settings")
    if recorded is None:
        report.warnings.append(f"rows checked by the data's sha256 only: this store's manifest predates its record of "
                               f"{', '.join('data.' + k for k in SELECTION_SETTINGS)}; `python -m stage1_extract status` checks them")
    for name, value in (recorded or {}).items():
        if not _same_rows(name, value, settings.get(name), made):
            report.problems.append(f"data.{name} changed since extraction ({value!r} -> {settings.get(name)!r}): the store holds other rows")
    if made.get("num_rows") is not None and not report.problems:
        planned = -(-int(made["num_rows"]) // int(manifest["samples_per_shard"]))
        present = {r["index"] for r in manifest["shards"]}
        report.stale += [(index, "missing from the manifest") for index in range(planned) if index not in present]
        report.stale += [(index, "orphaned: past the rows the manifest records") for index in sorted(present - set(range(planned)))]


TOKENS_CHANGED = "tokens changed: the same rows tokenize otherwise now (how stage 1 renders the chat template changed)"


def _same_rows(name: str, then: Any, now: Any, made: dict[str, Any]) -> bool:
    """Whether a row setting changed from `then` to `now` still selects the rows the manifest's data
    block (`made`) says were read: a limit the file ended before, a bad-row rule with no bad row, a
    format `auto` read. Only a change that can select other rows refuses (`status` reads them all)."""
    if then == now:
        return True
    if name == "max_samples" and made.get("rows_read") is not None:
        kept = int(made["rows_read"]) - int(made.get("bad_rows_skipped") or 0)
        if then is None or kept < then:  # the whole file was read: any limit at or past its rows keeps them
            return now is None or now >= kept
        return False
    if name == "on_bad_row":
        return not made.get("bad_rows_skipped")
    if name == "format":
        return "auto" in (then, now)  # auto reads a file in the one format it finds
    return False


def _compare_rows(manifest: dict[str, Any], rows: list[tuple[str, str | None]], report: Staleness) -> None:
    """Each shard's rows against the token cache's: their hashes, and the hashes of their tokens (the
    same rows can tokenize otherwise under another version of stage 1's chat-template handling)."""
    per = int(manifest["samples_per_shard"])
    records = {r["index"]: r for r in manifest["shards"]}
    planned = [rows[i : i + per] for i in range(0, len(rows), per)]
    already = {i for i, _ in report.stale}
    for index, chunk in enumerate(planned):
        record = records.get(index)
        tokens = [content for _, content in chunk if content is not None]
        if record is None:
            report.stale.append((index, "missing: rows added to the data"))
        elif index not in already and record.get("rows_sha256") != rows_sha256(h for h, _ in chunk):
            report.stale.append((index, "input rows changed"))
        elif index not in already and record.get("content_hashes") not in (None, tokens):
            report.stale.append((index, TOKENS_CHANGED))
    for index in sorted(set(records) - set(range(len(planned)))):
        report.stale.append((index, "orphaned: its rows left the data"))


def agreed_staleness(cfg: RunConfig, target: TargetInfo, manifest: dict[str, Any], rank: int, world_size: int) -> Staleness:
    """`store_staleness` as rank 0 computes it, on every rank (torch.distributed's default group: every
    rank calls this once). Ranks that each read the files could disagree (a token cache one node sees
    and another does not), and one raising while the others wait in DDP's set-up hangs the job until
    the NCCL timeout; rank 0 alone also hashes the data once instead of once per rank. An error on rank
    0 reaches every rank: a user error with its message, anything else naming rank 0's traceback."""
    verdict: Any = None
    if rank == 0:
        try:
            verdict = store_staleness(cfg, target, manifest)
        except Exception as exc:  # noqa: BLE001 - every rank must learn it, or they wait forever
            if world_size == 1:
                raise
            verdict, failure = (isinstance(exc, UserError), f"{type(exc).__name__}: {exc}"), exc
        for warning in getattr(verdict, "warnings", ()):
            log.warning("%s", warning)
    if world_size > 1:
        import torch.distributed as dist

        box = [verdict]
        dist.broadcast_object_list(box, src=0)
        verdict = box[0]
    if isinstance(verdict, tuple):
        if rank == 0:
            raise failure
        user_error, message = verdict
        if user_error:
            raise StoreError(f"rank 0 could not check the store: {message}")
        raise RuntimeError(f"rank 0 failed checking the store ({message}); its traceback is in rank 0's output")
    return verdict
