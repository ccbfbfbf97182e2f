"""Where a training run runs: the device, the mixed precision and the Accelerator, one per rank.

    accelerator = make_accelerator(cfg.train)       # cuda:LOCAL_RANK set current first; CPU (gloo) without a GPU
"""

from __future__ import annotations

import os
from typing import Any

import torch

from shared.errors import ConfigError
from stage2_train.train.config import TrainConfig

SHARDED_LAUNCHES = {  # accelerate launch's switches for modes whose state is not replicated on every rank
    "ACCELERATE_USE_FSDP": "FSDP",
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM",
}
MIXED_PRECISION = {"bf16": "bf16", "fp32": "no"}


def train_device(cfg: TrainConfig) -> str:
    """"cuda" or "cpu": `train.device` decides for training and evaluation alike."""
    cuda_ok = torch.cuda.is_available()
    if cfg.device == "cuda" and not cuda_ok:
        raise ConfigError("train.device=cuda but torch sees no CUDA device")
    return "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and cuda_ok) else "cpu"


def resolve_mixed_precision(cfg: TrainConfig, use_cuda: bool, launcher: str | None) -> str:
    """Accelerate's mixed_precision for this run. `accelerate launch` passes its config's choice in
    $ACCELERATE_MIXED_PRECISION: train.mixed_precision=auto follows it, an explicit setting that
    disagrees is refused naming both (never overridden in silence). fp16 is refused: it needs a loss
    scaler this trainer does not run, and bf16 is what DFlash drafters train in."""
    wanted = MIXED_PRECISION.get(cfg.mixed_precision, "bf16" if use_cuda else "no")
    if launcher in (None, "", wanted):
        return wanted
    if launcher == "fp16" or launcher not in ("bf16", "no"):
        raise ConfigError(
            f"accelerate launch is configured with mixed_precision={launcher}; this trainer runs bf16 or fp32 "
            f"(train.mixed_precision): set mixed_precision to bf16 or no in `accelerate config`"
        )
    if cfg.mixed_precision == "auto":
        return launcher
    raise ConfigError(
        f"train.mixed_precision={cfg.mixed_precision} but accelerate launch is configured with mixed_precision="
        f"{launcher}: set one of them to agree (train.mixed_precision=auto follows accelerate's)"
    )


def make_accelerator(cfg: TrainConfig) -> Any:
    """Accelerator on CUDA when there is one (or asked), else CPU (gloo under torchrun).

    Each rank's GPU is made current (`torch.cuda.set_device(LOCAL_RANK)`) before anything touches
    CUDA, so every default stream, event and allocation of this process is on its own device. FSDP,
    DeepSpeed and Megatron launches are refused by name: checkpoints here hold DDP-replicated state
    written once by rank 0, which sharded state would silently break."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, GradientAccumulationPlugin

    for var, name in SHARDED_LAUNCHES.items():
        if os.environ.get(var, "false").strip().lower() in ("1", "true", "yes", "y", "on"):
            raise ConfigError(
                f"accelerate launch is configured for {name} ({var}); this trainer keeps replicated DDP state "
                f"(its checkpoints write the model and optimizer once, from rank 0). The drafter fits every GPU "
                f"(`python -m stage2_train plan`): use distributed_type MULTI_GPU (`accelerate launch --multi_gpu`) "
                f"or torchrun"
            )
    # Accelerate divides every backward's loss by its own accumulation count, read from the environment
    # when not given: a count the launcher set would shrink each update that many times, silently.
    launcher_accum = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1").strip() or "1"
    if launcher_accum != "1":
        raise ConfigError(
            f"accelerate launch is configured with gradient_accumulation_steps={launcher_accum} "
            f"(ACCELERATE_GRADIENT_ACCUMULATION_STEPS); this trainer accumulates train.grad_accum micro-batches "
            f"itself: set train.grad_accum={launcher_accum} and gradient_accumulation_steps to 1 in `accelerate config`"
        )
    use_cuda = train_device(cfg) == "cuda"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    mixed = resolve_mixed_precision(cfg, use_cuda, os.environ.get("ACCELERATE_MIXED_PRECISION"))
    # cpu=True matters under torchrun: a plain Accelerator() there trains each rank alone. The
    # drafter's buffers (the target's embedding and LM head, the fitted projection) are equal on every
    # rank by construction: DDP's default would re-send them from rank 0 before every step (2.5 GB at 8B).
    ddp = DistributedDataParallelKwargs(broadcast_buffers=False)
    accelerator = Accelerator(cpu=not use_cuda, mixed_precision=mixed, kwargs_handlers=[ddp],
                              gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1))
    if accelerator.distributed_type.value in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        raise ConfigError(f"accelerate chose distributed_type {accelerator.distributed_type.value}; use MULTI_GPU or torchrun")
    if not use_cuda and cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    return accelerator
