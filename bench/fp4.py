"""The fp4 store's codec figures: the same data extracted as bf16, fp8 and fp4 stores, then per layer
the error of each against bf16, the bytes per token, the codec's rates and random sample reads
(docs/benchmarks.md, `fp4`; the drafters trained from them: `run_all.py --only fp4_compare`).

    .venv/bin/python bench/fp4.py [--config configs/default.yaml] [--run-dir runs/fp4-default] [--json out.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Row, arguments, calls_per_s, emit, fmt, relative_error, run_cli, yes  # noqa: E402

DTYPES = ("bf16", "fp8", "fp4")


def stage1(verb: str, config: str, run_dir: Path, *overrides: str) -> None:
    run_cli(["-m", "stage1_extract", verb, "--no-progress", "--config", config, f"run_dir={run_dir}", *overrides], run_dir / f"{verb}.log")


def ensure_stores(config: str, run_dir: Path) -> dict[str, Path]:
    from shared.paths import RunPaths

    if not RunPaths(run_dir).generated.is_file():
        stage1("generate", config, run_dir)
    stores = {dtype: run_dir / f"store-{dtype}" for dtype in DTYPES}
    for dtype, path in stores.items():
        if not (path / "manifest.json").is_file():
            stage1("extract", config, run_dir, f"store.path={path}", f"store.dtype={dtype}")
    return stores


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--run-dir", default="runs/fp4-default")
    args = parser.parse_args()
    import torch

    from shared.codecs import decode_hidden, encode_hidden
    from shared.fp4 import decode_fp4, encode_fp4
    from shared.reader import StoreReader
    from shared.store import bytes_per_token, read_shard_arrays

    torch.set_num_threads(1)
    stores = ensure_stores(args.config, Path(args.run_dir))
    readers = {dtype: StoreReader(str(path)) for dtype, path in stores.items()}
    exact = readers["bf16"]
    if not all(np.array_equal(r.sample_ids, exact.sample_ids) for r in readers.values()):
        raise SystemExit(f"{args.run_dir}: the three stores hold different samples; remove them and rerun")
    num_layers, hidden = exact.feature_shape
    channels = np.asarray(readers["fp4"].manifest["fp4_outlier_channels"], dtype=np.int32)
    none_apart = np.zeros((num_layers, 0), dtype=np.int32)
    errors: dict[str, list[np.ndarray]] = {"fp8": [], "fp4": [], "fp4, no exact channels": []}
    for index in range(len(exact)):
        x_TLH = exact[index]["hidden_TLH"].float()
        decoded = {"fp8": readers["fp8"][index]["hidden_TLH"], "fp4": readers["fp4"][index]["hidden_TLH"],
                   "fp4, no exact channels": decode_fp4(**encode_fp4(x_TLH, none_apart))}
        for name, y_TLH in decoded.items():
            errors[name].append(relative_error(y_TLH, x_TLH, eps=1e-30).numpy())
    per_layer = {name: [round(float(v), 4) for v in np.median(np.concatenate(e), axis=0)] for name, e in errors.items()}
    overall = {name: round(float(np.median(np.concatenate(e))), 4) for name, e in errors.items()}

    tokens = int(exact.lengths.sum())
    on_disk = {dtype: sum(p.stat().st_size for p in (path / "shards").rglob("*") if p.is_file()) for dtype, path in stores.items()}
    formula_8b = {dtype: bytes_per_token(dtype, 5, 4096, 64, outlier_channels=len(channels[0])) for dtype in DTYPES}

    # Decode rate of one shard's hidden states, one thread, from the stored arrays (no I/O).
    arrays = {dtype: read_shard_arrays(str(stores[dtype]), r.manifest["shards"][0]["name"]) for dtype, r in readers.items()}
    decoded_bytes = arrays["bf16"]["hidden"].nbytes  # what every decode returns (bf16)
    fp4_parts = {k: arrays["fp4"][k] for k in ("hidden_group_scale", "hidden_outliers", "hidden_outlier_channels")}
    decode_per_s = calls_per_s({
        "fp8": lambda: decode_hidden(arrays["fp8"]["hidden"], arrays["fp8"]["hidden_scale"], "fp8"),
        "fp4": lambda: decode_hidden(arrays["fp4"]["hidden"], arrays["fp4"]["hidden_scale"], "fp4", **fp4_parts),
    })
    x_TLH = decode_hidden(arrays["bf16"]["hidden"], None, "bf16")
    encode_per_s = calls_per_s({"fp8": lambda: encode_hidden(x_TLH, "fp8"), "fp4": lambda: encode_fp4(x_TLH, channels)})
    # Random sample reads through the reader (page cache warm, one thread): a new reader each round
    # (its decoded-chunk cache empty), and one long-lived reader whose chunk cache holds the store.
    order = np.random.default_rng(0).permutation(len(exact)).tolist()
    steady = {dtype: StoreReader(str(path)) for dtype, path in stores.items()}
    for reader in steady.values():
        [reader.read(i) for i in order]
    read_new = calls_per_s({d: (lambda p=p: [StoreReader(str(p)).read(i) for i in order]) for d, p in stores.items()}, rounds=3)
    read_steady = calls_per_s({d: (lambda r=r: [r.read(i) for i in order]) for d, r in steady.items()}, rounds=3)
    result = {
        "config": args.config, "run_dir": args.run_dir, "samples": len(exact), "tokens": tokens,
        "features": f"{num_layers} layers x {hidden}", "layer_ids": exact.manifest["layer_ids"],
        "outlier_channels": channels.tolist(),
        "relative_error_median_per_layer": per_layer, "relative_error_median": overall,
        "bytes_per_token_on_disk": {d: round(b / tokens, 1) for d, b in on_disk.items()},
        "bytes_per_token_qwen3_8b": formula_8b,
        "over_bf16_qwen3_8b": {d: round(formula_8b[d] / formula_8b["bf16"], 3) for d in DTYPES},
        "decode_mb_per_s": {d: round(v * decoded_bytes / 1e6) for d, v in decode_per_s.items()},
        "encode_mb_per_s": {d: round(v * decoded_bytes / 1e6) for d, v in encode_per_s.items()},
        "read_samples_per_s": {
            "new_reader": {d: round(v * len(order)) for d, v in read_new.items()},
            "steady": {d: round(v * len(order)) for d, v in read_steady.items()},
        },
        "compression": exact.manifest["storage"]["compression"],
    }
    return emit(result, args.json)


def rows(r: dict) -> list[Row]:
    out: list[Row] = []
    layers = ", ".join(str(i) for i in r["layer_ids"])
    for codec, errors in r["relative_error_median_per_layer"].items():
        out.append((f"{codec}: median per-token relative error, layers {layers} ({r['features']}, {r['tokens']:,} tokens)",
                    " / ".join(str(e) for e in errors), "", f"all layers {r['relative_error_median'][codec]}", ""))
    disk, b8, over = r["bytes_per_token_on_disk"], r["bytes_per_token_qwen3_8b"], r["over_bf16_qwen3_8b"]
    out.append((f"bytes/token on disk, bf16 / fp8 / fp4 ({r['compression']}, incl. top-64)",
                f"{fmt(disk['bf16'])} / {fmt(disk['fp8'])} / {fmt(disk['fp4'])}", "", "", ""))
    out.append(("bytes/token at Qwen3-8B (5 x 4096, top-64, formula): bf16 / fp8 / fp4",
                f"{b8['bf16']:,} / {b8['fp8']:,} / {b8['fp4']:,}", "", f"{over['fp8']}x / {over['fp4']}x of bf16", ""))
    out.append(("decode / encode MB/s of bf16 output, one thread: fp8 / fp4",
                f"{fmt(r['decode_mb_per_s']['fp8'])} / {fmt(r['decode_mb_per_s']['fp4'])} (encode "
                f"{fmt(r['encode_mb_per_s']['fp8'])} / {fmt(r['encode_mb_per_s']['fp4'])})", "", "", ""))
    if "read_samples_per_s" in r:
        new, steady = r["read_samples_per_s"]["new_reader"], r["read_samples_per_s"]["steady"]
        out.append(("random sample reads/s, one thread, warm page cache: a new reader / a long-lived one, fp8 vs fp4",
                    f"{new['fp8']} vs {new['fp4']} / {steady['fp8']} vs {steady['fp4']}", "fp4 >= fp8",
                    f"bf16 {new['bf16']} / {steady['bf16']}", yes(new["fp4"] >= new["fp8"] and steady["fp4"] >= steady["fp8"])))
    return out


if __name__ == "__main__":
    sys.exit(main())
