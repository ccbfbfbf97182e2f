"""Export a trained drafter as a Hugging Face folder in the public DFlash drafter layout.

    .venv/bin/python -m stage2_train export [--checkpoint runs/default/checkpoints] [--out DIR]

The folder (`config.json` + `model.safetensors`) is what z-lab/dflash `DFlashDraftModel.from_pretrained`,
SGLang (`--speculative-algorithm DFLASH`) and vLLM (`speculative_config={"method": "dflash"}`) load:

- `config.json`: a Qwen3 config (`model_type: qwen3`, `architectures: ["DFlashDraftModel"]`) whose
  `num_hidden_layers` is the DRAFTER's layer count, plus the DFlash fields the loaders read:
  top-level `block_size`; top-level `num_target_layers` = the TARGET's total decoder-layer count (the
  reference and SGLang pass it to `build_target_layer_ids(num_target_layers, num_draft_layers)`, which
  spreads ids over 1..num_target_layers-3, and SGLang checks every id < it); and
  `dflash_config: {target_layer_ids, mask_token_id, mask_token}` (ids = decoder layer i's output,
  HF `hidden_states[i + 1]`; `mask_token` is the string SGLang resolves when it has no id). Plain RoPE
  (`rope_scaling: null`), `tie_word_embeddings: false`. Our own provenance sits under
  `dflash_pipeline` (format version, target path and weights sha256, source checkpoint).
- `model.safetensors`: the drafter's own tensors, no embedding and no LM head (the serving engine
  borrows the target's), named as the reference names them (`fc.weight`, `hidden_norm.weight`,
  `norm.weight`, `layers.N.*`), which is `DFlashDrafter.state_dict()` as is.

`load_exported(folder, embed_VH, lm_head_VH)` reads such a folder back into a DFlashDrafter;
`read_checkpoint_weights(path)` reads a training checkpoint (`model.safetensors`, a folder holding
one, or a checkpoints folder whose `latest` names the newest step).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shared.config import RunConfig, Section
from shared.target import TargetArch
from stage2_train.model import DFlashDrafter, DrafterConfig

EXPORT_FORMAT_VERSION = 1
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
QWEN3_MASK_TOKEN = "<|MASK|>"  # what the reference adds to the Qwen3 tokenizer, landing on id 151669
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def section(cfg: RunConfig, name: str, cls: type[Section]) -> Any:
    """A run-config section as its dataclass, whether the config built it or kept it as a dict."""
    value = getattr(cfg, name, None)
    if isinstance(value, cls):
        return value
    return cls.from_dict(value or {})


# ---------------------------------------------------------------------------------------------
# Checkpoints


def checkpoints_dir(cfg: RunConfig) -> Path:
    """checkpoint.dir when the run config sets it, else run_dir/checkpoints (as the trainer saves)."""
    ckpt = getattr(cfg, "checkpoint", None)
    configured = ckpt.get("dir") if isinstance(ckpt, dict) else getattr(ckpt, "dir", None)
    return Path(configured) if configured else Path(cfg.run_dir) / "checkpoints"


def find_checkpoint(path: str | os.PathLike) -> Path:
    """The `model.safetensors` a path designates: the file itself, a step folder holding one, or a
    checkpoints folder (its `latest` file or link names the step; else the last `step_*` folder)."""
    path = Path(path)
    if path.is_file():
        if path.name == "latest":
            return find_checkpoint(path.parent / path.read_text().strip())
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"no drafter checkpoint at {path}")
    if (path / WEIGHTS_NAME).is_file():
        return path / WEIGHTS_NAME
    latest = path / "latest"
    if latest.is_file():
        return find_checkpoint(path / latest.read_text().strip())
    if latest.is_dir():
        return find_checkpoint(latest)
    steps = sorted(p for p in path.iterdir() if p.is_dir() and (p / WEIGHTS_NAME).is_file())
    if not steps:
        raise FileNotFoundError(f"{path}: no {WEIGHTS_NAME}, no `latest`, and no step folder holding one")
    return steps[-1] / WEIGHTS_NAME


def read_checkpoint_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Plain model tensors (reference names) of a training checkpoint or an export."""
    file = find_checkpoint(path)
    with safe_open(str(file), framework="pt") as fh:
        return {name: fh.get_tensor(name) for name in fh.keys()}


def build_drafter(
    cfg_model: DrafterConfig,
    arch: TargetArch,
    num_feature_layers: int,
    mask_token_id: int,
    embed_VH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    weights: dict[str, torch.Tensor] | None = None,
    seed: int | None = None,
) -> DFlashDrafter:
    """A drafter with the target's frozen parts and, when given, trained weights (names checked
    strictly). Without weights it is initialised from `seed` without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        drafter = DFlashDrafter(cfg_model, arch, num_feature_layers, mask_token_id)
    if weights is not None:
        missing, unexpected = drafter.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not fit model config (num_layers={cfg_model.num_layers}, "
                f"{num_feature_layers} feature layers): missing {sorted(missing)[:6]}, unexpected {sorted(unexpected)[:6]}"
            )
        dtype = next(iter(weights.values())).dtype
        drafter.to(dtype)
    drafter.set_frozen_parts(embed_VH, lm_head_VH)
    return drafter.eval()


# ---------------------------------------------------------------------------------------------
# Export


def drafter_hf_config(
    cfg_model: DrafterConfig,
    arch: TargetArch,
    layer_ids: list[int],
    mask_token_id: int,
    target_info: dict[str, Any],
    dtype: str,
) -> dict[str, Any]:
    """The config.json of the exported drafter (see the module docstring for each DFlash field)."""
    num_layers = cfg_model.num_layers
    dflash_config: dict[str, Any] = {"target_layer_ids": list(layer_ids), "mask_token_id": mask_token_id}
    if target_info.get("mask_token"):
        dflash_config["mask_token"] = target_info["mask_token"]
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": arch.hidden_size,
        "intermediate_size": cfg_model.intermediate_size or arch.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": arch.rms_norm_eps,
        # transformers < 5 reads rope_theta / rope_scaling, transformers 5 and vLLM rope_parameters.
        "rope_theta": arch.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": arch.rope_theta},
        "max_position_embeddings": arch.max_position_embeddings,
        "vocab_size": arch.vocab_size,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * num_layers,  # non-causal DFlash blocks (vLLM reads this)
        "initializer_range": cfg_model.init_std,
        "torch_dtype": dtype,
        "dtype": dtype,
        "block_size": cfg_model.block_size,
        "num_target_layers": arch.num_hidden_layers,
        "dflash_config": dflash_config,
        "dflash_pipeline": {
            "format_version": EXPORT_FORMAT_VERSION,
            "feature": "output of target decoder layer i (HF hidden_states[i + 1]), layers concatenated in id order",
            "target": {
                "model_type": arch.model_type,
                "num_hidden_layers": arch.num_hidden_layers,
                "hidden_size": arch.hidden_size,
                "vocab_size": arch.vocab_size,
                **{k: v for k, v in target_info.items() if k != "mask_token"},
            },
        },
    }


def export_drafter(
    drafter: DFlashDrafter,
    cfg_model: DrafterConfig,
    arch: TargetArch,
    layer_ids: list[int],
    mask_token_id: int,
    target_info: dict[str, Any],
    out_dir: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
) -> Path:
    """Write config.json and model.safetensors (weights in `dtype`, embeddings and LM head left out)."""
    if dtype not in DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if len(layer_ids) != drafter.num_feature_layers:
        raise ValueError(
            f"the drafter fuses {drafter.num_feature_layers} feature layers, got layer ids {layer_ids}"
        )
    if cfg_model.block_size != drafter.block_size or cfg_model.num_layers != len(drafter.layers):
        raise ValueError("cfg_model does not describe this drafter (block_size / num_layers differ)")
    if mask_token_id != drafter.mask_token_id:
        raise ValueError(f"mask_token_id {mask_token_id} differs from the drafter's {drafter.mask_token_id}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: t.detach().to("cpu", DTYPES[dtype]).contiguous() for name, t in drafter.state_dict().items()
    }
    config = drafter_hf_config(cfg_model, arch, layer_ids, mask_token_id, target_info, dtype)
    # Weights first, config last, each through a temp name: a folder with a config is complete.
    tmp = out / f".{WEIGHTS_NAME}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / WEIGHTS_NAME)
    tmp = out / f".{CONFIG_NAME}.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, out / CONFIG_NAME)
    return out


def read_export_config(out_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(out_dir) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no exported drafter at {out_dir} ({CONFIG_NAME} missing)")
    config = json.loads(path.read_text())
    for key in ("block_size", "num_target_layers", "dflash_config"):
        if key not in config:
            raise ValueError(f"{path}: `{key}` missing; not a DFlash drafter config")
    return config


def load_exported(
    out_dir: str | os.PathLike, embed_VH: torch.Tensor, lm_head_VH: torch.Tensor
) -> DFlashDrafter:
    """An exported folder back into our DFlashDrafter (weights keep their exported dtype)."""
    config = read_export_config(out_dir)
    dflash = config["dflash_config"]
    layer_ids = list(dflash["target_layer_ids"])
    arch = TargetArch(
        model_type=config.get("dflash_pipeline", {}).get("target", {}).get("model_type", "unknown"),
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_target_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        vocab_size=config["vocab_size"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config["rope_parameters"]["rope_theta"]
        if config.get("rope_parameters")
        else config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"],
        tie_word_embeddings=False,
    )
    cfg_model = DrafterConfig(
        num_layers=config["num_hidden_layers"],
        block_size=config["block_size"],
        intermediate_size=config["intermediate_size"],
    )
    weights = read_checkpoint_weights(Path(out_dir) / WEIGHTS_NAME)
    return build_drafter(
        cfg_model, arch, len(layer_ids), dflash["mask_token_id"], embed_VH, lm_head_VH, weights
    )


# ---------------------------------------------------------------------------------------------
# CLI


def mask_token_string(tokenizer: Any, mask_token_id: int) -> str | None:
    """The token string SGLang resolves: the tokenizer's own token, or the reference's added
    `<|MASK|>` when the id is the next one after the tokenizer's vocabulary (Qwen3: 151669)."""
    if mask_token_id < len(tokenizer):
        return tokenizer.convert_ids_to_tokens(mask_token_id)
    return QWEN3_MASK_TOKEN if mask_token_id == len(tokenizer) else None


def cmd_export(cfg: RunConfig, args: Any) -> dict[str, Any]:
    """`python -m stage2_train export [--checkpoint PATH] [--out DIR]`: the latest (or given)
    checkpoint of run_dir as a servable DFlash folder (default run_dir/export), weights in
    `args.dtype` when the CLI offers it (default bfloat16, as the published drafters)."""
    from shared.target_parts import load_embed_and_head
    from stage2_train.data import resolve_target, tokenizer_and_hash

    target = resolve_target(cfg)
    cfg_model = section(cfg, "model", DrafterConfig)
    arch, layer_ids, mask_token_id = target.arch, target.layer_ids, target.mask_token_id
    tokenizer, _ = tokenizer_and_hash(str(target.target_dir))
    checkpoint = find_checkpoint(getattr(args, "checkpoint", None) or checkpoints_dir(cfg))
    out_dir = Path(getattr(args, "out", None) or Path(cfg.run_dir) / "export")
    embed_VH, lm_head_VH = load_embed_and_head(target.target_dir)
    drafter = build_drafter(
        cfg_model, arch, len(layer_ids), mask_token_id, embed_VH, lm_head_VH, read_checkpoint_weights(checkpoint)
    )
    target_info = {
        "path": cfg.target.path,
        "resolved_path": str(target.target_dir),
        "weights_sha256": target.weights_sha256,
        "source_checkpoint": str(checkpoint),
        "mask_token": mask_token_string(tokenizer, mask_token_id),
    }
    dtype = getattr(args, "dtype", None) or "bfloat16"
    export_drafter(drafter, cfg_model, arch, layer_ids, mask_token_id, target_info, out_dir, dtype=dtype)
    if hasattr(cfg, "write_resolved"):
        cfg.write_resolved(out_dir / "dflash_pipeline_config.yaml")
    config = read_export_config(out_dir)
    return {
        "out_dir": str(out_dir),
        "checkpoint": str(checkpoint),
        "num_tensors": len(drafter.state_dict()),
        "bytes": (out_dir / WEIGHTS_NAME).stat().st_size,
        "block_size": config["block_size"],
        "num_target_layers": config["num_target_layers"],
        "dflash_config": config["dflash_config"],
    }
