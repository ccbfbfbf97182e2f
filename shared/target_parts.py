"""Read the target's embedding and LM head straight from its safetensors, nothing else.

    embed_VH, lm_head_VH = load_embed_and_head("path/to/target")

The drafter borrows both, frozen. Only these tensors are read (safetensors.safe_open), from a
single `model.safetensors`, a sharded folder with `model.safetensors.index.json`, or any set of
`*.safetensors` files. A tied model (no lm_head tensor) returns the embedding twice, as the same
tensor object. Tensors keep their stored dtype.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from shared.errors import InputFileError

EMBED_NAMES = (
    "model.embed_tokens.weight",
    "embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "transformer.wte.weight",
)
HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight")
INDEX_NAME = "model.safetensors.index.json"


def _weight_map(folder: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    index = folder / INDEX_NAME
    if index.is_file():
        mapping = json.loads(index.read_text()).get("weight_map")
        if not isinstance(mapping, dict):
            raise InputFileError(f"{index}: no weight_map")
        return {name: folder / file for name, file in mapping.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InputFileError(f"no *.safetensors weights (or {INDEX_NAME}) in {folder}")
    names: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as fh:
            names.update(dict.fromkeys(fh.keys(), path))
    return names


def _read(path: Path, name: str) -> torch.Tensor:
    if not path.is_file():
        raise InputFileError(f"{path} (listed for {name}) is missing")
    with safe_open(str(path), framework="pt") as fh:
        return fh.get_tensor(name)


def _explicitly_untied(folder: Path) -> bool:
    config = folder / "config.json"
    if not config.is_file():
        return False
    cfg = json.loads(config.read_text())
    tied = cfg.get("tie_word_embeddings", (cfg.get("text_config") or {}).get("tie_word_embeddings"))
    return tied is False


def load_embed_and_head(model_dir: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_VH, lm_head_VH) of the target in `model_dir`, read without loading the model."""
    folder = Path(model_dir)
    if not folder.is_dir():
        raise InputFileError(f"target folder not found: {folder}")
    weights = _weight_map(folder)
    embed_name = next((n for n in EMBED_NAMES if n in weights), None)
    if embed_name is None:
        raise InputFileError(f"no embedding tensor ({' / '.join(EMBED_NAMES)}) in the safetensors of {folder}")
    embed_VH = _read(weights[embed_name], embed_name)
    head_name = next((n for n in HEAD_NAMES if n in weights), None)
    if head_name is None:
        if _explicitly_untied(folder):
            raise InputFileError(
                f"no LM head tensor ({' / '.join(HEAD_NAMES)}) in {folder}, "
                f"but its config.json says tie_word_embeddings=false"
            )
        return embed_VH, embed_VH
    head_VH = _read(weights[head_name], head_name)
    if head_VH.shape != embed_VH.shape:
        raise InputFileError(
            f"{folder}: {head_name} {tuple(head_VH.shape)} and {embed_name} {tuple(embed_VH.shape)} differ in shape"
        )
    return embed_VH, head_VH


LAYER_TENSORS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


def load_target_layers(model_dir: str | os.PathLike, layer_ids: list[int]) -> dict[str, torch.Tensor]:
    """Decoder layers `layer_ids` and the final norm of the target, read alone from its safetensors,
    as {"layers.<j>.<name>": tensor} for the j-th id (q/k norms only where the target has them) and
    "norm.weight"."""
    folder = Path(model_dir)
    weights = _weight_map(folder)
    out: dict[str, torch.Tensor] = {}
    for j, layer in enumerate(layer_ids):
        for name in LAYER_TENSORS:
            full = f"model.layers.{layer}.{name}"
            if full in weights:
                out[f"layers.{j}.{name}"] = _read(weights[full], full)
    if "model.norm.weight" in weights:
        out["norm.weight"] = _read(weights["model.norm.weight"], "model.norm.weight")
    return out
