"""One GPU check (one H200, under 8 minutes): what only a GPU shows of extraction, drafter training
and generation, and what only a GPU measures.

    bash bench/gpu_check.sh                    # installs carried wheels / the gpu extra, then runs this
    python3 bench/gpu_check.py [--phases env,gpu_paths,packed_vs_padded,extract_8b,train,resume,...]
    .venv/bin/python bench/gpu_check.py --cpu-smoke          # every phase, tiny, on CPU (~4-6 min)

Phases, in order (docs/gpu.md, "Checking a GPU node", says what each shows): env, gpu_paths,
packed_vs_padded, extract_8b, train (a world-size-1 DDP wrap, grad_accum 3, evals and keep_best, the
measured peak against the memory plan), resume, tp_extract (2 GPUs; reported skipped on one),
generate, extract_smollm2 (bench/gpu_check_stage1.py, bench/gpu_check_train.py). A phase that fell
back (flash-attn or vllm missing) says so: status "fallback", never "ok". Results go to --json, else
$OUT/gpu_check.json, else bench/results/gpu_check.json (gpu_check_smoke.json for --cpu-smoke),
rewritten after every phase; `rows(result)` turns them into BENCHMARKS.md rows.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import Row, yes  # noqa: E402
from bench.common import fmt as common_fmt  # noqa: E402
from bench.gpu_check_kit import GPU_SIZES, SMOKE_SIZES, Context, Recorder  # noqa: E402
from bench.gpu_check_stage1 import (  # noqa: E402
    generate_worker,
    phase_env,
    phase_extract_8b,
    phase_extract_smollm2,
    phase_generate,
    phase_gpu_paths,
    phase_packed_vs_padded,
    phase_tp_extract,
)
from bench.gpu_check_train import phase_resume, phase_train, train_worker  # noqa: E402
from bench.gpu_check_train import rows_for as train_rows  # noqa: E402

OUT_OF_TIME = "out of time"
PHASES = {
    "env": phase_env,
    "gpu_paths": phase_gpu_paths,
    "packed_vs_padded": phase_packed_vs_padded,
    "extract_8b": phase_extract_8b,
    "train": phase_train,
    "resume": phase_resume,
    "tp_extract": phase_tp_extract,
    "generate": phase_generate,
    "extract_smollm2": phase_extract_smollm2,
}


# ---------------------------------------------------------------------------------------------
# Report


def fmt(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else common_fmt(value)


def rows(result: dict[str, Any]) -> list[Row]:
    """BENCHMARKS.md's gpu section (bench/run_all.py), from a gpu_check.json."""
    phases = result.get("phases", {})
    out: list[Row] = []
    env = phases.get("env", {})
    if env:
        where = env.get("gpu") or "CPU (smoke)"
        out.append(("GPU check: machine", f"{where}, torch {env.get('torch')}, CUDA {env.get('cuda')}", "", "", ""))
    taken: dict[str, str] = {}  # the last (most specific) note per missing thing
    for note in (f for p in phases.values() for f in p.get("fallbacks", [])):
        taken[note.split(" ->")[0]] = note
    if taken:
        out.append(("FALLBACKS taken", "; ".join(taken.values()), "", "", ""))
    for name in ("extract_smollm2", "extract_8b"):
        p = phases.get(name, {})
        if "extract_over_forward" not in p:
            continue
        forward = p["pure_forward"]
        attn = forward["attn_implementation"] + (", packed" if forward["packed"] else "")
        out.append((f"extraction tokens/s: {p['target']}; {attn}", fmt(p["tok_per_s"]), "",
                     f"pure forward {fmt(forward['tok_per_s'])} tok/s", ""))
        out.append((f"extraction wall time / pure target forward: {p['target']}", fmt(p["extract_over_forward"]), "<= 1.15",
                     f"forward {forward['seconds']} s on {fmt(forward['tokens'])} tokens; writer waited "
                     f"{p['extract']['writer_queue_wait_s']} s", yes(p["extract_over_forward"] <= 1.15)))
        e = p["extract"]
        if name == "extract_8b" and "writer_absorb_s" in e:
            busy = max(e["writer_absorb_s"], e["writer_seconds"] / e["writer_threads"])
            out.append(("8B extraction at full size: the writer's busiest thread (absorbing, or compressing per thread) / the target's forward",
                        f"{busy:.3g} s / {e['forward_seconds']} s", "writer < forward",
                        f"absorb {e['writer_absorb_s']} s, {e['writer_threads']} writer threads {e['writer_seconds']} s summed; the forward "
                        f"waited {e['writer_queue_wait_s']} s on a full queue (peak {e['writer_peak_queue_mb']} MB)", yes(busy < e["forward_seconds"])))
    gp = phases.get("gpu_paths", {})
    if "flex_20_shapes" in gp:
        copies, flex = gp["copies_after_event"], gp["flex_20_shapes"]
        out.append((f"stage 1 copies read after their event ({copies['device']})", "equal" if copies["equal"] else "**differ**",
                     "equal", f"pinned host memory: {copies['pinned']}", yes(copies["equal"])))
        buffers = gp["loader_buffers"]
        out.append(("loader host buffers: pinned, reused (10 micro-batches)", f"pinned {buffers['pinned']}, {buffers['allocated']} allocated",
                     "<= 3 allocated", "", yes(buffers["allocated"] <= 3)))
        out.append((f"compiled flex ({flex['backend']}): graphs after 20 pack shapes", str(flex["graphs_after_each"][-1]), "<= 6, none after the 10th",
                     f"max |diff| vs the rule {flex['max_abs_diff_vs_rule']:.2e}", yes(flex["graphs_after_each"][-1] <= 6)))
    p = phases.get("packed_vs_padded", {})
    if "hidden_max_rel_diff" in p:
        ok = p["hidden_max_rel_diff"] <= p["tolerance"]["hidden_rel"] and p["topk_logprob_max_abs_diff"] <= p["tolerance"]["logprob_abs"]
        out.append((f"packed vs padded extraction ({p['attn_implementation']}), max relative hidden diff",
                    f"{p['hidden_max_rel_diff']:.2e}", f"<= {p['tolerance']['hidden_rel']}",
                    f"top-k log-prob max diff {p['topk_logprob_max_abs_diff']:.2e}; top-1 agreement {p['top1_agreement']:.3f}", yes(ok)))
    out.extend(train_rows(phases))
    tp = phases.get("tp_extract", {})
    if "hidden_max_rel_diff" in tp:
        out.append((f"tensor-parallel extraction (2 ranks) vs one device, {tp['samples']} samples, max relative hidden diff",
                    f"{tp['hidden_max_rel_diff']:.2e}", "bf16 rounding", f"top-k ids equal {tp['topk_ids_equal']}", ""))
    elif tp.get("status") == "skipped":
        out.append(("tensor-parallel extraction", "skipped", "", tp.get("why", ""), ""))
    g = phases.get("generate", {})
    if "tok_per_s" in g:
        label = "vllm" if g["backend"] == "vllm" else "transformers (FALLBACK: vllm not installed)"
        out.append((f"generation tokens/s, {g['prompts']} prompts, {label}", fmt(g["tok_per_s"]), "",
                     f"with the engine start ({g['engine_start_s']} s): {fmt(g['tok_per_s_with_start'])} tok/s", ""))
    for name, p in phases.items():
        if p.get("status") == "failed":
            out.append((f"phase {name}", "failed: " + p.get("error", "")[:200].replace("|", "/").replace("\n", " "), "ok", "",
                         yes(False)))
    return out


def print_summary(result: dict[str, Any]) -> None:
    print("\n== summary")
    for name, p in result["phases"].items():
        print(f"   {name:<16} {p['status']:<9} {p.get('seconds', 0):>7.1f} s")
    table = rows(result)
    width = max(len(r[0]) for r in table) if table else 0
    for figure, value, goal, baseline, met in table:
        goal_met = f" [goal {goal}: {met}]" if goal else ""
        print(f"   {figure:<{width}}  {value}{goal_met}" + (f"  ({baseline})" if baseline else ""))
    print(f"   total {result['elapsed_s']} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_generate_worker"]:
        return generate_worker(argv[1], argv[2:])
    if argv[:1] == ["_train_worker"]:
        return train_worker(argv[1], argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="every phase, tiny, on CPU (tests the plumbing)")
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of " + ",".join(PHASES))
    parser.add_argument("--json", type=Path, help="where to write the results (default: $OUT or bench/results)")
    parser.add_argument("--work-dir", type=Path, help="parent of the work folder (default: the temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--peak-tflops", type=float, help="bf16 peak for MFU when the device is not known")
    parser.add_argument("--train-steps", type=int, help="steps of the first training run (default: 3 on GPU)")
    parser.add_argument("--deadline-s", type=float, help="stop starting work after this many seconds (default 450)")
    args = parser.parse_args(argv)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: still write the JSON and clean up
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only; never wait on a network
    sizes = SMOKE_SIZES if args.cpu_smoke else GPU_SIZES
    if args.train_steps:
        sizes = replace(sizes, train_steps=args.train_steps)
    if args.deadline_s:
        sizes = replace(sizes, deadline_s=args.deadline_s)
    phases = [p for p in args.phases.split(",") if p]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        parser.error(f"unknown phases {unknown}; choose from {list(PHASES)}")
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        parser.error("torch sees no CUDA device: run on a GPU, or pass --cpu-smoke")
    if args.cpu_smoke:
        torch.set_num_threads(1)
    out = args.json or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else
                        REPO / "bench" / "results" / ("gpu_check_smoke.json" if args.cpu_smoke else "gpu_check.json"))
    work = Path(tempfile.mkdtemp(prefix="gpu_check_", dir=args.work_dir))
    rec = Recorder(out, sizes.deadline_s)
    rec.result.update({"cpu_smoke": args.cpu_smoke, "sizes": asdict(sizes), "work_dir": str(work), "todo": phases})
    ctx = Context(sizes=sizes, work=work, rec=rec, peak_tflops=args.peak_tflops)
    print(f"gpu_check: phases {phases}, work folder {work}, results {out}", flush=True)
    try:
        for name in phases:
            if rec.left() < 20:
                rec.result["phases"][name] = {"status": "skipped", "why": OUT_OF_TIME}
                continue
            with rec.phase(name) as entry:
                PHASES[name](entry, ctx)
    finally:
        rec.write()
        if os.environ.get("OUT") and (work / "logs").is_dir():
            with open(Path(os.environ["OUT"]) / "gpu_check_logs.txt", "w") as logs:
                for path in sorted((work / "logs").iterdir()):
                    logs.write(f"===== {path.name}\n{path.read_text()[-200_000:]}\n")
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print_summary(rec.result)
    print(f"results: {out}")
    # A phase this machine cannot run (tp_extract on one GPU) is reported, not failed; out of time is.
    failed = [n for n, p in rec.result["phases"].items() if p["status"] == "failed" or p.get("why") == OUT_OF_TIME]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
