"""The data path at the real per-sample size: an 8B-shaped store (Qwen3-8B's 5 x 4096 features,
top-64, 2,048 tokens per sample, random bf16 values, ~84 MB per sample) written with the project's
own writer, read back by the training loader, against the machine's own read bandwidth.

    .venv/bin/python bench/store8b.py [--samples 48] [--json out.json]

Its figures (sequential read, loader, H200 demand) and goals: docs/benchmarks.md, `store8b`.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Row, arguments, emit, evict, fmt, yes  # noqa: E402

LAYERS, HIDDEN, TOP_K, TOKENS, PROMPT = 5, 4096, 64, 2048, 256


def build_store(root: Path, num_samples: int, per_shard: int, compression: str) -> dict:
    """Shards of Qwen3-8B-shaped random samples, written one at a time by the project's writer."""
    import torch

    from shared.store import StoreConfig
    from testkit.store import make_store, samples

    shards = (samples(min(per_shard, num_samples - start), seed=start, layers=LAYERS, hidden=HIDDEN, k=TOP_K,
                      tokens=(TOKENS, TOKENS + 1), vocab=151936, first_id=start, dtype=torch.bfloat16)
              for start in range(0, num_samples, per_shard))
    started = time.perf_counter()
    records = make_store(str(root), shards, StoreConfig(compression=compression, shard_mb=1024), layer_ids=[1, 9, 17, 25, 33],
                         target={"hidden_size": HIDDEN, "num_hidden_layers": 36, "vocab_size": 151936})
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
    from shared.reader import StoreReader
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
    """One sample's training FLOPs (512 anchors x 16 slots, every slot scored but the anchor's) for the
    5-layer drafter on Qwen3-8B."""
    from stage2_train.model.config import DrafterConfig
    from stage2_train.model.flops import DrafterShape, StepWork, train_step_flops
    from stage2_train.train.memory_plan import KNOWN_TARGETS

    shape = DrafterShape.of(DrafterConfig(num_layers=5, block_size=16), KNOWN_TARGETS["qwen3-8b"], LAYERS)
    anchors = 512
    work = StepWork(context_tokens=TOKENS, blocks=anchors, scored_rows=anchors * 15,
                    attention_pairs=sum(16 * (a + 16) for a in np.linspace(PROMPT, TOKENS - 2, anchors).astype(int)))
    flops = train_step_flops(shape, work)["total"]
    return {"flops_per_sample": flops, "samples_per_s": round(mfu * peak / flops, 2), "mfu": mfu, "peak_tflops": peak / 1e12}


def zstd_decode_rate(root: Path) -> float:
    """MB/s of decoding one shard's zstd chunks (decoded bytes), as the reader does with a zstd store."""
    from shared.chunks import ChunkSource, decode_chunk, open_shard_array
    from shared.reader import StoreReader
    from shared.store import StoreFiles

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
    parser = arguments(__doc__)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--per-shard", type=int, default=12, help="shard_mb=1024 at ~84 MB per sample")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench_store8b_", dir=os.environ.get("BENCH_TMP")))
    zroot = root.with_name(root.name + "_zstd")
    try:
        built = build_store(root, args.samples, args.per_shard, "none")
        results: dict = {"samples": args.samples, "tokens_per_sample": TOKENS, "features": f"{LAYERS} x {HIDDEN} bf16, top-{TOP_K}",
                         "store_gib": round(built["bytes"] / 2**30, 2),
                         "write": {**built, "mb_per_s": round(built["bytes"] / 2**20 / built["write_s"], 1)}}
        evict(root)
        cold_seq = sequential_read(root)
        warm_seq = sequential_read(root)
        evict(root)
        cold_loader, warm_loader = loader_epochs(root, args.threads, 2)  # epoch 1 cold, epoch 2 cached
        demand = h200_samples_per_s()
        results["sequential_read_mb_per_s"] = {"cold": round(cold_seq, 1), "warm": round(warm_seq, 1)}
        results["loader"] = {"threads": args.threads,
                             "cold": {**cold_loader, "over_sequential": round(cold_loader["mb_per_s"] / cold_seq, 3)},
                             "warm": {**warm_loader, "over_sequential": round(warm_loader["mb_per_s"] / warm_seq, 3)}}
        results["h200_demand"] = demand
        results["loader_over_h200_demand"] = round(warm_loader["samples_per_s"] / demand["samples_per_s"], 3)
        build_store(zroot, min(args.per_shard, args.samples), args.per_shard, "zstd")
        results["zstd_decode_mb_per_s"] = round(zstd_decode_rate(zroot), 1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(zroot, ignore_errors=True)
    return emit(results, args.json)


def rows(r: dict) -> list[Row]:
    seq, ld, d = r["sequential_read_mb_per_s"], r["loader"], r["h200_demand"]
    return [
        (f"8B-shaped store ({r['features']}, {r['tokens_per_sample']} tokens/sample, {r['samples']} samples, {r['store_gib']} GiB)",
         f"written at {r['write']['mb_per_s']} MB/s", "", "the project's writer", ""),
        *((f"loader MB/s ({ld['threads']} threads, 512 anchors x 16 slots collated) / sequential read, {mode}",
           fmt(ld[mode]["over_sequential"]), ">= 0.7", f"{ld[mode]['mb_per_s']} vs {seq[mode]} MB/s", yes(ld[mode]["over_sequential"] >= 0.7))
          for mode in ("cold", "warm")),
        ("loader samples/s / what one H200 trains (5-layer 8B drafter, 40% MFU)", fmt(r["loader_over_h200_demand"]), ">= 1",
         f"{ld['warm']['samples_per_s']} vs {d['samples_per_s']} samples/s ({d['flops_per_sample'] / 1e12:.0f} TFLOP per sample)",
         yes(r["loader_over_h200_demand"] >= 1)),
        ("zstd decode MB/s per thread (real activations compress ~1.26x)", fmt(r["zstd_decode_mb_per_s"]), "", "", ""),
    ]


if __name__ == "__main__":
    sys.exit(main())
