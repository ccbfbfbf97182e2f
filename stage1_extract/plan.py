"""`plan`: the store's size against the free space, before anything runs.

    python -m stage1_extract plan --config my-qwen3.yaml
"""

from __future__ import annotations

import math
from typing import Any

from shared.config import RunConfig
from stage1_extract.prepare import token_bytes
from stage1_extract.resolve import prepare_run


def cmd_plan(cfg: RunConfig, *, gpu: str | None = None, gpus: int = 8) -> dict[str, Any]:
    prepared = prepare_run(cfg)
    rows = prepared.rows
    kept = [r for r in rows if not r.skipped]
    tokens = int(sum(len(r.input_ids) for r in kept))
    per_token = token_bytes(prepared.header)
    free = prepared.files.free_bytes()
    return {
        "samples": len(kept),
        "samples_truncated": sum(r.truncated for r in rows),
        "samples_skipped": sum(r.skipped for r in rows),
        "tokens": tokens,
        "bytes_per_token": per_token,
        "total_bytes": tokens * per_token,
        "total_gib": round(tokens * per_token / 2**30, 3),
        "compression_note": "zstd typically saves 1.2-1.3x on hidden states (not counted)"
        if cfg.store.compression == "zstd"
        else "uncompressed",
        "num_shards_estimate": math.ceil(tokens * per_token / (cfg.store.shard_mb * 2**20)) if tokens else 0,
        "store": prepared.files.url,
        "storage": f"{cfg.store.dtype}+{cfg.store.compression}",
        "free_bytes": free,
        "fits": None if free is None else tokens * per_token <= free,
        "bad_rows_skipped": prepared.stats.bad_rows,
    }
