"""`plan`: the store's size against the free space, and the hours of each stage, before anything runs.

    python -m stage1_extract plan --config my-qwen3.yaml --gpu h100 --gpus 8

The first command a user runs. Before `generate` there are no answers to measure: the prompts are
tokenized (up to `SAMPLE_ROWS` of them, spread over the data, the totals scaled) with each answer to
come estimated: where the data holds an answer at that turn, its own length capped at
generate.max_new_tokens (another model's answer to the same prompt); where it does not,
`ANSWER_SHARE` x max_new_tokens (a guess, not a measurement). Beside that estimate stands the bound
with every answer at max_new_tokens: the store can be no larger. After `generate` the answers
themselves are tokenized, as `extract` will.

Hours come from the per-GPU rates in `GPUS` (each with its source) for the GPU kind and count the
user names; every assumption is spelled in the result, so a user can replace it with their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.config import RunConfig
from shared.conversation_files import read_conversations
from shared.conversations import Conversation, ReadStats
from shared.errors import ConfigError, DataError
from shared.identity import prompts_path
from shared.paths import RunPaths
from shared.target import TargetArch, cached_tokenizer
from stage1_extract.generate import assistant_slots
from stage1_extract.generate_command import prompts_format
from stage1_extract.merge import row_accounting
from stage1_extract.prepare import row_limits, token_bytes
from stage1_extract.resolve import prepare_run, resolve_store
from stage1_extract.template import check_template_variables
from stage1_extract.tensor_parallel import (
    RESERVE_GIB,
    fitting_size,
    launch_problem,
    weight_gib_per_gpu,
    working_set_gib,
)
from stage1_extract.tokens import resolve_workers, tokenize_all

SAMPLE_ROWS = 20_000  # prompts tokenized before generate; the totals are scaled to all rows
ANSWER_SHARE = 0.5  # an answer the data does not hold: this share of generate.max_new_tokens (a guess)


@dataclass(frozen=True)
class GpuRates:
    """What one GPU does, for the hour estimates; `source` says where each figure comes from."""

    name: str
    bf16_tflops: float  # dense bf16 peak (no sparsity), TFLOP/s
    generate_tok_s: float  # vLLM output tokens/s per GPU, offline batch, an 8B target in bf16
    source: str
    memory_gib: float  # nvidia-smi's total: H100 SXM 81,559 MiB, H200 143,771, A100 SXM 80 GB 81,920, L40S 46,068


# Generation runs the target in bf16 (target.dtype: vllm gets no quantization), while the published
# offline figures for an 8B target are FP8: MLPerf Inference v5.1 Llama-3.1-8B Offline, Red Hat's
# vLLM 0.10.0 submissions with FP8 weights, 5,777 tok/s on one H100 and 1,642 on one L40S. vLLM's FP8
# page puts FP8 W8A8 at "up to a 1.6x improvement in throughput" over 16-bit, so bf16 is taken as the
# FP8 figure / 1.6: at most that much slower, hours on the long side.
FP8_SPEEDUP = 1.6
MLPERF = "MLPerf Inference v5.1 Llama-3.1-8B Offline, {} tok/s on one {} with FP8 weights (Red Hat, vLLM 0.10.0)"
BF16 = f"/ {FP8_SPEEDUP:g} for bf16 (vLLM's FP8 W8A8 page: up to {FP8_SPEEDUP:g}x the throughput)"
H100_BF16_TOK_S = 5777.0 / FP8_SPEEDUP

GPUS = {
    "h100": GpuRates(
        "H100 SXM", 989.0, H100_BF16_TOK_S,
        f"bf16 peak: NVIDIA H100 datasheet; generation: {MLPERF.format('5,777', 'H100')} {BF16}", 79.6,
    ),
    "h200": GpuRates(
        "H200 SXM", 989.0, H100_BF16_TOK_S * 4.8 / 3.35,
        "bf16 peak: NVIDIA H200 datasheet (the H100's compute); generation: the H100's bf16 figure x 4.8/3.35 TB/s "
        "memory bandwidth (decoding reads every weight per step)", 140.4,
    ),
    "a100": GpuRates(
        "A100 SXM", 312.0, H100_BF16_TOK_S / 2,
        "bf16 peak: NVIDIA A100 datasheet; generation: the H100's bf16 figure / 2 (Lambda's vLLM benchmark: H100 ~2x "
        "A100)", 80.0,
    ),
    "l40s": GpuRates(
        "L40S", 362.0, 1642.0 / FP8_SPEEDUP,
        f"bf16 peak: NVIDIA L40S datasheet; generation: {MLPERF.format('1,642', 'L40S')} {BF16}", 45.0,
    ),
}
DEFAULT_GPU = "h100"
EXTRACT_MFU = 0.40  # the target's forward in bf16 with flash-attn, as the README's capacity model assumes
WRITE_GB_S_PER_NODE = 2.0  # sustained writes to the store, per node of 8 GPUs (the README's capacity model)
TRAIN_TOK_S = 26_000.0  # the failed run: an 8B target's DFlash drafter on 8 GPUs (BRIEF.md); taken as 8 H100s
TRAIN_GPUS, TRAIN_GPU = 8, "h100"
REFERENCE_PARAMS = 8e9  # the generation rates' target


def cmd_plan(cfg: RunConfig, *, gpu: str | None = None, gpus: int = 8) -> dict[str, Any]:
    """Samples, tokens, bytes and free space of the store this config makes, and hours per stage on
    `gpus` GPUs of kind `gpu` (default h100)."""
    kind = (gpu or DEFAULT_GPU).lower()
    if kind not in GPUS:
        raise ConfigError(f"plan --gpu {gpu!r}: known GPU kinds are {', '.join(GPUS)} (their rates: stage1_extract/plan.py)")
    if gpus < 1:
        raise ConfigError(f"plan --gpus must be >= 1, got {gpus}")
    problem = launch_problem(cfg.extract.tensor_parallel_size, gpus, f"plan --gpus {gpus}")
    if problem is not None:  # before a row is read: extract would refuse this job as late as that
        raise ConfigError(problem)
    data = cfg.data
    generated = RunPaths.of(cfg).generated
    if data.regenerate and not generated.exists():
        target, files, header = resolve_store(cfg)
        sizes = estimate_answers(cfg, target.target_dir)
        answers = (
            f"estimated from {sizes.num_tokenized} of {sizes.num_rows} prompts tokenized"
            + (" (spread over the data, totals scaled)" if sizes.num_tokenized < sizes.num_rows else "")
            + f": {sizes.given} answer(s) at the data's own length (at most generate.max_new_tokens="
            f"{cfg.generate.max_new_tokens}), {sizes.guessed} at {ANSWER_SHARE:g} x max_new_tokens (a guess); "
            f"run `python -m stage1_extract generate` and plan again to measure them"
        )
        scale = sizes.scale
        plan = store_size(len(sizes.lengths) * scale, sizes.lengths.sum() * scale, sizes.truncated * scale,
                          sizes.skipped * scale, header, cfg)
        bound = store_size(len(sizes.bound_lengths) * scale, sizes.bound_lengths.sum() * scale, 0, 0, header, cfg)
        plan.update({"answers": "estimated", "answers_estimated": answers, "total_bytes_at_most": bound["total_bytes"],
                     "bad_rows_skipped": sizes.bad_rows})
        generate_tokens = float(sizes.answer_tokens * scale)
    else:
        prepared = prepare_run(cfg)
        target, files, header = prepared.target, prepared.files, prepared.header
        rows = prepared.rows
        kept = [len(r.input_ids) for r in rows if not r.skipped]
        plan = store_size(len(kept), sum(kept), sum(r.truncated for r in rows), sum(r.skipped for r in rows), header, cfg)
        plan.update({"answers": "generated" if data.regenerate else "given (data.regenerate=false)",
                     "bad_rows_skipped": prepared.stats.bad_rows})
        made = {"source": str(prepared.source), "rows_read": prepared.stats.rows, "bad_rows_skipped": prepared.stats.bad_rows,
                "leading_turns_dropped": prepared.stats.leading_turns_dropped,
                **({"generate": prepared.generate} if prepared.regenerated else {})}
        plan["rows"] = row_accounting(made, plan["samples"], plan["samples_skipped"])  # as extract will count them
        if prepared.generated_problem:
            plan["generated_data"] = prepared.generated_problem
        generate_tokens = None
    plan["gpu_memory"] = extraction_memory(cfg, target, kind)
    free = files.free_bytes()
    plan.update(
        {
            "store": files.url,
            "storage": cfg.store.describe(),
            "free_bytes": free,
            "fits": None if free is None else plan["total_bytes"] <= free,
            "time": stage_hours(target.arch, plan, generate_tokens, kind, gpus, int(cfg.value("train.epochs", 6))),
        }
    )
    return plan


def extraction_memory(cfg: RunConfig, target: Any, kind: str) -> dict[str, Any]:
    """GiB on each GPU while extracting at `extract.tensor_parallel_size`: the target's weights (split by
    its TP plan, the embedding and norms whole), the forward's working set, a reserve; ConfigError when
    that passes the GPU's memory, naming the smallest size that fits."""
    rates, extract, arch = GPUS[kind], cfg.extract, target.arch
    dtype = cfg.target.dtype if cfg.target.dtype != "auto" else "bf16"  # what a GPU runs
    dtype_bytes = 4 if dtype == "fp32" else 2
    attn = cfg.target.attn_implementation  # packed with sdpa or eager: a [tokens, tokens] mask per batch
    packed_mask = attn if extract.packed == "on" and attn in ("sdpa", "eager") else None

    def need(tp: int) -> tuple[float, float, str]:
        weights, source = weight_gib_per_gpu(target.target_dir, arch, dtype_bytes, tp)
        working = working_set_gib(
            arch, len(target.layer_ids), extract.batch_tokens, extract.lm_head_chunk_tokens, dtype_bytes, tp, packed_mask
        )
        return weights, working, source

    tp = extract.tensor_parallel_size
    weights, working, source = need(tp)
    total = weights + working + RESERVE_GIB
    smallest = fitting_size(lambda t: sum(need(t)[:2]) + RESERVE_GIB <= rates.memory_gib, arch)
    out = {
        "tensor_parallel_size": tp,
        "weights_gib_per_gpu": round(weights, 2),
        "working_set_gib": round(working, 2),
        "reserve_gib": RESERVE_GIB,
        "total_gib": round(total, 2),
        "gpu": kind,
        "gpu_memory_gib": rates.memory_gib,
        "fits": total <= rates.memory_gib,
        "smallest_tensor_parallel_size": smallest,
        "basis": f"{dtype} weights from {source}, split {tp} way(s) but the embedding and norms; working set: one "
        f"{extract.batch_tokens:,}-token batch's layer activations, captured layers and one "
        f"{extract.lm_head_chunk_tokens:,}-token LM-head chunk (an upper bound)"
        + (f", and the packed batch's [tokens, tokens] {attn} mask" if packed_mask else "")
        + "; reserve for the CUDA context and NCCL",
    }
    if not out["fits"]:
        fix = (f"set extract.tensor_parallel_size={smallest} (and launch a multiple of it per node)" if smallest
               else "no tensor-parallel size the target's heads allow fits: use a larger GPU (--gpu)")
        raise ConfigError(
            f"extract.tensor_parallel_size={tp}: {weights:.1f} GiB of weights per GPU + {working:.1f} GiB working set + "
            f"{RESERVE_GIB:g} GiB reserve = {total:.1f} GiB, more than a {rates.name}'s {rates.memory_gib:g} GiB; {fix}"
        )
    return out


def store_size(
    samples: float, tokens: float, truncated: float, skipped: float, header: dict[str, Any], cfg: RunConfig
) -> dict[str, Any]:
    """The store's samples, tokens and bytes (of the samples kept; estimates are rounded)."""
    samples, tokens = int(round(samples)), int(round(float(tokens)))
    per_token = token_bytes(header, cfg.store)
    total = tokens * per_token
    return {
        "samples": samples,
        "samples_truncated": int(round(truncated)),
        "samples_skipped": int(round(skipped)),
        "tokens": tokens,
        "mean_tokens": round(tokens / max(1, samples), 1),
        "bytes_per_token": per_token,
        "total_bytes": total,
        "total_gib": round(total / 2**30, 3),
        "compression_note": "zstd typically saves 1.2-1.3x on hidden states (not counted)"
        if cfg.store.compression == "zstd"
        else "uncompressed",
        "num_shards_estimate": math.ceil(total / (cfg.store.shard_mb * 2**20)) if tokens else 0,
    }


# ---------------------------------------------------------------------------------------------
# Answers before they exist


@dataclass
class AnswerEstimate:
    lengths: np.ndarray  # per kept sampled row: tokens after the template, answers estimated, cut to max_length
    bound_lengths: np.ndarray  # the same with every answer at max_new_tokens
    truncated: int
    skipped: int
    answer_tokens: float  # tokens the target will generate for the sampled rows
    given: int  # answers estimated from the data's own
    guessed: int  # answers estimated at ANSWER_SHARE x max_new_tokens
    num_rows: int
    num_tokenized: int
    bad_rows: int

    @property
    def scale(self) -> float:
        return self.num_rows / max(1, self.num_tokenized)


def estimate_answers(cfg: RunConfig, target_dir: Any) -> AnswerEstimate:
    """Every prompt's length after the template with the answers `generate` will write, estimated
    (module docstring). Each turn to be generated is rendered empty and its answer's tokens added."""
    data, max_new = cfg.data, cfg.generate.max_new_tokens
    tokenizer, _ = cached_tokenizer(str(target_dir))
    check_template_variables(tokenizer, data.chat_template_kwargs, cfg.target.path)
    stats = ReadStats()
    conversations = prompt_conversations(cfg, tokenizer, stats)
    if not conversations:
        raise DataError(f"{prompts_path(cfg)}: no usable rows")
    step = max(1, math.ceil(len(conversations) / SAMPLE_ROWS))
    sample = conversations[::step]
    emptied, answers = [], []
    for conv in sample:
        messages, lengths = list(conv.messages), []
        for slot in assistant_slots(conv.messages):
            given = messages[slot]["content"] if slot < len(messages) else None
            lengths.append(given)
            reply = {"role": "assistant", "content": ""}
            messages = messages[:slot] + [reply] + messages[slot + 1 :]
        emptied.append(Conversation(conv.row, messages, conv.source, conv.tools))
        answers.append(lengths)
    texts = [t for row in answers for t in row if t]
    counts = iter(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
    given = guessed = 0
    answer_lengths = []
    for row in answers:
        per_row = []
        for text in row:
            if text:
                per_row.append(min(max_new, next(counts)))
                given += 1
            else:
                per_row.append(round(ANSWER_SHARE * max_new))
                guessed += 1
        answer_lengths.append(per_row)
    kept, bound, answer_tokens, truncated, skipped, bad = [], [], 0.0, 0, 0, 0
    big = 1 << 30  # the full length: truncation is decided below, with the answers added
    workers = resolve_workers(data.tokenize_workers)
    for per_row, (row, sample_out) in zip(answer_lengths, tokenize_all(tokenizer, emptied, big, workers, data.chat_template_kwargs)):
        if isinstance(sample_out, str):
            if data.on_bad_row == "raise":
                raise DataError(f"{prompts_path(cfg)}: row {row}: {sample_out} (set data.on_bad_row=skip to skip and count bad rows)")
            bad += 1
            continue
        length = len(sample_out.input_ids) + sum(per_row)
        if length > data.max_length and data.on_long == "skip":
            skipped += 1
            continue
        truncated += length > data.max_length
        kept.append(min(length, data.max_length))
        bound.append(min(len(sample_out.input_ids) + max_new * len(per_row), data.max_length))
        answer_tokens += sum(per_row)
    return AnswerEstimate(
        np.asarray(kept, dtype=np.float64), np.asarray(bound, dtype=np.float64), truncated, skipped, answer_tokens,
        given, guessed, len(conversations), len(sample), stats.bad_rows + round(bad * len(conversations) / len(sample)),
    )


def prompt_conversations(cfg: RunConfig, tokenizer: Any, stats: ReadStats) -> list[Conversation]:
    """The prompts `generate` will read (the embedded default set is built in memory, not written)."""
    data = cfg.data
    if data.path is None:
        from stage1_extract.corpus import default_conversations

        count = data.num_default_prompts if data.max_samples is None else min(data.max_samples, data.num_default_prompts)
        return default_conversations(data.num_default_prompts, question_share=data.default_question_share)[:count]
    return list(
        read_conversations(
            prompts_path(cfg), data_format=prompts_format(cfg), on_bad_row=data.on_bad_row,
            max_samples=data.max_samples, stats=stats, limits=row_limits(tokenizer, data.max_length),
        )
    )


# ---------------------------------------------------------------------------------------------
# Hours


def target_params(arch: TargetArch) -> float:
    """Parameters a token passes through: attention and MLP of every layer, and the LM head."""
    attention = arch.hidden_size * arch.head_dim * (2 * arch.num_attention_heads + 2 * arch.num_key_value_heads)
    mlp = 3 * arch.hidden_size * arch.intermediate_size
    return float(arch.num_hidden_layers * (attention + mlp) + arch.vocab_size * arch.hidden_size)


def stage_hours(
    arch: TargetArch, plan: dict[str, Any], generate_tokens: float | None, kind: str, gpus: int, epochs: int
) -> dict[str, dict[str, Any]]:
    """{stage: {hours, gpus, gpu, basis}} for generate (when the answers are still to come), extract
    and train, each with the assumptions it rests on."""
    rates = GPUS[kind]
    params = target_params(arch)
    out: dict[str, dict[str, Any]] = {}

    def entry(seconds: float, basis: str) -> dict[str, Any]:
        return {"hours": float(f"{seconds / 3600:.3g}"), "gpus": gpus, "gpu": kind, "basis": basis}

    if generate_tokens is not None:
        per_gpu = rates.generate_tok_s * REFERENCE_PARAMS / params
        out["generate"] = entry(
            generate_tokens / (per_gpu * gpus),
            f"{generate_tokens:,.0f} answer tokens at {per_gpu:,.0f} tok/s per GPU: {rates.generate_tok_s:,.0f} for a bf16 8B "
            f"target x 8B / {params / 1e9:.2g}B parameters ({rates.source.split('generation: ')[1]}); prefill not "
            f"counted apart",
        )
    tokens, total_bytes = plan["tokens"], plan["total_bytes"]
    flops = 2 * params + 4 * plan["mean_tokens"] * arch.hidden_size * arch.num_hidden_layers  # dense + attention
    compute_s = tokens * flops / (gpus * rates.bf16_tflops * 1e12 * EXTRACT_MFU)
    nodes = math.ceil(gpus / 8)
    write_s = total_bytes / (nodes * WRITE_GB_S_PER_NODE * 1e9)
    out["extract"] = entry(
        max(compute_s, write_s),
        f"{flops / 1e9:.3g} GFLOP/token at {EXTRACT_MFU:.0%} of {rates.bf16_tflops:g} TFLOP/s bf16 = "
        f"{compute_s / 3600:.2f} h, against writing {total_bytes / 1e12:.3g} TB at {WRITE_GB_S_PER_NODE:g} GB/s per node "
        f"({nodes} node(s)) = {write_s / 3600:.2f} h: the larger counts",
    )
    scale = rates.bf16_tflops / GPUS[TRAIN_GPU].bf16_tflops
    per_gpu = TRAIN_TOK_S / TRAIN_GPUS * scale
    out["train"] = entry(
        epochs * tokens / (per_gpu * gpus),
        f"train.epochs={epochs} x {tokens:,} tokens at {per_gpu:,.0f} tok/s per GPU: the failed run's "
        f"{TRAIN_TOK_S:,.0f} tok/s on {TRAIN_GPUS} GPUs (an 8B target's drafter, taken as {TRAIN_GPU.upper()}s)"
        + (f" x {scale:.2f} ({rates.name} / {GPUS[TRAIN_GPU].name} bf16 peak)" if kind != TRAIN_GPU else "")
        + "; train.max_steps, if set, stops it earlier",
    )
    return out
