"""What the held-out curve costs: the default preset trained as `make train` trains it (eval every
`eval.every_steps`, 16 anchors a sample during training, every anchor at the end), and the share of
the run's wall time the evals during training took.

    .venv/bin/python bench/eval_cost.py [--config configs/default.yaml] [--json out.json] [key=value ...]

Figures: the evals' share of training time (goal <= 5%), each eval's seconds, and what the same
curve would cost with every anchor scored (the final, dense eval's seconds times the number of
evals), which is why the preset samples anchors during training. Needs the default store
(`make train` builds it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import emit  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    t0 = time.perf_counter()
    import stage1_extract  # noqa: F401 - both stages' config sections
    import stage2_train  # noqa: F401
    from shared.config import load_run_config

    base = load_run_config(args.config, args.overrides)
    store = base.store.url(base.run_dir)
    if not (Path(store) / "manifest.json").is_file():
        raise SystemExit(f"{store}: no store; run `make train` (or `make extract CONFIG={args.config}`) first")
    with tempfile.TemporaryDirectory(prefix="eval-cost-") as tmp:
        cmd = [sys.executable, "-m", "stage2_train", "train", "--json", "--no-progress", "--config", args.config,
               f"run_dir={tmp}", f"store.path={store}", "train.resume=never", "log.wandb=disabled",
               "checkpoint.every_steps=0", *args.overrides]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        rows = [json.loads(line) for line in (Path(tmp) / "train_log.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    during, final = evals[:-1], evals[-1]
    elapsed = train[-1]["elapsed_s"]  # the run's clock at its last step, evals during training included
    during_s = sum(r["eval_s"] for r in during)
    cfg = base.eval
    result = {
        "config": args.config, "overrides": args.overrides, "steps": train[-1]["step"], "every_steps": cfg.every_steps,
        "offline_max_samples": cfg.offline_max_samples, "anchors_per_sample_during_training": cfg.offline_max_anchors_per_seq,
        "evals_during_training": len(during), "eval_s_each": [r["eval_s"] for r in during],
        "blocks_each": statistics.median(r["num_blocks"] for r in during) if during else None,
        "train_elapsed_s": elapsed, "eval_share": round(during_s / elapsed, 4) if elapsed else None,
        "median_step_s": statistics.median(r["step_s"] for r in train),
        "final_dense_eval_s": final["eval_s"], "final_dense_blocks": final["num_blocks"],
        "dense_curve_share_estimate": round(final["eval_s"] * len(during) / elapsed, 4) if elapsed else None,
        "heldout_points": [{k: r.get(k) for k in ("step", "accuracy", "accept_len", "accept_len_se", "walk_tau", "ce")} for r in evals],
    }
    return emit(result, args.json, t0)


if __name__ == "__main__":
    raise SystemExit(main())
