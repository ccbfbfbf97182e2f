"""The plan pinned by a store's first run: its identity header (`shared/identity.py`) and
samples_per_shard. A shard is current when its part record carries the header key of the current
settings and the hash of its input rows (`merge.record_matches`); `status` names the fields that
changed. `extract` continues a store only with the data it was made from (`other_data_problem`);
`reprocess` is the verb that replaces shards.
"""

from __future__ import annotations

from typing import Any

from shared.config import dotted_differences
from shared.errors import StoreError
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
        changed = dotted_differences({k: plan["header"].get(k) for k in header}, header)
        if changed:
            field_name, (before, now) = next(iter(changed.items()))
            also = f" (and {', '.join(list(changed)[1:])})" if len(changed) > 1 else ""
            raise StoreError(
                f"{files.url}/plan.json: this store was started with {field_name}={before!r}, the config now "
                f"gives {now!r}{also}. Run `python -m stage1_extract reprocess` to update the stale shards, or use "
                f"another store.path"
            )
        return int(plan["samples_per_shard"])
    files.write_json("plan.json", {"header": header, "samples_per_shard": samples_per_shard, "num_rows": num_rows})
    return samples_per_shard


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
        + "; `extract` does not replace them. If you edited the data, run `python -m stage1_extract reprocess` "
        "(it re-extracts only those shards); for another dataset, set store.path (or run_dir) to a new folder"
    )
