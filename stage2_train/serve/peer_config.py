"""The peers' drafter configs read as this pipeline's: speculators' DFlash, DSpark and DFlash2 config.json
as the z-lab layout (`from_speculators`), the variant a z-lab layout config describes (`variant_of`), and
what DFlashDrafter cannot compute refused by name (`refuse_unsupported`). `serve/load.py`'s
`folder_description` reads a folder through them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.errors import CheckpointError

SPECULATORS_BLOCK_SIZE = 8  # what a speculators config.json without block_size means
SPECULATORS_TYPES = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel", "dflash2": "DFlash2DraftModel"}
# The variants' own fields, as speculators' config.json (top level) and z-lab's / SpecForge's
# `dflash_config` name them.
DSPARK_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# What a DSpark config that leaves a field out means: speculators' DSparkSpeculatorConfig defaults, and
# SpecForge's (the only z-lab-layout DSpark: z-lab has none): no Markov head unless markov_rank is given,
# a confidence head only with a positive confidence_head_alpha, and reading the hidden state alone.
SPECULATORS_DSPARK_DEFAULTS = {"markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
                               "confidence_head_with_markov": True, "sample_from_anchor": True}


def from_speculators(config: dict[str, Any], where: Path) -> dict[str, Any]:
    """A speculators DFlash, DSpark or DFlash2 config.json read as the z-lab layout `folder_description`
    reads (its weights need no renaming). Layer ids come back as id - 1; sliding layers are refused
    (other semantics)."""
    kind = config.get("speculators_model_type")
    layer = dict(config.get("transformer_layer_config") or {})
    if not layer:
        raise CheckpointError(f"{where}: speculators_model_type={kind} but no transformer_layer_config")
    if "sliding_attention" in (layer.get("layer_types") or []):
        raise CheckpointError(
            f"{where}: transformer_layer_config.layer_types has sliding_attention: speculators fixes each block's window "
            f"at its anchor (PR #749), which this drafter does not compute; start from a full-attention drafter"
        )
    draft_vocab, vocab = config.get("draft_vocab_size"), layer.get("vocab_size")
    if draft_vocab is not None and draft_vocab != vocab:
        # Its own [draft_vocab, H] lm_head and d2t/t2d maps would reach check_fit as unexpected tensors, unexplained.
        raise CheckpointError(
            f"{where}: draft_vocab_size={draft_vocab} but the verifier's vocab_size is {vocab}: a reduced draft vocabulary "
            f"(its own lm_head and d2t/t2d maps), while this pipeline's drafter scores the target's whole vocabulary through "
            f"the target's LM head; start from a drafter trained with the full vocabulary (draft_vocab_size = vocab_size)"
        )
    if kind != "dspark" and config.get("sample_from_anchor"):
        raise CheckpointError(f"{where}: sample_from_anchor=true is not the {kind} block this pipeline trains")
    dflash = dict(config.get("dflash_config") or {})
    # speculators' DFlashSpeculatorConfig default (its DSpark and DFlash2 configs extend it), not z-lab's 16
    block = dflash.get("block_size", config.get("block_size", SPECULATORS_BLOCK_SIZE))
    aux = config.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux:
        raise CheckpointError(f"{where}: aux_hidden_state_layer_ids is missing")
    layer.pop("layer_types", None)
    layer.update({"use_sliding_window": False, "sliding_window": None})
    own = DSPARK_FIELDS if kind == "dspark" else DFLASH2_FIELDS if kind == "dflash2" else ()
    return {
        **layer,
        **({"dflash_pipeline": config["dflash_pipeline"]} if "dflash_pipeline" in config else {}),
        "architectures": [SPECULATORS_TYPES[kind]],
        "block_size": block,
        "dflash_config": {
            "target_layer_ids": [i - 1 for i in aux], "mask_token_id": config.get("mask_token_id", dflash.get("mask_token_id")),
            # speculators' own defaults for what its file leaves out: `variant_of` reads a bare field as SpecForge's
            **{name: config.get(name, SPECULATORS_DSPARK_DEFAULTS.get(name)) for name in own
               if name in config or name in SPECULATORS_DSPARK_DEFAULTS},
        },
    }


def variant_of(config: dict[str, Any], value: Any, where: Path) -> dict[str, Any]:
    """The variant a (z-lab layout) config describes, from its architectures, with its own fields."""
    names = config.get("architectures") or []
    if "DSparkDraftModel" in names:
        from stage2_train.model.dspark import check_dspark_config

        specforge = {"markov_rank": 0, "enable_confidence_head": float(value("confidence_head_alpha", 0.0) or 0.0) > 0,
                     "confidence_head_with_markov": False}
        fields = {**specforge, **{name: value(name) for name in DSPARK_FIELDS if value(name) is not None}}
        return {"variant": "dspark", **check_dspark_config(fields, str(where))}
    if "DFlash2DraftModel" in names:
        sizes = {name: value(name) for name in DFLASH2_FIELDS}
        missing = [name for name, v in sizes.items() if not isinstance(v, int) or v < 1]
        if missing:
            raise CheckpointError(f"{where}: a DFlash2DraftModel without {missing} (dflash_config or top level)")
        if value("output_multiplier", 1.0) != 1.0 or value("final_logit_softcapping"):
            raise CheckpointError(
                f"{where}: output_multiplier / final_logit_softcapping change the unary logits, which this drafter does not"
            )
        return {"variant": "dflash2", **sizes}
    return {"variant": "dflash"}


def refuse_unsupported(config: dict[str, Any], where: Path) -> None:
    names = config.get("architectures") or []
    if names and not set(names) & set(SPECULATORS_TYPES.values()):
        # Read as a DFlash drafter, another trainer's drafter (SpecForge's DominoDraftModel, an EAGLE head) met
        # check_fit later with its own heads as "unexpected" weights, or a missing DFlash field, never its name.
        raise CheckpointError(
            f"{where}: architectures {names} is not a drafter this pipeline builds ({', '.join(SPECULATORS_TYPES.values())}); "
            f"start from (or evaluate) a DFlash, DSpark or DFlash2 drafter folder"
        )
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
