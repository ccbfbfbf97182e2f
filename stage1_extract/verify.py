"""`verify`: every shard of a store checked against its manifest record, field by field (the group
is there and its name carries the record's index; samples, tokens, per-sample lengths and ids,
content hashes and supervised pairs (recounted from the loss mask), bytes on disk and the content checksum agree with the arrays; shapes, dtypes and
offsets hold; values are finite); `--deep` also tokenizes the input data again (no cache) and
compares every stored sample's input_ids and loss_mask with it, and every recorded prompt hash (the
held-out split key of a regenerated row) with the one the data gives its row, which proves a store
matches its data whatever happened to any cache. A bad shard says how it is fixed: when only the manifest's
record is wrong and the shard's part record agrees with the shard, `--repair` rebuilds the record
(nothing re-extracted); otherwise `--repair` extracts the shard again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shared.codecs import hidden_array_specs, hidden_problem
from shared.shard_records import record_problem
from shared.store import (
    StoreFiles,
    content_checksum,
    load_manifest,
    read_manifest,
    read_shard_arrays,
    supervised_pairs,
)
from stage1_extract.batching import content_hash
from stage1_extract.merge import part_path

REBUILD = "rebuild the record"
EXTRACT = "extract again"


def check_store(url: str, tokenized_afresh: Callable[[], Any] | None) -> dict[str, Any]:
    """The store against its manifest; with `tokenized_afresh` (--deep: the rows prepared again, no
    token cache), against the data too."""
    report = verify_store(url)
    report["deep"] = tokenized_afresh is not None
    if tokenized_afresh is None:
        return report
    fresh = tokenized_afresh()
    rows = {r.sample_id: r for r in fresh.rows}
    files = StoreFiles(url)
    manifest = load_manifest(files)
    manifest_index = {r["name"]: r["index"] for r in manifest["shards"] if r["name"]}
    known = {b["shard"] for b in report["bad_shards"]}
    tokens = deep_problems(url, rows)
    for shard, why in tokens.items():
        if shard not in known:
            report["bad_shards"].append(
                {"shard": shard, "index": manifest_index[shard], "fields": ["input_ids"], "error": why, "fix": EXTRACT, "deep": True}
            )
    present = files.present("shards", [r["name"] for r in manifest["shards"] if r["name"]])
    for record in manifest["shards"]:
        if not record["name"] or record["name"] in known or record["name"] in tokens:
            continue
        problem = split_key_problem(record, rows, fresh.source.name)
        if problem is not None:
            index = record["index"]
            report["bad_shards"].append(
                {"shard": record["name"], "index": index, "fields": [problem.split(":", 1)[0]], "error": problem,
                 "fix": REBUILD if part_record_holds(url, files, present, manifest, index, rows) else EXTRACT, "deep": True}
            )
    report["ok"] = not report["bad_shards"]
    return report


# The split keys a record holds per sample, and the row attribute each is read from afresh.
SPLIT_KEY_FIELDS = {"prompt_hashes": "prompt_hash", "opening_hashes": "opening_hash"}


def split_key_problem(record: dict[str, Any], rows_by_id: dict[int, Any], data: str) -> str | None:
    """'<field>: ...' when a shard record's split keys (prompt hashes, opening hashes) are not the ones
    the data (`data`, read afresh into `rows_by_id`) gives its samples' rows, or None. Nothing in the
    shard can recount them: a record whose keys differ puts rows that belong together on both sides
    of the held-out split, and one that lacks them moves the whole store's split onto another key
    (`split_hashes`). Every sample's row must be in `rows_by_id` (`deep_problems` names a shard whose
    rows are not)."""
    for field, attribute in SPLIT_KEY_FIELDS.items():
        fresh = [getattr(rows_by_id[sample_id], attribute)[:16] for sample_id in record["sample_ids"]]
        want = fresh if fresh and all(fresh) else None  # `prepare.split_keys` gives every row one, or none
        have = record.get(field)
        if have == want:
            continue
        if want is None:
            return f"{field}: the record keys its samples on them, {data} gives their rows none"
        if have is None:
            return (f"{field}: none in the record, {data} gives each of its {len(want)} rows one (without them the "
                    f"held-out split of the whole store keys on another hash)")
        differ = [s for s, (a, b) in enumerate(zip(have, want)) if a != b]
        first = differ[0]
        return (f"{field}: {len(differ)} of {len(want)} samples' split keys are not their row's in {data}, first sample "
                f"{first} (input row {record['sample_ids'][first]}): {have[first]} in the record, {want[first]} in {data}")
    return None


def verify_store(url: str) -> dict[str, Any]:
    manifest = read_manifest(url)
    files = StoreFiles(url)
    present = files.present("shards", [r["name"] for r in manifest["shards"] if r["name"]])
    bad: list[dict[str, Any]] = []
    for record in manifest["shards"]:
        if not record["name"]:
            continue
        problems = record_disagreements(url, files, present, manifest, record)
        if problems:
            bad.append(
                {
                    "shard": record["name"],
                    "index": record["index"],
                    "fields": sorted({p.split(":", 1)[0] for p in problems}),
                    "error": "; ".join(problems)[:600],
                    "fix": REBUILD if part_record_holds(url, files, present, manifest, record["index"]) else EXTRACT,
                }
            )
    made = manifest.get("data") or {}  # what the shards were made from, as the manifest counted it
    return {"store": url, "shards_checked": len(manifest["shards"]), "bad_shards": bad, "ok": not bad,
            "answers_cut": made.get("answers_cut"), "answers_cut_unknown": made.get("answers_cut_unknown"),
            "context_turns": made.get("context_turns")}


def part_record_holds(
    url: str, files: StoreFiles, present: set[str], manifest: dict[str, Any], index: int,
    rows_by_id: dict[int, Any] | None = None,
) -> bool:
    """True when the shard's part record (what `reprocess` and `--repair` rebuild the manifest from)
    is sound and agrees with its shard group in every field; given the data's rows (`--deep`), also
    holds the split keys the data gives them."""
    try:
        part = files.read_json(part_path(index))
    except (OSError, ValueError):
        return False
    if record_problem(part, index) is not None or not part["name"]:
        return False
    if rows_by_id is not None and (
        any(i not in rows_by_id for i in part["sample_ids"]) or split_key_problem(part, rows_by_id, "") is not None
    ):
        return False
    return not record_disagreements(url, files, present, manifest, part)


def record_disagreements(url: str, files: StoreFiles, present: set[str], manifest: dict[str, Any], record: dict[str, Any]) -> list[str]:
    """'field: what disagrees' for every field of the shard record that its shard group
    contradicts; a group that is missing or unreadable is one problem ('name: ...', 'arrays: ...')."""
    import numpy as np

    name = record["name"]
    if name not in present:
        return [f"name: no shard group {name} in the store"]
    problems = []
    if not name.startswith(f"shard-{record['index']:06d}-"):
        problems.append(f"index: the record says {record['index']}, the group's name {name}")
    try:
        arrays = read_shard_arrays(url, name)
    except Exception as exc:  # noqa: BLE001 - every failure is reported per shard
        return problems + [f"arrays: unreadable ({type(exc).__name__}: {str(exc)[:200]})"]
    layers, hidden, top_k = len(manifest["layer_ids"]), manifest["target"]["hidden_size"], manifest["top_k"]
    tokens, samples = len(arrays.get("input_ids", ())), len(arrays.get("sample_ids", ()))
    if tokens != record["num_tokens"]:
        problems.append(f"num_tokens: the shard holds {tokens} tokens, the record says {record['num_tokens']}")
    if samples != record["num_samples"]:
        problems.append(f"num_samples: the shard holds {samples} samples, the record says {record['num_samples']}")
    storage = manifest["storage"]
    expect = {
        **hidden_array_specs(storage["dtype"], tokens, layers, hidden, storage.get("fp4_outlier_channels", 0)),
        "topk_logprobs": ((tokens, top_k), np.float16),
        "topk_ids": ((tokens, top_k), np.int32),
        "input_ids": ((tokens,), np.int32),
        "loss_mask": ((tokens,), np.bool_),
        "offsets": ((samples + 1,), np.int64),
        "sample_ids": ((samples,), np.int64),
    }
    for array, (shape, dtype) in expect.items():
        if array not in arrays:
            problems.append(f"arrays: {array} is missing")
        elif arrays[array].shape != shape or arrays[array].dtype != dtype:
            problems.append(f"arrays: {array} is {arrays[array].dtype}{arrays[array].shape}, expected {np.dtype(dtype)}{shape}")
    if any(p.startswith("arrays:") for p in problems):
        return problems
    offsets = arrays["offsets"]
    if offsets[0] != 0 or offsets[-1] != tokens or (np.diff(offsets) <= 0).any():
        return problems + [f"arrays: offsets run {offsets[0]}..{offsets[-1]} over {tokens} tokens, not upward from 0"]
    problems += _per_sample(record, "sample_ids", arrays["sample_ids"].tolist())
    problems += _per_sample(record, "lengths", np.diff(offsets).tolist())
    spans = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))
    if "content_hashes" in record:
        fresh = [content_hash(arrays["input_ids"][a:b], arrays["loss_mask"][a:b]) for a, b in spans]
        problems += _per_sample(record, "content_hashes", fresh)
    if "supervised_pairs" in record:  # the trainer's block budget: a wrong count packs too many blocks
        problems += _per_sample(record, "supervised_pairs", [supervised_pairs(arrays["loss_mask"][a:b]) for a, b in spans])
    problem = hidden_problem(arrays, storage["dtype"], manifest.get("fp4_outlier_channels"))
    if problem:
        problems.append(f"arrays: {problem}")
    if not np.isfinite(arrays["topk_logprobs"]).all():
        problems.append("arrays: non-finite top-k log-probs")
    if content_checksum(arrays) != record["checksum"]:
        problems.append("checksum: the arrays' content checksum differs from the record's")
    size = files.size(f"shards/{name}")
    if size != record["bytes"]:
        problems.append(f"bytes: the group's files hold {size} bytes, the record says {record['bytes']}")
    return problems


def _per_sample(record: dict[str, Any], field: str, shard_values: list[Any]) -> list[str]:
    listed = record[field]
    if listed == shard_values:
        return []
    if len(listed) != len(shard_values):
        return [f"{field}: {len(listed)} in the record, {len(shard_values)} samples in the shard"]
    s = next(i for i, (a, b) in enumerate(zip(listed, shard_values)) if a != b)
    return [f"{field}: sample {s} has {shard_values[s]!r} in the shard, {listed[s]!r} in the record"]


def deep_problems(url: str, rows_by_id: dict[int, Any]) -> dict[str, str]:
    """Shard name -> the first sample whose stored tokens or loss mask differ from the data's
    (tokenized afresh), or that the data no longer holds."""
    import numpy as np

    manifest = read_manifest(url)
    out: dict[str, str] = {}
    for record in manifest["shards"]:
        if not record["name"]:
            continue
        try:
            arrays = read_shard_arrays(url, record["name"])
        except Exception as exc:  # noqa: BLE001 - the shallow check names it already
            out[record["name"]] = f"unreadable ({type(exc).__name__})"
            continue
        offsets = arrays["offsets"]
        for s, sample_id in enumerate(arrays["sample_ids"].tolist()):
            row = rows_by_id.get(sample_id)
            if row is None:
                out[record["name"]] = f"sample of input row {sample_id}: the data has no such row now (run `python -m stage1_extract status`)"
                break
            a, b = int(offsets[s]), int(offsets[s + 1])
            for name, stored, fresh in (
                ("input_ids", arrays["input_ids"][a:b], np.asarray(row.input_ids, dtype=np.int32)),
                ("loss_mask", arrays["loss_mask"][a:b], np.asarray(row.loss_mask, dtype=bool)),
            ):
                if stored.shape != fresh.shape or not np.array_equal(stored, fresh):
                    where = "its length" if stored.shape != fresh.shape else f"token {int(np.flatnonzero(stored != fresh)[0])}"
                    out[record["name"]] = f"input row {sample_id}: stored {name} differ from the data at {where}"
                    break
            if record["name"] in out:
                break
    return out
