"""Scaling study: extraction and training throughput and peak memory as the data grows (1x, 4x, 16x
samples) and as sequences grow (fixed total tokens, longer samples). < 5 min on 2 CPU cores.

    .venv/bin/python bench/scaling.py [--json out.json] [--base-samples 32] [--lengths 128,512,2048]

Every point is a real CLI run in its own process; what each reports: docs/benchmarks.md, `scaling`.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Row, arguments, emit, fmt, run_cli, run_training, steady, step_figures  # noqa: E402

ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def mixed_lengths(count: int, seed: int) -> list[int]:
    """Lognormal lengths between 64 and 640 tokens (median ~200), like chat data, shorter."""
    rng = random.Random(seed)
    return [int(min(640, max(64, rng.lognormvariate(5.3, 0.6)))) for _ in range(count)]


def extract_point(root: Path, name: str, target: Path, lengths: list[int], max_length: int, seed: int) -> dict:
    from testkit.data import chat_rows, stage1_overrides, write_jsonl

    run_dir = root / name  # chats of about `length` tokens each (one word ~ one token here)
    data = write_jsonl(root / f"{name}.jsonl", chat_rows(len(lengths), seed, [max(8, n - 40) for n in lengths]))
    stage1 = stage1_overrides(target, data, run_dir,
                              **{"data.max_length": max_length, "extract.batch_tokens": max(4096, max_length)})
    cmd = ["-m", "stage1_extract", "extract", "--json", "--no-progress", "--config", "configs/default.yaml", *stage1]
    first = run_cli(cmd, root / f"{name}.extract.log", ONE_THREAD)
    summary = first.summary
    # The same command again: every shard is done, so this is the fixed cost of any later command
    # (status, resume, reprocess): read the token cache, hash the settings, check each shard.
    rerun = run_cli(cmd, root / f"{name}.rerun.log", ONE_THREAD)
    return {
        "rows": len(lengths), "tokens": summary["num_tokens"], "shards": summary["shards_total"], "wall_s": round(first.seconds, 2),
        "prepare_s": summary["prepare_seconds"], "loop_s": summary["seconds"], "forward_s": summary["forward_seconds"],
        "merge_s": summary.get("merge_seconds"), "rerun_s": round(rerun.seconds, 2), "rerun_prepare_s": rerun.summary["prepare_seconds"],
        "loop_tok_per_s": summary["tok_per_s"], "peak_rss_mib": first.peak_rss_mib,
        "train_on": [*stage1, f"store.path={run_dir / 'store'}"],  # the settings that made the store: it is fresh
    }


def train_point(root: Path, name: str, store: list[str], steps: int, budget: int, anchors: int) -> dict:
    from stage2_train.observe.metrics import read_log

    run = run_training(root / f"{name}.train", [
        *store, "train.cpu_threads=1", f"train.max_steps={steps}", f"sampler.micro_batch_tokens={budget}",
        f"sampler.max_anchors_per_seq={anchors}", "model.num_layers=1", "eval.holdout_fraction=0.05", "checkpoint.every_steps=0",
    ], env=ONE_THREAD)
    rows = run.rows
    measured, figures = steady(rows), step_figures(rows)
    start = next(r for r in read_log(run.paths.log, "event") if r["event"] == "run_start")
    return {"steps": len(rows), "startup_s": round(start["time"] - run.launched, 2), "step_s": round(figures["step_s_median"], 3),
            **{k: figures[k] for k in ("tok_per_s", "blocks_per_s", "data_wait_frac")},
            "blocks_per_token": round(sum(r["blocks"] for r in measured) / sum(r["tokens"] for r in measured), 3),
            "wall_s": round(run.seconds, 2), "peak_rss_mib": run.peak_rss_mib}


def relative_to_linear(points: list[dict], size_key: str, cost_key: str) -> list[float]:
    """cost / size, normalised to the first point: 1.0 everywhere = linear; > 1 = superlinear."""
    base = points[0][cost_key] / points[0][size_key]
    return [round(p[cost_key] / p[size_key] / base, 3) for p in points]


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--base-samples", type=int, default=32, help="the 1x sample count")
    parser.add_argument("--multiples", default="1,4,16")
    parser.add_argument("--lengths", default="128,512,2048", help="sample lengths of the length sweep")
    parser.add_argument("--length-tokens", type=int, default=16384, help="total tokens per length point")
    parser.add_argument("--steps", type=int, default=6, help="training steps per point")
    parser.add_argument("--anchors", type=int, default=16, help="anchors per sample in the length sweep")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench_scaling_"))
    from testkit.target import build_tiny_target

    target = build_tiny_target(root / "target", max_positions=16384)
    results: dict = {"target": "random Llama, 6 layers x 64 wide, vocab 49152, top-8 stored; 1-layer B=16 drafter", "samples": [], "lengths": []}

    for multiple in (int(m) for m in args.multiples.split(",")):
        count = args.base_samples * multiple
        point = {"multiple": multiple, **extract_point(root, f"n{multiple}", target, mixed_lengths(count, multiple), 1024, multiple)}
        point["train"] = train_point(root, f"n{multiple}", point.pop("train_on"), args.steps, 1024, 8)
        results["samples"].append(point)
        print(json.dumps(point), flush=True)

    for length in (int(x) for x in args.lengths.split(",")):
        count = max(2, args.length_tokens // length)
        point = {"length": length, **extract_point(root, f"l{length}", target, [length] * count, length + 64, length)}
        # A fixed anchor cap per sample (as the recipe's 512, smaller for CPU): blocks per token fall
        # as samples grow, and each block attends to a longer context.
        point["train"] = train_point(root, f"l{length}", point.pop("train_on"), args.steps, max(1024, length + 64), args.anchors)
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
    results["length_tok_per_s"] = {"extract_loop": [p["loop_tok_per_s"] for p in lens], "train": [p["train"]["tok_per_s"] for p in lens],
                                   "train_blocks_per_s": [p["train"]["blocks_per_s"] for p in lens]}
    return emit(results, args.json)


def rows(r: dict) -> list[Row]:
    def slash(values, show=fmt) -> str:
        return " / ".join(show(v) for v in values)

    s, lin, rss, lens, t = r["samples"], r["samples_vs_linear"], r["samples_peak_rss_mib"], r["lengths"], r["length_tok_per_s"]
    sizes, lengths = slash(f"{p['multiple']}x" for p in s), slash((p["length"] for p in lens), str)
    return [
        (f"extraction loop time per token, {sizes} samples (1.0 = linear)", slash(lin["loop_s"]), "~1",
         f"{slash(p['tokens'] for p in s)} tokens in {slash((p['shards'] for p in s), str)} shards", ""),
        (f"extraction whole-command time per token, {sizes}", slash(lin["wall_s"]), "",
         f"fixed start-up {s[0]['prepare_s']} s (imports, tokenizer) amortised", ""),
        (f"a later command on the done store (token cache + checks), {sizes}", slash(f"{p['rerun_s']} s" for p in s), "flat",
         f"first extraction's prepare: {slash((p['prepare_s'] for p in s), str)} s", ""),
        (f"extraction peak RSS MiB, {sizes}", slash(rss["extract"], str), "flat", "", ""),
        (f"training blocks/s, {sizes}", slash(p["train"]["blocks_per_s"] for p in s), "flat",
         f"tokens/s {slash(p['train']['tok_per_s'] for p in s)}; start-up {slash((p['train']['startup_s'] for p in s), str)} s", ""),
        (f"training peak RSS MiB, {sizes}", slash(rss["train"], str), "flat", "", ""),
        (f"extraction tokens/s at sample length {lengths}", slash(t["extract_loop"]), "", "same total tokens per point", ""),
        (f"training tokens/s at sample length {lengths} ({lens[0]['train']['blocks_per_token']} -> "
         f"{lens[-1]['train']['blocks_per_token']} blocks per token)", slash(t["train"]), "", f"blocks/s {slash(t['train_blocks_per_s'])}", ""),
        ("training peak RSS MiB by length", slash((p["train"]["peak_rss_mib"] for p in lens), str), "", "", ""),
    ]


if __name__ == "__main__":
    sys.exit(main())
