"""Random sample reads from the feature store against the simplest peer format, the same samples
stored as one safetensors file per sample (SpecForge/speculators style, uncompressed).

    .venv/bin/python bench/reader.py [--store runs/default/store] [--json out.json]

Its figures (cold, warm and steady reads) and goals: docs/benchmarks.md, `reader`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Row, arguments, emit, evict, fmt, yes  # noqa: E402
from shared.reader import StoreReader  # noqa: E402


def write_per_sample_files(reader: StoreReader, out: Path) -> int:
    """Every sample as its own safetensors file (hidden as stored bits, uncompressed); returns bytes."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for index in range(len(reader)):
        s = reader[index]
        save_file({"hidden": s["hidden_TLH"].view(torch.int16), "input_ids": s["input_ids_T"].to(torch.int32),
                   "loss_mask": s["loss_mask_T"], "topk_logprobs": s["topk_logprobs_TK"].to(torch.float16),
                   "topk_ids": s["topk_ids_TK"].to(torch.int32)}, out / f"{index:07d}.safetensors")
    return sum(p.stat().st_size for p in out.iterdir())


def uncompressed_copy(reader: StoreReader, out: Path) -> Path:
    """The same store rewritten by the project's writer with store.compression=none (same shards,
    same samples, same manifest otherwise)."""
    import json

    import torch

    from shared.codecs import SampleFeatures
    from shared.store import StoreConfig, write_shard

    manifest = json.loads(json.dumps(reader.manifest))
    cfg = StoreConfig(**{**manifest["storage"], "compression": "none"})
    for shard, record in enumerate(manifest["shards"]):
        start = int(reader._shard_start[shard])
        samples = [SampleFeatures(s["sample_id"], s["input_ids_T"].numpy(), s["loss_mask_T"].numpy(), s["hidden_TLH"],
                                  s["topk_logprobs_TK"], s["topk_ids_TK"].to(torch.int32))
                   for s in map(reader.read, range(start, start + record["num_samples"]))]
        channels = manifest.get("fp4_outlier_channels")  # fp4: re-encoded with the store's channel set
        record.update(write_shard(str(out), record["name"], samples, cfg, None if channels is None else np.asarray(channels)))
    manifest["storage"]["compression"] = "none"
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def rate(read, order: list[int]) -> float:
    started = time.perf_counter()
    for index in order:
        read(index)
    return len(order) / (time.perf_counter() - started)


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--store", default="runs/default/store")
    parser.add_argument("--reads", type=int, default=1000)
    args = parser.parse_args()
    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    store = Path(args.store)
    if not (store / "manifest.json").is_file():
        raise SystemExit(f"{store}: no store (run `make train` first, or pass --store)")
    reader = StoreReader(str(store))
    n = len(reader)
    per_file = Path(tempfile.mkdtemp(prefix="bench_reader_"))
    try:
        file_bytes = write_per_sample_files(reader, per_file)
        rng = np.random.default_rng(0)
        once = rng.permutation(n).tolist()
        many = rng.integers(0, n, args.reads).tolist()

        def read_file(index: int) -> dict:
            """The sample as the loader takes it from the store reader (same dtypes)."""
            t = load_file(per_file / f"{index:07d}.safetensors")
            return {"sample_id": index, "input_ids_T": t["input_ids"].long(), "loss_mask_T": t["loss_mask"],
                    "hidden_TLH": t["hidden"].view(torch.bfloat16), "topk_logprobs_TK": t["topk_logprobs"].float(),
                    "topk_ids_TK": t["topk_ids"].long()}

        results: dict = {"store": str(store), "samples": n, "tokens": int(reader.lengths.sum()),
                         "store_bytes": sum(p.stat().st_size for p in store.rglob("*") if p.is_file()),
                         "per_file_bytes": file_bytes, "storage": reader.manifest["storage"]}
        plain = uncompressed_copy(reader, per_file.with_name(per_file.name + "_none"))
        results["uncompressed_store_bytes"] = sum(p.stat().st_size for p in plain.rglob("*") if p.is_file())
        evict(store), evict(per_file), evict(plain)
        measured = {}
        for mode in ("cold", "warm"):  # the files evicted, then the same reads with the files cached
            ours, plain_rate, files = rate(StoreReader(str(store)).read, once), rate(StoreReader(str(plain)).read, once), rate(read_file, once)
            measured[mode] = {"store": round(ours, 1), "store_uncompressed": round(plain_rate, 1), "per_file": round(files, 1),
                              "ratio": round(ours / files, 3), "ratio_uncompressed": round(plain_rate / files, 3)}
        steady_reader = StoreReader(str(store))
        rate(steady_reader.read, once)  # fill its chunk cache, as the first epoch does
        steady_store = rate(steady_reader.read, many)
        steady_files = rate(read_file, many)
        results["samples_per_s"] = {**measured, "steady": {
            "store": round(steady_store, 1), "per_file": round(steady_files, 1), "ratio": round(steady_store / steady_files, 3),
            "chunk_cache_hits": steady_reader._chunks.hits, "chunk_cache_misses": steady_reader._chunks.misses}}
    finally:
        shutil.rmtree(per_file, ignore_errors=True)
        shutil.rmtree(per_file.with_name(per_file.name + "_none"), ignore_errors=True)
    return emit(results, args.json)


def rows(r: dict) -> list[Row]:
    out: list[Row] = []
    sp = r["samples_per_s"]
    for mode in ("cold", "warm"):
        m = sp[mode]
        for store, key in ((f"store as configured ({r['storage']['compression']})", ""), ("same store uncompressed", "_uncompressed")):
            out.append((f"random sample reads, {mode} page cache, {store} / per-file safetensors", fmt(m["ratio" + key]), ">= 0.5",
                        f"{m['store' + key]} vs {m['per_file']} samples/s", yes(m["ratio" + key] >= 0.5)))
    m = sp["steady"]
    out.append(("1,000 random reads by one long-lived reader (its chunk cache warm) / per-file", fmt(m["ratio"]), "",
                f"{m['store']} vs {m['per_file']} samples/s", ""))
    return out


if __name__ == "__main__":
    sys.exit(main())
