"""The `generate` verb: the target rewrites every assistant turn of the prompts (vllm on GPU, one
engine per rank under torchrun; transformers on CPU), resumable part by part.

    torchrun --nproc_per_node 8 -m stage1_extract generate --config my-qwen3.yaml

It resolves what generation needs from the run config (the prompts, the target, the sampling
settings and what the answers' provenance records) and hands `generate.generate_all` sections.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shared.config import RunConfig
from shared.conversation_files import read_conversations
from shared.conversations import Conversation, ReadStats
from shared.errors import ConfigError, DataError
from shared.files import write_atomic
from shared.fingerprints import config_fingerprint, weights_fingerprint
from shared.identity import generate_settings, generation_inputs, prompt_template, prompts_path
from shared.lock import exclusive
from shared.paths import RunPaths
from shared.target import (
    TargetArch,
    cached_tokenizer,
    resolve_target_dir,
    stop_token_ids,
)
from shared.target_model import load_target_model, resolve_device, resolve_dtype
from shared.token_cache import source_fingerprint
from stage1_extract.backends import (
    BatchEngine,
    backend_problem,
    resolve_backend,
    transformers_backend,
    vllm_engine,
)
from stage1_extract.distributed import distributed_context, rank_device
from stage1_extract.generate import generate_all
from stage1_extract.template import check_template_variables, template_refusal

log = logging.getLogger(__name__)


def prompts_format(cfg: RunConfig) -> str:
    """data.format describes data.path; the embedded default prompts are read as what they are."""
    return cfg.data.format if cfg.data.path is not None else "auto"


def default_prompts(cfg: RunConfig) -> Path:
    """The conversations `generate` reads (shared.identity.prompts_path), the embedded default prompt
    set written under run_dir the first time it is needed."""
    path = prompts_path(cfg)
    if cfg.data.path is None and not path.exists():
        from stage1_extract.corpus import write_default_prompts

        write_default_prompts(path, cfg.data.num_default_prompts, cfg.data.default_question_share)
    return path


def template_accepted(
    conversations: list[Conversation], tokenizer: Any, source: Path, cfg: RunConfig, stats: ReadStats
) -> list[Conversation]:
    """The rows the chat template renders: one it refuses is a bad row (named, or skipped and counted with
    data.on_bad_row=skip) before any is generated, not a jinja traceback mid-run naming none."""
    kept = []
    for conv in conversations:
        problem = template_refusal(tokenizer, conv.messages, conv.tools, cfg.data.chat_template_kwargs)
        if problem is None:
            kept.append(conv)
            continue
        message = f"{source}: row {conv.row}: {problem}"
        if cfg.data.on_bad_row == "raise":
            raise DataError(message + " (set data.on_bad_row=skip to skip and count bad rows)")
        stats.bad_rows += 1
        log.warning("skipping %s", message)
    return kept


def cmd_generate(cfg: RunConfig, progress: bool = True) -> dict[str, Any]:
    if not cfg.data.regenerate:  # `make extract` always asks; with answers given there is nothing to do
        return {"skipped": "data.regenerate=false: extraction reads data.path as it is", "input": cfg.data.path}
    problem = backend_problem(cfg.generate.backend)
    # Before any data is read when nothing was made yet (reading 800K rows first would hide it for
    # minutes); a run whose parts are all done needs no engine (`make extract` always asks generate).
    if problem is not None and not any(RunPaths.of(cfg).generated_parts.glob("part-*.parquet")):
        raise ConfigError(problem)
    source = default_prompts(cfg)
    stats = ReadStats()
    conversations = list(
        read_conversations(
            source, data_format=prompts_format(cfg), on_bad_row=cfg.data.on_bad_row, max_samples=cfg.data.max_samples,
            stats=stats,
        )
    )
    paths = RunPaths.of(cfg)
    out = paths.generated
    rank, world, local_rank = distributed_context()
    if rank == 0:
        cfg.write_resolved(out.with_name("generate_config.yaml"))
    # vLLM forks its engine process: CUDA must not be initialised here first. torch's plain
    # is_available() runs cuInit (the fork's CUDA then fails); its NVML check does not.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    device = resolve_device(cfg.extract.device)
    backend_name = resolve_backend(cfg.generate.backend, device)
    model_dir = resolve_target_dir(cfg.target)
    tokenizer, fingerprints = cached_tokenizer(str(model_dir))  # the one extract and status use, loaded once
    check_template_variables(tokenizer, cfg.data.chat_template_kwargs, cfg.target.path)
    template = prompt_template(fingerprints)  # what renders the prompts answered
    weights_sha256, config_sha256 = weights_fingerprint(model_dir), config_fingerprint(model_dir)
    settings = generate_settings(cfg, weights_sha256, template, config_sha256)
    # The tokens a sample may hold: a prompt past them is not sent, on every backend (generate.py).
    positions = TargetArch.from_dir(model_dir).max_position_embeddings
    context = min((cfg.data.max_length, f"data.max_length={cfg.data.max_length}"),
                  (positions, f"the target's max_position_embeddings={positions}"))
    conversations = template_accepted(conversations, tokenizer, source, cfg, stats)
    read_counts = {"prompts": str(source), "rows_read": stats.rows, "bad_rows_skipped": stats.bad_rows,
                   "leading_turns_dropped": stats.leading_turns_dropped}

    def make_engine():
        if problem is not None:
            raise ConfigError(problem)
        if backend_name == "vllm":
            dtype = resolve_dtype(cfg.target.dtype, device)
            stop_ids = stop_token_ids(tokenizer, model_dir=model_dir)
            with vllm_process_view(local_rank, world, cfg.generate.tensor_parallel_size):
                return vllm_engine(str(model_dir), cfg.generate, cfg.generate.seed, dtype, stop_ids, rank)
        model = load_target_model(cfg.target, rank_device(cfg.extract.device, local_rank))
        return BatchEngine(transformers_backend(model, tokenizer, cfg.generate, cfg.generate.seed))

    # Rank 0 holds the data folder; every other rank its own slot, so a second job is refused on each.
    lock_dir = out.parent if rank == 0 else paths.generated_parts / "ranks" / str(rank)
    with exclusive(str(lock_dir), "stage1_extract generate") as lock:
        if rank == 0:  # what the answers were made from goes with them: gone until they are rewritten
            paths.generated_provenance.unlink(missing_ok=True)
        result = generate_all(
            conversations, tokenizer, make_engine, out, cfg.generate, settings, cfg.generate.seed,
            progress=progress and rank == 0, rank=rank, world=world, context=context, read_counts=read_counts,
            template_kwargs=cfg.data.chat_template_kwargs,
        )
        if rank == 0:
            inputs = generation_inputs(cfg, weights_sha256, source_fingerprint(source), template, config_sha256)
            provenance = {"prompts": str(source), "inputs": inputs, "num_conversations": result.num_conversations}
            write_atomic(paths.generated_provenance, json.dumps(provenance, indent=1))
    return {
        "output": str(result.path),
        "prompts": str(source),
        "rows_read": stats.rows,  # rows of the user's file read, bad ones included
        "conversations": result.num_conversations,
        "bad_rows_skipped": stats.bad_rows,
        "leading_turns_dropped": stats.leading_turns_dropped,  # not regenerated: they answer no user turn
        "generated_tokens": result.num_generated_tokens,
        "seconds": round(result.seconds, 1),
        "backend_start_seconds": round(result.start_seconds, 3),
        "generate_call_seconds": round(result.generate_seconds, 3),
        "parts_reused": result.parts_reused,
        "tool_call_turns_kept": result.tool_call_turns_kept,
        # Turns whose prompt passed `prompt_limit` (a sample's context, or vLLM's max_model_len): kept as the data has them.
        "long_prompt_turns_kept": result.long_prompt_turns_kept,
        "prompt_limit": result.prompt_limit,
        "prompt_limit_why": result.prompt_limit_why,
        "in_flight_limit": result.in_flight_limit,  # requests kept in the engine: its max_num_seqs, at least a part
        # Answers generate.max_new_tokens cut before the target ended them (their end-of-turn marker is
        # not supervised, their rows' later turns dropped), and answers of parts too old to say.
        "answers": result.answers,
        "answers_cut": result.answers_cut,
        "answers_cut_share": round(result.answers_cut / result.answers, 4) if result.answers else 0.0,
        "answers_cut_unknown": result.answers_cut_unknown,
        "turns_dropped_after_cut": result.turns_dropped_after_cut,
        "max_new_tokens": cfg.generate.max_new_tokens,
        "backend": backend_name,
        "rank": rank,
        "world_size": world,
        "lock": lock,
    }


@contextmanager
def vllm_process_view(local_rank: int, world: int, tensor_parallel_size: int) -> Iterator[None]:
    """What a vLLM engine of one torchrun rank must see while it starts: only this rank's GPU(s)
    (local ranks x tensor_parallel_size consecutive devices), and no torchrun variables (with RANK or
    WORLD_SIZE set vLLM would join the launcher's world instead of building its own of one engine).
    The engine's worker processes are spawned, not forked (a fork of a process that touched CUDA
    cannot use it, and vLLM forks unless it sees CUDA initialised). The environment is restored
    afterwards; the engine's processes keep the view they started with."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT")
    kept = (*names, "CUDA_VISIBLE_DEVICES", "VLLM_WORKER_MULTIPROC_METHOD")
    saved = {k: os.environ[k] for k in kept if k in os.environ}
    try:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if world > 1:
            visible = saved.get("CUDA_VISIBLE_DEVICES")
            devices = visible.split(",") if visible else [str(i) for i in range(local_device_count())]
            first = local_rank * tensor_parallel_size
            mine = devices[first : first + tensor_parallel_size]
            if len(mine) < tensor_parallel_size:
                raise ConfigError(
                    f"generate: local rank {local_rank} x generate.tensor_parallel_size={tensor_parallel_size} needs GPUs "
                    f"{first}..{first + tensor_parallel_size - 1}, this node has {len(devices)}; run "
                    f"--nproc_per_node {max(1, len(devices) // tensor_parallel_size)}"
                )
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
            for name in names:
                os.environ.pop(name, None)
        yield
    finally:
        for name in kept:
            os.environ.pop(name, None)
        os.environ.update(saved)


def local_device_count() -> int:
    import torch

    return torch.cuda.device_count()
