"""What a sliding window saves in the drafter's attention on a long context.

    .venv/bin/python bench/attention.py [--context 8192] [--anchors 512] [--json out.json]

One sample, the recipe's 512 anchors and block 16, full attention against sliding windows W = 4096,
2048, 512: the SDPA plan's masks and scores and flex's visible pairs (docs/benchmarks.md, `attention`).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Row, arguments, emit  # noqa: E402

HEADS = 32  # Qwen3-8B's drafter: the target's attention heads


def visible_pairs(anchors: list[int], block: int, window: int | None, causal: bool) -> int:
    """Exact count of (query, key) pairs the rule lets through, one sample."""
    total = 0
    for a in anchors:
        for i in range(block):
            ctx = a if window is None else max(0, min(a, window - 1 - i))
            own = (i + 1 if causal else block) if window is None else (min(i + 1, window) if causal else min(block, window))
            total += ctx + own
    return total


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--anchors", type=int, default=512)
    args = parser.parse_args()
    from stage2_train.model.attention import FULL, MaskKind, _plan_groups
    from testkit.drafter import make_packed_batch

    T, B = args.context, 16
    anchors = sorted(random.Random(0).sample(range(T - B), args.anchors))
    batch = make_packed_batch([[1] * T], [anchors], B, 8)
    kinds = {"full": (FULL, None, False), **{f"sliding W={w}": (MaskKind(w, True), w, True) for w in (4096, 2048, 512)}}
    rows = {}
    full_pairs = visible_pairs(anchors, B, None, False)
    for name, (kind, window, causal) in kinds.items():
        plan = _plan_groups(batch, B, 64, "sdpa", kind)
        mask_elems = sum(g.mask_QC.numel() for g in plan.groups)
        largest = max(plan.groups, key=lambda g: g.mask_QC.numel())
        pairs = visible_pairs(anchors, B, window, causal)
        rows[name] = {"sdpa_mask_mb": round(mask_elems / 2**20, 1), "largest_group_keys": int(largest.mask_QC.shape[1]),
                      "largest_group_scores_mb_fp32_32_heads": round(HEADS * largest.mask_QC.numel() * 4 / 2**20, 1),
                      "visible_pairs": pairs, "visible_pairs_vs_full": round(pairs / full_pairs, 4)}
    for name in rows:
        rows[name]["sdpa_mask_vs_full"] = round(rows[name]["sdpa_mask_mb"] / rows["full"]["sdpa_mask_mb"], 3)
    return emit({"context": T, "anchors": args.anchors, "block_size": B, "chunk_blocks": 64, "kinds": rows}, args.json)


def rows(r: dict) -> list[Row]:
    full = r["kinds"]["full"]
    return [(f"{kind} at {r['context']:,} context, {r['anchors']} anchors: visible pairs (flex's work) / SDPA masks / largest group's fp32 scores",
             f"{k['visible_pairs_vs_full']}x / {k['sdpa_mask_mb']} MB / {k['largest_group_scores_mb_fp32_32_heads']:,} MB", "falls with W",
             f"full: 1.0 / {full['sdpa_mask_mb']} MB / {full['largest_group_scores_mb_fp32_32_heads']:,} MB", "")
            for kind, k in r["kinds"].items() if kind != "full"]


if __name__ == "__main__":
    raise SystemExit(main())
