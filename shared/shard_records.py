"""What a shard record of manifest.json must hold, checked whenever a manifest is loaded.

A record (written by stage 1's shard writer into parts/shard-NNNNNN.json, then merged into the
manifest) describes one shard group: its name (None when every sample of the shard was skipped),
its index, how many samples and tokens it holds, each sample's input row, length and supervised pairs
(the anchor positions that set the trainer's block budget), the content checksum, and the hash of the
input rows it was made from. Readers index these fields directly, so
a record that lacks one, or whose fields disagree with each other, is refused here by field and
shard rather than as a KeyError somewhere in training.
"""

from __future__ import annotations

from typing import Any

# field -> the JSON types it may have (None: JSON null)
REQUIRED = {
    "index": (int,),
    "name": (str, type(None)),
    "num_samples": (int,),
    "num_tokens": (int,),
    "bytes": (int,),
    "checksum": (str, type(None)),
    "sample_ids": (list,),
    "lengths": (list,),
    "rows_sha256": (str,),
}


# Per-sample fields a store written before they existed lacks: content_hashes (duplicates, the split)
# and supervised_pairs (the trainer's block budget; the reader counts them from the loss masks then);
# prompt_hashes only a store of regenerated rows made at identity version 5 or later has, opening_hashes
# only a store made at version 6 or later.
OPTIONAL = ("content_hashes", "supervised_pairs", "prompt_hashes", "opening_hashes")
HASHES = ("content_hashes", "prompt_hashes", "opening_hashes")


def _first_recorded(records: list[dict[str, Any]], fields: tuple[str, ...]) -> tuple[str, list[str]] | None:
    for field in fields:
        if records and all(field in r for r in records):
            return field, [h for r in records for h in r[field]]
    return None


def split_hashes(records: list[dict[str, Any]]) -> tuple[str, list[str]] | None:
    """(the field, every sample's hash in store order) that keys the held-out split: `opening_hashes`
    when every record lists them (a row's turns through its first user turn: rows that open alike,
    copies or not, fall on one side, since online eval decodes from the opening), else `prompt_hashes`
    (regenerated rows: copies of a prompt share it whatever answers were sampled for each), else
    `content_hashes` (identical samples share it), else None (a store written before any: the split
    keys on sample ids). A store keeps the field it was made with (`shared/identity.py`: prompt hashes
    from identity version 5, openings from 6), so an older store resumed or re-extracted keeps its split."""
    return _first_recorded(records, ("opening_hashes", "prompt_hashes", "content_hashes"))


def duplicate_hashes(records: list[dict[str, Any]]) -> tuple[str, list[str]] | None:
    """(the field, every sample's hash in store order) that counts duplicates: a regenerated row's
    prompt, else the sample's tokens and loss mask (rows that only open alike are not copies)."""
    return _first_recorded(records, ("prompt_hashes", "content_hashes"))


def record_problem(record: Any, position: int) -> str | None:
    """Why the record at `position` of the manifest's shard list is unusable, naming the shard and
    the field, or None."""
    if not isinstance(record, dict):
        return f"shards[{position}] is a JSON {type(record).__name__}, not an object"
    where = f"shards[{position}]" + (f" ({record['name']})" if isinstance(record.get("name"), str) else "")
    for field, kinds in REQUIRED.items():
        if field not in record:
            return f"{where} has no {field!r}"
        value = record[field]
        if not isinstance(value, kinds) or isinstance(value, bool):
            return f"{where}.{field} is {value!r:.60}, not {' or '.join(_kind_name(k) for k in kinds)}"
    if record["index"] != position:
        return f"{where}.index is {record['index']}, but the record is number {position} of the list"
    num = record["num_samples"]
    for field in ("sample_ids", "lengths", *HASHES, "supervised_pairs"):
        values = record.get(field)
        if values is None and field in OPTIONAL:
            continue
        if not isinstance(values, list) or len(values) != num:
            have = f"{len(values)} entries" if isinstance(values, list) else repr(values)
            return f"{where}.{field} has {have}, num_samples is {num}"
        kind = str if field in HASHES else int
        if not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
            return f"{where}.{field} holds a value that is not {_kind_name(kind)}"
    if any(n <= 0 for n in record["lengths"]):
        return f"{where}.lengths holds a length below 1"
    for s, (pairs, length) in enumerate(zip(record.get("supervised_pairs") or (), record["lengths"])):
        if not 0 <= pairs < length:  # positions t and t + 1 both inside the sample
            return f"{where}.supervised_pairs[{s}] is {pairs}, outside 0..{length - 1} for a sample of {length} tokens"
    if sum(record["lengths"]) != record["num_tokens"]:
        return f"{where}.lengths sum to {sum(record['lengths'])}, num_tokens is {record['num_tokens']}"
    if (record["name"] is None) != (num == 0):
        return f"{where} has name {record['name']!r} and {num} samples (a shard without a group holds none)"
    return None


def _kind_name(kind: type) -> str:
    return {int: "an integer", str: "a string", list: "a list", dict: "an object", type(None): "null"}[kind]
