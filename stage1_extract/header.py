"""The store's identity: the header of everything that changes a shard's bytes, its key, and the
plan pinned by the first run.

A shard is current when its part record carries the header key of the current settings and the
hash of its input rows (`merge.record_matches`); `header_differences` names the fields that changed
(`status` prints them).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from shared.config import dotted_differences
from shared.errors import StoreError
from shared.store import SCHEMA_VERSION, StoreConfig, StoreFiles


def settings_header(
    *,
    target_path: str,
    weights_sha256: str,
    arch: Any,
    tokenizer_hashes: dict[str, str],
    layer_ids: list[int],
    top_k: int,
    store: StoreConfig,
    max_length: int,
    on_long: str,
) -> dict[str, Any]:
    """Everything that determines the stored values: the manifest's identity section."""
    return {
        "schema_version": SCHEMA_VERSION,
        "target": {
            "path": target_path,
            "weights_sha256": weights_sha256,
            "model_type": arch.model_type,
            "num_hidden_layers": arch.num_hidden_layers,
            "hidden_size": arch.hidden_size,
            "vocab_size": arch.vocab_size,
        },
        "tokenizer_sha256": tokenizer_hashes["tokenizer_sha256"],
        "chat_template_sha256": tokenizer_hashes["chat_template_sha256"],
        "layer_ids": list(layer_ids),
        "top_k": top_k,
        "storage": {
            "dtype": store.dtype,
            "compression": store.compression,
            "zstd_level": store.zstd_level,
            "chunk_tokens": store.chunk_tokens,
        },
        "max_length": max_length,
        "on_long": on_long,
    }


def header_key(header: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()


def header_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted names of the identity fields that differ ('target.weights_sha256', 'top_k', ...)."""
    return list(dotted_differences(old, new))


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
        for field_name, value in header.items():
            if plan["header"].get(field_name) != value:
                raise StoreError(
                    f"{files.url}/plan.json: this store was started with {field_name}="
                    f"{plan['header'].get(field_name)!r}, the config now gives {value!r}. "
                    f"Run `python -m stage1_extract reprocess` to update the stale shards, or use another store.path"
                )
        return int(plan["samples_per_shard"])
    files.write_json("plan.json", {"header": header, "samples_per_shard": samples_per_shard, "num_rows": num_rows})
    return samples_per_shard
