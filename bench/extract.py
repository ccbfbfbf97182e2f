"""Stage-1 benchmark: extraction overhead, bytes per token per storage option, random read speed.

    .venv/bin/python bench/extract.py [--samples 48] [--json bench/results_extract.json]

The embedded default target over documentation answers (real activations); its figures and goals:
docs/benchmarks.md, `extract`.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Row, arguments, documentation_chats, emit, fmt, pure_forward, relative_error, yes  # noqa: E402


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--samples", type=int, default=48)
    args = parser.parse_args()
    import torch

    from shared.codecs import decode_hidden, encode_hidden
    from shared.config import load_run_config
    from shared.paths import RunPaths
    from shared.reader import StoreReader
    from shared.store import StoreConfig, bytes_per_token, read_manifest, write_shard
    from shared.target_model import load_target_model
    from stage1_extract import commands as pipeline
    from stage1_extract.resolve import prepare_run

    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="bench_extract_"))
    data = documentation_chats(work / "data.parquet", args.samples)
    overrides = [f"run_dir={work}", f"data.path={data}", "data.regenerate=false", "store.shard_mb=16", "extract.device=cpu"]
    cfg = load_run_config("configs/default.yaml", overrides)
    prepared = prepare_run(cfg)
    rows = [r for r in prepared.rows if not r.skipped]
    tokens = sum(len(r.input_ids) for r in rows)

    # 1. Pure forward over the same batches extraction will use, features kept in memory.
    forward, features = pure_forward(load_target_model(cfg.target, "cpu"), cfg, prepared, keep=True)
    forward_s = forward["seconds"]

    # 2. The real extraction (bf16 + zstd, background writer), from scratch.
    started = time.perf_counter()
    summary = pipeline.cmd_extract(cfg, progress=False)
    extract_total_s = time.perf_counter() - started
    extract_loop_s = summary["seconds"]

    # 3. Bytes per token per storage option, from the same features.
    features.sort(key=lambda f: f.sample_id)
    sizes, by_array = {}, {}
    for dtype in ("bf16", "fp8"):
        for compression in ("none", "zstd"):
            url = str(work / f"store_{dtype}_{compression}")
            record = write_shard(url, "shard-000000-bench", features, StoreConfig(dtype=dtype, compression=compression))
            sizes[f"{dtype}+{compression}"] = record["bytes"] / tokens
            if compression == "none":  # where the bytes go: per array, summed over its files
                shard_dir = Path(url) / "shards" / "shard-000000-bench"
                by_array[dtype] = {
                    a.name: round(sum(f.stat().st_size for f in a.rglob("*") if f.is_file()) / tokens, 1)
                    for a in sorted(shard_dir.iterdir()) if a.is_dir()
                }
    peers = work / "torch_save"
    peers.mkdir()
    for f in features:
        torch.save(
            {"input_ids": torch.from_numpy(f.input_ids_T), "loss_mask": torch.from_numpy(f.loss_mask_T),
             "hidden_state": f.hidden_TLH.reshape(len(f.input_ids_T), -1).to(torch.bfloat16)},
            peers / f"data_{f.sample_id}.ckpt",
        )
    sizes["torch.save per sample (SpecForge-style, no top-k)"] = sum(p.stat().st_size for p in peers.iterdir()) / tokens

    # fp8 reconstruction error against the fp32 features.
    rel = torch.cat([relative_error(decode_hidden(*encode_hidden(f.hidden_TLH, "fp8"), "fp8"), f.hidden_TLH).flatten() for f in features])
    bf16_rel = torch.cat([relative_error(f.hidden_TLH.to(torch.bfloat16), f.hidden_TLH).flatten() for f in features])

    # 4. Random window reads (what the trainer does).
    store = RunPaths.of(cfg).store
    reader = StoreReader(store)
    rng = random.Random(0)
    window = 256
    count, nbytes = 0, 0
    started = time.perf_counter()
    while time.perf_counter() - started < 5.0:
        i = rng.randrange(len(reader))
        length = int(reader.lengths[i])
        start = rng.randrange(max(1, length - window))
        sample = reader.read(i, start, start + window)
        nbytes += sum(v.numel() * v.element_size() for v in sample.values() if isinstance(v, torch.Tensor))
        count += 1
    read_s = time.perf_counter() - started

    manifest = read_manifest(store)
    hidden_size = manifest["target"]["hidden_size"]
    results = {
        "samples": len(rows),
        "tokens": tokens,
        "padded_tokens": forward["padded_tokens"],  # the padded batches of the SDPA path (flash-attn packs them)
        "layers": prepared.layer_ids,
        "forward_s": round(forward_s, 2),
        "extract_loop_s": round(extract_loop_s, 2),
        "extract_total_s": round(extract_total_s, 2),
        "extract_over_forward": round(extract_loop_s / forward_s, 3),
        "extract_total_over_forward": round(extract_total_s / forward_s, 3),
        "writer_queue_wait_s": summary["writer_queue_wait_s"],
        "writer_seconds": summary["writer_seconds"],  # summed over the writer threads
        "writer_threads": summary["writer_threads"],
        "writer_peak_queue_mb": summary["writer_peak_queue_mb"],
        "extract_forward_s": summary["forward_seconds"],
        "forward_tok_per_s": round(tokens / forward_s, 1),
        "bytes_per_token": {k: round(v, 1) for k, v in sizes.items()},
        "bytes_per_token_by_array": by_array,
        "fp8_over_bf16": round(sizes["fp8+none"] / sizes["bf16+none"], 3),
        "fp8+zstd_over_bf16": round(sizes["fp8+zstd"] / sizes["bf16+none"], 3),
        # The top-k (64 x 6 bytes) and ids cost the same in both: the ratio of the hidden states
        # alone, and the whole-store ratio at Qwen3-8B's size (5 layers x 4096), from the formula.
        "fp8_hidden_over_bf16": round((hidden_size + 4) / (hidden_size * 2), 3),
        "fp8_over_bf16_at_qwen3_8b": round(bytes_per_token("fp8", 5, 4096, 64) / bytes_per_token("bf16", 5, 4096, 64), 3),
        "fp8_rel_error_mean": round(float(rel.mean()), 4),
        "fp8_rel_error_p99": round(float(rel.quantile(0.99)), 4),
        "bf16_rel_error_mean": round(float(bf16_rel.mean()), 5),
        "read_windows_per_s": round(count / read_s, 1),
        "read_mb_per_s": round(nbytes / read_s / 2**20, 1),
        "read_window_tokens": window,
        "store_shards": len(manifest["shards"]),
    }
    return emit(results, args.json)


def rows(r: dict) -> list[Row]:
    out: list[Row] = []
    out.append(("extraction wall time / pure target forward", fmt(r["extract_over_forward"]), "<= 1.15",
                f"forward {r['forward_s']} s on {r['tokens']} tokens"
                + (f" ({r['padded_tokens']} padded)" if "padded_tokens" in r else ""), yes(r["extract_over_forward"] <= 1.15)))
    bpt = r["bytes_per_token"]
    peer = bpt["torch.save per sample (SpecForge-style, no top-k)"]
    for key in ("bf16+none", "bf16+zstd", "fp8+none", "fp8+zstd"):
        out.append((f"bytes/token {key} (incl. top-64)", fmt(bpt[key]), "", f"torch.save per sample: {fmt(peer)} (no top-k)", ""))
    out.append(("fp8 / bf16 bytes (whole store)", fmt(r["fp8_over_bf16"]), "<= 0.55", "bf16 in the same run", yes(r["fp8_over_bf16"] <= 0.55)))
    if "bytes_per_token_by_array" in r:
        arrays = r["bytes_per_token_by_array"]
        names = [k for k in dict.fromkeys([*arrays["bf16"], *arrays["fp8"]]) if max(arrays["bf16"].get(k, 0), arrays["fp8"].get(k, 0)) >= 1]
        split = ", ".join(f"{k} {fmt(arrays['bf16'].get(k, 0))} -> {fmt(arrays['fp8'].get(k, 0))}" for k in names)
        out.append(("where the bytes go (bytes/token per array, bf16 -> fp8, uncompressed)", split, "", "", ""))
    out.append(("fp8 / bf16 bytes (hidden states only)", fmt(r.get("fp8_hidden_over_bf16")), "<= 0.55", "top-k costs the same in both",
                yes(r.get("fp8_hidden_over_bf16", 1) <= 0.55)))
    out.append(("fp8 / bf16 bytes at Qwen3-8B size (formula)", fmt(r.get("fp8_over_bf16_at_qwen3_8b")), "<= 0.55", "", yes(r.get("fp8_over_bf16_at_qwen3_8b", 1) <= 0.55)))
    out.append(("fp8 reconstruction error (relative L2, mean / p99)", f"{r['fp8_rel_error_mean']} / {r['fp8_rel_error_p99']}", "",
                f"bf16 rounding alone: {r['bf16_rel_error_mean']}", ""))
    if "writer_seconds" in r:
        out.append((f"who limits extraction: writer threads busy ({r['writer_threads']} threads, summed) / target forward",
                    f"{r['writer_seconds']} s / {r['extract_forward_s']} s", "writer < forward",
                    f"forward blocked on a full queue {r['writer_queue_wait_s']} s; peak queue {r['writer_peak_queue_mb']} MB", yes(r["writer_seconds"] / r["writer_threads"] < r["extract_forward_s"])))
    out.append((f"random {r['read_window_tokens']}-token window reads", f"{r['read_windows_per_s']}/s ({r['read_mb_per_s']} MB/s)", "", "", ""))
    return out


if __name__ == "__main__":
    sys.exit(main())
