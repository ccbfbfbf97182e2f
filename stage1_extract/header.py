"""The plan pinned by a store's first run: its identity header (`shared/identity.py`) and
samples_per_shard. A shard is current when its part record carries the header key of the current
settings and the hash of its input rows (`merge.record_matches`); `status` names the fields that
changed. `extract` continues a store only with the data it was made from (`other_data_problem`);
`reprocess` is the verb that replaces shards.
"""

from __future__ import annotations

from typing import Any

from shared.errors import StoreError
from shared.identity import header_changes
from shared.store import StoreFiles
from stage1_extract.batching import ShardPlan
from stage1_extract.merge import foreign_shards


def load_or_pin_plan(
    files: StoreFiles, header: dict[str, Any], samples_per_shard: int, num_rows: int, repin: bool = False
) -> int:
    """The first run pins samples_per_shard; later runs must agree on the header, or reprocess
    (repin=True), which adopts the new header and keeps the shard boundaries."""
    if files.exists("plan.json"):
        plan = files.read_json("plan.json")
        if repin and plan["header"] != header:
            plan.update({"header": header, "num_rows": num_rows})
            files.write_json("plan.json", plan)
        changed = header_changes(plan["header"], header)
        if changed:
            raise StoreError(changed_plan_message(files.url, changed))
        return int(plan["samples_per_shard"])
    files.write_json("plan.json", {"header": header, "samples_per_shard": samples_per_shard, "num_rows": num_rows})
    return samples_per_shard


def plan_problem(files: StoreFiles, header: dict[str, Any]) -> str | None:
    """Why this config cannot continue the store (its plan.json pinned another header), before a
    command deletes anything it would then be unable to make again; None when it can."""
    if not files.exists("plan.json"):
        return None
    pinned = files.read_json("plan.json")["header"]
    changed = header_changes(pinned, header)
    return changed_plan_message(files.url, changed) if changed else None


# The setting behind each header field a user sets, and what an absent field means (a TP size is in
# the header only above 1): the refusal says which value continues the store.
SETTING_OF = {
    "top_k": "extract.top_k",
    "max_length": "data.max_length",
    "on_long": "data.on_long",
    "extraction.compute_dtype": "target.dtype",
    "extraction.attn_implementation": "target.attn_implementation",
    "extraction.packed": "extract.packed",
    "extraction.tensor_parallel_size": "extract.tensor_parallel_size",
    **{f"storage.{k}": f"store.{k}" for k in ("dtype", "compression", "zstd_level", "chunk_tokens", "fp4_outlier_channels")},
}
ABSENT_MEANS = {"extraction.tensor_parallel_size": 1}


def changed_plan_message(url: str, changed: dict[str, list[Any]]) -> str:
    """The refusal of a changed identity field: the cheap fix (set it back) first where a setting gives
    it, then `reprocess` (which re-extracts every shard it makes stale)."""
    field_name, (before, now) = next(iter(changed.items()))
    before, now = (ABSENT_MEANS.get(field_name, v) if v is None else v for v in (before, now))
    also = f" (and {', '.join(list(changed)[1:])})" if len(changed) > 1 else ""
    setting = SETTING_OF.get(field_name) or (f"data.{field_name}" if field_name.startswith("chat_template_kwargs.") else None)
    if setting is None:  # the target, tokenizer, template or layers: nothing to set back
        return (
            f"{url}/plan.json: this store was started with {field_name}={before!r}, the config now gives {now!r}{also}. "
            f"Run `python -m stage1_extract reprocess` to update the stale shards, or use another store.path"
        )
    shown = {True: "on", False: "off"}.get(before, before) if field_name == "extraction.packed" else before
    return (
        f"{url}/plan.json: this store was started with {setting}={shown} ({field_name}), the config now gives {now!r}{also}: "
        f"set {setting}={shown} to continue this store, or run `python -m stage1_extract reprocess` to re-extract its "
        f"shards with the new value, or use another store.path"
    )


def other_data_problem(files: StoreFiles, shards: list[ShardPlan], records: dict[int, dict[str, Any]], source: Any) -> str | None:
    """Why `extract` must not continue this store: shards made from other rows than the data gives
    (`records`: every part record, `merge.part_records(..., beyond_plan=True)`). Replacing them is
    `reprocess`'s job; a second dataset pointed at the same store.path would otherwise silently
    re-extract the first one's shards, and merge would delete them."""
    foreign = foreign_shards(shards, records)
    if not foreign:
        return None
    made_from = (files.read_json("manifest.json").get("data") or {}).get("source") if files.exists("manifest.json") else None
    shown = ", ".join(str(i) for i in foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
    return (
        f"{files.url}: shard(s) {shown} were extracted from other input rows than {source} gives"
        + (f" (the store was made from {made_from})" if made_from and str(made_from) != str(source) else "")
        + "; extraction does not replace them. If you edited the data, run `python -m stage1_extract reprocess` "
        "(it re-extracts only those shards); for another dataset, set store.path (or run_dir) to a new folder"
    )
