"""The 8B presets' worst training step (the densest micro-batch their token and block budgets allow),
traced with fake tensors, what each removed cost would add back, and the largest budgets that fit an
80 GB and a 141 GB GPU (`python -m stage2_train plan --search` for each preset).

    .venv/bin/python bench/plan.py [--json out.json] [--presets qwen3-8b,llama-3.1-8b]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, Row, arguments, emit, fmt, yes  # noqa: E402


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--presets", default="qwen3-8b,llama-3.1-8b")
    args = parser.parse_args()
    command = [sys.executable, "-m", "stage2_train", "plan", "--json", "--search", "--config"]
    results = {p: json.loads(subprocess.run([*command, p], cwd=REPO, capture_output=True, text=True, check=True).stdout)
               for p in args.presets.split(",")}
    return emit({"presets": results}, args.json)


def rows(r: dict) -> list[Row]:
    out: list[Row] = []
    for preset, p in r["presets"].items():
        fits = ", ".join(f"{gpu}: {'yes' if ok else '**no**'}" for gpu, ok in p["fits"].items())
        mb, budgets = p["micro_batch"], p["budgets"]
        out.append((f"{preset}: worst-case GPU memory of a training step (densest micro-batch of sampler.micro_batch_tokens="
                    f"{budgets['micro_batch_tokens']}, micro_batch_blocks={budgets['micro_batch_blocks']}: {mb['tokens']:,} tokens, "
                    f"{mb['block_rows']:,} block rows; grad_accum {budgets['grad_accum']}, checkpointing; DDP buckets and a 4 GiB reserve included)",
                    f"{p['peak_gib']} GiB", "<= 76 GiB", f"without checkpointing {p['traced_peak_gib']['without_checkpointing']['peak_with_untraced']} GiB; {fits}",
                    yes(p["peak_gib"] <= 76.0)))
        removed = "; ".join(f"{name} +{cost['would_add']} GiB" for name, cost in p.get("removed_costs_gib", {}).items())
        if removed:
            out.append((f"{preset}: costs the step no longer pays, each traced by putting it back", removed, "", "", ""))
        untraced = round(p["untraced_gib"]["ddp_buckets"] + p["untraced_gib"]["cuda_context_nccl_fragmentation"], 1)
        for gpu, best in p.get("largest_budgets", {}).items():
            out.append((f"{preset}: largest budgets that fit {gpu} (sampler.micro_batch_tokens / micro_batch_blocks)",
                        f"{fmt(best['micro_batch_tokens'])} / {fmt(best['micro_batch_blocks'])}", "",
                        f"traced peak {best['traced_peak_gib']} GiB + untraced {untraced} GiB <= {p['gpus_gib'][gpu]} GiB", ""))
    return out


if __name__ == "__main__":
    sys.exit(main())
