"""Stage-1 benchmark: extraction overhead, bytes per token per storage option, random read speed.

    .venv/bin/python bench/extract.py [--samples 48] [--json bench/results_extract.json]

The shard writer at the 8B shape alone: `--only-8b`. Its figures and goals: docs/benchmarks.md, `extract`.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Row, arguments, documentation_chats, emit, fmt, pure_forward, relative_error, yes  # noqa: E402


def writer_at_8b(batches: int = 4, scale: int = 8, threads: int = 2) -> dict:
    """The shard writer against the target's forward at the 8B preset's shape, scaled down `scale`x."""
    import shutil

    import torch

    from shared.codecs import encode_sample
    from shared.store import StoreConfig
    from stage1_extract.batching import ShardPlan, TokenizedRow
    from stage1_extract.extract import ExtractConfig, host_token_bytes, writer_queue_mb
    from stage1_extract.plan import EXTRACT_MFU, GPUS, target_params
    from stage1_extract.writer import HostBatch, ShardWriter, host_bytes
    from stage2_train.train.memory_plan import KNOWN_TARGETS
    from testkit.store import samples as random_samples

    layers, hidden, top_k, sample_tokens = 5, 4096, 64, 2048
    batch_tokens = 65536 // scale
    per_batch = batch_tokens // sample_tokens
    flops = 2 * target_params(KNOWN_TARGETS["qwen3-8b"]) + 4 * sample_tokens * hidden * 36
    forward_s = batch_tokens * flops / (GPUS["h100"].bf16_tflops * 1e12 * EXTRACT_MFU)
    samples = random_samples(batches * per_batch, layers=layers, hidden=hidden, k=top_k, tokens=(sample_tokens, sample_tokens + 1),
                             vocab=151936, dtype=torch.bfloat16)
    rows = [TokenizedRow(s.sample_id, str(s.sample_id), s.input_ids_T, s.loss_mask_T) for s in samples]
    per_shard = 12  # shard_mb 1024 at ~84 MB per sample
    shards = [ShardPlan(i, rows[a : a + per_shard], f"b{i}", "bench") for i, a in enumerate(range(0, len(rows), per_shard))]
    queue_mb = writer_queue_mb(ExtractConfig(batch_tokens=batch_tokens), host_token_bytes(layers, hidden, 2, top_k))
    out: dict = {"batch_tokens": batch_tokens, "scale": scale, "batches": batches, "queue_mb": queue_mb,
                 "forward_s_per_batch_h100": round(forward_s, 3), "store": "bf16 + zstd", "writer_threads": threads}
    # The absorbing thread's own work per sample, alone on the machine: encoding (a copy of the
    # states) against the host scan the device's sum replaced.
    from stage1_extract.writer import check_finite

    for name, work in (("encode", lambda s: encode_sample(s, "bf16")), ("host_scan", check_finite)):
        started = time.perf_counter()
        for sample in samples[:per_batch]:
            work(sample)
        out[f"{name}_s_per_65k_batch_alone"] = round((time.perf_counter() - started) * scale, 2)
    # The sums the device computes during its forward (here ahead of the timed run).
    sums = [torch.stack([t.sum(dtype=torch.float32) for s in samples[b * per_batch : (b + 1) * per_batch]
                         for t in (s.hidden_TLH, s.topk_logprobs_TK)]).sum() for b in range(batches)]
    for name, device_sum in (("device_sum", True), ("host_scan", False)):
        root = Path(tempfile.mkdtemp(prefix="bench_writer8b_"))
        try:
            writer = ShardWriter(str(root), StoreConfig(dtype="bf16", compression="zstd", shard_mb=1024), shards, queue_mb, threads)
            started = time.perf_counter()
            for b in range(batches):
                batch = samples[b * per_batch : (b + 1) * per_batch]
                time.sleep(forward_s)  # the target's forward of the next batch, on the GPU
                writer.put(HostBatch(batch, None, host_bytes(batch), sums[b] if device_sum else None))
            stats = writer.finish()
            wall = time.perf_counter() - started
        finally:
            shutil.rmtree(root, ignore_errors=True)
        out[name] = {"absorb_s_per_65k_batch": round(stats.absorb_seconds / batches * scale, 2),
                     "writer_s_per_65k_batch": round(stats.write_seconds / batches * scale / threads, 2),  # per thread
                     "forward_waited_s": round(stats.queue_wait_seconds, 2), "wall_over_forward": round(wall / (batches * forward_s), 3),
                     "host_checked_batches": stats.host_checked_batches}
    out["forward_s_per_65k_batch_h100"] = round(forward_s * scale, 2)
    return out


def codec_rates(features: list) -> dict:
    """Per stored array (as stored: bf16 bits, fp16 log-probs, int32 ids): ratio and decode MB/s of
    each candidate codec, one thread, beside a memcpy of the same bytes."""
    import numpy as np
    import torch
    from numcodecs import LZ4, Blosc, Zstd, blosc

    from bench.common import calls_per_s

    blosc.set_nthreads(1)  # one decoding thread, as one loader thread decodes

    arrays = {"hidden (bf16)": torch.cat([f.hidden_TLH.to(torch.bfloat16) for f in features]).view(torch.int16).numpy(),
              "topk_logprobs (fp16)": torch.cat([f.topk_logprobs_TK for f in features]).to(torch.float16).numpy(),
              "topk_ids (int32)": torch.cat([torch.as_tensor(f.topk_ids_TK) for f in features]).to(torch.int32).numpy()}
    codecs = {"zstd-3 (the store's)": Zstd(3), "lz4": LZ4(), "blosc lz4 + bit shuffle": Blosc("lz4", 5, Blosc.BITSHUFFLE)}
    out = {}
    for name, data in arrays.items():
        raw = np.ascontiguousarray(data)
        encoded = {c: codec.encode(raw) for c, codec in codecs.items()}
        per_s = calls_per_s({"memcpy": raw.copy, **{c: (lambda c=codecs[c], e=e: c.decode(e)) for c, e in encoded.items()}}, min_s=0.3)
        out[name] = {"memcpy_mb_per_s": round(per_s["memcpy"] * raw.nbytes / 1e6),
                     **{c: {"ratio": round(raw.nbytes / len(e), 3), "decode_mb_per_s": round(per_s[c] * raw.nbytes / 1e6)}
                        for c, e in encoded.items()}}
    return out


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--only-8b", action="store_true", help="only the writer at the 8B shape")
    args = parser.parse_args()
    if args.only_8b:
        return emit({"writer_at_8b": writer_at_8b()}, args.json)
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
                arrays = [a for a in sorted((Path(url) / "shards" / "shard-000000-bench").iterdir()) if a.is_dir()]
                by_array[dtype] = {a.name: round(sum(f.stat().st_size for f in a.rglob("*") if f.is_file()) / tokens, 1) for a in arrays}
    peers = work / "torch_save"
    peers.mkdir()
    for f in features:
        torch.save({"input_ids": torch.from_numpy(f.input_ids_T), "loss_mask": torch.from_numpy(f.loss_mask_T),
                    "hidden_state": f.hidden_TLH.reshape(len(f.input_ids_T), -1).to(torch.bfloat16)}, peers / f"data_{f.sample_id}.ckpt")
    sizes["torch.save per sample (SpecForge-style, no top-k)"] = sum(p.stat().st_size for p in peers.iterdir()) / tokens

    # fp8 reconstruction error against the fp32 features.
    rel = torch.cat([relative_error(decode_hidden(*encode_hidden(f.hidden_TLH, "fp8"), "fp8"), f.hidden_TLH).flatten() for f in features])
    bf16_rel = torch.cat([relative_error(f.hidden_TLH.to(torch.bfloat16), f.hidden_TLH).flatten() for f in features])

    # 4. Each stored array's compression and one-thread decode rate under candidate codecs, on these
    # real activations: why the reader's zstd figures are what they are, what a faster codec would buy.
    codecs = codec_rates(features)

    # 5. Random window reads (what the trainer does).
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
        "samples": len(rows), "tokens": tokens,
        "padded_tokens": forward["padded_tokens"],  # the padded batches of the SDPA path (flash-attn packs them)
        "layers": prepared.layer_ids, "forward_s": round(forward_s, 2),
        "extract_loop_s": round(extract_loop_s, 2), "extract_total_s": round(extract_total_s, 2),
        "extract_over_forward": round(extract_loop_s / forward_s, 3), "extract_total_over_forward": round(extract_total_s / forward_s, 3),
        # The writer's figures as the command reports them (writer_seconds summed over its threads).
        **{k: summary[k] for k in ("writer_queue_wait_s", "writer_seconds", "writer_threads", "writer_peak_queue_mb")},
        "extract_forward_s": summary["forward_seconds"], "forward_tok_per_s": round(tokens / forward_s, 1),
        "bytes_per_token": {k: round(v, 1) for k, v in sizes.items()}, "bytes_per_token_by_array": by_array,
        "fp8_over_bf16": round(sizes["fp8+none"] / sizes["bf16+none"], 3),
        "fp8+zstd_over_bf16": round(sizes["fp8+zstd"] / sizes["bf16+none"], 3),
        # The top-k (64 x 6 bytes) and ids cost the same in both: the ratio of the hidden states
        # alone, and the whole-store ratio at Qwen3-8B's size (5 layers x 4096), from the formula.
        "fp8_hidden_over_bf16": round((hidden_size + 4) / (hidden_size * 2), 3),
        "fp8_over_bf16_at_qwen3_8b": round(bytes_per_token("fp8", 5, 4096, 64) / bytes_per_token("bf16", 5, 4096, 64), 3),
        "fp8_rel_error_mean": round(float(rel.mean()), 4), "fp8_rel_error_p99": round(float(rel.quantile(0.99)), 4),
        "bf16_rel_error_mean": round(float(bf16_rel.mean()), 5),
        "read_windows_per_s": round(count / read_s, 1), "read_mb_per_s": round(nbytes / read_s / 2**20, 1),
        "read_window_tokens": window, "store_shards": len(manifest["shards"]), "writer_at_8b": writer_at_8b(), "codecs": codecs,
    }
    return emit(results, args.json)


def rows(r: dict) -> list[Row]:
    out: list[Row] = []
    out.append(("extraction wall time / pure target forward", fmt(r["extract_over_forward"]), "<= 1.15",
                f"forward {r['forward_s']} s on {r['tokens']} tokens ({r['padded_tokens']} padded)", yes(r["extract_over_forward"] <= 1.15)))
    bpt = r["bytes_per_token"]
    peer = bpt["torch.save per sample (SpecForge-style, no top-k)"]
    for key in ("bf16+none", "bf16+zstd", "fp8+none", "fp8+zstd"):
        out.append((f"bytes/token {key} (incl. top-64)", fmt(bpt[key]), "", f"torch.save per sample: {fmt(peer)} (no top-k)", ""))
    out.append(("fp8 / bf16 bytes (whole store)", fmt(r["fp8_over_bf16"]), "<= 0.55", "bf16 in the same run", yes(r["fp8_over_bf16"] <= 0.55)))
    arrays = r["bytes_per_token_by_array"]
    names = [k for k in dict.fromkeys([*arrays["bf16"], *arrays["fp8"]]) if max(arrays["bf16"].get(k, 0), arrays["fp8"].get(k, 0)) >= 1]
    split = ", ".join(f"{k} {fmt(arrays['bf16'].get(k, 0))} -> {fmt(arrays['fp8'].get(k, 0))}" for k in names)
    out.append(("where the bytes go (bytes/token per array, bf16 -> fp8, uncompressed)", split, "", "", ""))
    out.append(("fp8 / bf16 bytes (hidden states only)", fmt(r["fp8_hidden_over_bf16"]), "<= 0.55", "top-k costs the same in both",
                yes(r["fp8_hidden_over_bf16"] <= 0.55)))
    out.append(("fp8 / bf16 bytes at Qwen3-8B size (formula)", fmt(r["fp8_over_bf16_at_qwen3_8b"]), "<= 0.55", "", yes(r["fp8_over_bf16_at_qwen3_8b"] <= 0.55)))
    out.append(("fp8 reconstruction error (relative L2, mean / p99)", f"{r['fp8_rel_error_mean']} / {r['fp8_rel_error_p99']}", "",
                f"bf16 rounding alone: {r['bf16_rel_error_mean']}", ""))
    out.append((f"who limits extraction: writer threads busy ({r['writer_threads']} threads, summed) / target forward",
                f"{r['writer_seconds']} s / {r['extract_forward_s']} s", "writer < forward",
                f"forward blocked on a full queue {r['writer_queue_wait_s']} s; peak queue {r['writer_peak_queue_mb']} MB", yes(r["writer_seconds"] / r["writer_threads"] < r["extract_forward_s"])))
    w = r["writer_at_8b"]
    out.append((f"8B-shaped writer, per 65K-token batch: absorbing (encode) / host scan it replaced / target forward (H100 model), CPU, scaled {w['scale']}x",
                f"{w['encode_s_per_65k_batch_alone']} s / {w['host_scan_s_per_65k_batch_alone']} s / {w['forward_s_per_65k_batch_h100']} s",
                "absorb < forward", f"under the writer's {w['writer_threads']} zstd threads: absorb {w['device_sum']['absorb_s_per_65k_batch']} s "
                f"(host scan {w['host_scan']['absorb_s_per_65k_batch']} s), each writer thread {w['device_sum']['writer_s_per_65k_batch']} s",
                yes(w["encode_s_per_65k_batch_alone"] < w["forward_s_per_65k_batch_h100"])))
    out.append((f"random {r['read_window_tokens']}-token window reads", f"{r['read_windows_per_s']}/s ({r['read_mb_per_s']} MB/s)", "", "", ""))
    for array, c in r.get("codecs", {}).items():  # since bench/codecs.py moved here
        codecs = [k for k in c if k != "memcpy_mb_per_s"]
        out.append((f"{array}: compression ratio / one-thread decode MB/s, " + " / ".join(codecs),
                    " / ".join(f"{c[k]['ratio']}x {fmt(c[k]['decode_mb_per_s'])}" for k in codecs), "", f"memcpy {fmt(c['memcpy_mb_per_s'])} MB/s", ""))
    return out


if __name__ == "__main__":
    sys.exit(main())
