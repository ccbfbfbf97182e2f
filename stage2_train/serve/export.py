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

Reading drafter folders (ours, or published ones from z-lab / SpecForge in either of z-lab's
layouts): `drafter_spec(folder)` reads and checks config.json, `load_exported(folder, embed, head)`
builds the DFlashDrafter, `init_weights_for(folder, model_cfg, target)` gives the weights to start
training from (`model.init_from`) after checking they fit the target. What the drafter cannot
compute (YaRN RoPE, sliding-window or causal layers, biases) is refused naming the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from shared.errors import CheckpointError
from shared.files import atomic_path, write_atomic
from shared.target import TargetArch, dflash_layer_ids
from stage2_train.model.config import DrafterConfig
from stage2_train.model.drafter import DFlashDrafter, build_drafter
from stage2_train.train.checkpoint.format import read_weights

EXPORT_FORMAT_VERSION = 1
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
QWEN3_MASK_TOKEN = "<|MASK|>"  # what the reference adds to the Qwen3 tokenizer, landing on id 151669
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
    layer_types = list(cfg_model.layer_types or ["full_attention"] * num_layers)
    sliding = "sliding_attention" in layer_types
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
        # z-lab and SpecForge read the attention layout at the top level; Qwen3Config keeps
        # sliding_window only with use_sliding_window (without it z-lab would run sliding layers
        # causal and unwindowed, SpecForge would refuse the file).
        "use_sliding_window": sliding,
        "sliding_window": cfg_model.sliding_window if sliding else None,
        "max_window_layers": 0,
        "layer_types": layer_types,
        "initializer_range": cfg_model.init_std,
        "torch_dtype": dtype,
        "dtype": dtype,
        "block_size": cfg_model.block_size,
        "num_target_layers": arch.num_hidden_layers,
        **({"is_causal": cfg_model.is_causal} if cfg_model.is_causal is not None else {}),
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
    format: str = "zlab",
) -> Path:
    """Write config.json and model.safetensors (weights in `dtype`, embeddings and LM head left out):
    z-lab's layout (what SGLang and vLLM's dflash method load), or speculators' (its trainer and
    vLLM's speculators path; the same tensors under the same names)."""
    if format not in ("zlab", "speculators"):
        raise ValueError(f"export format must be zlab or speculators, got {format!r}")
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
        name: t.detach().to("cpu", DTYPES[dtype]).contiguous() for name, t in drafter.folded_state_dict().items()
    }
    config = drafter_hf_config(cfg_model, arch, layer_ids, mask_token_id, target_info, dtype)
    if format == "speculators":
        config = speculators_config(config, arch, layer_ids, str(target_info.get("resolved_path") or target_info.get("path", "")))
    # Weights first, config last, each through a temp name: a folder with a config is complete.
    with atomic_path(out / WEIGHTS_NAME) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_atomic(out / CONFIG_NAME, json.dumps(config, indent=2) + "\n")
    return out


SPECULATORS_VERSION = "0.9.0"  # the release whose DFlash format this writes (its converter: PR #617)


def speculators_config(hf_config: dict[str, Any], arch: TargetArch, layer_ids: list[int], target_dir: str) -> dict[str, Any]:
    """vllm-project/speculators' DFlash config.json for the same weights (its names are ours):
    the drafter's Qwen3 config inside `transformer_layer_config`, the DFlash fields top-level,
    `aux_hidden_state_layer_ids` = layer id + 1 (speculators names the residual stream entering a
    layer, HF hidden_states[id]; z-lab the layer's output), and the verifier as a local folder, from
    which speculators refills what it does not save (embed_tokens, lm_head, verifier_norm)."""
    if "sliding_attention" in hf_config["layer_types"]:
        raise CheckpointError(
            "export --format speculators: this drafter has sliding-window layers, and speculators computes them "
            "another way (its window is fixed at the block's anchor, z-lab's and SpecForge's moves with each query), "
            "so it would serve other outputs; export the zlab format, or train full-attention layers"
        )
    layer_cfg = {
        k: hf_config[k]
        for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "hidden_act", "attention_bias", "attention_dropout", "rms_norm_eps", "rope_parameters",
            "max_position_embeddings", "vocab_size", "tie_word_embeddings", "initializer_range", "layer_types",
            "use_sliding_window", "sliding_window",
        )
    }
    block = hf_config["block_size"]
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "block_size": block,
        "mask_token_id": hf_config["dflash_config"]["mask_token_id"],
        "aux_hidden_state_layer_ids": [i + 1 for i in layer_ids],
        "draft_vocab_size": arch.vocab_size,
        "target_hidden_size": None,
        "sample_from_anchor": False,
        "sliding_window_non_causal": False,
        "tie_word_embeddings": False,
        "transformer_layer_config": {"model_type": "qwen3", **layer_cfg},
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block - 1, "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": target_dir, "architectures": hf_config["dflash_pipeline"]["target"].get("architectures") or []},
        },
        "torch_dtype": hf_config["torch_dtype"],
        "dtype": hf_config["torch_dtype"],
        "dflash_pipeline": hf_config["dflash_pipeline"],
    }


def from_speculators(config: dict[str, Any], where: Path) -> dict[str, Any]:
    """A speculators DFlash config.json read as the z-lab layout `drafter_spec` reads (its weights
    need no renaming). Layer ids come back as id - 1; sliding layers are refused (other semantics)."""
    layer = dict(config.get("transformer_layer_config") or {})
    if not layer:
        raise CheckpointError(f"{where}: speculators_model_type=dflash but no transformer_layer_config")
    if "sliding_attention" in (layer.get("layer_types") or []):
        raise CheckpointError(
            f"{where}: transformer_layer_config.layer_types has sliding_attention: speculators fixes each block's window "
            f"at its anchor (PR #749), which this drafter does not compute; start from a full-attention drafter"
        )
    if config.get("sample_from_anchor"):
        raise CheckpointError(f"{where}: sample_from_anchor=true is not the DFlash block this pipeline trains")
    dflash = dict(config.get("dflash_config") or {})
    block = dflash.get("block_size", config.get("block_size", 16))
    aux = config.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux:
        raise CheckpointError(f"{where}: aux_hidden_state_layer_ids is missing")
    layer.pop("layer_types", None)
    layer.update({"use_sliding_window": False, "sliding_window": None})
    return {
        **layer,
        "block_size": block,
        "dflash_config": {"target_layer_ids": [i - 1 for i in aux], "mask_token_id": config.get("mask_token_id", dflash.get("mask_token_id"))},
    }


def read_export_config(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"no DFlash drafter at {folder} ({CONFIG_NAME} missing)")
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


@dataclass
class DrafterSpec:
    """What a DFlash drafter folder says about the model it holds, in both z-lab layouts: DFlash
    fields top-level (`block_size`, `num_target_layers`, `dflash_config.target_layer_ids`) or,
    newer, inside `dflash_config` (values there win, as z-lab's loader reads them)."""

    config: DrafterConfig
    arch: TargetArch  # the drafter's own dimensions; num_hidden_layers = the target's layer count
    layer_ids: list[int]
    mask_token_id: int


def drafter_spec(folder: str | os.PathLike) -> DrafterSpec:
    """Read and check a drafter folder's config.json; refuse what DFlashDrafter cannot compute,
    naming the field (YaRN or other scaled RoPE, sliding-window or causal layers, biases)."""
    config = read_export_config(folder)
    where = Path(folder) / CONFIG_NAME
    if config.get("speculators_model_type") == "dflash":
        config = from_speculators(config, where)
    dflash = config.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise CheckpointError(f"{where}: dflash_config must be an object, got {dflash!r}")

    def value(name: str, default: Any = None) -> Any:
        return dflash.get(name, config.get(name, default))

    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if not isinstance(config.get(key), int):
            raise CheckpointError(f"{where}: `{key}` missing or not an integer; not a DFlash drafter config")
    refuse_unsupported(config, where)
    mask_token_id = value("mask_token_id")
    if not isinstance(mask_token_id, int):
        raise CheckpointError(
            f"{where}: dflash_config.mask_token_id is missing; set it to the target's mask token id "
            f"(the published Qwen3 drafters use 151669)"
        )
    num_target_layers = value("num_target_layers")
    layer_ids = value("target_layer_ids")
    if layer_ids is None:
        if not isinstance(num_target_layers, int):
            raise CheckpointError(f"{where}: neither dflash_config.target_layer_ids nor num_target_layers is given")
        layer_ids = dflash_layer_ids(num_target_layers, config["num_hidden_layers"])
    rope = config.get("rope_parameters") or {}
    heads = config["num_attention_heads"]
    arch = TargetArch(
        model_type=config.get("dflash_pipeline", {}).get("target", {}).get("model_type", "unknown"),
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=num_target_layers if isinstance(num_target_layers, int) else max(layer_ids) + 3,
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        vocab_size=config.get("vocab_size", 0),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=False,
    )
    block_size = value("block_size", 16)
    types = config.get("layer_types")
    sliding = bool(types) and "sliding_attention" in types
    cfg = DrafterConfig(
        num_layers=config["num_hidden_layers"],
        block_size=block_size,
        intermediate_size=config["intermediate_size"],
        layer_types=tuple(types) if sliding else None,
        sliding_window=config.get("sliding_window") if sliding else None,
        is_causal=config.get("is_causal"),
    )
    return DrafterSpec(cfg, arch, list(layer_ids), mask_token_id)


def refuse_unsupported(config: dict[str, Any], where: Path) -> None:
    rope_types = {
        (config.get(key) or {}).get("rope_type", (config.get(key) or {}).get("type"))
        for key in ("rope_scaling", "rope_parameters")
    }
    rope_type = next((t for t in sorted(rope_types - {None, "default"}, key=str)), None)
    if rope_type is not None:
        raise CheckpointError(
            f"{where}: rope type {rope_type!r} (rope_scaling / rope_parameters) is not supported; this pipeline "
            f"computes plain RoPE only, so the drafter's outputs would be wrong"
        )
    layer_types = config.get("layer_types") or []
    other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if other:
        raise CheckpointError(f"{where}: layer_types {other} are not supported (full_attention and sliding_attention are)")
    if layer_types and len(layer_types) != config.get("num_hidden_layers"):
        raise CheckpointError(f"{where}: layer_types lists {len(layer_types)} layers, num_hidden_layers is {config.get('num_hidden_layers')}")
    if "sliding_attention" in layer_types:
        window = config.get("sliding_window")
        if not config.get("use_sliding_window") or not isinstance(window, int) or window < 1:
            raise CheckpointError(
                f"{where}: layer_types has sliding_attention but use_sliding_window={config.get('use_sliding_window')!r}, "
                f"sliding_window={window!r}: z-lab would then run those layers causal without a window and SpecForge "
                f"refuses the file; set use_sliding_window: true and a sliding_window"
            )
    elif config.get("use_sliding_window") and not layer_types:
        raise CheckpointError(
            f"{where}: use_sliding_window=true without layer_types (Qwen3's max_window_layers rule): list layer_types"
        )
    if config.get("is_causal") is not None and not isinstance(config.get("is_causal"), bool):
        raise CheckpointError(f"{where}: is_causal must be true, false or absent, got {config.get('is_causal')!r}")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise CheckpointError(f"{where}: {key}=true is not supported (the drafter's projections have no bias)")
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act={config['hidden_act']!r} is not supported (silu only)")


def load_exported(folder: str | os.PathLike, embed_VH: torch.Tensor, lm_head_VH: torch.Tensor) -> DFlashDrafter:
    """A drafter folder (ours, z-lab's, SpecForge's) as a DFlashDrafter; weights keep their dtype."""
    spec = drafter_spec(folder)
    weights, _ = read_weights(Path(folder) / WEIGHTS_NAME)
    return build_drafter(
        spec.config, spec.arch, len(spec.layer_ids), spec.mask_token_id, embed_VH, lm_head_VH, weights=weights
    ).eval()


def init_weights_for(folder: str | os.PathLike, cfg: DrafterConfig, target: Any) -> dict[str, torch.Tensor]:
    """The weights of a published or exported drafter, to start training from (`model.init_from`),
    after checking it fits this target and model config; every mismatch names the field to set."""
    spec = drafter_spec(folder)
    where = f"model.init_from={str(folder)!r}"
    checks = [
        ("hidden_size", spec.arch.hidden_size, target.arch.hidden_size, "the target's hidden size"),
        ("target_layer_ids", spec.layer_ids, target.layer_ids, "target.layer_ids"),
        ("mask_token_id", spec.mask_token_id, target.mask_token_id, "target.mask_token_id"),
        ("num_hidden_layers", spec.config.num_layers, cfg.num_layers, "model.num_layers"),
        ("block_size", spec.config.block_size, cfg.block_size, "model.block_size"),
        ("layer_types", spec.config.layer_types, cfg.layer_types, "model.layer_types"),
        ("sliding_window", spec.config.sliding_window, cfg.sliding_window if cfg.layer_types else None, "model.sliding_window"),
        ("is_causal", spec.config.is_causal, cfg.is_causal, "model.is_causal"),
        (
            "intermediate_size",
            spec.config.intermediate_size,
            cfg.intermediate_size or target.arch.intermediate_size,
            "model.intermediate_size",
        ),
        ("num_attention_heads", spec.arch.num_attention_heads, target.arch.num_attention_heads, "the target's heads"),
        ("num_key_value_heads", spec.arch.num_key_value_heads, target.arch.num_key_value_heads, "the target's kv heads"),
    ]
    for name, theirs, ours, setting in checks:
        if (list(theirs) if isinstance(theirs, (list, tuple)) else theirs) != (list(ours) if isinstance(ours, (list, tuple)) else ours):
            raise CheckpointError(
                f"{where}: the drafter has {name}={theirs!r} but this run has {ours!r} ({setting}); "
                f"set {setting}={theirs!r} or start from another drafter"
            )
    weights, _ = read_weights(Path(folder) / WEIGHTS_NAME)
    return weights


def mask_token_string(tokenizer: Any, mask_token_id: int) -> str | None:
    """The token string SGLang resolves: the tokenizer's own token, or the reference's added
    `<|MASK|>` when the id is the next one after the tokenizer's vocabulary (Qwen3: 151669)."""
    if mask_token_id < len(tokenizer):
        return tokenizer.convert_ids_to_tokens(mask_token_id)
    return QWEN3_MASK_TOKEN if mask_token_id == len(tokenizer) else None
