"""Stage 2 commands: check, batches (the dry run), train, eval, export, doctor, report.

Each takes the composed RunConfig and returns a JSON-able value; `__main__` only parses and prints.
This is the one module that composes the rooms (data, model, train, observe, serve); the heavier
ones are imported inside the command that needs them, so `doctor` never loads torch models and
`train` never loads the speculative decoder. Stage 2 never imports stage 1: the stages talk only
through the store.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from shared.config import RunConfig
from shared.errors import StoreError
from shared.files import write_atomic

# ---------------------------------------------------------------------------------------------
# batches and train


def cmd_batches(cfg: RunConfig, num_steps: int, world_size: int = 1) -> list[dict[str, Any]]:
    """The next `num_steps` optimizer steps the training run would take (all ranks), nothing trained."""
    from stage2_train.data.run_data import open_run_data
    from stage2_train.data.sampler import describe_steps

    return describe_steps(open_run_data(cfg, world_size=world_size).sampler, num_steps)


def cmd_train(cfg: RunConfig, *, progress: bool = True) -> dict[str, Any]:
    from stage2_train.data.view import resolve_target
    from stage2_train.train.trainer import Trainer, make_accelerator

    init_weights = None
    if cfg.model.init_from:
        from stage2_train.serve.export import init_weights_for

        init_weights = init_weights_for(cfg.model.init_from, cfg.model, resolve_target(cfg.target))
    accelerator = make_accelerator(cfg.train)
    trainer = None
    try:
        with ExitStack() as stack:
            run_dir_lock(stack, accelerator, str(cfg.run_dir))
            trainer = Trainer(cfg, accelerator, init_weights=init_weights, progress=progress)
            summary = trainer.fit()
        rank, world = accelerator.process_index, accelerator.num_processes
        return {**summary, "rank": rank, "world_size": world, "run_dir": str(cfg.run_dir)}
    finally:
        if trainer is not None:
            trainer.close()
        accelerator.end_training()  # destroys the process group: a clean exit under torchrun


def run_dir_lock(stack: ExitStack, accelerator: Any, run_dir: str) -> None:
    """Rank 0 holds run_dir's lock while training; every rank learns at once if another command has it
    (two trainings would interleave one log, one config and one checkpoint folder)."""
    import torch

    from shared.lock import exclusive_on_rank0

    def all_ok(ok: bool) -> bool:
        if accelerator.num_processes == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], device=accelerator.device)
        return int(accelerator.reduce(flag, reduction="sum").item()) == accelerator.num_processes

    stack.enter_context(exclusive_on_rank0(run_dir, "stage2_train train", accelerator.process_index, all_ok))


def cmd_plan(cfg: RunConfig, sample_tokens: int, search: bool = False, world_size: int = 8) -> dict[str, Any]:
    """The GPU memory of one training step of this config, traced with fake tensors
    (`train/memory_plan.py`), at the target's shape: its folder's config.json, or the published
    shape of a known target named by target.path (planning needs no weights)."""
    from pathlib import PurePath

    from shared.errors import ConfigError
    from shared.target import EMBEDDED_DEFAULT, TargetArch, resolve_target_dir
    from stage2_train.train.memory_plan import KNOWN_TARGETS, plan

    folder = Path(cfg.target.path).expanduser()
    if cfg.target.path == EMBEDDED_DEFAULT or (folder / "config.json").is_file():
        arch, source = TargetArch.from_dir(resolve_target_dir(cfg.target)), "config.json"
    else:
        folder_name = PurePath(cfg.target.path).name.lower()
        # A folder named after its model: Llama-3.1-8B-Instruct, Meta-Llama-3.1-8B-Instruct, Qwen3-8B
        name = next((known for known in KNOWN_TARGETS if known in folder_name), None)
        if name is None:
            raise ConfigError(
                f"target.path={cfg.target.path!r}: no config.json there and not a known shape ({', '.join(KNOWN_TARGETS)}); "
                f"copy the target's config.json into that folder to plan for it"
            )
        arch, source = KNOWN_TARGETS[name], f"the published {name} shape"
    layers = len(cfg.target.layer_ids) if cfg.target.layer_ids else cfg.target.num_feature_layers
    out = plan(
        cfg.model, cfg.loss, arch, layers, cfg.sampler.micro_batch_tokens, sample_tokens,
        cfg.sampler.max_anchors_per_seq, world_size=world_size, search=search,
    )
    return {"config": cfg.source, "shape_from": source, **out}


# ---------------------------------------------------------------------------------------------
# eval and export


def _trained_drafter(cfg: RunConfig, target: Any, checkpoint_arg: str | None, device: Any = "cpu") -> tuple[Any, Path]:
    """The drafter of `checkpoint_arg` (or of the run's newest checkpoint that verifies) and the file read."""
    from shared.target_parts import load_embed_and_head
    from stage2_train.model.drafter import build_drafter
    from stage2_train.train.checkpoint.select import read_model_weights, resolve_checkpoint

    weights, source = read_model_weights(resolve_checkpoint(checkpoint_arg, cfg.checkpoint.resolve_dir(cfg.run_dir)))
    embed_VH, lm_head_VH = load_embed_and_head(target.target_dir)
    drafter = build_drafter(
        cfg.model, target.arch, len(target.layer_ids), target.mask_token_id, embed_VH, lm_head_VH, weights=weights
    )
    return drafter.to(device).eval(), source


def cmd_eval(cfg: RunConfig, checkpoint: str | None = None) -> dict[str, Any]:
    """Offline and online evaluation of the newest (or given) checkpoint on the held-out split, on
    the GPU when there is one; also written to run_dir/eval/<checkpoint>.json."""
    import numpy as np

    from shared.target_parts import load_embed_and_head
    from stage2_train.data.split import heldout_mask
    from stage2_train.data.view import open_store, resolve_target
    from stage2_train.model.drafter import build_drafter
    from stage2_train.serve.online_eval import acceptance_gap
    from stage2_train.train.evaluate import offline_eval

    target = resolve_target(cfg.target)
    reader = open_store(cfg.store.url(cfg.run_dir), target)  # the trainer's checks: target, tokenizer, layers
    eval_cfg = cfg.eval
    heldout = np.flatnonzero(heldout_mask(reader.split_keys, eval_cfg.holdout_fraction, eval_cfg.split_seed))
    if len(heldout) == 0:
        raise StoreError(f"eval.holdout_fraction={eval_cfg.holdout_fraction} leaves no held-out sample among {len(reader)}")
    from stage2_train.train.trainer import train_device

    device = train_device(cfg.train)
    trained, source = _trained_drafter(cfg, target, checkpoint, device)
    embed_VH, lm_head_VH = load_embed_and_head(target.target_dir)
    untrained = build_drafter(
        cfg.model, target.arch, len(target.layer_ids), target.mask_token_id, embed_VH, lm_head_VH, seed=cfg.seed
    ).to(device).eval()
    # Every anchor, as the run's final eval: `walk_tau` (the offline estimate of online tau) needs
    # them all; eval.offline_max_anchors_per_seq samples the evals during training only.
    offline = offline_eval(
        trained,
        reader,
        heldout[: eval_cfg.offline_max_samples],
        max_anchors_per_seq=None,
        batch_tokens=eval_cfg.offline_batch_tokens,
        seed=cfg.seed,
        gamma=cfg.loss.gamma,
    )
    online = _online(cfg, target, reader, heldout, {"trained": trained, "untrained": untrained}, device)
    result = {
        "checkpoint": str(source),
        "num_heldout": int(len(heldout)),
        "offline": offline,
        "online": online,
        "gap": acceptance_gap(offline, online["proposers"]["trained"]["tau"]),
    }
    name = source.parent.name if source.name == "model.safetensors" else source.stem
    result["written_to"] = str(write_json(Path(cfg.run_dir) / "eval" / f"{name}.json", result))
    return result


def _online(cfg: RunConfig, target: Any, reader: Any, heldout: Any, drafters: dict[str, Any], device: str) -> dict[str, Any]:
    """Speculative decoding of held-out prompts with each drafter and the n-gram baseline."""
    import torch

    from shared.target import stop_token_ids
    from stage2_train.data.view import tokenizer_and_hash
    from stage2_train.serve.online_eval import bootstrap_tau, heldout_prompts, load_online_target, online_eval
    from stage2_train.serve.speculative import DFlashProposer, NgramProposer

    target_model = load_online_target(cfg.target, cfg.eval.online_dtype, device)
    tokenizer, _ = tokenizer_and_hash(str(target.target_dir))
    prompts = heldout_prompts(reader, heldout, cfg.eval.online_num_prompts)
    feature_dtype = torch.bfloat16  # the store holds bf16 (fp8 decodes to bf16): what training saw
    proposers = {
        name: DFlashProposer(drafter, target.layer_ids, feature_dtype=feature_dtype, name=name)
        for name, drafter in drafters.items()
    }
    proposers["ngram"] = NgramProposer(cfg.model.block_size - 1)
    online = online_eval(
        target_model,
        proposers,
        [p for _, p in prompts],
        max_new_tokens=cfg.eval.online_max_new_tokens,
        eos_token_ids=stop_token_ids(tokenizer, target_model),
    )
    online["sample_ids"] = [sid for sid, _ in prompts]
    # A few prompts move tau by hundredths: each proposer's 95% interval over prompts, and the
    # others' difference from the trained drafter paired over the same prompts.
    trained_per = online["proposers"]["trained"]["per_prompt"]
    for name, entry in online["proposers"].items():
        paired = None if name == "trained" else trained_per
        entry["interval"] = {k: round(v, 4) for k, v in bootstrap_tau(entry["per_prompt"], baseline=paired).items()}
    return online


def cmd_export(cfg: RunConfig, checkpoint: str | None = None, out: str | None = None, format: str = "zlab") -> dict[str, Any]:
    """The newest (or given) checkpoint as a servable DFlash folder (default run_dir/export), weights
    in bfloat16 as the published drafters; `format` zlab (default) or speculators."""
    from stage2_train.data.view import resolve_target, tokenizer_and_hash
    from stage2_train.serve.export import WEIGHTS_NAME, export_drafter, mask_token_string, read_export_config

    target = resolve_target(cfg.target)
    drafter, source = _trained_drafter(cfg, target, checkpoint)
    tokenizer, _ = tokenizer_and_hash(str(target.target_dir))
    out_dir = Path(out or Path(cfg.run_dir) / "export")
    target_info = {
        "path": cfg.target.path,
        "resolved_path": str(target.target_dir),
        "weights_sha256": target.weights_sha256,
        "source_checkpoint": str(source),
        "mask_token": mask_token_string(tokenizer, target.mask_token_id),
        "architectures": json.loads((target.target_dir / "config.json").read_text()).get("architectures") or [],
    }
    export_drafter(drafter, cfg.model, target.arch, target.layer_ids, target.mask_token_id, target_info, out_dir, format=format)
    cfg.write_resolved(out_dir / "dflash_pipeline_config.yaml")
    config = read_export_config(out_dir)
    if format == "speculators":
        return {"out_dir": str(out_dir), "checkpoint": str(source), "format": format,
                "aux_hidden_state_layer_ids": config["aux_hidden_state_layer_ids"], "block_size": config["block_size"]}
    return {
        "out_dir": str(out_dir),
        "checkpoint": str(source),
        "num_tensors": len(drafter.folded_state_dict()),
        "bytes": (out_dir / WEIGHTS_NAME).stat().st_size,
        "block_size": config["block_size"],
        "num_target_layers": config["num_target_layers"],
        "dflash_config": config["dflash_config"],
    }


# ---------------------------------------------------------------------------------------------
# Commands over a training log (no config needed)


def cmd_doctor(log_path: Path, as_json: bool, cfg: RunConfig | None = None) -> tuple[str, int]:
    from stage2_train.observe.doctor import doctor

    return doctor(log_path, as_json, cfg.detectors if cfg is not None else None)


def cmd_report(log_path: Path, out_dir: Path | None) -> dict[str, Any]:
    from stage2_train.observe.report import report

    return report(log_path, out_dir)


def write_json(path: Path, data: Any) -> Path:
    return write_atomic(path, json.dumps(data, indent=1, default=str))
