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

from bench.common import emit  # noqa: E402


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


if __name__ == "__main__":
    sys.exit(main())
