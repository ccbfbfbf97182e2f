"""Part records and the manifest: which shards are done, and manifest.json built from every rank's
records (written last), with the groups no record lists removed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shared.errors import StoreError
from shared.shard_records import duplicate_hashes, split_hashes
from shared.store import StoreFiles
from stage1_extract.batching import ShardPlan


def part_path(index: int) -> str:
    return f"parts/shard-{index:06d}.json"


def record_matches(record: dict[str, Any] | None, shard: ShardPlan) -> bool:
    """A shard is done when its part record matches its input rows, the settings and its tokens."""
    return (record is not None and record.get("rows_sha256") == shard.rows_sha256 and record.get("header_key") == shard.key
            and not tokens_changed(record, shard))


def tokens_changed(record: dict[str, Any], shard: ShardPlan) -> bool:
    """Whether the shard's rows tokenize otherwise now than when it was extracted (a chat template
    handled otherwise by stage 1's code: the row hashes and settings alike, the tokens not). A record
    without content hashes cannot tell: not changed."""
    stored = record.get("content_hashes")
    return stored is not None and stored != [r.content_hash for r in shard.kept]


PART_READ_THREADS = 32


def part_records(
    files: StoreFiles, shards: list[ShardPlan], beyond_plan: bool = False, by_name: bool = False
) -> dict[int, dict[str, Any]]:
    """The part record of every shard that has one: one listing, then reads in parallel. On an
    object store each read is a latency-bound GET; 100K shards read one by one take minutes.
    `beyond_plan` (with every planned shard): also the records of indices past the last one.
    `by_name`: every planned shard's record read by its name, not found through the listing (the
    merge, seconds after other nodes wrote theirs: NFS serves a cached listing for up to a minute,
    while an open asks the server)."""
    present = set(files.list("parts"))
    wanted = [s.index for s in shards if by_name or part_path(s.index).rsplit("/", 1)[1] in present]
    if beyond_plan:
        wanted += sorted(i for i in (int(n[6:-5]) for n in present if n.startswith("shard-") and n.endswith(".json")) if i >= len(shards))
    with ThreadPoolExecutor(PART_READ_THREADS, thread_name_prefix="dflash-parts") as pool:
        records = list(pool.map(lambda index: _read_part(files, index, by_name), wanted))
    return {index: record for index, record in zip(wanted, records) if record is not None}


def _read_part(files: StoreFiles, index: int, absent_ok: bool) -> dict[str, Any] | None:
    try:
        return files.read_json(part_path(index))
    except FileNotFoundError:
        if absent_ok:
            return None
        raise


def shard_groups(files: StoreFiles) -> set[str]:
    """The names of the shard groups in the store: one listing of shards/, not a request per shard."""
    return set(files.list("shards"))


def group_gone(record: dict[str, Any], groups: set[str]) -> bool:
    """Whether the shard group a record names is absent from `groups` (`shard_groups`); a record
    without a group (every sample skipped) has none to lose."""
    return bool(record.get("name")) and record["name"] not in groups


def done_shards(
    files: StoreFiles, shards: list[ShardPlan], records: dict[int, dict[str, Any]] | None = None,
    groups: set[str] | None = None,
) -> set[int]:
    """Indices of the shards whose part record matches their rows and settings and whose group is in
    the store: a group deleted by hand leaves its record behind, and that shard is extracted again."""
    records = part_records(files, shards) if records is None else records
    groups = shard_groups(files) if groups is None else groups
    return {s.index for s in shards if record_matches(records.get(s.index), s) and not group_gone(records[s.index], groups)}


def foreign_shards(shards: list[ShardPlan], records: dict[int, dict[str, Any]]) -> list[int]:
    """Indices of the part records (`part_records(..., beyond_plan=True)`) made from other input rows
    than the shard planned at their index, or past the last one: what `extract` must not replace."""
    return sorted(i for i, r in records.items() if i >= len(shards) or r.get("rows_sha256") != shards[i].rows_sha256)


def merge_manifest(files: StoreFiles, header: dict[str, Any], shards: list[ShardPlan], extra: dict[str, Any]) -> dict[str, Any]:
    """Build manifest.json from the part records (all ranks), then drop unlisted shard groups."""
    found = part_records(files, shards, by_name=True)
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
            "num_empty_turns": sum(r.get("num_empty_turns", 0) for r in records),
            "num_duplicates": count_duplicates(records),
            "split_key": split_key(records),
            "shards": records,
        }
    )
    files.write_json("manifest.json", manifest)
    for name in orphans(files, records):
        files.remove(name)  # leftovers of a crash, of a replaced shard, or of rows no longer in the data
    return manifest


def count_duplicates(records: list[dict[str, Any]]) -> int | None:
    """Samples whose duplicate key equals an earlier sample's (`duplicate_hashes`: a regenerated row's
    prompt, else its tokens); None for part records written before content hashes were recorded."""
    chosen = duplicate_hashes(records)
    if chosen is None:
        return None
    return len(chosen[1]) - len(set(chosen[1]))


def split_key(records: list[dict[str, Any]]) -> str:
    """What keys the held-out split of a store of these records: "opening", "prompt", "tokens" or "sample_id"."""
    chosen = split_hashes(records)
    return {"opening_hashes": "opening", "prompt_hashes": "prompt", "content_hashes": "tokens"}[chosen[0]] if chosen else "sample_id"


def row_accounting(data: dict[str, Any], num_samples: int, num_skipped: int) -> dict[str, Any] | None:
    """The rows of the user's file on their way to the store, counted at each stage from the
    manifest's `data` block (`data` is that block): read from the user's file, dropped by `generate`
    (bad rows), dropped by `extract` (bad rows, and rows too long with data.on_long=skip), stored; and
    the turns before a row's first user turn dropped (by whichever stage read the user's file). None
    for a manifest merged before extract counted the rows it read; `dropped_by_generate` is None
    where the generated file predates generate's counts, and absent where nothing was regenerated."""
    if "rows_read" not in data:
        return None
    generated = data.get("generate")
    regenerated = "generate" in data
    out: dict[str, Any] = {
        "data": generated["prompts"] if generated else data["source"],
        "rows": generated["rows_read"] if generated else (None if regenerated else data["rows_read"]),
        "dropped_by_extract": data["bad_rows_skipped"] + num_skipped,
        "bad_rows_skipped_by_extract": data["bad_rows_skipped"],
        "skipped_too_long": num_skipped,
        "stored": num_samples,
        "leading_turns_dropped": data.get("leading_turns_dropped", 0) + (generated or {}).get("leading_turns_dropped", 0),
    }
    if regenerated:
        out["generated"] = data["source"]
        out["generated_rows"] = data["rows_read"]
        out["dropped_by_generate"] = generated["bad_rows_skipped"] if generated else None
    return out


def orphans(files: StoreFiles, records: list[dict[str, Any]]) -> list[str]:
    """Store paths that no manifest record refers to: unlisted shard groups and part records."""
    listed = {r["name"] for r in records if r["name"]}
    parts = {part_path(r["index"]).split("/")[1] for r in records}
    out = [f"shards/{n}" for n in files.list("shards") if n.startswith("shard-") and n not in listed]
    out += [f"parts/{n}" for n in files.list("parts") if n.startswith("shard-") and n not in parts]
    return out
