"""Batching benchmark: our length-mixed packer vs HF group_by_length vs six homogeneous length buckets.

    .venv/bin/python bench/data.py [--json out.json] [--lengths-npy lengths.npy] [--budget 16384]

Its figures and goals: docs/benchmarks.md, `data`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Row, arguments, emit, fmt, yes  # noqa: E402
from stage2_train.data.config import SamplerConfig  # noqa: E402
from stage2_train.data.sampler import LengthMixedSampler  # noqa: E402

HIST_EDGES = np.array([0, 128, 256, 512, 1024, 2048, np.inf])  # token-length bins for mixing
BUCKET_EDGES = np.array([0, 256, 512, 1024, 1536, 2048, np.inf])  # the six homogeneous buckets
BUCKET_MAX_SAMPLES = 64  # the failed run's max_batch_size

# A plan: steps x micro-batches (world_size * grad_accum, rank-major) x sample indices.
Plan = list[list[list[int]]]


def ours(lengths: np.ndarray, budget: int, world_size: int, grad_accum: int, seed: int) -> Plan:
    # Tokens only, as the bucketed and group-by-length packers compared here: the block budget (what
    # the memory plan sizes, `sampler.micro_batch_blocks`) needs loss masks these lengths do not have.
    cfg = SamplerConfig(micro_batch_tokens=budget, micro_batch_blocks=budget)
    return LengthMixedSampler(cfg, lengths, seed=seed, world_size=world_size, grad_accum=grad_accum).plan_epoch(0)


def group_steps(batches: list[list[int]], per_step: int) -> Plan:
    """Consecutive micro-batches form a step; the last step is padded with empty micro-batches."""
    steps = [batches[i : i + per_step] for i in range(0, len(batches), per_step)]
    steps[-1] = steps[-1] + [[] for _ in range(per_step - len(steps[-1]))]
    return steps


def hf_group_by_length(lengths: np.ndarray, budget: int, world_size: int, grad_accum: int, seed: int) -> Plan:
    """transformers' LengthGroupedSampler: shuffled megabatches of 50 batches, each sorted by length,
    cut into fixed-size batches padded to their longest sample; batch size fits the longest sample."""
    batch_size = max(1, budget // int(lengths.max()))
    order = np.random.default_rng(seed).permutation(len(lengths))
    mega = 50 * batch_size
    batches = []
    for start in range(0, len(order), mega):
        chunk = order[start : start + mega]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        batches += [chunk[i : i + batch_size].tolist() for i in range(0, len(chunk), batch_size)]
    return group_steps(batches, world_size * grad_accum)


def six_buckets(lengths: np.ndarray, budget: int, world_size: int, grad_accum: int, seed: int) -> Plan:
    """Six fixed length buckets; padded token-budget batches inside each; batch order shuffled."""
    rng = np.random.default_rng(seed)
    bucket_of = np.digitize(lengths, BUCKET_EDGES[1:-1])
    batches = []
    for b in range(len(BUCKET_EDGES) - 1):
        members = rng.permutation(np.flatnonzero(bucket_of == b))
        batch: list[int] = []
        longest = 0
        for i in members.tolist():
            new_longest = max(longest, int(lengths[i]))
            if batch and (new_longest * (len(batch) + 1) > budget or len(batch) == BUCKET_MAX_SAMPLES):
                batches.append(batch)
                batch, new_longest = [], int(lengths[i])
            batch.append(i)
            longest = new_longest
        if batch:
            batches.append(batch)
    batches = [batches[i] for i in rng.permutation(len(batches))]
    return group_steps(batches, world_size * grad_accum)


METHODS = {"ours": ours, "hf_group_by_length": hf_group_by_length, "six_buckets": six_buckets}


def token_histogram(lengths: np.ndarray) -> np.ndarray:
    hist, _ = np.histogram(lengths, bins=HIST_EDGES, weights=lengths)
    return hist / hist.sum()


def evaluate(plan: Plan, lengths: np.ndarray, budget: int, world_size: int) -> dict[str, float]:
    micro_batches = sum(len(step) for step in plan)
    whole = token_histogram(lengths)
    tv, imbalance = [], []
    for step in plan:
        step_lengths = np.concatenate([lengths[b] for b in step if b])
        tv.append(0.5 * np.abs(token_histogram(step_lengths) - whole).sum())
        per_rank = len(step) // world_size
        rank_tokens = [sum(int(lengths[b].sum()) for b in step[r * per_rank : (r + 1) * per_rank]) for r in range(world_size)]
        imbalance.append(max(rank_tokens) / np.mean(rank_tokens))
    return {"steps": len(plan), "efficiency": float(lengths.sum() / (micro_batches * budget)),
            "mixing_tv_median": float(np.median(tv)), "mixing_tv_worst": float(np.max(tv)),
            "imbalance_median": float(np.median(imbalance)), "imbalance_worst": float(np.max(imbalance))}


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--lengths-npy", type=Path, help="token count per sample (1-D .npy)")
    parser.add_argument("--num-samples", type=int, default=20_000)
    parser.add_argument("--budget", type=int, default=SamplerConfig().micro_batch_tokens)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.lengths_npy:
        lengths = np.load(args.lengths_npy).astype(np.int64)
        source = str(args.lengths_npy)
    else:
        rng = np.random.default_rng(args.seed)
        lengths = np.clip(rng.lognormal(6.3, 0.8, args.num_samples), 64, 3072).astype(np.int64)
        source = f"lognormal(6.3, 0.8) clipped to [64, 3072], n={args.num_samples}, seed={args.seed}"

    # (label, world_size, grad_accum): one rank (step = micro-batch), and the failed run's 8 x 4.
    setups = [("1x1", 1, 1), ("2x1", 2, 1), ("8x1", 8, 1), ("8x4", 8, 4)]
    results: dict[str, dict] = {}
    for label, world_size, grad_accum in setups:
        for name, method in METHODS.items():
            start = time.perf_counter()
            plan = method(lengths, args.budget, world_size, grad_accum, args.seed)
            row = evaluate(plan, lengths, args.budget, world_size)
            row["plan_s"] = time.perf_counter() - start
            results[f"{name}@{label}"] = row

    big = np.resize(lengths, 800_000)  # planning cost at the recipe's data-set size
    start = time.perf_counter()
    ours(big, args.budget, 8, 4, args.seed)
    plan_800k_s = time.perf_counter() - start

    return emit({"lengths": source, "num_samples": int(len(lengths)), "token_budget": args.budget,
                 "hist_edges": [float(e) for e in HIST_EDGES], "bucket_edges": [float(e) for e in BUCKET_EDGES],
                 "results": results, "plan_800k_s": plan_800k_s}, args.json)


def rows(r: dict) -> list[Row]:
    res = r["results"]
    ours, buckets, hf, one = res["ours@8x4"], res["six_buckets@8x4"], res["hf_group_by_length@8x4"], res["ours@1x1"]
    return [
        (f"packing efficiency, budget {r['token_budget']} (8 ranks x 4 accum)", fmt(ours["efficiency"]), ">= 0.98",
         f"six buckets {fmt(buckets['efficiency'])}, HF group_by_length {fmt(hf['efficiency'])}", yes(ours["efficiency"] >= 0.98)),
        ("packing efficiency, 1 rank", fmt(one["efficiency"]), ">= 0.98", f"six buckets {fmt(res['six_buckets@1x1']['efficiency'])}",
         yes(one["efficiency"] >= 0.98)),
        ("length mixing: TV distance per optimizer step, median / worst (8x4)",
         f"{fmt(ours['mixing_tv_median'])} / {fmt(ours['mixing_tv_worst'])}", "lower is better",
         f"six buckets {fmt(buckets['mixing_tv_median'])} / {fmt(buckets['mixing_tv_worst'])}", ""),
        *((f"token imbalance max/mean, {ranks} ranks (worst step)", fmt(res[f"ours@{ranks}x1"]["imbalance_worst"], 4), "<= 1.05",
           f"six buckets {fmt(res[f'six_buckets@{ranks}x1']['imbalance_worst'])}", yes(res[f"ours@{ranks}x1"]["imbalance_worst"] <= 1.05))
          for ranks in (2, 8)),
    ]


if __name__ == "__main__":
    sys.exit(main())
