"""What the held-out curve costs: the default preset trained as `make train` trains it (eval every
`eval.every_steps`, 16 anchors a sample during training, every anchor at the end), and the share of
the run's wall time the evals during training took.

    .venv/bin/python bench/eval_cost.py [--config configs/default.yaml] [--json out.json] [key=value ...]

Needs the default store (`make train` builds it). Its figures and goal: docs/benchmarks.md, `eval_cost`.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Row, arguments, emit, existing_store, run_training, yes  # noqa: E402


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    store = existing_store(args.config, args.overrides)
    from shared.config import load_run_config
    from stage2_train.observe.metrics import read_log

    with tempfile.TemporaryDirectory(prefix="eval-cost-") as tmp:
        done = run_training(Path(tmp) / "run", [f"store.path={store}", "checkpoint.every_steps=0", *args.overrides], args.config)
        rows = read_log(done.paths.log)
    train, evals = ([r for r in rows if r["kind"] == kind] for kind in ("train", "eval"))
    during, final = evals[:-1], evals[-1]
    elapsed = train[-1]["elapsed_s"]  # the run's clock at its last step, evals during training included
    during_s = sum(r["eval_s"] for r in during)
    cfg = load_run_config(args.config, args.overrides).eval
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
    return emit(result, args.json)


def rows(r: dict) -> list[Row]:
    return [(f"held-out evals' share of training time ({r['evals_during_training']} evals of {r['offline_max_samples']} samples x "
             f"{r['anchors_per_sample_during_training']} anchors, every {r['every_steps']} of {r['steps']} steps)",
             f"{r['eval_share']:.1%}", "<= 5%", f"each {', '.join(str(x) for x in r['eval_s_each'])} s; median step {r['median_step_s']:.3g} s",
             yes(r["eval_share"] <= 0.05)),
            ("the same curve with every anchor scored (final eval's cost x evals)", f"{r['dense_curve_share_estimate']:.1%}", "",
             f"final dense eval {r['final_dense_eval_s']} s, {r['final_dense_blocks']} blocks", "")]


if __name__ == "__main__":
    raise SystemExit(main())
