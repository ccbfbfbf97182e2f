"""`verify`: every shard of a store checked against its manifest (readable, shapes, dtypes, sample
counts and ids, finite values, content checksum); `--deep` also tokenizes the input data again
(no cache) and compares every stored sample's input_ids and loss_mask with it, which proves a store
matches its data whatever happened to any cache; `--repair` re-extracts the bad shards.
"""

from __future__ import annotations

from typing import Any

from shared.store import (
    StoreFiles,
    content_checksum,
    hidden_array_specs,
    hidden_problem,
    read_manifest,
    read_shard_arrays,
)


def verify_store(url: str) -> dict[str, Any]:
    import numpy as np

    manifest = read_manifest(url)
    layers, hidden, top_k = len(manifest["layer_ids"]), manifest["target"]["hidden_size"], manifest["top_k"]
    storage = manifest["storage"]
    files = StoreFiles(url)
    present = set(files.list("shards"))
    bad: list[dict[str, Any]] = []
    for record in manifest["shards"]:
        if not record["name"]:
            continue
        try:
            if record["name"] not in present:
                raise ValueError("shard group is missing")
            arrays = read_shard_arrays(url, record["name"])
            tokens = record["num_tokens"]
            expect = {
                **hidden_array_specs(storage["dtype"], tokens, layers, hidden, storage.get("fp4_outlier_channels", 0)),
                "topk_logprobs": ((tokens, top_k), np.float16),
                "topk_ids": ((tokens, top_k), np.int32),
                "input_ids": ((tokens,), np.int32),
                "loss_mask": ((tokens,), np.bool_),
                "offsets": ((record["num_samples"] + 1,), np.int64),
                "sample_ids": ((record["num_samples"],), np.int64),
            }
            for name, (shape, dtype) in expect.items():
                if name not in arrays:
                    raise ValueError(f"array {name} missing")
                if arrays[name].shape != shape or arrays[name].dtype != dtype:
                    raise ValueError(f"{name} is {arrays[name].dtype}{arrays[name].shape}, expected {np.dtype(dtype)}{shape}")
            if arrays["sample_ids"].tolist() != record["sample_ids"]:
                raise ValueError("sample ids differ from the manifest")
            problem = hidden_problem(arrays, storage["dtype"], manifest.get("fp4_outlier_channels"))
            if problem:
                raise ValueError(problem)
            if not np.isfinite(arrays["topk_logprobs"]).all():
                raise ValueError("non-finite top-k log-probs")
            if content_checksum(arrays) != record["checksum"]:
                raise ValueError("checksum mismatch")
        except Exception as exc:  # noqa: BLE001 - every failure is reported per shard
            bad.append({"shard": record["name"], "index": record["index"], "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    return {"store": url, "shards_checked": len(manifest["shards"]), "bad_shards": bad, "ok": not bad}


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
                out[record["name"]] = f"sample of input row {sample_id}: the data has no such row now (run `status`)"
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
