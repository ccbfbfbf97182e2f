"""The data path at the real per-sample size: an 8B-shaped store (Qwen3-8B's 5 x 4096 features,
top-64, 2,048 tokens per sample, random bf16 values, ~84 MB per sample) written with the project's
own writer, read back by the training loader, against the machine's own read bandwidth.

    .venv/bin/python bench/store8b.py [--samples 48] [--json out.json]

Figures:
  sequential read MB/s   a plain Python read of every store file (16 MB blocks), page cache
                         evicted first (cold) and again with the files cached (warm): the baseline
  loader MB/s            sample bytes delivered by the PrefetchLoader (2 threads, reading and
                         collating 512 anchors x 16 slots per sample, as the 8B preset trains) over
                         one epoch right after the eviction (cold) and a second one (warm); the goal
                         is >= 70% of the sequential rate measured in this run
  H200 demand            samples/s one H200 consumes training the 5-layer 8B drafter at 40% MFU,
                         from bench/gpu_flops.py's FLOP count of a sample: the loader's samples/s
                         is set beside it
The store is written uncompressed (random values do not compress; real activations compress
~1.26x with zstd, and zstd's decode rate is measured on one shard too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import emit  # noqa: E402
from bench.gpu_flops import DrafterShape, StepWork, train_step_flops  # noqa: E402
from bench.reader import evict  # noqa: E402

LAYERS, HIDDEN, TOP_K, TOKENS, PROMPT = 5, 4096, 64, 2048, 256
QWEN3_8B = DrafterShape(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936,
                        num_layers=5, num_feature_layers=5, block_size=16)


def synthetic_sample(sample_id: int, rng: np.random.Generator):
    import torch

    from shared.store import SampleFeatures

    hidden = torch.from_numpy(rng.standard_normal((TOKENS, LAYERS, HIDDEN), dtype=np.float32)).to(torch.bfloat16)
    return SampleFeatures(
        sample_id=sample_id,
        input_ids_T=rng.integers(0, 151936, TOKENS).astype(np.int32),
        loss_mask_T=np.arange(TOKENS) >= PROMPT,
        hidden_TLH=hidden,
        topk_logprobs_TK=torch.from_numpy(-rng.random((TOKENS, TOP_K), dtype=np.float32) * 10),
        topk_ids_TK=torch.from_numpy(rng.integers(0, 151936, (TOKENS, TOP_K)).astype(np.int32)),
    )


def build_store(root: Path, num_samples: int, per_shard: int, compression: str) -> dict:
    """Shards written with shared.store.write_shard, and the manifest the reader needs."""
    from shared.store import SCHEMA_VERSION, StoreConfig, write_shard

    cfg = StoreConfig(compression=compression, shard_mb=1024)
    rng = np.random.default_rng(0)
    records, started = [], time.perf_counter()
    for index, start in enumerate(range(0, num_samples, per_shard)):
        shard = [synthetic_sample(sid, rng) for sid in range(start, min(start + per_shard, num_samples))]
        record = write_shard(str(root), f"shard-{index:06d}-synthetic", shard, cfg)
        record.update(index=index, sample_ids=[s.sample_id for s in shard], lengths=[TOKENS] * len(shard), rows_sha256="")
        records.append(record)
    manifest = {
        "schema_version": SCHEMA_VERSION, "storage": cfg.model_dump(exclude={"path", "shard_mb"}), "shards": records,
        "layer_ids": [1, 9, 17, 25, 33], "top_k": TOP_K, "max_length": TOKENS,
        "target": {"hidden_size": HIDDEN, "num_hidden_layers": 36, "vocab_size": 151936},
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return {"write_s": round(time.perf_counter() - started, 1), "bytes": sum(r["bytes"] for r in records)}


def sequential_read(root: Path) -> float:
    """MB/s of reading every file once, 16 MB at a time."""
    total, started = 0, time.perf_counter()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        with open(path, "rb", buffering=0) as fh:
            while block := fh.read(16 << 20):
                total += len(block)
    return total / 2**20 / (time.perf_counter() - started)


def loader_epochs(root: Path, threads: int, epochs: int) -> list[dict]:
    """Samples and MB/s the PrefetchLoader delivers per epoch: every sample once in a random order,
    each collated with up to 512 anchors and the stored top-k (the KL term's inputs)."""
    from shared.store import StoreReader
    from stage2_train.data.anchors import AnchorSampler
    from stage2_train.data.config import SamplerConfig
    from stage2_train.data.loader import PrefetchLoader
    from stage2_train.data.sampler import LengthMixedSampler

    reader = StoreReader(str(root), cache_mb=64)
    cfg = SamplerConfig(micro_batch_tokens=TOKENS, max_anchors_per_seq=512)
    sampler = LengthMixedSampler(cfg, reader.lengths, seed=0)
    loader = PrefetchLoader(reader, sampler, AnchorSampler(cfg, block_size=16, seed=0), mask_token_id=151669,
                            num_threads=threads, prefetch=2 * threads, gather_topk=True)
    sample_bytes = TOKENS * (LAYERS * HIDDEN * 2 + TOP_K * 6 + 5)
    out = []
    for _ in range(epochs):
        count, started = 0, time.perf_counter()
        for loaded in loader:  # the rest of the epoch
            count += loaded.batch.num_samples
        elapsed = time.perf_counter() - started
        out.append({"samples_per_s": round(count / elapsed, 2), "mb_per_s": round(count * sample_bytes / 2**20 / elapsed, 1), "samples": count})
    loader.close()
    return out


def h200_samples_per_s(mfu: float = 0.4, peak: float = 989e12) -> dict:
    """One sample's training FLOPs (512 anchors x 16 slots, every slot scored but the anchor's)."""
    anchors = 512
    work = StepWork(
        context_tokens=TOKENS,
        blocks=anchors,
        scored_rows=anchors * 15,
        attention_pairs=sum(16 * (a + 16) for a in np.linspace(PROMPT, TOKENS - 2, anchors).astype(int)),
    )
    flops = train_step_flops(QWEN3_8B, work)["total"]
    return {"flops_per_sample": flops, "samples_per_s": round(mfu * peak / flops, 2), "mfu": mfu, "peak_tflops": peak / 1e12}


def zstd_decode_rate(root: Path) -> float:
    """MB/s of decoding one shard's zstd chunks (decoded bytes), as the reader does with a zstd store."""
    from shared.chunks import ChunkSource, decode_chunk, open_shard_array
    from shared.store import StoreFiles, StoreReader

    reader = StoreReader(str(root))
    name = reader.manifest["shards"][0]["name"]
    files = StoreFiles(str(root))
    source = ChunkSource(files.fs, files.root, True)
    array = open_shard_array(source, f"shards/{name}/hidden")
    started, total = time.perf_counter(), 0
    for k in range(len(array.index)):
        total += decode_chunk(source, array, k).nbytes
    return total / 2**20 / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--per-shard", type=int, default=12, help="shard_mb=1024 at ~84 MB per sample")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench_store8b_", dir=os.environ.get("BENCH_TMP")))
    zroot = root.with_name(root.name + "_zstd")
    try:
        built = build_store(root, args.samples, args.per_shard, "none")
        results: dict = {
            "samples": args.samples,
            "tokens_per_sample": TOKENS,
            "features": f"{LAYERS} x {HIDDEN} bf16, top-{TOP_K}",
            "store_gib": round(built["bytes"] / 2**30, 2),
            "write": {**built, "mb_per_s": round(built["bytes"] / 2**20 / built["write_s"], 1)},
        }
        evict(root)
        cold_seq = sequential_read(root)
        warm_seq = sequential_read(root)
        evict(root)
        cold_loader, warm_loader = loader_epochs(root, args.threads, 2)  # epoch 1 cold, epoch 2 cached
        demand = h200_samples_per_s()
        results["sequential_read_mb_per_s"] = {"cold": round(cold_seq, 1), "warm": round(warm_seq, 1)}
        results["loader"] = {
            "threads": args.threads,
            "cold": {**cold_loader, "over_sequential": round(cold_loader["mb_per_s"] / cold_seq, 3)},
            "warm": {**warm_loader, "over_sequential": round(warm_loader["mb_per_s"] / warm_seq, 3)},
        }
        results["h200_demand"] = demand
        results["loader_over_h200_demand"] = round(warm_loader["samples_per_s"] / demand["samples_per_s"], 3)
        build_store(zroot, min(args.per_shard, args.samples), args.per_shard, "zstd")
        results["zstd_decode_mb_per_s"] = round(zstd_decode_rate(zroot), 1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(zroot, ignore_errors=True)
    return emit(results, args.json, t0)


if __name__ == "__main__":
    sys.exit(main())
