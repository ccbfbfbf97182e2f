"""Compression ratio and single-thread decode rate of each stored array under candidate codecs,
on real activations (the first samples of the default store); not part of `make bench`.

    .venv/bin/python bench/codecs.py [--store runs/default/store] [--samples 12] [--json out.json]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("BLOSC_NTHREADS", "1")  # one decoding thread, as one loader thread decodes

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import arguments, emit, rate  # noqa: E402


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--store", default="runs/default/store")
    parser.add_argument("--samples", type=int, default=12)
    args = parser.parse_args()
    import torch
    from numcodecs import LZ4, Blosc, Zstd

    from shared.reader import StoreReader

    if not (Path(args.store) / "manifest.json").is_file():
        raise SystemExit(f"{args.store}: no store (run `make train` first, or pass --store)")
    reader = StoreReader(args.store)
    samples = [reader[i] for i in range(min(args.samples, len(reader)))]
    arrays = {  # as stored
        "hidden (bf16)": torch.cat([s["hidden_TLH"] for s in samples]).view(torch.int16).numpy(),
        "topk_logprobs (fp16)": torch.cat([s["topk_logprobs_TK"] for s in samples]).to(torch.float16).numpy(),
        "topk_ids (int32)": torch.cat([s["topk_ids_TK"] for s in samples]).to(torch.int32).numpy(),
    }
    codecs = {
        "zstd-3 (the store's)": Zstd(3),
        "zstd-1": Zstd(1),
        "lz4": LZ4(),
        "blosc lz4 + byte shuffle": Blosc("lz4", 5, Blosc.SHUFFLE),
        "blosc lz4 + bit shuffle": Blosc("lz4", 5, Blosc.BITSHUFFLE),
    }
    results: dict = {"store": args.store, "tokens": int(sum(len(s["input_ids_T"]) for s in samples)), "arrays": {}}
    for name, data in arrays.items():
        raw = np.ascontiguousarray(data)
        rows = {"memcpy_mb_per_s": round(rate(raw.copy, raw.nbytes, 0.3), 0)}
        for codec_name, codec in codecs.items():
            encoded = codec.encode(raw)
            rows[codec_name] = {
                "ratio": round(raw.nbytes / len(encoded), 3),
                "decode_mb_per_s": round(rate(lambda c=codec, e=encoded: c.decode(e), raw.nbytes, 0.3), 0),
            }
        results["arrays"][name] = rows
    return emit(results, args.json)


if __name__ == "__main__":
    sys.exit(main())
