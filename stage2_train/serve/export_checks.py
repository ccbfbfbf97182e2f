"""An exported DFlash drafter checked against its target: the layer ids and the mask token.

    findings = check_export(view, target, weight_shapes(folder))    # [Finding(severity, field, problem, fix)]

The traps the field reports most (BRIEF sections 2, 10, 11), each named by the config.json field as
the file spells it, with the fix: a field the engines read that contradicts the drafter's own
description (our exports: edited after export); target layer ids that are missing (z-lab's loader
and SGLang then pick build_target_layer_ids(num_target_layers, num_hidden_layers) silently, sglang
#37475), shifted by one (speculators' id + 1 in a z-lab file, or HF hidden_states indices taken for
layer ids), beyond the target, including its last layer (after the final norm, never captured), or
not the count fc.weight fuses; a num_target_layers of another target; a mask token outside the
vocabulary, one that text or the chat template produces, another than the target's, or a
`mask_token` string that SGLang resolves to another id. Shape, rotary settings, weights and the
target the drafter was trained against are `export_fit.py`'s.
"""

from __future__ import annotations

from typing import Any

from shared import mask_token
from shared.errors import ConfigError
from shared.target import dflash_layer_ids, vocab_id
from stage2_train.serve.export import QWEN3_MASK_TOKEN
from stage2_train.serve.export_fit import check_dims, check_identity, check_rope, feature_layers_in_weights
from stage2_train.serve.export_view import RETRAIN, ExportView, Finding, TargetSide


def check_export(view: ExportView, target: TargetSide, shapes: dict[str, tuple[int, ...]]) -> list[Finding]:
    """Every finding about the export against `target`; `shapes` are its tensors' (weight_shapes)."""
    findings = check_required(view)
    findings += check_description(view)
    findings += check_layers(view, target, shapes)
    findings += check_mask(view, target)
    findings += check_dims(view, target)
    findings += check_rope(view, target)
    findings += check_identity(view, target)
    return findings


def check_required(view: ExportView) -> list[Finding]:
    out = []
    block = view.get("block_size")
    if not isinstance(block, int) or block < 2:
        out.append(
            Finding(
                "error",
                view.name("block_size"),
                f"is {block!r}: z-lab's loader requires it and SGLang falls back to "
                f"--speculative-num-draft-tokens, which may not be the block the drafter was trained on",
                "set it to the drafter's training block size (model.block_size; the published drafters use 16)",
            )
        )
    if view.layout == "z-lab" and not isinstance(view.get("num_target_layers"), int):
        out.append(
            Finding(
                "error",
                "num_target_layers",
                "is missing: z-lab's loader requires it, and SGLang then checks layer ids "
                "against (and derives missing ones from) whatever target it runs",
                "set num_target_layers to the target's decoder-layer count (its config.json num_hidden_layers)",
            )
        )
    return out


# The description's fields that the engines read from config.json.
_DESCRIBED = (
    "block_size",
    "target_layer_ids",
    "mask_token_id",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rope_theta",
    "rms_norm_eps",
    "layer_types",
    "sliding_window",
    "is_causal",
)


def check_description(view: ExportView) -> list[Finding]:
    """Our own exports carry the description the drafter was trained with (`dflash_pipeline.drafter`):
    a field the engines read that disagrees with it was edited after export."""
    if view.recorded is None:
        return []
    out = []
    renamed = {"num_layers": "num_hidden_layers"}
    for key in (*_DESCRIBED, "num_layers"):
        if key not in view.recorded:
            continue
        have = view.get(renamed.get(key, key))
        want = view.recorded[key]
        if key == "layer_types" and have is None:
            continue  # absent means all full attention, which the description lists
        if key in ("rope_theta", "rms_norm_eps") and isinstance(have, (int, float)) and not isinstance(have, bool):
            have = float(have)
        if _plain(have) != _plain(want):
            field_name = view.name(renamed.get(key, key))
            out.append(
                Finding(
                    "error",
                    field_name,
                    f"is {_plain(view.written(key, have))!r}, but the drafter was trained with {_plain(view.written(key, want))!r} "
                    f"(its description, dflash_pipeline.drafter): config.json was edited after export",
                    f"set {field_name} back to {_plain(view.written(key, want))!r}, or export again (`python -m stage2_train export`)",
                )
            )
    return out


def check_layers(view: ExportView, target: TargetSide, shapes: dict[str, tuple[int, ...]]) -> list[Finding]:
    out = []
    name, L = view.name("target_layer_ids"), target.arch.num_hidden_layers
    ids = view.get("target_layer_ids")
    fused = feature_layers_in_weights(shapes, view.get("hidden_size"))
    drafter_layers = view.get("num_hidden_layers")
    recorded = list(view.recorded["target_layer_ids"]) if view.recorded else None
    num_target = view.get("num_target_layers")
    if isinstance(num_target, int) and num_target != L:
        out.append(
            Finding(
                "error",
                view.name("num_target_layers"),
                f"is {num_target}, the target has {L} decoder layers: the drafter was made for another target, or the "
                f"field is wrong (SGLang checks every layer id against it and derives missing ids from it)",
                f"set num_target_layers={L} if the drafter was trained on this target's features, {RETRAIN}",
            )
        )
    if ids is None:
        raw = view.get("target_layer_ids_as_written")
        if raw is not None:
            out.append(
                Finding(
                    "error",
                    name,
                    f"is {raw!r}, not a list of layer ids",
                    "write the layer ids as a list of integers",
                )
            )
            return out
        base = num_target if isinstance(num_target, int) else L
        try:
            fallback = dflash_layer_ids(base, drafter_layers) if isinstance(drafter_layers, int) else None
        except ConfigError:
            fallback = None
        trained = recorded or (None if fused is None else f"{fused} layers (fc.weight's input width)")
        out.append(
            Finding(
                "error",
                name,
                f"is missing: z-lab's loader and SGLang then take build_target_layer_ids({base}, num_hidden_layers="
                f"{drafter_layers}) = {fallback} without a word (sglang #37475); the drafter was trained on {trained or 'layers it does not say'}",
                f"write {name} = the layers the drafter was trained on"
                + (f" ({view.written('target_layer_ids', recorded)})" if recorded else ""),
            )
        )
        return out
    if fused is not None and fused != len(ids):
        out.append(
            Finding(
                "error",
                name,
                f"lists {len(ids)} layers, but fc.weight fuses {fused} ({fused} x hidden_size inputs)",
                f"list the {fused} layers the drafter was trained on",
            )
        )
    beyond = [i for i in ids if i < 0 or i >= L]
    if beyond:
        out.append(
            Finding(
                "error",
                name,
                f"{view.written('target_layer_ids', ids)} names layers {view.written('target_layer_ids', beyond)} "
                f"the target does not have (layers 0..{L - 1}{', written as id + 1' if view.layout == 'speculators' else ''})",
                f"use the layers the drafter was trained on; the DFlash rule for this target gives {_rule(L, len(ids))}, {RETRAIN}",
            )
        )
    elif L - 1 in ids:
        out.append(
            Finding(
                "error",
                name,
                f"includes the target's last layer ({L - 1}): HF's hidden_states[{L}] is taken after the final norm, and "
                f"serving engines never capture that layer, so the drafter is served other features than it was trained on",
                f"retrain on layers up to {L - 2} (the DFlash rule ends at {L - 3}: {_rule(L, len(ids))})",
            )
        )
    out += _shifted(view, ids, L, recorded)
    return out


def _shifted(view: ExportView, ids: list[int], L: int, recorded: list[int] | None) -> list[Finding]:
    """Ids equal to the DFlash rule moved by one: speculators' +1 in a z-lab file (or missing in a
    speculators file), or HF's hidden_states index taken for the layer id."""
    rule = _rule(L, len(ids))
    if rule is None or ids == rule or (recorded is not None and ids == recorded):
        return []
    name = view.name("target_layer_ids")
    for delta in (1, -1):
        if ids != [r + delta for r in rule]:
            continue
        if view.layout == "speculators":
            why = (
                "looks like id + 1 applied twice"
                if delta == 1
                else "looks like z-lab's ids written without speculators' + 1 (its aux ids name HF hidden_states[id])"
            )
        else:
            why = (
                "looks like speculators' aux_hidden_state_layer_ids (id + 1) written as z-lab's target_layer_ids"
                if delta == 1
                else "looks like HF hidden_states indices taken for layer ids (hidden_states[i] is layer i - 1's output)"
            )
        return [
            Finding(
                "warning",
                name,
                f"is {view.written('target_layer_ids', ids)}, the DFlash rule over this target's {L} layers shifted by {delta:+d}: "
                f"{why}; an off-by-one here silently ruins acceptance",
                f"if the drafter was trained on the rule's layers, set {name}={view.written('target_layer_ids', rule)}",
            )
        ]
    return []


def check_mask(view: ExportView, target: TargetSide) -> list[Finding]:
    out = []
    name, mask = view.name("mask_token_id"), view.get("mask_token_id")
    V, tokenizer = target.arch.vocab_size, target.tokenizer
    want = target.mask_token_id
    suggestion = (
        f"{want} ({target.token(want)})" if want is not None else "an unused special token id of the target"
    )
    if not isinstance(mask, int) or isinstance(mask, bool):
        out.append(
            Finding(
                "error",
                name,
                f"is {mask!r}: engines then resolve the mask token string ({QWEN3_MASK_TOKEN!r} by default), "
                f"which lands on {sglang_mask_id(tokenizer, view.get('mask_token') or QWEN3_MASK_TOKEN)} for this tokenizer",
                f"set {name} to the id the drafter was trained with (the target's: {suggestion})",
            )
        )
        return out
    if not 0 <= mask < V:
        out.append(
            Finding(
                "error",
                name,
                f"is {mask}, outside the target's vocabulary [0, {V}): the engines refuse it or index out of range",
                f"set {name} to the id the drafter was trained with (the target's: {suggestion})",
            )
        )
        return out
    why = not_reserved(target, mask)
    if why:
        out.append(
            Finding(
                "error",
                name,
                f"is {mask}, {why}: the drafter cannot tell its mask slots from real text",
                f"retrain with a reserved token (target.mask_token_id={suggestion}) and export again",
            )
        )
    if want is not None and mask != want:
        out.append(
            Finding(
                "warning",
                name,
                f"is {mask} ({target.token(mask)}), the target's mask token is {want} ({target.token(want)}), "
                f"which this pipeline (and, on Qwen3, the published drafters) train with",
                f"if the drafter was trained with {want}, set {name}={want}; if it was trained with {mask}, keep it and "
                f"make sure serving reads the id",
            )
        )
    if view.layout == "z-lab":
        text = view.get("mask_token")
        resolved = sglang_mask_id(tokenizer, text or QWEN3_MASK_TOKEN)
        if resolved != mask:
            said = f"is {text!r}" if text else f"is absent, so SGLang uses {QWEN3_MASK_TOKEN!r}"
            right = (
                target.token(mask)
                if mask < len(tokenizer)
                else (QWEN3_MASK_TOKEN if mask == len(tokenizer) else None)
            )
            out.append(
                Finding(
                    "error",
                    view.name("mask_token"),
                    f"{said}, which resolves to id {resolved} in the target's tokenizer, not {name}={mask}: SGLang versions "
                    f"that resolve the string feed the drafter another mask token",
                    f"set {view.name('mask_token')}={right!r}"
                    if right
                    else f"pick a {name} the tokenizer can name",
                )
            )
    return out


def sglang_mask_id(tokenizer: Any, text: str) -> int:
    """The id SGLang resolves a mask token string to: the tokenizer's own mask token, a vocabulary
    entry, else a token it adds (the next id after the tokenizer's, as z-lab's demo does)."""
    if (
        getattr(tokenizer, "mask_token", None) == text
        and getattr(tokenizer, "mask_token_id", None) is not None
    ):
        return int(tokenizer.mask_token_id)
    found = vocab_id(tokenizer, text)
    return found if found is not None else len(tokenizer)


def not_reserved(target: TargetSide, token_id: int) -> str | None:
    """Why `token_id` is a token that text or the chat template produces (None when reserved)."""
    return mask_token.not_reserved(target.tokenizer, target.folder, token_id)


def _rule(num_layers: int, count: int) -> list[int] | None:
    try:
        return dflash_layer_ids(num_layers, count)
    except ConfigError:
        return None


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (tuple, list)) else value
