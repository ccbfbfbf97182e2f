"""The 8B presets' training-step memory, traced with fake tensors, and the largest micro-batch that
fits an 80 GB and a 141 GB GPU (`python -m stage2_train plan --search` for each preset).

    .venv/bin/python bench/plan.py [--json out.json] [--presets qwen3-8b,llama-3.1-8b] [--sample-tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Row, emit, fmt  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--presets", default="qwen3-8b,llama-3.1-8b")
    parser.add_argument("--sample-tokens", type=int, default=1024)
    args = parser.parse_args()
    started = time.perf_counter()
    results = {}
    for preset in args.presets.split(","):
        done = subprocess.run(
            [sys.executable, "-m", "stage2_train", "plan", "--json", "--config", preset, "--search", "--sample-tokens", str(args.sample_tokens)],
            cwd=REPO, capture_output=True, text=True, check=True,
        )
        results[preset] = json.loads(done.stdout)
    return emit({"presets": results, "sample_tokens": args.sample_tokens}, args.json, started)



def rows(r: dict) -> list[Row]:
    out: list[Row] = []
    for preset, p in r["presets"].items():
        fits = ", ".join(f"{gpu}: {'yes' if ok else '**no**'}" for gpu, ok in p["fits"].items())
        mb = p["micro_batch"]
        out.append((f"{preset}: peak GPU memory of one training step ({mb['tokens']} tokens, {mb['block_rows']:,} block rows, checkpointing)",
                    f"{p['peak_gib']} GiB", "fits 80 GB", f"without checkpointing {p['traced_peak_gib']['without_checkpointing']['peak_with_untraced']} GiB; {fits}",
                    "yes" if p["fits"]["H100/A100 80 GB"] else "**no**"))
        for gpu, best in p.get("largest_micro_batch_tokens", {}).items():
            out.append((f"{preset}: largest sampler.micro_batch_tokens that fits {gpu}", fmt(best["micro_batch_tokens"]), "",
                        f"traced peak {best['traced_peak_gib']} GiB + untraced {round(p['untraced_gib']['ddp_buckets'] + p['untraced_gib']['cuda_context_nccl_fragmentation'], 1)} GiB", ""))
    return out


if __name__ == "__main__":
    sys.exit(main())
