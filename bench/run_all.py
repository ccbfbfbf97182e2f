"""Run every benchmark and write BENCHMARKS.md and bench/results.json from that one run.

    make bench            # = .venv/bin/python bench/run_all.py [--only data,extract,...]
    .venv/bin/python bench/run_all.py --render                # BENCHMARKS.md again from bench/results.json

Each benchmark runs as its own subprocess, one after another (never two on 2 cores at once), and owns
its report: its module's `rows(result)` gives its lines of BENCHMARKS.md (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
PY = sys.executable

from bench.common import REPO, Row  # noqa: E402

BENCHES = {
    "data": ["bench/data.py"],
    "sampler": ["bench/sampler.py"],
    "extract": ["bench/extract.py", "--samples", "48"],
    "reader": ["bench/reader.py"],
    "store8b": ["bench/store8b.py"],
    "train": ["bench/train.py"],
    "checkpoint": ["bench/checkpoint.py"],
    "learning": ["bench/learning.py"],
    "scaling": ["bench/scaling.py", "--base-samples", "16", "--length-tokens", "8192"],
    "eval_cost": ["bench/eval_cost.py"],
    "attention": ["bench/attention.py"],
    "projection": ["bench/projection.py"],
}


def compare(name: str, *variants: str, long: bool = False, prompts: tuple[int, int] | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """bench/compare.py at equal steps and seed: 400 steps of the default preset decoded on 12 held-out
    and 32 unseen prompts, or (`long`) 1,600 of cpu-long's on 24 and 16; `variants`: NAME:overrides."""
    heldout, unseen = prompts or ((24, 16) if long else (12, 32))
    preset = ["--config", "configs/cpu-long.yaml", "--steps", "1600"] if long else ["--steps", "400"]
    return ["bench/compare.py", *preset, "--name", name, "--heldout", str(heldout), "--unseen", str(unseen),
            *(f"--variant={v}" for v in variants), *extra]


# The fp4 stores: the same data extracted as bf16, fp8 and fp4 by bench/fp4.py (its --run-dir).
FP4_STORES = ("fp8:store.path={}/store-fp8,store.dtype=fp8", "bf16:store.path={}/store-bf16", "fp4:store.path={}/store-fp4,store.dtype=fp4")
# Run on request only (`--only learning_long`): the long CPU preset trains up to an hour.
EXTRA_BENCHES = {
    "learning_long": ["bench/learning.py", "--config", "configs/cpu-long.yaml", "--n", "100"],
    "plan8b": ["bench/plan.py"],  # ~15 min of fake-tensor traces on 2 cores
    # Settings at equal steps and seed, decoded on the same prompts with paired intervals (~2 h; ~1.5 h).
    "levers": compare("levers-default", "base:loss.weighting=decay", "dpace:loss.weighting=dpace",
                      "muon:loss.weighting=decay,optim.name=muon", "distill:loss.weighting=decay,loss.distill_positions=all",
                      "distill16:loss.weighting=decay,loss.distill_positions=all,sampler.max_anchors_per_seq=16",
                      "sliding64:loss.weighting=decay,model.layer_types=[sliding_attention],model.sliding_window=64",
                      "pcaH:loss.weighting=decay,model.feature_projection=pca",
                      "pcaH2:loss.weighting=decay,model.feature_projection=pca,model.projection_dim=288"),
    "levers_long": compare("levers-cpu-long", "dpace:", "decay:loss.weighting=decay",
                           "sliding64:model.layer_types=[sliding_attention],model.sliding_window=64", long=True),
    # Needs the all-questions store first: make extract ARGS="run_dir=runs/questions data.default_question_share=1.0"
    "questions": compare("qmix", "mixed:", "questions:store.path=runs/questions/store", prompts=(0, 44)),
    # fp4 hidden states: bench/fp4.py builds the three stores and measures the codec (~15 min), then
    # drafters trained from each at equal steps and seed.
    "fp4": ["bench/fp4.py", "--config", "configs/default.yaml", "--run-dir", "runs/fp4-default"],
    "fp4_compare": compare("fp4-default", *(v.format("runs/fp4-default") for v in FP4_STORES),
                           extra=("store.path=runs/fp4-default/store-bf16",)),
    "fp4_long": ["bench/fp4.py", "--config", "configs/cpu-long.yaml", "--run-dir", "runs/fp4-cpu-long"],
    "fp4_compare_long": compare("fp4-cpu-long", *(v.format("runs/fp4-cpu-long") for v in FP4_STORES), long=True,
                                extra=("store.path=runs/fp4-cpu-long/store-bf16",)),
    # The drafter variants (docs/variants.md): DFlash (the CPU default, D-PACE) against DSpark and DFlash2
    # trained from the same store at equal steps and seed, decoded on the same prompts, DSpark also with
    # its confidence stop (~1 h; ~2.5 h).
    **{name: compare(label, "dflash:", "dspark:model.variant=dspark", "dflash2:model.variant=dflash2", long=long,
                     extra=("--confidence-stop", "dspark=0.5"))
       for name, label, long in (("variants", "variants-default", False), ("variants_long", "variants-cpu-long", True))},
}
ALL = {**BENCHES, **EXTRA_BENCHES}
GPU_RESULT = REPO / "bench" / "results" / "gpu_check.json"  # copied here from a device run, never made by make bench


def run(name: str, out_dir: Path) -> dict:
    out = out_dir / f"{name}.json"
    command = [PY, *ALL[name], "--json", str(out)]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    seconds = round(time.perf_counter() - started, 1)
    if proc.returncode != 0:
        return {"error": proc.stderr[-3000:], "seconds": seconds, "command": " ".join(command[1:])}
    return {"result": json.loads(out.read_text()), "seconds": seconds, "command": ".venv/bin/python " + " ".join(ALL[name])}


def rows(name: str, result: dict) -> list[Row]:
    """The benchmark's own rows for its result (each bench module's `rows`)."""
    return importlib.import_module(f"bench.{Path(ALL[name][0]).stem}").rows(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="comma-separated subset (default: every BENCHES entry, none with --adopt)")
    parser.add_argument("--adopt", action="append", default=[], metavar="NAME=JSON",
                        help="record a result its own command wrote (a long EXTRA bench run by hand, in the background)")
    parser.add_argument("--render", action="store_true", help="only write BENCHMARKS.md from bench/results.json (runs nothing)")
    args = parser.parse_args()
    out_dir = REPO / "bench" / "results"
    out_dir.mkdir(exist_ok=True)
    only = args.only if args.only is not None else ("" if args.adopt else ",".join(BENCHES))
    names = [n for n in only.split(",") if n]
    results_path = REPO / "bench" / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    if args.render:
        return write_markdown(results)
    for spec in args.adopt:
        name, path = spec.split("=", 1)
        result = json.loads(Path(path).read_text())
        results[name] = {"result": result, "seconds": result.get("total_s", 0), "command": ".venv/bin/python " + " ".join(ALL[name]),
                         "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(Path(path).stat().st_mtime))}
    for name in names:
        print(f"== {name}", flush=True)
        results[name] = {**run(name, out_dir), "date": time.strftime("%Y-%m-%d %H:%M")}
        print(f"   {results[name]['seconds']} s" + (" FAILED" if "error" in results[name] else ""), flush=True)
    results["_machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M")}
    results_path.write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(results)


def table(figures: list[Row]) -> list[str]:
    return ["| figure | value | goal | baseline (same run) | met |", "|---|---|---|---|---|", *(f"| {' | '.join(r)} |" for r in figures)]


def write_markdown(results: dict) -> None:
    lines = [
        "# Benchmarks",
        "",
        f"Written by `make bench` (`bench/run_all.py`) on {results['_machine']['date']}, "
        f"{results['_machine']['cpus']} CPU cores, no GPU. Every figure below comes from a benchmark run, not a test; raw numbers are in "
        "`bench/results.json`. Each figure is taken against a baseline measured in the same run "
        "(`--only NAME` reruns one section and keeps the others).",
        "",
    ]
    for name in (n for n in ALL if n in results):
        entry = results[name]
        when = f", {entry['date']}" if "date" in entry else ""
        lines += [f"## {name}", "", f"Command: `{entry['command']}` ({entry['seconds']} s{when})", ""]
        if "error" in entry:
            lines += ["Failed:", "", "```", entry["error"][-1500:], "```", ""]
            continue
        lines += [*table(rows(name, entry["result"])), ""]
    lines += ["## gpu", ""]
    if GPU_RESULT.exists():
        from bench.gpu_check import rows as gpu_rows

        gpu = json.loads(GPU_RESULT.read_text())
        lines += [f"Command: `bash bench/gpu_check.sh` on a device machine ({gpu.get('date', '?')}); not part of `make bench`.", ""]
        lines += table(gpu_rows(gpu))
    else:
        lines += [
            "`bench/gpu_check.sh` (one H200, < 8 min: flash-attn extraction on SmolLM2 and on a Qwen3-8B-shaped "
            "target, a short bf16 drafter training run with MFU, a vllm generate) **has not run on a GPU yet**: "
            "no GPU was lent to this project's sessions. Its plumbing runs on CPU "
            "(`.venv/bin/python bench/gpu_check.py --cpu-smoke`, a slow test). When it runs, copy its "
            "`gpu_check.json` to `bench/results/` and rerun `make bench`.",
        ]
    lines.append("")
    notes = REPO / "bench" / "NOTES.md"
    if notes.exists():
        lines += [notes.read_text()]
    (REPO / "BENCHMARKS.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
