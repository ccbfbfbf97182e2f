"""`verify`: every shard of a store checked against its manifest (readable, shapes, dtypes, sample
counts and ids, finite values, content checksum); `--repair` re-extracts the bad ones.
"""

from __future__ import annotations

from typing import Any

from shared.store import StoreFiles, content_checksum, read_manifest, read_shard_arrays


def verify_store(url: str) -> dict[str, Any]:
    import numpy as np

    manifest = read_manifest(url)
    layers, hidden, top_k = len(manifest["layer_ids"]), manifest["target"]["hidden_size"], manifest["top_k"]
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
                "hidden": ((tokens, layers, hidden), np.uint16 if manifest["storage"]["dtype"] == "bf16" else np.uint8),
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
            bits = arrays["hidden"]
            nonfinite = ((bits & 0x7F80) == 0x7F80) if bits.dtype == np.uint16 else ((bits & 0x7F) == 0x7F)
            if nonfinite.any():
                raise ValueError(f"{int(nonfinite.sum())} non-finite hidden values")
            if not np.isfinite(arrays["topk_logprobs"]).all():
                raise ValueError("non-finite top-k log-probs")
            if content_checksum(arrays) != record["checksum"]:
                raise ValueError("checksum mismatch")
        except Exception as exc:  # noqa: BLE001 - every failure is reported per shard
            bad.append({"shard": record["name"], "index": record["index"], "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    return {"store": url, "shards_checked": len(manifest["shards"]), "bad_shards": bad, "ok": not bad}
