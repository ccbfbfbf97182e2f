"""bench/gpu_check.py's training phases (docs/gpu.md, "Checking a GPU node"): `train`, the 8B preset's
drafter as torchrun's one rank in a DDP wrap (`train_worker`), its measured peak against
`stage2_train plan --json`, its tokens/s and MFU; `resume`, that run continued from its checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common import REPO, Row, fmt, step_figures, yes
from bench.gpu_check_kit import Context, gpu_memory_peak

CONFIG = "configs/qwen3-8b.yaml"


def train_overrides(ctx: Context, run_dir: Path, steps: int, resume: str) -> list[str]:
    return [*ctx.big["overrides"], f"run_dir={run_dir}", f"train.max_steps={steps}", f"train.epochs={steps + 1}",
            f"train.resume={resume}", "log.every_steps=1", "log.wandb=disabled", *ctx.sizes.train_overrides]


def ddp_run(ctx: Context, overrides: list[str], name: str) -> tuple[dict[str, Any], str | None]:
    """One `stage2_train train` under torchrun (one rank, DDP-wrapped by `train_worker`); the worker's
    report, and the error when it failed or timed out."""
    report_path = ctx.work / f"{name}_ddp.json"
    # TORCH_LOGS=recompiles: each recompilation of the flex kernels lands in the log. The allocator as
    # a user runs it: PYTORCH_CUDA_ALLOC_CONF empty (torch's defaults, no expandable_segments).
    env = {"TORCH_LOGS": "recompiles", "PYTORCH_CUDA_ALLOC_CONF": ""}
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", str(Path(__file__).resolve().with_name("gpu_check.py")),
            "_train_worker", str(report_path), "train", "--json", "--no-progress", "--config", CONFIG, *overrides]
    error = None
    try:
        ctx.run_cli(args, name, ctx.rec.left() - 15, env)
    except subprocess.TimeoutExpired:
        error = "timed out (figures from the steps it logged)"
    except RuntimeError as exc:
        error = str(exc)
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    return report, error


def start_plan(ctx: Context, big_overrides: list[str]) -> subprocess.Popen:
    """`python -m stage2_train plan --json` for the training's config (its budgets, grad_accum, model;
    the run folder does not matter), started as soon as the target exists: it traces on the CPU while
    the GPU extracts and trains. Its output: logs/plan.json."""
    overrides = [*big_overrides, *ctx.sizes.train_overrides]
    (ctx.work / "logs").mkdir(parents=True, exist_ok=True)
    out = (ctx.work / "logs" / "plan.json").open("w")
    env = {**os.environ, **ctx.env(), "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.Popen([sys.executable, "-m", "stage2_train", "plan", "--json", "--config", CONFIG, *overrides, "--world-size", "8"],
                            cwd=REPO, env=env, stdout=out, stderr=subprocess.DEVNULL)


def bf16_peak(device_name: str, override_tflops: float | None) -> tuple[float | None, str]:
    """The device's dense bf16 peak, from the datasheet figures `stage1_extract plan` sizes runs with."""
    from stage1_extract.plan import GPUS

    if override_tflops:
        return override_tflops * 1e12, f"{override_tflops:g} TFLOP/s (--peak-tflops)"
    for rates in GPUS.values():
        if rates.name.split()[0] in device_name:
            return rates.bf16_tflops * 1e12, f"{rates.name} dense bf16 {rates.bf16_tflops:g} TFLOP/s (datasheet)"
    return None, f"n/a: no bf16 peak known for {device_name!r} (pass --peak-tflops)"


def train_figures(cfg: Any, ctx: Context, rows: list[dict], peak: float | None) -> dict[str, Any]:
    """Throughput over the logged steps after the first `train_skip_steps` (compilation), and the model
    FLOPs achieved and MFU (`utilization`) over the work of each step, replayed from the trainer's own
    sampler and anchors (`step_work`; left out when it does not give the tokens and blocks logged)."""
    from stage2_train.data.run_data import open_run_data
    from stage2_train.model.flops import DrafterShape, step_work, utilization

    out: dict[str, Any] = {"steps_logged": len(rows), "first_step_s": round(rows[0]["step_s"], 2),
                           **step_figures(rows, ctx.sizes.train_skip_steps)}
    with contextlib.closing(open_run_data(cfg)) as data:
        shape = DrafterShape.of(cfg.model, data.target.arch, len(data.target.layer_ids))
        works = step_work(data.sampler, data.anchors, data.reader.sample_ids[data.train_indices], ctx.big["loss_masks"], rows,
                          label_shift=cfg.model.label_shift)
    out.update({"drafter": asdict(shape), "work_matches_log": all((r["tokens"], r["blocks"]) == (w.context_tokens, w.blocks)
                                                                  for r, w in zip(rows, works))})
    if not out["work_matches_log"]:
        return out
    rows, works = rows[-out["steps_measured"]:], works[-out["steps_measured"]:]  # step_figures' steady steps
    return {**out, **utilization(shape, works, rows, peak),
            "block_tok_per_s": round(statistics.median(w.blocks * shape.block_size / r["step_s"] for r, w in zip(rows, works)), 1),
            "blocks_per_step": round(statistics.mean(w.blocks for w in works), 1),
            "context_tokens_per_step": round(statistics.mean(w.context_tokens for w in works), 1),
            "samples_per_step": round(statistics.mean(r["samples"] for r in rows), 1)}


def phase_train(entry: dict[str, Any], ctx: Context) -> None:
    import torch

    from shared.config import load_run_config
    from shared.paths import RunPaths
    from stage2_train.observe.metrics import read_log
    from stage2_train.train.checkpoint.select import best_pointer, step_dirs

    if not ctx.big:
        raise RuntimeError("no store to train on: extract_8b did not finish")
    sizes, cuda = ctx.sizes, ctx.sizes.device == "cuda"
    run_dir = ctx.work / "train"
    overrides = train_overrides(ctx, run_dir, sizes.train_steps, "never")
    cfg = load_run_config(CONFIG, overrides)
    entry.update({"overrides": overrides, "grad_accum": cfg.train.grad_accum, "micro_batch_tokens": cfg.sampler.micro_batch_tokens,
                  "micro_batch_blocks": cfg.sampler.blocks_budget(), "steps": sizes.train_steps,
                  "precision": "bf16 autocast" if cuda else "fp32 (CPU)", "allocator": "torch's defaults (no expandable_segments)"})
    planner = ctx.big["planner"]
    with gpu_memory_peak(entry, cuda):
        report, error = ddp_run(ctx, overrides, "train")
    paths = RunPaths(run_dir)
    log = read_log(paths.log) if paths.log.is_file() else []
    rows = [r for r in log if r.get("kind") == "train"]
    entry.update({"ddp": report, "evals": sum(r.get("kind") == "eval" for r in log), "best": best_pointer(paths.checkpoints),
                  "checkpoints": [p.name for p in step_dirs(paths.checkpoints)]})
    try:
        planner.wait(timeout=max(30.0, ctx.rec.left() - 150))
        plan = json.loads((ctx.work / "logs" / "plan.json").read_text())
        entry["plan"] = {"peak_gib": plan["peak_gib"], "micro_batch": plan["micro_batch"],
                         "traced_total_gib": plan["traced_peak_gib"]["with_checkpointing" if cfg.model.activation_checkpointing else "without_checkpointing"]["Total"]}
    except (subprocess.TimeoutExpired, ValueError, KeyError) as exc:
        planner.kill()
        entry["plan"] = f"not finished: {type(exc).__name__}: {exc}"[:300]
    if rows:
        peak, entry["peak"] = bf16_peak(torch.cuda.get_device_name(0), ctx.peak_tflops) if cuda else (None, "n/a on CPU")
        entry.update(train_figures(cfg, ctx, rows, peak))
    if error:
        raise RuntimeError(error)
    check_ddp_run(entry, report, cfg, sizes.train_steps, rows, cuda)
    ctx.big["train"] = {"run_dir": run_dir, "losses": {r["step"]: r["loss"] for r in rows}}


def check_ddp_run(entry: dict[str, Any], report: dict[str, Any], cfg: Any, steps: int, rows: list[dict], cuda: bool) -> None:
    """What the phase must show, each named when it does not hold."""
    problems = []
    if report.get("wrapped") != "DistributedDataParallel" or report.get("backend") != ("nccl" if cuda else "gloo"):
        problems.append(f"the drafter ran as {report.get('wrapped')} over {report.get('backend')}, not DDP over {'nccl' if cuda else 'gloo'}")
    if report.get("broadcast_buffers") is not False:
        problems.append(f"DDP broadcast_buffers is {report.get('broadcast_buffers')}: the frozen embedding and LM head go out every step")
    if report.get("no_sync") != steps * (cfg.train.grad_accum - 1):
        problems.append(f"no_sync entered {report.get('no_sync')} times, expected {steps * (cfg.train.grad_accum - 1)}")
    if len(rows) != steps or entry["evals"] < 1 or entry["best"] is None:
        problems.append(f"{len(rows)} steps logged, {entry['evals']} evals, best checkpoint {entry['best']}")
    plan = entry.get("plan")
    if cuda and not isinstance(plan, dict):
        problems.append(f"no memory plan to hold the measured peak against ({plan})")
    elif cuda:
        measured = entry["gpu_memory_peak_gib"] if entry["gpu_memory_peak_gib"] is not None else report.get("max_reserved_gib")
        entry["measured_over_planned"] = round(measured / plan["peak_gib"], 3)
        if measured > plan["peak_gib"]:
            problems.append(f"measured peak {measured} GiB is above the plan's {plan['peak_gib']} GiB (its margin included)")
    if problems:
        raise RuntimeError("; ".join(problems))


def phase_resume(entry: dict[str, Any], ctx: Context) -> None:
    """The train phase's run continued from its checkpoint (train.resume=auto) to resume_steps more."""
    from shared.paths import RunPaths
    from stage2_train.observe.metrics import read_log
    from stage2_train.train.checkpoint.select import step_dirs

    trained = ctx.big.get("train") if ctx.big else None
    if not trained:
        raise RuntimeError("no run to resume: train did not finish")
    sizes, run_dir = ctx.sizes, trained["run_dir"]
    steps = sizes.train_steps + sizes.resume_steps
    overrides = train_overrides(ctx, run_dir, steps, "auto")
    entry["overrides"] = overrides
    started = time.perf_counter()
    report, error = ddp_run(ctx, overrides, "resume")
    entry.update({"ddp": report, "seconds_to_finish": round(time.perf_counter() - started, 1)})
    if error:
        raise RuntimeError(error)
    paths = RunPaths(run_dir)
    starts, rows = [r for r in read_log(paths.log, "event") if r.get("event") == "run_start"], read_log(paths.log, "train")
    entry.update({"resumed_from": starts[-1].get("resumed_from") if starts else None, "steps_logged": [r["step"] for r in rows],
                  "checkpoints": [p.name for p in step_dirs(paths.checkpoints)]})
    expected = list(range(1, steps + 1))
    if entry["resumed_from"] is None or entry["steps_logged"] != expected:
        raise RuntimeError(f"resume started from {entry['resumed_from']} and logged steps {entry['steps_logged']}, expected {expected}")
    if {r["step"]: r["loss"] for r in rows if r["step"] <= sizes.train_steps} != trained["losses"]:
        raise RuntimeError("the resumed run's log no longer holds the first run's losses")


def train_worker(report_path: str, argv: list[str]) -> int:
    """`python -m stage2_train <argv>` as torchrun's one rank, DDP-wrapped: Accelerate wraps a model
    only when it counts more than one process (`PartialState.use_distributed`), so that count is
    lifted here; what was wrapped, over which backend, how often no_sync was entered and torch's peak
    memory go to `report_path`."""
    import accelerate
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    from stage2_train import __main__ as cli

    report: dict[str, Any] = {"wrapped": None, "backend": None, "world_size": None, "no_sync": 0}
    PartialState.use_distributed = property(lambda self: self.distributed_type != DistributedType.NO)
    real_prepare, real_no_sync = accelerate.Accelerator.prepare, accelerate.Accelerator.no_sync

    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real_prepare(self, *args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out
        report.update({"wrapped": type(model).__name__, "world_size": self.num_processes,
                       "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
                       "static_graph": getattr(model, "static_graph", None), "reducer": hasattr(model, "reducer"),
                       "broadcast_buffers": getattr(model, "broadcast_buffers", None)})
        return out

    @contextmanager
    def no_sync(self: Any, model: Any) -> Any:
        report["no_sync"] += 1
        with real_no_sync(self, model):
            yield

    accelerate.Accelerator.prepare, accelerate.Accelerator.no_sync = prepare, no_sync
    try:
        return cli.main(argv)
    finally:
        if torch.cuda.is_available():
            report.update({"max_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                           "max_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)})
        Path(report_path).write_text(json.dumps(report))


def rows_for(phases: dict[str, Any]) -> list[Row]:
    """The training phases' BENCHMARKS.md rows."""
    out = []
    t, r = phases.get("train", {}), phases.get("resume", {})
    if isinstance(t.get("plan"), dict) and t.get("gpu_memory_peak_gib") is not None:
        out.append((f"drafter training peak GPU memory (nvidia-smi), preset micro-batch ({fmt(t['micro_batch_tokens'])} tokens / "
                    f"{fmt(t['micro_batch_blocks'])} blocks), grad_accum {t['grad_accum']}, short supervised samples",
                    f"{t['gpu_memory_peak_gib']} GiB", "<= plan", f"`stage2_train plan` peak_gib {t['plan']['peak_gib']} (torch max "
                    f"reserved {t.get('ddp', {}).get('max_reserved_gib')} GiB)", yes(t["gpu_memory_peak_gib"] <= t["plan"]["peak_gib"])))
    if "ddp" in t and t.get("status") in ("ok", "fallback"):
        d = t["ddp"]
        out.append(("world-size-1 DDP wrap (reducer, no_sync, activation checkpointing, compiled flex), evals, keep_best",
                    f"{d.get('wrapped')} over {d.get('backend')}", "DDP", f"no_sync {d.get('no_sync')}; {t.get('evals')} evals; best {t.get('best')}",
                    yes(True)))
    if "tok_per_s" in t:
        out.append((f"drafter training context tokens/s, {t.get('precision')}, grad_accum {t['grad_accum']}", fmt(t["tok_per_s"]), "",
                    f"{fmt(t.get('block_tok_per_s'))} block tokens/s; median step {t.get('step_s_median')} s; MFU {fmt(t.get('mfu'))}", ""))
    if r.get("status") == "ok":
        out.append(("resume of that run (train.resume=auto)", f"from step {r['resumed_from']}", "continues", f"steps {r['steps_logged']}", yes(True)))
    return out
