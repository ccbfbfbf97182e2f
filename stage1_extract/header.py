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
from shared.target import pick_attn_implementation, resolve_dtype
from stage1_extract.distributed import resolve_device


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
    extraction: dict[str, Any],
) -> dict[str, Any]:
    """Everything that determines the stored bytes: the manifest's identity section. `extraction`
    is how the target ran (`extraction_settings`): compute dtype, attention kernel, packing and the
    batch shapes, since a bf16 or packed shard differs from an fp32 or padded one (and a batch of
    another shape can differ in the last bits), so two such shards must never pass as one store."""
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
        "storage": store.identity(),
        "max_length": max_length,
        "on_long": on_long,
        "extraction": dict(extraction),
    }


def extraction_settings(target_cfg: Any, extract_cfg: Any) -> dict[str, Any]:
    """How the target runs, resolved without loading it (the same rules `load_target_model` and the
    loop apply): these go into the header, and the loop reads them back from it."""
    device = resolve_device(extract_cfg.device)
    attn = pick_attn_implementation(target_cfg.attn_implementation, device)
    return {
        "compute_dtype": resolve_dtype(target_cfg.dtype, device),
        "attn_implementation": attn,
        "packed": extract_cfg.packed == "on" or (extract_cfg.packed == "auto" and attn == "flash_attention_2"),
        "batch_tokens": extract_cfg.batch_tokens,
        "max_batch_samples": extract_cfg.max_batch_samples,
        "window_shards": extract_cfg.window_shards,
        "lm_head_chunk": extract_cfg.lm_head_chunk,
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
