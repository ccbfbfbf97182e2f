"""Stores of random features written by the project's own writer, for tests and benchmarks.

    make_store(url, [samples(7, seed=1), samples(5, seed=2)], StoreConfig())   # shards shard-000000-x, ...

`make_store` writes each shard with `shared.store.write_shard` as it comes (a generator of shards keeps
memory to one shard) and then the manifest StoreReader needs, no more.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from shared.codecs import SampleFeatures
from shared.store import SCHEMA_VERSION, StoreConfig, write_shard


def samples(
    count: int, seed: int = 0, layers: int = 3, hidden: int = 40, k: int = 5, tokens: tuple[int, int] = (20, 300),
    vocab: int = 1000, first_id: int = 0, dtype: torch.dtype = torch.float32,
) -> list[SampleFeatures]:
    """Samples `first_id`.. of random features, each of a length in [tokens[0], tokens[1]), about 70% of
    its tokens supervised."""
    rng = np.random.default_rng(seed)
    out = []
    for sid in range(first_id, first_id + count):
        T = int(rng.integers(*tokens))
        out.append(
            SampleFeatures(
                sample_id=sid,
                input_ids_T=rng.integers(0, vocab, T).astype(np.int32),
                loss_mask_T=rng.random(T) < 0.7,
                hidden_TLH=torch.from_numpy(rng.standard_normal((T, layers, hidden), dtype=np.float32)).to(dtype),
                topk_logprobs_TK=torch.from_numpy(-rng.random((T, k)).astype(np.float32)),
                topk_ids_TK=torch.from_numpy(rng.integers(0, vocab, (T, k)).astype(np.int32)),
            )
        )
    return out


def make_store(url: str, shards: Iterable[list[SampleFeatures]], cfg: StoreConfig, **manifest: Any) -> list[dict[str, Any]]:
    """A store of these shards and a minimal manifest (`manifest` replaces its fields); returns the
    shard records."""
    import fsspec

    records, first = [], None
    for index, shard in enumerate(shards):
        first = first or shard[0]
        record = write_shard(url, f"shard-{index:06d}-x", shard, cfg)
        record.update(index=index, sample_ids=[s.sample_id for s in shard], lengths=[len(s.input_ids_T) for s in shard], rows_sha256="")
        records.append(record)
    num_layers, top_k = first.hidden_TLH.shape[1], first.topk_ids_TK.shape[1]
    manifest = {
        "schema_version": SCHEMA_VERSION, "storage": cfg.model_dump(exclude={"path", "shard_mb"}), "shards": records,
        "layer_ids": list(range(1, num_layers + 1)), "target": {}, "top_k": top_k,
        "max_length": max(n for r in records for n in r["lengths"]), **manifest,
    }
    with fsspec.open(f"{url}/manifest.json", "w") as fh:
        json.dump(manifest, fh)
    return records
