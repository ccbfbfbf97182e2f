"""Stage 2 commands: batches (the dry run), train, check; eval/export/doctor/report delegate.

Each takes the composed RunConfig and returns a JSON-able value; `__main__` only parses and prints.
Stage 2 never imports stage 1: the stages talk only through the store.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from shared.config import RunConfig, Section
from shared.store import StoreConfig
from shared.target import TargetConfig
from shared.target_parts import load_embed_and_head
from stage2_train.checkpoint import CheckpointConfig, Checkpointer
from stage2_train.data import EvalConfig, TargetInfo, open_train_data
from stage2_train.detectors import DetectorConfig, LiveDetectors
from stage2_train.loss import LossConfig
from stage2_train.metrics import LogConfig, MetricsSink
from stage2_train.model import DFlashDrafter, DrafterConfig
from stage2_train.noise import NoiseConfig, NoiseSchedule
from stage2_train.sampler import SamplerConfig, describe_steps
from stage2_train.trainer import OptimConfig, TrainConfig, Trainer

SECTIONS: dict[str, type[Section]] = {
    "target": TargetConfig,
    "store": StoreConfig,
    "sampler": SamplerConfig,
    "noise": NoiseConfig,
    "model": DrafterConfig,
    "loss": LossConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "log": LogConfig,
    "doctor": DetectorConfig,
}


def to_json(value: Any) -> str:
    return json.dumps(value, indent=1, default=str)


# ---------------------------------------------------------------------------------------------
# check and batches


def recipe_warnings(cfg: RunConfig) -> list[str]:
    """Every section's departures from the published recipe, gamma checked against the block size."""
    warnings: list[str] = []
    for name, value in cfg.sections.items():
        if name == "loss":
            warnings.extend(value.recipe_warnings(block_size=cfg.model.block_size))
        elif isinstance(value, Section):
            warnings.extend(value.recipe_warnings())
    return warnings


def cmd_check(cfg: RunConfig) -> list[str]:
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    warnings = recipe_warnings(cfg)
    for warning in warnings:
        print(f"WARNING: {warning}", file=sys.stderr)
    if not warnings:
        print("# no departures from the published DFlash recipe", file=sys.stderr)
    return warnings


def cmd_batches(cfg: RunConfig, num_steps: int, world_size: int = 1) -> list[dict[str, Any]]:
    """The next `num_steps` optimizer steps the training run would take (all ranks), nothing trained."""
    data = open_train_data(cfg, rank=0, world_size=world_size)
    return describe_steps(data.sampler, num_steps)


# ---------------------------------------------------------------------------------------------
# train


def make_accelerator(cfg: TrainConfig) -> Any:
    """Accelerator on CUDA when there is one (or asked), else CPU (gloo under torchrun)."""
    from accelerate import Accelerator

    cuda_ok = torch.cuda.is_available()
    if cfg.device == "cuda" and not cuda_ok:
        raise ValueError("train.device=cuda but torch sees no CUDA device")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and cuda_ok)
    bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and use_cuda)
    # cpu=True matters under torchrun: a plain Accelerator() there trains each rank alone.
    accelerator = Accelerator(cpu=not use_cuda, mixed_precision="bf16" if bf16 else "no")
    if not use_cuda and cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    return accelerator


def build_model(cfg: RunConfig, target: TargetInfo, frozen_dtype: torch.dtype) -> DFlashDrafter:
    """The drafter, initialised from cfg.seed (identical on every rank), with the target's frozen parts."""
    torch.manual_seed(cfg.seed)
    model = DFlashDrafter(cfg.model, target.arch, len(target.layer_ids), target.mask_token_id)
    embed_VH, lm_head_VH = load_embed_and_head(target.target_dir)
    tied = embed_VH is lm_head_VH
    embed_VH = embed_VH.to(frozen_dtype)
    model.set_frozen_parts(embed_VH, embed_VH if tied else lm_head_VH.to(frozen_dtype))
    return model


def resolved_settings(data: Any, world_size: int) -> dict[str, Any]:
    """Values known only at run time, saved with the config (checkpoints compare them on resume)."""
    return {
        "layer_ids": data.target.layer_ids,
        "target_fingerprint": data.target.weights_sha256,
        "mask_token_id": data.target.mask_token_id,
        "world_size": world_size,
        "store": data.reader.url,
        "num_train_samples": len(data.train_indices),
        "num_heldout_samples": len(data.heldout_indices),
    }


def hyperparameters(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """The settings that shape the optimisation, flat, for the run_start event and wandb."""
    return {
        **{f"optim.{k}": v for k, v in cfg.optim.to_dict().items()},
        "seed": cfg.seed,
        "epochs": cfg.train.epochs,
        "max_steps": cfg.train.max_steps,
        "world_size": world_size,
        "grad_accum": cfg.sampler.grad_accum,
        "token_budget_per_micro_batch": cfg.sampler.token_budget,
        "token_budget_per_step": cfg.sampler.token_budget * cfg.sampler.grad_accum * world_size,
        "max_anchors_per_seq": cfg.sampler.max_anchors_per_seq,
        "block_size": cfg.model.block_size,
        "num_layers": cfg.model.num_layers,
        "loss.gamma": cfg.loss.gamma,
        "loss.ce_weight": cfg.loss.ce_weight,
        "loss.kl_weight": cfg.loss.kl_weight,
        "noise.std": cfg.noise.std,
        "noise.warmup_steps": cfg.noise.warmup_steps,
        "noise.kind": cfg.noise.kind,
        "recipe_warnings": recipe_warnings(cfg),
    }


def cmd_train(cfg: RunConfig, *, progress: bool = True) -> dict[str, Any]:
    accelerator = make_accelerator(cfg.train)
    rank, world_size = accelerator.process_index, accelerator.num_processes
    run_dir = Path(cfg.run_dir)
    sink = None
    try:
        if accelerator.is_main_process:
            cfg.write_resolved(run_dir / "train_config.yaml")
        sink = MetricsSink(cfg.log, run_dir, rank=rank, run_config=cfg.to_dict())
        data = open_train_data(
            cfg,
            rank=rank,
            world_size=world_size,
            num_threads=cfg.train.num_data_threads,
            prefetch=cfg.train.prefetch,
        )
        frozen_dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
        model = build_model(cfg, data.target, frozen_dtype)
        trainer = Trainer(
            model=model,
            data=data,
            accelerator=accelerator,
            loss_cfg=cfg.loss,
            optim_cfg=cfg.optim,
            train_cfg=cfg.train,
            noise=NoiseSchedule(cfg.noise),
            sink=sink,
            checkpointer=Checkpointer(cfg.checkpoint, cfg.checkpoint.resolve_dir(run_dir), sink, rank, world_size),
            seed=cfg.seed,
            log_every=cfg.log.every_steps,
            eval_cfg=cfg.eval,
            detectors=LiveDetectors(cfg.doctor),
            run_config={**cfg.to_dict(), "resolved": resolved_settings(data, world_size)},
            hyperparameters=hyperparameters(cfg, world_size),
            progress=progress,
        )
        summary = trainer.fit()
        return {**summary, "rank": rank, "world_size": world_size, "run_dir": str(run_dir)}
    finally:
        if sink is not None:
            sink.close()
        accelerator.end_training()  # destroys the process group: a clean exit under torchrun


# ---------------------------------------------------------------------------------------------
# Commands other components provide


COMMAND_MODULES = {
    "eval": "stage2_train.evaluate",
    "export": "stage2_train.export",
    "doctor": "stage2_train.doctor",
    "report": "stage2_train.report",
}


def command_function(command: str) -> Any:
    """`cmd_<command>` of the component that provides it, imported only when that command runs
    (matplotlib, the target model and the speculative decoder stay out of `train`)."""
    return getattr(importlib.import_module(COMMAND_MODULES[command]), f"cmd_{command}")
