"""The learning curve on the CPU default: online tau after 0, N, 4N and 16N optimizer steps of ONE
run, beside the n-gram drafter on the same held-out prompts, against CPU minutes.

    .venv/bin/python bench/learning.py [--config configs/default.yaml] [--n 25] [--json out.json]
    .venv/bin/python bench/learning.py --config configs/cpu-long.yaml --n 100    # the long preset

Needs the default store (`make train` builds it). How each point is measured: docs/benchmarks.md, `learning`.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, Row, arguments, emit, existing_store, figure, fmt, run_training, yes  # noqa: E402


def curve(cfg, n: int, prompts: int, max_new_tokens: int) -> dict:
    """Each checkpoint's drafter (and the untrained one, or model.init_from's) by the one evaluation."""
    from shared.paths import RunPaths
    from stage2_train.observe.metrics import read_log
    from stage2_train.serve.evaluation import HeldoutSet, evaluate_drafters

    paths, heldout = RunPaths.of(cfg), HeldoutSet.open(cfg)
    steps = [0, n, 4 * n, 16 * n]
    later = {f"step_{s}": heldout.load(paths.step(s), cfg.model).drafter for s in steps[1:]}
    # step 0 of a projected run: its fitted projection (never trained), which every checkpoint carries
    start = heldout.load(cfg.model.init_from, cfg.model).drafter.float() if cfg.model.init_from else \
        heldout.untrained(cfg, trained=later[f"step_{steps[1]}"])
    drafters = {"step_0": start, **later}
    rows = {r["step"]: r for r in read_log(paths.log, "train")}
    chosen = heldout.prompts(prompts)
    report = evaluate_drafters(drafters, heldout, prompts=[p for _, p in chosen], cfg=cfg, baseline=f"step_{steps[-1]}",
                               max_new_tokens=max_new_tokens)
    online, proposers = report["online"], report["online"]["proposers"]
    points = []
    for step in steps:
        tau, offline = proposers[f"step_{step}"]["tau"], report["offline"][f"step_{step}"]
        points.append({
            "step": step, "cpu_min": round(rows[step]["cpu_s"] / 60, 2) if step else 0.0,
            "wall_min": round(rows[step]["elapsed_s"] / 60, 2) if step else 0.0, "online_tau": round(tau, 4),
            "exact": proposers[f"step_{step}"]["exact"], "walk_tau": round(offline["walk_tau"], 4),
            "walk_over_online": round(offline["walk_tau"] / tau, 4), "heldout_accuracy": round(offline["accuracy"], 4),
            "heldout_acc_slot1": round(offline["acc_per_pos"][0], 4),
        })
    return {
        "points": points,  # intervals over prompts; diffs paired against the last point
        "intervals": {"last": proposers[f"step_{steps[-1]}"]["interval"], "untrained_minus_last": proposers["step_0"]["interval"],
                      "ngram_minus_last": proposers["ngram"]["interval"]},
        "ngram_tau": round(proposers["ngram"]["tau"], 4), "ngram_exact": proposers["ngram"]["exact"],
        "prompts": len(chosen), "max_new_tokens": max_new_tokens, "heldout_samples": int(len(heldout.heldout)),
        "greedy_wall_s": online["greedy_wall_s"],
    }


def plot(result: dict, path: Path, title: str) -> None:
    points = result["points"]
    x = [p["cpu_min"] for p in points]
    with figure(path, (7, 4)) as ax:
        ax.plot(x, [p["online_tau"] for p in points], "o-", label="DFlash drafter, online tau")
        ax.plot(x, [p["walk_tau"] for p in points], "s--", alpha=0.7, label="DFlash drafter, offline walk_tau")
        for p, xi in zip(points, x):
            ax.annotate(f"{p['step']} steps", (xi, p["online_tau"]), textcoords="offset points", xytext=(4, 6), fontsize=8)
        ax.axhline(result["ngram_tau"], color="tab:red", ls=":", label=f"n-gram drafter ({result['ngram_tau']:.2f})")
        ax.axhline(points[0]["online_tau"], color="grey", ls=":", label=f"untrained ({points[0]['online_tau']:.2f})")
        ax.set_xlabel("training CPU minutes (2 cores)")
        ax.set_ylabel("tau (tokens per target forward)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, loc="upper left")


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--n", type=int, default=25, help="points at 0, N, 4N, 16N optimizer steps")
    parser.add_argument("--prompts", type=int, default=12, help="held-out prompts (the default store holds out 12)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--run-dir", default=None, help="default: a fresh runs/learning-<preset>")
    parser.add_argument("--png", default=None, help="default: bench/results/learning-<preset>.png")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    import torch

    from shared.config import load_run_config

    torch.set_num_threads(1)
    preset = Path(args.config).stem
    store = existing_store(args.config, args.overrides)
    run_dir = Path(args.run_dir or REPO / "runs" / f"learning-{preset}")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_training(run_dir, [f"store.path={store}", f"train.max_steps={16 * args.n}", "train.epochs=1000",
                           f"checkpoint.every_steps={args.n}", "checkpoint.keep_latest_k=20", *args.overrides,
                           "eval.every_steps=0"], args.config)  # evaluated here, so CPU minutes are training only
    cfg = load_run_config(args.config, [*args.overrides, f"run_dir={run_dir}", f"store.path={store}"])
    started = time.perf_counter()
    result = {"config": args.config, "overrides": args.overrides, "n": args.n, **curve(cfg, args.n, args.prompts, args.max_new_tokens)}
    result["eval_s"] = round(time.perf_counter() - started, 1)  # offline and online, the target loaded
    png = Path(args.png or REPO / "bench" / "results" / f"learning-{preset}.png")
    plot(result, png, f"{preset}: online tau on {result['prompts']} held-out prompts x {args.max_new_tokens} tokens")
    result["png"] = str(png.relative_to(REPO)) if png.is_relative_to(REPO) else str(png)
    return emit(result, args.json)


def rows(r: dict) -> list[Row]:
    out: list[Row] = []
    points = r["points"]
    first, last = points[0], points[-1]
    curve = " / ".join(f"{p['online_tau']:.3f}" for p in points)
    steps = " / ".join(str(p["step"]) for p in points)
    cpu = " / ".join(f"{p['cpu_min']:.1f}" for p in points)
    out.append((f"online tau after {steps} steps ({r['prompts']} held-out prompts x {r['max_new_tokens']} tokens)", curve, "",
                f"n-gram drafter {fmt(r['ngram_tau'])} on the same prompts; CPU minutes {cpu}", ""))
    iv = r.get("intervals")  # results from before intervals: the point estimates alone

    def gain(key: str) -> tuple[str, float | None]:  # trained - other, [95% paired interval over prompts]
        d = iv[key]
        low = -d["diff_hi"] if d.get("diff_hi") is not None else None
        return (f"{-d['diff']:+.3f} [{low:+.3f}, {-d['diff_lo']:+.3f}]" if low is not None else f"{-d['diff']:+.3f} (no interval)"), low

    untrained, low_u = gain("untrained_minus_last") if iv else (fmt(last["online_tau"] - first["online_tau"]), None)
    out.append(("trained - untrained online tau (last point)", untrained, ">= 0.3, interval above 0",
                f"untrained {fmt(first['online_tau'])}", yes(last["online_tau"] - first["online_tau"] >= 0.3 and (low_u is None or low_u > 0))))
    ngram, low_n = gain("ngram_minus_last") if iv else (fmt(last["online_tau"] - r["ngram_tau"]), None)
    out.append(("trained - n-gram online tau (last point)", ngram, "> 0, interval above 0", f"n-gram {fmt(r['ngram_tau'])}",
                yes(low_n > 0) if low_n is not None else yes(last["online_tau"] > r["ngram_tau"]) + (" (no interval)" if not iv else "")))
    worst = max(abs(p["walk_over_online"] - 1) for p in points)
    out.append(("offline walk_tau vs online tau, worst relative gap over the points", fmt(worst), "<= 0.15",
                " / ".join(f"{p['walk_tau']:.3f}" for p in points), yes(worst <= 0.15)))
    exact = all(p["exact"] for p in points) and r["ngram_exact"]
    out.append(("speculative output == target greedy, every point", str(exact), "True", "", yes(exact)))
    out.append(("plot", f"![learning curve]({r['png']})", "", "", ""))
    return out


if __name__ == "__main__":
    sys.exit(main())
