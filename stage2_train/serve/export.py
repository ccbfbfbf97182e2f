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
  `dflash_pipeline` (format version, the drafter's description, the target's name and weights sha256,
  and `training`: the held-out split and store digest it was trained with, which `eval` reuses).
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
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from shared.errors import CheckpointError
from shared.files import atomic_path, write_atomic
from stage2_train.model.description import DrafterDescription
from stage2_train.model.drafter import DFlashDrafter

log = logging.getLogger(__name__)

EXPORT_FORMAT_VERSION = 1
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
QWEN3_MASK_TOKEN = "<|MASK|>"  # what the reference adds to the Qwen3 tokenizer, landing on id 151669
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---------------------------------------------------------------------------------------------
# Export


ARCHITECTURES = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel", "dflash2": "DFlash2DraftModel"}


def drafter_hf_config(
    description: DrafterDescription, target_info: dict[str, Any], dtype: str, training: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The config.json of the exported drafter (see the module docstring for each DFlash field). A
    DFlash2 drafter is z-lab's `DFlash2DraftModel` (its convolution and selector sizes in `dflash_config`,
    where z-lab, SpecForge and SGLang read them); z-lab's layout has no DSpark."""
    d = description
    layer_types = list(d.layer_types)
    sliding = "sliding_attention" in layer_types
    dflash_config: dict[str, Any] = {"target_layer_ids": list(d.target_layer_ids), "mask_token_id": d.mask_token_id}
    if target_info.get("mask_token"):
        dflash_config["mask_token"] = target_info["mask_token"]
    if d.variant == "dflash2":
        dflash_config.update({
            "block_size": d.block_size, "conv_kernel_size": d.conv_kernel_size, "conv_group_size": d.conv_group_size,
            "selector_rank": d.selector_rank, "selector_top_k": d.selector_top_k,
        })
    return {
        "architectures": [ARCHITECTURES[d.variant]],
        "model_type": "qwen3",
        "hidden_size": d.hidden_size,
        "intermediate_size": d.intermediate_size,
        "num_hidden_layers": d.num_layers,
        "num_attention_heads": d.num_attention_heads,
        "num_key_value_heads": d.num_key_value_heads,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": d.rms_norm_eps,
        # transformers < 5 reads rope_theta / rope_scaling, transformers 5 and vLLM rope_parameters.
        "rope_theta": d.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": d.rope_theta},
        "max_position_embeddings": d.max_position_embeddings,
        "vocab_size": d.vocab_size,
        "tie_word_embeddings": False,
        # z-lab and SpecForge read the attention layout at the top level; Qwen3Config keeps
        # sliding_window only with use_sliding_window (without it z-lab would run sliding layers
        # causal and unwindowed, SpecForge would refuse the file).
        "use_sliding_window": sliding,
        "sliding_window": d.sliding_window if sliding else None,
        "max_window_layers": 0,
        "layer_types": layer_types,
        "initializer_range": 0.02,
        "torch_dtype": dtype,
        "dtype": dtype,
        "block_size": d.block_size,
        "num_target_layers": d.num_target_layers,
        **({"is_causal": d.is_causal} if d.is_causal is not None else {}),
        "dflash_config": dflash_config,
        "dflash_pipeline": {
            "format_version": EXPORT_FORMAT_VERSION,
            "feature": "output of target decoder layer i (HF hidden_states[i + 1]), layers concatenated in id order",
            # The drafter's own description, as training saved it: what this pipeline rebuilds it from.
            "drafter": {**d.to_dict(), "feature_projection": "none", "projection_dim": None},
            "target": {
                "model_type": d.target_model_type,
                "num_hidden_layers": d.num_target_layers,
                "hidden_size": d.hidden_size,
                "vocab_size": d.vocab_size,
                **{k: v for k, v in target_info.items() if k != "mask_token"},
            },
            **({"training": training} if training else {}),
        },
    }


def export_drafter(
    drafter: DFlashDrafter,
    description: DrafterDescription,
    target_info: dict[str, Any],
    out_dir: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    format: str = "zlab",
    training: dict[str, Any] | None = None,
) -> Path:
    """Write config.json and model.safetensors (weights in `dtype`, embeddings and LM head left out):
    z-lab's layout (what SGLang and vLLM's dflash method load; DFlash and DFlash2, a DSpark drafter is
    refused by name), or speculators' (its trainer and vLLM's speculators path, every variant; the same
    tensors under the same names). A projected drafter is written as the standard drafter it equals
    (the projection folded into fc). `training`: its held-out split and store digest
    (`serve/trained_on.py`), recorded under dflash_pipeline.training."""
    if format not in ("zlab", "speculators"):
        raise ValueError(f"export format must be zlab or speculators, got {format!r}")
    if dtype not in DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    d = description
    if (len(d.target_layer_ids), d.block_size, d.num_layers, d.mask_token_id) != (
        drafter.num_feature_layers, drafter.block_size, len(drafter.layers), drafter.mask_token_id
    ):
        raise ValueError(
            f"the description (layer ids {list(d.target_layer_ids)}, block {d.block_size}, {d.num_layers} layers, mask "
            f"{d.mask_token_id}) is not this drafter's ({drafter.num_feature_layers} feature layers, block "
            f"{drafter.block_size}, {len(drafter.layers)} layers, mask {drafter.mask_token_id})"
        )
    out = Path(out_dir)
    blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:  # mkdir would raise FileExistsError / NotADirectoryError, a bare traceback
        raise CheckpointError(
            f"export --out {out}: {blocker} is a file, not a folder; give --out a new folder (or one holding an earlier export)"
        )
    stale = stale_weights(out)
    if stale:
        # vLLM and SGLang read model.safetensors.index.json when there is one and load the shards it lists,
        # so the drafter written here would not be the one served.
        raise CheckpointError(
            f"export --out {out}: the folder holds other weights ({', '.join(stale[:4])}{', ...' * (len(stale) > 4)}), which "
            f"loaders would read instead of or beside the {WEIGHTS_NAME} written here; remove them or export to another folder"
        )
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: t.detach().to("cpu", DTYPES[dtype]).contiguous() for name, t in drafter.folded_state_dict().items()
    }
    if format == "zlab" and d.variant == "dspark":
        raise CheckpointError(
            "export --format zlab: z-lab's layout has no DSpark drafter (its loaders build DFlash and DFlash2); "
            "export --format speculators, the layout vLLM's dspark method and speculators read"
        )
    config = drafter_hf_config(d, target_info, dtype, training)
    if format == "speculators":
        config = speculators_config(config, d, str(target_info.get("verifier") or target_info.get("name", "")))
    # Weights first, config last, each through a temp name: a folder with a config is complete.
    with atomic_path(out / WEIGHTS_NAME) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_atomic(out / CONFIG_NAME, json.dumps(config, indent=2) + "\n")
    return out


def stale_weights(out: Path) -> list[str]:
    """Weight files in `out` an export does not write (another tool's shards, their index, pickled
    weights): the names, sorted; [] for a new folder or one holding an earlier export."""
    if not out.is_dir():
        return []
    patterns = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth")
    return sorted({p.name for pattern in patterns for p in out.glob(pattern) if p.name != WEIGHTS_NAME})


SPECULATORS_VERSION = "0.9.0"  # the release whose DFlash format this writes (its converter: PR #617)


def speculators_config(hf_config: dict[str, Any], description: DrafterDescription, verifier: str) -> dict[str, Any]:
    """vllm-project/speculators' config.json for the same weights (its names are ours), for each
    variant (`speculators_model_type` dflash, dspark or dflash2): the drafter's Qwen3 config inside
    `transformer_layer_config`, the block fields and the variant's own top-level (DSpark's
    `sample_from_anchor: true`, Markov rank and head, confidence head; DFlash2's convolution and
    selector sizes), `aux_hidden_state_layer_ids` = layer id + 1 (speculators names the residual stream
    entering a layer, HF hidden_states[id]; z-lab the layer's output), and the verifier as a local
    folder, from which speculators refills what it does not save (embed_tokens, lm_head, verifier_norm)."""
    d = description
    layer_ids = list(d.target_layer_ids)
    if "sliding_attention" in hf_config["layer_types"]:
        raise CheckpointError(
            "export --format speculators: this drafter has sliding-window layers, and speculators computes them "
            "another way (its window is fixed at the block's anchor, z-lab's and SpecForge's moves with each query), "
            "so it would serve other outputs; export the zlab format, or train full-attention layers"
        )
    if d.is_causal:  # only full layers are left here, and speculators runs them bidirectionally inside the block
        raise CheckpointError(
            "export --format speculators: this drafter was trained with model.is_causal=true (causal inside the block), "
            "and speculators' config has no such field: it would run the block bidirectionally and draft other tokens; "
            "export the zlab format (it carries is_causal), or train with model.is_causal unset"
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
    variant: dict[str, Any] = {}
    if d.variant == "dspark":
        if d.markov_head != "vanilla":  # written as speculators trains it; what an engine serves differs
            log.warning(
                "export --format speculators: a DSpark drafter with model.markov_head=%s loads in speculators' own "
                "DSparkDraftModel, but vLLM's dspark method serves the vanilla Markov head only: check your serving "
                "engine before deploying it (or train model.markov_head=vanilla)", d.markov_head,
            )
        variant = {
            "markov_rank": d.markov_rank, "markov_head_type": d.markov_head, "enable_confidence_head": d.confidence_head,
            "confidence_head_with_markov": bool(d.confidence_head),
        }
    elif d.variant == "dflash2":
        variant = {
            "conv_kernel_size": d.conv_kernel_size, "conv_group_size": d.conv_group_size, "selector_rank": d.selector_rank,
            "selector_top_k": d.selector_top_k,
        }
    return {
        "architectures": [ARCHITECTURES[d.variant]],
        "speculators_model_type": d.variant,
        "speculators_version": SPECULATORS_VERSION,
        "block_size": block,
        "mask_token_id": hf_config["dflash_config"]["mask_token_id"],
        "aux_hidden_state_layer_ids": [i + 1 for i in layer_ids],
        "draft_vocab_size": hf_config["vocab_size"],
        "target_hidden_size": None,
        "sample_from_anchor": d.label_shift == 1,
        # speculators' per-variant default; it only concerns sliding layers, which this export refuses
        "sliding_window_non_causal": d.variant == "dflash2",
        "tie_word_embeddings": False,
        **variant,
        "transformer_layer_config": {"model_type": "qwen3", **layer_cfg},
        "speculators_config": {
            "algorithm": d.variant,
            "default_proposal_method": "greedy",
            "proposal_methods": [{
                "proposal_type": "greedy", "speculative_tokens": block - 1 + d.label_shift, "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }],
            "verifier": {"name_or_path": verifier, "architectures": hf_config["dflash_pipeline"]["target"].get("architectures") or []},
        },
        "torch_dtype": hf_config["torch_dtype"],
        "dtype": hf_config["torch_dtype"],
        "dflash_pipeline": hf_config["dflash_pipeline"],
    }


def mask_token_string(tokenizer: Any, mask_token_id: int) -> str | None:
    """The token string SGLang resolves: the tokenizer's own token, or the reference's added
    `<|MASK|>` when the id is the next one after the tokenizer's vocabulary (Qwen3: 151669)."""
    if mask_token_id < len(tokenizer):
        return tokenizer.convert_ids_to_tokens(mask_token_id)
    return QWEN3_MASK_TOKEN if mask_token_id == len(tokenizer) else None
