"""`status`: every shard of the store against the current config and data (current, stale and why,
missing, orphaned); `shard_report` is the same reading, which `reprocess` takes before it starts.

    python -m stage1_extract status --config my-qwen3.yaml [--deep]
"""

from __future__ import annotations

from typing import Any

from shared.config import RunConfig
from shared.errors import StoreError
from shared.freshness import TOKENS_CHANGED
from shared.identity import header_differences
from shared.store import StoreConfig, load_manifest
from stage1_extract.batching import ShardPlan
from stage1_extract.merge import (
    done_shards,
    group_gone,
    part_records,
    record_matches,
    row_accounting,
    shard_groups,
    tokens_changed,
)
from stage1_extract.prepare import Prepared, planned_shards
from stage1_extract.resolve import prepare_run


def shard_report(cfg: RunConfig) -> dict[str, Any]:
    """Per shard of the current config and data: current, stale (and why), missing; plus orphans."""
    return _shard_states(prepare_run(cfg), cfg.store, every_record=False)[0]


def _shard_states(
    prepared: Prepared, store: StoreConfig, every_record: bool
) -> tuple[dict[str, Any], list[ShardPlan], set[int]]:
    """(the report, the planned shards, the done ones among those whose part record was read: every
    shard's, or only the shards the manifest does not list). Part records are read once."""
    files = prepared.files
    shards = planned_shards(prepared, store)
    manifest, damaged = None, None
    if files.exists("manifest.json"):
        try:
            manifest = load_manifest(files)
        except StoreError as exc:  # reprocess rebuilds it from the part records
            damaged = str(exc)
    listed = {r["index"]: r for r in manifest["shards"]} if manifest else {}
    header_changes = header_differences(manifest, prepared.header) if manifest else []
    rows: list[dict[str, Any]] = []
    read = shards if every_record else [s for s in shards if s.index not in listed]
    records, groups = part_records(files, read), shard_groups(files)
    done = done_shards(files, read, records, groups)
    for shard in shards:
        record = listed.get(shard.index)
        if record is None:
            part = records.get(shard.index)
            if shard.index in done:
                state, why = "missing", "extracted, manifest not yet merged"
            elif record_matches(part, shard) and group_gone(part, groups):
                state, why = "missing", _gone(part["name"])
            else:
                state, why = "missing", "not extracted"
        elif group_gone(record, groups):  # checked first: whatever else changed, there is nothing to read
            state, why = "missing", _gone(record["name"])
        elif record.get("header_key") != shard.key:
            state, why = "stale", "settings changed: " + ", ".join(header_changes or ["schema"])
        elif record["rows_sha256"] != shard.rows_sha256:
            state, why = "stale", "input rows changed"
        elif tokens_changed(record, shard):
            state, why = "stale", TOKENS_CHANGED
        else:
            state, why = "current", ""
        rows.append({"index": shard.index, "state": state, "why": why, "samples": len(shard.rows)})
    orphaned = [r["name"] or f"index {r['index']}" for i, r in listed.items() if i >= len(shards)]
    counts = {state: sum(r["state"] == state for r in rows) for state in ("current", "stale", "missing")}
    made = (manifest or {}).get("data") or {}
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
        # As the manifest counted them (None: no manifest, or one merged before they were counted).
        "answers_cut": made.get("answers_cut"),
        "answers_cut_unknown": made.get("answers_cut_unknown"),
        "context_turns": made.get("context_turns"),
        # The user's rows at each stage on their way to the store, as the manifest counted them.
        "rows": row_accounting(made, manifest["num_samples"], manifest["num_skipped"]) if manifest else None,
        "complete": manifest is not None and counts["current"] == len(shards) and not orphaned
        and prepared.generated_problem is None,
    }
    return report, shards, done


def _gone(name: str) -> str:
    return (f"its group shards/{name} is not in the store (deleted?): `python -m stage1_extract extract` "
            f"or `python -m stage1_extract reprocess` extracts it again")


def cmd_status(cfg: RunConfig, deep: bool = False) -> dict[str, Any]:
    """Every shard current, stale (and why), missing or orphaned, against the config and the data;
    `deep` rehashes the target's weights instead of trusting the fingerprint cache."""
    report, shards, done_indices = _shard_states(prepare_run(cfg, deep=deep), cfg.store, every_record=True)
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
