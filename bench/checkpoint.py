"""Checkpoint benchmark: how long a save stops a training loop, async vs sync, side by side.

    .venv/bin/python bench/checkpoint.py [--json out.json] [--steps 24] [--every 8] [--threads 1]

Its loop, figures and goals: docs/benchmarks.md, `checkpoint`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Row, arguments, emit, yes  # noqa: E402
from stage2_train.observe.config import LogConfig  # noqa: E402
from stage2_train.observe.metrics import MetricsSink, read_log  # noqa: E402
from stage2_train.train.checkpoint.format import optimizer_state  # noqa: E402
from stage2_train.train.checkpoint.saver import Checkpointer  # noqa: E402
from stage2_train.train.config import CheckpointConfig  # noqa: E402

GOAL_BLOCKED = 0.5
GOAL_DURING = 1.5


def build(width: int, num_blocks: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(num_blocks)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def run_mode(async_save: bool, args: argparse.Namespace, root: Path) -> dict:
    model, opt = build(args.width, args.blocks, seed=0)
    x_BW, y_BW = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    mode = "async" if async_save else "sync"
    sink = MetricsSink(LogConfig(wandb="disabled"), root / f"{mode}-log")  # the trainer's event log
    ckpt = Checkpointer(CheckpointConfig(every_steps=args.every, keep_latest_k=2, async_save=async_save), root / mode, sink)

    def state_fn() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer_state(opt), "rng": {"torch": torch.get_rng_state()},
                "trainer": {"step": step}}

    step_s, call_s, overlapped = [], [], []
    t_run = None
    for step in range(1 - args.warmup, args.steps + 1):
        if step == 1:
            t_run = time.perf_counter()
        busy = ckpt.busy
        t0 = time.perf_counter()
        loss = nn.functional.mse_loss(model(x_BW), y_BW)
        opt.zero_grad()
        loss.backward()
        opt.step()
        t1 = time.perf_counter()
        if step >= 1:
            ckpt.maybe_save(step, state_fn)
            step_s.append(t1 - t0)
            call_s.append(time.perf_counter() - t1)
            overlapped.append(busy)  # a background write ran during (part of) this step
    ckpt.finalize()  # also reports the last save's end event
    total_s = time.perf_counter() - t_run
    sink.close()
    ends = [e for e in read_log(sink.path, "event") if e["event"] == "checkpoint_end"]

    clean = [s for s, o in zip(step_s, overlapped) if not o]
    median_s = statistics.median(clean)
    during = [s / median_s for s, o in zip(step_s, overlapped) if o]
    blocked = [e["blocked_s"] / median_s for e in ends]
    return {
        "mode": mode, "num_saves": len(ends), "checkpoint_mb": round(ends[0]["bytes"] / 2**20, 1), "median_step_s": round(median_s, 4),
        "blocked_s": [round(e["blocked_s"], 4) for e in ends], "write_s": [round(e["write_s"], 4) for e in ends],
        "blocked_over_step_median": round(statistics.median(blocked), 3), "blocked_over_step_max": round(max(blocked), 3),
        "num_steps_during_save": len(during), "during_over_step_mean": round(statistics.mean(during), 3) if during else None,
        "during_over_step_max": round(max(during), 3) if during else None, "total_s": round(total_s, 2),
        "cost_per_save_s": round((total_s - len(step_s) * median_s) / max(1, len(ends)), 3),
    }


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the loop (the machine has 2 cores)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write checkpoints (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        results = [run_mode(True, args, Path(tmp)), run_mode(False, args, Path(tmp))]
    async_r = results[0]
    return emit({
        "params": sum(p.numel() for p in build(args.width, args.blocks, 0)[0].parameters()),
        "args": {k: str(v) for k, v in vars(args).items()}, "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "results": results,
        "goals": {"blocked_over_step": GOAL_BLOCKED, "during_over_step": GOAL_DURING},
        "async_goals_met": async_r["blocked_over_step_max"] <= GOAL_BLOCKED and (async_r["during_over_step_max"] or 0) <= GOAL_DURING,
    }, args.json)


def rows(r: dict) -> list[Row]:
    a, s = (next(x for x in r["results"] if x["mode"] == mode) for mode in ("async", "sync"))
    return [(f"loop blocked by a save / median step ({a['checkpoint_mb']} MB state)", f"{a['blocked_over_step_median']} (max {a['blocked_over_step_max']})",
             "<= 0.5", f"sync save: {s['blocked_over_step_median']} (max {s['blocked_over_step_max']})", yes(a["blocked_over_step_max"] <= 0.5)),
            ("step time during a save / median", f"{a['during_over_step_mean']} (max {a['during_over_step_max']})", "<= 1.5",
             "", yes(a["during_over_step_mean"] is not None and a["during_over_step_mean"] <= 1.5))]


if __name__ == "__main__":
    sys.exit(main())
