"""What a stage-1 verb resolves from the run config, once, before any step runs.

    prepared = prepare_run(cfg)       # the target's record, the store's header and files, the rows

The verbs (`commands.py`, `plan.py`, `generate_command.py`) are the only stage-1 code that holds the
whole RunConfig; the steps they call (prepare, tokens, extract, writer, generate, verify) receive
sections and records. The store's identity (`shared/identity.py`) is computed from the run config
here, the same way stage 2 computes it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from shared.config import RunConfig
from shared.errors import ConfigError
from shared.identity import extraction_source, generated_problem, prompt_template, store_header
from shared.mask_token import check_mask_token
from shared.paths import RunPaths
from shared.store import StoreFiles
from shared.target import TargetInfo, resolve_target
from stage1_extract.data import DataConfig
from stage1_extract.forward import check_packing
from stage1_extract.prepare import Prepared, pinned_header, prepare
from stage1_extract.tensor_parallel import tensor_parallel_problem


def source_format(data: DataConfig) -> str:
    """How the conversations extraction reads are parsed: data.format describes data.path; the
    answers `generate` writes are read as what they are."""
    return "auto" if data.regenerate else data.format


def resolve_store(cfg: RunConfig, *, deep: bool = False) -> tuple[TargetInfo, StoreFiles, dict[str, Any]]:
    """(the target's record, the store's files, its identity header). `deep`: rehash the target's
    weights whatever the fingerprint cache says."""
    target = resolve_target(cfg.target, deep=deep)
    check_mask_token(cfg.target, target)
    files = StoreFiles(RunPaths.of(cfg).store)
    pinned = pinned_header(files)
    header = store_header(cfg, target, pinned.get("extraction"), pinned.get("identity_version"))
    if header["extraction"]["packed"]:  # before any row is read: a refused setting costs nothing
        check_packing(header["extraction"]["attn_implementation"], target.arch.model_type)
    tensor_parallel = cfg.extract.tensor_parallel_size  # how this run splits the target (not the store's identity)
    problem = tensor_parallel_problem(target.arch, tensor_parallel)
    if problem:
        raise ConfigError(f"{problem}: choose a size that divides them (`python -m stage1_extract plan` names the smallest that fits)")
    if tensor_parallel > 1 and cfg.store.dtype == "fp4":
        raise ConfigError(
            f"store.dtype=fp4 with extract.tensor_parallel_size={tensor_parallel}: fp4 fits its outlier channels on "
            f"rank 0 with the whole target on one GPU; store bf16 or fp8 for a target split across GPUs"
        )
    return target, files, header


def prepare_run(cfg: RunConfig, *, use_token_cache: bool = True, deep: bool = False) -> Prepared:
    """The rows of the data extraction reads, tokenized (or from the token cache), with the store's
    header and whether the generated answers still belong to this config."""
    target, files, header = resolve_store(cfg, deep=deep)
    source: Path = extraction_source(cfg)
    cache_root = RunPaths.of(cfg).token_cache if use_token_cache else None
    prepared = prepare(cfg.data, target, header, files, source, source_format(cfg.data), cache_root)
    return replace(prepared, generated_problem=generated_problem(
        cfg, target.weights_sha256, prompt_template(target.tokenizer_hashes()), target.config_sha256))
