"""The learning curve on the CPU default: online tau after 0, N, 4N and 16N optimizer steps of ONE
run, beside the n-gram drafter on the same held-out prompts, against CPU minutes.

    .venv/bin/python bench/learning.py [--config configs/default.yaml] [--n 25] [--json out.json]
    .venv/bin/python bench/learning.py --config configs/cpu-long.yaml --n 100    # the long preset

Needs the default store (`make train` builds it). The run trains 16N steps with a checkpoint every N
steps (its LR schedule spans the 16N); each point's drafter is read from its checkpoint. Online tau:
the target decodes each held-out prompt greedily alone, then speculatively with each drafter
(tokens per verifying forward, bonus included); every output must equal the greedy one token for
token (`exact`). Offline: `walk_tau` on the held-out store samples, evaluated here from each
checkpoint (the run itself does no eval, so its clock is training only). CPU minutes: the training
process's CPU time at that step (both cores count). Writes a PNG of tau against CPU minutes (`--png`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import emit  # noqa: E402


def train(config: str, run_dir: Path, store: str, n: int, extra: list[str]) -> None:
    command = [
        sys.executable, "-m", "stage2_train", "train", "--json", "--no-progress", "--config", config,
        f"run_dir={run_dir}", f"store.path={store}", f"train.max_steps={16 * n}", "train.epochs=1000",
        f"checkpoint.every_steps={n}", "checkpoint.keep_latest_k=20", "train.resume=never",
        "log.wandb=disabled", *extra, "eval.every_steps=0",  # evaluated here, so CPU minutes are training only
    ]
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"training failed:\n{done.stderr[-3000:]}")


def curve(cfg, run_dir: Path, n: int, prompts: int, max_new_tokens: int) -> dict:
    import numpy as np
    import torch

    from shared.target import cached_tokenizer, resolve_target, stop_token_ids
    from shared.target_parts import load_embed_and_head
    from stage2_train.data.split import heldout_mask
    from stage2_train.data.view import open_store
    from stage2_train.model.drafter import build_drafter
    from stage2_train.observe.metrics import read_log
    from stage2_train.serve.online_eval import heldout_prompts, load_online_target, online_eval
    from stage2_train.serve.speculative import DFlashProposer, NgramProposer
    from stage2_train.train.checkpoint.select import read_model_weights
    from stage2_train.train.evaluate import offline_eval

    target = resolve_target(cfg.target)
    reader = open_store(cfg.store.url(cfg.run_dir), target)
    heldout = np.flatnonzero(heldout_mask(reader.split_keys, cfg.eval.holdout_fraction, cfg.eval.split_seed))
    embed_VH, lm_head_VH = load_embed_and_head(target.target_dir)
    common = (cfg.model, target.arch, len(target.layer_ids), target.mask_token_id, embed_VH, lm_head_VH)
    steps = [0, n, 4 * n, 16 * n]
    drafters = {0: build_drafter(*common, seed=cfg.seed).eval()}
    if cfg.model.init_from:
        from stage2_train.serve.export import init_weights_for

        weights = {k: v.float() for k, v in init_weights_for(cfg.model.init_from, cfg.model, target).items()}
        drafters[0] = build_drafter(*common, weights=weights).eval()
    for step in steps[1:]:
        weights, _ = read_model_weights(run_dir / "checkpoints" / f"step_{step:06d}")
        drafters[step] = build_drafter(*common, weights=weights).eval()
    rows = {r["step"]: r for r in read_log(run_dir / "train_log.jsonl", "train")}
    evals = {
        step: offline_eval(drafter, reader, heldout[: cfg.eval.offline_max_samples].tolist(),
                           max_anchors_per_seq=None, seed=cfg.seed, gamma=cfg.loss.gamma)  # every anchor: walk_tau
        for step, drafter in drafters.items()
    }

    target_model = load_online_target(cfg.target, cfg.eval.online_dtype)
    tokenizer, _ = cached_tokenizer(str(target.target_dir))
    chosen = heldout_prompts(reader, heldout, prompts)
    proposers = {f"step_{s}": DFlashProposer(d, target.layer_ids, feature_dtype=torch.bfloat16, name=f"step_{s}")
                 for s, d in drafters.items()}
    proposers["ngram"] = NgramProposer(cfg.model.block_size - 1)
    started = time.perf_counter()
    online = online_eval(target_model, proposers, [p for _, p in chosen], max_new_tokens=max_new_tokens,
                         eos_token_ids=stop_token_ids(tokenizer, target_model))
    points = []
    for step in steps:
        tau = online["proposers"][f"step_{step}"]["tau"]
        walk = evals[step]["walk_tau"]
        points.append({
            "step": step,
            "cpu_min": round(rows[step]["cpu_s"] / 60, 2) if step else 0.0,
            "wall_min": round(rows[step]["elapsed_s"] / 60, 2) if step else 0.0,
            "online_tau": round(tau, 4),
            "exact": online["proposers"][f"step_{step}"]["exact"],
            "walk_tau": round(walk, 4),
            "walk_over_online": round(walk / tau, 4),
            "heldout_accuracy": round(evals[step]["accuracy"], 4),
            "heldout_acc_slot1": round(evals[step]["acc_per_pos"][0], 4),
        })
    return {
        "points": points,
        "ngram_tau": round(online["proposers"]["ngram"]["tau"], 4),
        "ngram_exact": online["proposers"]["ngram"]["exact"],
        "prompts": len(chosen),
        "max_new_tokens": max_new_tokens,
        "heldout_samples": int(len(heldout)),
        "online_eval_s": round(time.perf_counter() - started, 1),
        "greedy_wall_s": online["greedy_wall_s"],
    }


def plot(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    x = [p["cpu_min"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4))
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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--n", type=int, default=25, help="points at 0, N, 4N, 16N optimizer steps")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--run-dir", default=None, help="default: a fresh runs/learning-<preset>")
    parser.add_argument("--png", default=None, help="default: bench/results/learning-<preset>.png")
    parser.add_argument("--json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    t0 = time.perf_counter()
    import torch

    import stage1_extract  # noqa: F401 - each stage registers its config sections on import
    import stage2_train  # noqa: F401
    from shared.config import load_run_config

    torch.set_num_threads(1)
    preset = Path(args.config).stem
    base = load_run_config(args.config, args.overrides)
    store = base.store.url(base.run_dir)
    if not (Path(store) / "manifest.json").is_file():
        raise SystemExit(f"{store}: no store; run `make train` (or `make extract CONFIG={args.config}`) first")
    run_dir = Path(args.run_dir or REPO / "runs" / f"learning-{preset}")
    shutil.rmtree(run_dir, ignore_errors=True)
    train(args.config, run_dir, store, args.n, args.overrides)
    cfg = load_run_config(args.config, [*args.overrides, f"run_dir={run_dir}", f"store.path={store}"])
    result = {"config": args.config, "overrides": args.overrides, "n": args.n, **curve(cfg, run_dir, args.n, args.prompts, args.max_new_tokens)}
    png = Path(args.png or REPO / "bench" / "results" / f"learning-{preset}.png")
    plot(result, png, f"{preset}: online tau on {result['prompts']} held-out prompts x {args.max_new_tokens} tokens")
    result["png"] = str(png.relative_to(REPO)) if png.is_relative_to(REPO) else str(png)
    return emit(result, args.json, t0)


if __name__ == "__main__":
    sys.exit(main())
