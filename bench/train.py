"""Training benchmark: CPU throughput, the step-time split, and 1 vs 2 processes (< 3 min).

    .venv/bin/python bench/train.py [--json out.json]                      # a tiny store it builds
    .venv/bin/python bench/train.py --store runs/default/store --anchors 4  # the default SmolLM2 store

Its figures and goals: docs/benchmarks.md, `train`.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import STARTED, Row, arguments, emit, fmt, run_training, steady, step_figures, yes  # noqa: E402


def tiny_store(root: Path) -> list[str]:
    """A 6-layer, 64-wide random Llama with SmolLM2's tokenizer and a 60-chat store of it (stage 1);
    returns the overrides that train on it (the stage-1 settings that made it, so it is fresh)."""
    import torch

    from shared.config import load_run_config
    from shared.paths import RunPaths
    from stage1_extract import commands as stage1
    from testkit.data import chat_rows, stage1_overrides, train_overrides_for, write_jsonl
    from testkit.target import build_tiny_target

    torch.set_num_threads(1)
    target = build_tiny_target(root / "target")
    data = write_jsonl(root / "chat.jsonl", chat_rows(60))
    stage1.cmd_extract(load_run_config("configs/default.yaml", stage1_overrides(target, data, root / "run")), progress=False)
    return train_overrides_for(target, Path(RunPaths(root / "run").store), root, {})


def throughput(rows: list[dict], block_size: int) -> dict:
    figures, steady_rows = step_figures(rows), steady(rows)
    step_s = statistics.mean(r["step_s"] for r in steady_rows)
    return {**figures, "scored_rows_per_s": round(figures["blocks_per_s"] * (block_size - 1), 1),
            "tokens_per_step": round(statistics.mean(r["tokens"] for r in steady_rows), 1),
            "blocks_per_step": round(statistics.mean(r["blocks"] for r in steady_rows), 1), "step_s": round(step_s, 4),
            "split_share": {p: round(s / step_s, 3) for p, s in figures["split_s"].items()}, **epoch_boundaries(rows)}


def epoch_boundaries(rows: list[dict]) -> dict:
    """The wall time between consecutive steps at each epoch boundary (the first step of epochs 1,
    2, ...) against the median step-to-step time: planning the next epoch must not show here."""
    gaps = [(b["elapsed_s"] - a["elapsed_s"], b) for a, b in zip(rows, rows[1:])]
    median = statistics.median(g for g, _ in gaps)
    at_boundary = [g for g, row in gaps if row["step_in_epoch"] == 0]
    return {"epochs": rows[-1]["epoch"] + 1, "median_step_gap_s": round(median, 4), "boundary_step_gaps_s": [round(g, 4) for g in at_boundary],
            "boundary_over_median_max": round(max(at_boundary) / median, 3) if at_boundary else None}


def loader_rate(config: str, overrides: list[str], trainer_step_s: float, seconds: float = 10.0) -> dict:
    """Micro-batches per second the PrefetchLoader delivers alone (2 threads, as in training),
    over the rate the trainer consumed them: the loader must keep ahead by a wide margin."""
    from shared.config import load_run_config
    from stage2_train.data.run_data import open_run_data

    data = open_run_data(load_run_config(config, overrides), num_threads=2, prefetch=4)
    count, started = 0, time.perf_counter()
    with data.loader as loader:
        while time.perf_counter() - started < seconds:
            for _ in loader:
                count += 1
                if time.perf_counter() - started >= seconds:
                    break
    rate = count / (time.perf_counter() - started)
    return {"batches_per_s": round(rate, 2), "trainer_batches_per_s": round(1 / trainer_step_s, 2),
            "loader_over_trainer": round(rate * trainer_step_s, 1)}


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--store", help="an existing store (default: build a tiny one)")
    parser.add_argument("--config", default="configs/default.yaml", help="preset for --store runs")
    parser.add_argument("--steps", type=int, default=30, help="several tiny epochs (~6 steps each)")
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--anchors", type=int, default=8, help="sampler.max_anchors_per_seq")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-ddp", action="store_true")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench_train_"))
    base = ["log.wandb=disabled", "eval.holdout_fraction=0.05", f"sampler.max_anchors_per_seq={args.anchors}",
            f"model.block_size={args.block_size}", f"loss.gamma={ {16: 7.0, 10: 5.0, 8: 4.0}.get(args.block_size, 7.0) }",
            "model.num_layers=1", f"train.cpu_threads={args.threads}"]
    if args.store:
        base += [f"store.path={args.store}"]
        store_desc = args.store
    else:
        base = [*tiny_store(root), *base]
        store_desc = "tiny (6 layers x 64 wide, vocab 49152, 60 chats)"
    results: dict = {"store": store_desc, "threads": args.threads, "build_store_s": round(time.perf_counter() - STARTED, 1)}

    def train(name: str, overrides: list[str], nproc: int = 1):
        return run_training(root / name, [*base, *overrides], args.config, nproc, env={"OMP_NUM_THREADS": str(args.threads)})

    budget = f"sampler.micro_batch_tokens={args.token_budget}"
    run = train("throughput", [budget, f"train.max_steps={args.steps}"])
    results["throughput"] = {"token_budget": args.token_budget, "wall_s": round(run.seconds, 1), **throughput(run.rows, args.block_size)}
    results["loader"] = loader_rate(args.config, [*base, budget, f"run_dir={run.paths.run_dir}"], results["throughput"]["step_s"])

    if not args.skip_ddp:
        small = [f"sampler.micro_batch_tokens={args.token_budget // 2}", "train.max_steps=4"]
        one_run, two_run = train("one", [*small, "train.grad_accum=2"]), train("two", [*small, "train.grad_accum=1"], nproc=2)
        one, two = one_run.rows, two_run.rows
        diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(one, two)]
        results["ddp"] = {
            "steps": len(diffs), "losses_1proc": [r["loss"] for r in one], "losses_2proc": [r["loss"] for r in two],
            "max_abs_loss_diff": max(diffs), "max_rel_loss_diff": max(d / abs(a["loss"]) for d, a in zip(diffs, one)),
            "max_rel_grad_norm_diff": max(abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] for a, b in zip(one, two)),
            "wall_s_1proc": round(one_run.seconds, 1), "wall_s_2proc": round(two_run.seconds, 1),
        }
    return emit(results, args.json)


def rows(r: dict) -> list[Row]:
    out: list[Row] = []
    t = r["throughput"]
    out.append(("training tokens/s on CPU (tiny store)", fmt(t["tok_per_s"]), "", f"{t['blocks_per_s']} blocks/s", ""))
    split = ", ".join(f"{k.replace('_s', '')} {v:.0%}" for k, v in t["split_share"].items())
    out.append(("step time split", split, "", f"step {t['step_s']} s", ""))
    out.append(("data-wait fraction during training", fmt(t["data_wait_frac"]), "< 0.02", "", yes(t["data_wait_frac"] < 0.02)))
    if t.get("boundary_over_median_max") is not None:
        out.append((f"longest step-to-step gap at an epoch boundary / median step ({t['epochs']} epochs)",
                    fmt(t["boundary_over_median_max"]), "<= 1.2",
                    f"median {t['median_step_gap_s']} s; boundaries {t['boundary_step_gaps_s']}",
                    yes(t["boundary_over_median_max"] <= 1.2)))
    if "loader" in r:
        out.append(("loader delivery rate / trainer consumption", fmt(r["loader"]["loader_over_trainer"]), ">= 5",
                    f"trainer {r['loader']['trainer_batches_per_s']} batches/s", yes(r["loader"]["loader_over_trainer"] >= 5)))
    if "ddp" in r:
        d = r["ddp"]
        out.append(("2 processes vs 1, same global batch: max rel. loss diff", fmt(d["max_rel_loss_diff"]), "float tolerance",
                    f"{d['steps']} steps", yes(d["max_rel_loss_diff"] < 1e-5)))
    return out


if __name__ == "__main__":
    sys.exit(main())
