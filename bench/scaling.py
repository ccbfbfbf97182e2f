"""Scaling study: extraction and training throughput and peak memory as the data grows (1x, 4x, 16x
samples) and as sequences grow (fixed total tokens, longer samples). < 5 min on 2 CPU cores.

    .venv/bin/python bench/scaling.py [--json out.json] [--base-samples 32] [--lengths 128,512,2048]

Every point is a real CLI run in its own process (`python -m stage1_extract extract`, then
`python -m stage2_train train` on that store), so its peak memory is its own (max RSS from wait4).
The target is a 6-layer, 64-wide random Llama with SmolLM2's tokenizer (49K vocab): on CPU the
target forward is then cheap and what grows with the data is the pipeline itself: tokenizing,
the LM head and top-k, the writer, shard bookkeeping, the reader and the sampler.

Reported per point:
  extract: rows, tokens, shards, wall, prepare (read + tokenize every row; includes importing
           transformers, ~4 s here), extraction loop, forward, manifest merge, tokens/s of the
           loop, peak RSS; then the same command again (all shards done: token cache + checks)
  train:   startup (process start -> first step: imports, open store, split, plan, model), steady
           tokens/s and blocks/s (median over steps after the first two), peak RSS
and, per sweep, each cost relative to linear in the data size (1.0 = linear; what the notes explain).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import emit  # noqa: E402

WORDS = (
    "the of and to in is was for on that with as by at from his her an which you were are this be "
    "had not but what all when can there one so out if about up them some time could would into "
    "make like him has two more very after words long just where most know get through back much "
    "before also good new write our used me man too any day same right look think such here take "
    "why things help put years different away again off went old number great tell men say small"
).split()


def write_rows(path: Path, lengths: list[int], seed: int) -> Path:
    """Chats whose rendered length is about `length` tokens each (one word ~ one token here)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i, length in enumerate(lengths):
            question = " ".join(rng.choice(WORDS) for _ in range(12))
            answer = " ".join(rng.choice(WORDS) for _ in range(max(8, length - 40)))
            row = {"messages": [{"role": "user", "content": f"{i}: {question}"}, {"role": "assistant", "content": answer}]}
            f.write(json.dumps(row) + "\n")
    return path


def mixed_lengths(count: int, seed: int) -> list[int]:
    """Lognormal lengths between 64 and 640 tokens (median ~200), like chat data, shorter."""
    rng = random.Random(seed)
    return [int(min(640, max(64, rng.lognormvariate(5.3, 0.6)))) for _ in range(count)]


def build_target(root: Path) -> Path:
    from shared.tiny_target import build_tiny_target

    return build_tiny_target(root / "target", max_positions=16384)


def run_measured(cmd: list[str], log: Path) -> tuple[float, float, int, str]:
    """(launch unix time, wall seconds, peak RSS in MiB, stdout) of one child process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    launched, started = time.time(), time.perf_counter()
    out_path = log.with_suffix(".out")
    with out_path.open("w") as out, log.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])}... failed; its output ({log}):\n{log.read_text()[-3000:]}")
    return launched, wall, usage.ru_maxrss // 1024, out_path.read_text()  # Linux reports KiB


def extract_point(root: Path, name: str, target: Path, lengths: list[int], max_length: int, seed: int) -> dict:
    data = write_rows(root / f"{name}.jsonl", lengths, seed)
    run_dir = root / name
    cmd = [
        sys.executable, "-m", "stage1_extract", "extract", "--json", "--no-progress",
        "--config", "configs/default.yaml", f"run_dir={run_dir}", f"target.path={target}", "target.dtype=fp32",
        "target.num_feature_layers=3", f"data.path={data}", "data.regenerate=false", f"data.max_length={max_length}",
        "extract.top_k=8", f"extract.batch_tokens={max(4096, max_length)}", "store.shard_mb=1", "extract.window_shards=1",
    ]
    _, wall, rss, stdout = run_measured(cmd, root / f"{name}.extract.log")
    summary = json.loads(stdout)
    # The same command again: every shard is done, so this is the fixed cost of any later command
    # (status, resume, reprocess): read the token cache, hash the settings, check each shard.
    _, rerun_wall, _, rerun_out = run_measured(cmd, root / f"{name}.rerun.log")
    rerun = json.loads(rerun_out)
    return {
        "rows": len(lengths),
        "tokens": summary["num_tokens"],
        "shards": summary["shards_total"],
        "wall_s": round(wall, 2),
        "prepare_s": summary["prepare_seconds"],
        "loop_s": summary["seconds"],
        "forward_s": summary["forward_seconds"],
        "merge_s": summary.get("merge_seconds"),
        "rerun_s": round(rerun_wall, 2),
        "rerun_prepare_s": rerun["prepare_seconds"],
        "loop_tok_per_s": summary["tok_per_s"],
        "peak_rss_mib": rss,
        "store": str(run_dir / "store"),
    }


def train_point(root: Path, name: str, target: Path, store: str, steps: int, budget: int, anchors: int) -> dict:
    from stage2_train.observe.metrics import read_log

    run_dir = root / f"{name}.train"
    cmd = [
        sys.executable, "-m", "stage2_train", "train", "--json", "--no-progress", "--config", "configs/default.yaml",
        f"run_dir={run_dir}", f"store.path={store}", f"target.path={target}", "target.num_feature_layers=3",
        "target.dtype=fp32", "extract.top_k=8", "log.wandb=disabled", "train.resume=never", "train.cpu_threads=1",
        f"train.max_steps={steps}", f"sampler.micro_batch_tokens={budget}", f"sampler.max_anchors_per_seq={anchors}",
        "model.num_layers=1", "eval.holdout_fraction=0.05", "checkpoint.every_steps=0",
    ]
    launched, wall, rss, _ = run_measured(cmd, root / f"{name}.train.log")
    log = run_dir / "train_log.jsonl"
    rows = read_log(log, "train")
    start = next(r for r in read_log(log, "event") if r["event"] == "run_start")
    steady = rows[2:] if len(rows) > 3 else rows
    return {
        "steps": len(rows),
        "startup_s": round(start["time"] - launched, 2),
        "step_s": round(statistics.median(r["step_s"] for r in steady), 3),
        "tok_per_s": round(statistics.median(r["tokens"] / r["step_s"] for r in steady), 1),
        "blocks_per_s": round(statistics.median(r["blocks"] / r["step_s"] for r in steady), 1),
        "blocks_per_token": round(sum(r["blocks"] for r in steady) / sum(r["tokens"] for r in steady), 3),
        "data_wait_frac": round(statistics.mean(r["data_wait_frac"] for r in steady), 4),
        "wall_s": round(wall, 2),
        "peak_rss_mib": rss,
    }


def relative_to_linear(points: list[dict], size_key: str, cost_key: str) -> list[float]:
    """cost / size, normalised to the first point: 1.0 everywhere = linear; > 1 = superlinear."""
    base = points[0][cost_key] / points[0][size_key]
    return [round(p[cost_key] / p[size_key] / base, 3) for p in points]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--base-samples", type=int, default=32, help="the 1x sample count")
    parser.add_argument("--multiples", default="1,4,16")
    parser.add_argument("--lengths", default="128,512,2048", help="sample lengths of the length sweep")
    parser.add_argument("--length-tokens", type=int, default=16384, help="total tokens per length point")
    parser.add_argument("--steps", type=int, default=6, help="training steps per point")
    parser.add_argument("--anchors", type=int, default=16, help="anchors per sample in the length sweep")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench_scaling_"))
    t0 = time.perf_counter()
    target = build_target(root)
    results: dict = {"target": "random Llama, 6 layers x 64 wide, vocab 49152, top-8 stored; 1-layer B=16 drafter", "samples": [], "lengths": []}

    for multiple in (int(m) for m in args.multiples.split(",")):
        count = args.base_samples * multiple
        point = {"multiple": multiple, **extract_point(root, f"n{multiple}", target, mixed_lengths(count, multiple), 1024, multiple)}
        point["train"] = train_point(root, f"n{multiple}", target, point.pop("store"), args.steps, 1024, 8)
        results["samples"].append(point)
        print(json.dumps({k: v for k, v in point.items()}), flush=True)

    for length in (int(x) for x in args.lengths.split(",")):
        count = max(2, args.length_tokens // length)
        point = {"length": length, **extract_point(root, f"l{length}", target, [length] * count, length + 64, length)}
        # A fixed anchor cap per sample (as the recipe's 512, smaller for CPU): blocks per token fall
        # as samples grow, and each block attends to a longer context.
        point["train"] = train_point(root, f"l{length}", target, point.pop("store"), args.steps, max(1024, length + 64), args.anchors)
        results["lengths"].append(point)
        print(json.dumps(point), flush=True)

    s = results["samples"]
    flat = [{**p, **{f"train_{k}": v for k, v in p["train"].items()}} for p in s]
    results["samples_vs_linear"] = {
        key: relative_to_linear(flat, "tokens", key) for key in ("wall_s", "prepare_s", "loop_s", "forward_s", "merge_s")
        if all(p.get(key) for p in flat)
    }
    results["samples_vs_linear"]["train_startup_s"] = relative_to_linear(flat, "tokens", "train_startup_s")
    results["samples_peak_rss_mib"] = {"extract": [p["peak_rss_mib"] for p in s], "train": [p["train"]["peak_rss_mib"] for p in s]}
    lens = results["lengths"]
    results["length_tok_per_s"] = {
        "extract_loop": [p["loop_tok_per_s"] for p in lens],
        "train": [p["train"]["tok_per_s"] for p in lens],
        "train_blocks_per_s": [p["train"]["blocks_per_s"] for p in lens],
    }
    return emit(results, args.json, t0)


if __name__ == "__main__":
    sys.exit(main())
