"""The sampler at the users' scale: 902,087 samples, 8 ranks, 49,152-token micro-batches x 4.

    .venv/bin/python bench/sampler.py [--json out.json] [--samples 902087]

Its figures and goals: docs/benchmarks.md, `sampler`.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Row, arguments, calls_per_s, emit, fmt, yes  # noqa: E402
from stage2_train.data.config import SamplerConfig  # noqa: E402
from stage2_train.data.sampler import LengthMixedSampler  # noqa: E402
from stage2_train.data.split import heldout_mask  # noqa: E402


def synthetic_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(1500), 0.75, n), 64, 8192).astype(np.int64)


def hand_out(sampler: LengthMixedSampler, epochs: int) -> dict[str, float]:
    """Consume this rank's micro-batches for `epochs` epochs as a loader would; the longest wait for
    the next one (an epoch boundary must not wait for planning: the next plan is built ahead)."""
    stream = sampler.upcoming()
    waits = []
    start_epoch = sampler.epoch
    while sampler.epoch < start_epoch + epochs:
        t0 = time.perf_counter()
        ref = next(stream)
        waits.append(time.perf_counter() - t0)
        sampler.mark_consumed(ref)
        if ref.step_in_epoch == ref.steps_in_epoch - 1 and ref.micro_step == sampler.grad_accum - 1:
            time.sleep(2.0)  # an epoch takes hours on GPUs: the look-ahead plan has time to finish
    return {"micro_batches": len(waits), "max_wait_s": max(waits)}


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--samples", type=int, default=902_087)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=6, help="the schedule's epochs (start-up figures)")
    args = parser.parse_args()
    lengths = synthetic_lengths(args.samples)
    cfg = SamplerConfig(micro_batch_tokens=49_152, max_anchors_per_seq=512)
    grad_accum = 4
    results: dict = {"samples": args.samples, "tokens": int(lengths.sum()), "length_median": float(np.median(lengths)),
                     "ranks": args.ranks, "micro_batch_tokens": cfg.micro_batch_tokens, "grad_accum": grad_accum}

    # Start-up: split, sampler (plans epoch 0), schedule length, first micro-batch.
    wall0, cpu0 = time.perf_counter(), time.process_time()
    keys = np.arange(args.samples, dtype=np.int64)
    held = heldout_mask(keys, 0.01, 0)
    train_lengths = lengths[~held]
    sampler = LengthMixedSampler(cfg, train_lengths, seed=0, rank=0, world_size=args.ranks, grad_accum=grad_accum)
    total = sampler.estimated_total_steps(args.epochs)
    first = next(sampler.upcoming())
    results["startup"] = {"wall_s": round(time.perf_counter() - wall0, 3), "cpu_s": round(time.process_time() - cpu0, 3),
                          "estimated_total_steps": total, "steps_epoch0": first.steps_in_epoch, "heldout_samples": int(held.sum())}

    # CPU seconds per epoch plan, and the baseline float-keyed search of the old planner.
    # `upcoming()` above started planning epoch 1 in the background: let it finish, and count this
    # thread's CPU only (process time counted both builds at once and read 2x).
    for thread in list(sampler._planning.values()):
        thread.join()
    cpu0 = time.thread_time()
    plan = sampler._build_plan(1)
    results["plan_cpu_s"] = round(time.thread_time() - cpu0, 3)
    results["steps_epoch1"] = len(plan)
    cum = np.cumsum(train_lengths)
    key = int(cum[len(cum) // 2])
    per_s = calls_per_s({"float_key": lambda: np.searchsorted(cum, key + 0.5), "int_key": lambda: np.searchsorted(cum, key)}, min_s=0.05)
    results["searchsorted_us"] = {"float_key": round(1e6 / per_s["float_key"], 1), "int_key": round(1e6 / per_s["int_key"], 2)}
    results["baseline_plan_every_epoch_up_front_cpu_s"] = round(results["plan_cpu_s"] * args.epochs, 2)

    # Plan builds per epoch over 4 epochs handed out, and peak RSS after 1, 2, 4 epochs.
    sampler = LengthMixedSampler(cfg, train_lengths, seed=0, rank=0, world_size=args.ranks, grad_accum=grad_accum)
    builds_before = sampler.plan_builds
    rss, waits = {}, []
    for upto in (1, 2, 4):
        out = hand_out(sampler, upto - sampler.epoch)
        waits.append(out["max_wait_s"])
        rss[upto] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # MiB
    for thread in list(sampler._planning.values()):
        thread.join()
    builds = sampler.plan_builds - builds_before + 1  # + epoch 0's, built in the constructor
    results["plan_builds"] = {"epochs_handed_out": 4, "builds": builds,
                              "builds_per_epoch": round(builds / 5, 2),  # epochs 0..4 (4 = look-ahead)
                              "plans_in_memory": len(sampler._plans), "max_wait_for_a_micro_batch_s": round(max(waits), 4)}
    results["peak_rss_mib_after_epochs"] = rss
    return emit(results, args.json)


def rows(r: dict) -> list[Row]:
    st, b = r["startup"], r["plan_builds"]
    return [
        (f"plan builds per epoch per rank ({r['samples']:,} samples, {r['ranks']} ranks, {b['epochs_handed_out']} epochs)",
         fmt(b["builds_per_epoch"]), "1", f"plans held at once: {b['plans_in_memory']}", yes(b["builds_per_epoch"] <= 1.0)),
        ("CPU seconds per epoch plan", fmt(r["plan_cpu_s"]), "<= 1.0",
         f"float-keyed search {r['searchsorted_us']['float_key']} us vs int key {r['searchsorted_us']['int_key']} us per call",
         yes(r["plan_cpu_s"] <= 1.0)),
        ("sampler start-up before the first micro-batch (split, plan, schedule length)", f"{st['wall_s']} s", "<= 5 s",
         f"planning every epoch up front: {r['baseline_plan_every_epoch_up_front_cpu_s']} CPU s", yes(st["wall_s"] <= 5)),
        ("longest wait for a micro-batch over 4 epochs (the next plan is built ahead)", f"{b['max_wait_for_a_micro_batch_s']} s", "", "", ""),
        ("peak RSS MiB after 1 / 2 / 4 epochs", " / ".join(str(v) for v in r["peak_rss_mib_after_epochs"].values()), "flat", "", ""),
    ]


if __name__ == "__main__":
    sys.exit(main())
