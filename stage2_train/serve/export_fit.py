"""An exported DFlash drafter's shape, rotary settings, weights and origin against its target.

    findings = check_dims(view, target) + check_rope(view, target) + check_identity(view, target)
    findings += check_weights(view, weight_shapes(folder), target)

The width and vocabulary must be the target's (the drafter reads its features and borrows its
embedding and LM head); heads and head_dim are the target's in every reference drafter. Peers'
trainers copy the target's rotary settings into the drafter, so a difference there means the file
lost them; this pipeline trains plain, full RoPE with the target's theta. The tensors are checked
against config.json (a wrong head count splits q/k/v wrongly), an embedding or LM head shipped with
the drafter against the target's own (untied, shifted by a row, another model's), and the target
weights our exports record against the target's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stage2_train.serve.export_view import RETRAIN, ExportView, Finding, TargetSide, rope_settings


def check_dims(view: ExportView, target: TargetSide) -> list[Finding]:
    arch = target.arch
    out = []
    for key, theirs, severity in (
        ("hidden_size", arch.hidden_size, "error"),
        ("vocab_size", arch.vocab_size, "error"),
        ("num_attention_heads", arch.num_attention_heads, "warning"),
        ("num_key_value_heads", arch.num_key_value_heads, "warning"),
        ("head_dim", arch.head_dim, "warning"),
    ):
        have = view.get(key)
        if have == theirs:
            continue
        if severity == "error":
            problem = (
                f"is {have!r}, the target's is {theirs}: the drafter reads the target's features and borrows its "
                f"embedding and LM head, so it cannot run with this target"
            )
        else:
            problem = (
                f"is {have!r}, the target's is {theirs}: DFlash drafters copy the target's attention shape"
            )
        out.append(
            Finding(severity, view.name(key), problem, f"use the target the drafter was made for, {RETRAIN}")
        )
    draft_vocab = view.config.get("draft_vocab_size")
    if view.layout == "speculators" and draft_vocab is not None and draft_vocab != arch.vocab_size:
        out.append(
            Finding(
                "error",
                "draft_vocab_size",
                f"is {draft_vocab}, the target's vocabulary is {arch.vocab_size}: a DFlash drafter "
                f"scores the target's whole vocabulary through its LM head",
                f"set draft_vocab_size={arch.vocab_size}",
            )
        )
    return out


def check_rope(view: ExportView, target: TargetSide) -> list[Finding]:
    """The drafter's rotary settings against the target's. Peers' trainers copy the target's into the
    drafter, so a difference there means the file lost them (warning); this pipeline trains plain,
    full RoPE with the target's theta, so in our own exports only the theta must match."""
    mine, theirs = (
        {k: view.get(k) for k in ("rope_theta", "rope_type", "partial_rotary_factor")},
        rope_settings(target.config),
    )
    out = []
    if mine["rope_theta"] != theirs["rope_theta"]:
        out.append(
            Finding(
                "warning",
                view.name("rope_theta"),
                f"is {mine['rope_theta']:g}, the target's is {theirs['rope_theta']:g}: DFlash drafters "
                f"take the target's rotary base, so this one was made for another target or edited",
                f"set it to {theirs['rope_theta']:g} if the drafter was trained with it, {RETRAIN}",
            )
        )
    ours = view.recorded is not None
    for key, label in (("rope_type", "rotary scaling"), ("partial_rotary_factor", "partial rotary factor")):
        if ours and mine[key] != ({"rope_type": "default", "partial_rotary_factor": 1.0}[key]):
            out.append(
                Finding(
                    "error",
                    view.name(key),
                    f"is {mine[key]!r}, but this pipeline trained the drafter with plain, full RoPE: "
                    f"engines would rotate its queries and keys another way",
                    "remove it (export again)",
                )
            )
        elif not ours and mine[key] != theirs[key]:
            out.append(
                Finding(
                    "warning",
                    view.name(key),
                    f"{label} is {mine[key]!r}, the target's is {theirs[key]!r}: trainers copy the "
                    f"target's rotary settings into the drafter, so serving may rotate differently than training did",
                    f"write the {label} the drafter was trained with (the target's, {theirs[key]!r}, for SpecForge and z-lab)",
                )
            )
    return out


def check_identity(view: ExportView, target: TargetSide) -> list[Finding]:
    recorded = (view.recorded or {}).get("target_weights_sha256") or view.recorded_target.get(
        "weights_sha256"
    )
    if not recorded or recorded == target.weights_sha256:
        return []
    source = view.recorded_target.get("hub_id") or view.recorded_target.get("name") or "another target"
    return [
        Finding(
            "error",
            "dflash_pipeline.target.weights_sha256",
            f"the drafter was trained against target weights {recorded[:12]} ({source}), this target's are "
            f"{target.weights_sha256[:12]}: another model or revision, and acceptance collapses when the target's weights change",
            f"serve it with the target it was trained on (revision {view.recorded_target.get('commit', '?')}), {RETRAIN}",
        )
    ]


# ---------------------------------------------------------------------------------------------
# Weights


def weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the folder's safetensors, from their headers (nothing loaded)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():
                shapes[key] = tuple(fh.get_slice(key).get_shape())
    return shapes


def feature_layers_in_weights(shapes: dict[str, tuple[int, ...]], hidden: Any) -> int | None:
    fc = shapes.get("fc.weight")
    if fc is None or len(fc) != 2 or not isinstance(hidden, int) or fc[1] % hidden:
        return None
    return fc[1] // hidden


def check_weights(view: ExportView, shapes: dict[str, tuple[int, ...]], target: TargetSide) -> list[Finding]:
    """The tensors against config.json (a wrong head count splits q/k/v wrongly), and an embedding or
    LM head shipped with the drafter against the target's own (untied, shifted or another model's)."""
    if not shapes:
        return [
            Finding("error", "model.safetensors", "no *.safetensors weights in the folder", "export again")
        ]
    H, heads, kv, dim = (
        view.get(k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    out = []
    if "fc.weight" not in shapes:
        out.append(
            Finding(
                "error",
                "fc.weight",
                "is missing: not a DFlash drafter's weights (or renamed)",
                "export again",
            )
        )
    layers = sorted(
        {int(k.split(".")[1]) for k in shapes if k.startswith("layers.") and k.split(".")[1].isdigit()}
    )
    if len(layers) != view.get("num_hidden_layers"):
        out.append(
            Finding(
                "error",
                view.name("num_hidden_layers"),
                f"is {view.get('num_hidden_layers')!r}, the weights hold {len(layers)} layers",
                f"set {view.name('num_hidden_layers')}={len(layers)}",
            )
        )
    expected = {
        "q_proj": (heads, "num_attention_heads"),
        "k_proj": (kv, "num_key_value_heads"),
        "v_proj": (kv, "num_key_value_heads"),
    }
    for proj, (count, key) in expected.items():
        shape = shapes.get(f"layers.0.self_attn.{proj}.weight")
        if shape is None or not all(isinstance(v, int) for v in (count, dim, H)):
            continue
        if shape != (count * dim, H):
            out.append(
                Finding(
                    "error",
                    view.name(key),
                    f"{count} heads of {dim} give {proj} ({count * dim}, {H}), the weights hold {shape}",
                    f"set {view.name(key)} and head_dim to the weights' ({shape[0]} = heads x head_dim)",
                )
            )
    out += _borrowed_parts(shapes, view.folder, target)
    return out


def _borrowed_parts(shapes: dict[str, tuple[int, ...]], folder: Path, target: TargetSide) -> list[Finding]:
    import torch
    from safetensors import safe_open

    from shared.target_parts import load_embed_and_head

    names = [k for k in shapes if k.split(".")[-2:-1] in (["embed_tokens"], ["lm_head"])]
    if not names:
        return []
    shipped = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            shipped.update({name: fh.get_tensor(name).float() for name in names if name in fh.keys()})
    embed_VH, head_VH = load_embed_and_head(target.folder)
    out = []
    for name, mine in shipped.items():
        theirs = embed_VH if "embed_tokens" in name else head_VH
        what = "embedding" if "embed_tokens" in name else "LM head"
        if mine.shape != theirs.shape:
            out.append(
                Finding(
                    "error",
                    name,
                    f"has shape {tuple(mine.shape)}, the target's {what} {tuple(theirs.shape)}: another vocabulary",
                    f"drop {name} from the export (engines borrow the target's), {RETRAIN}",
                )
            )
            continue
        theirs = theirs.float()
        tol = dict(rtol=1e-2, atol=1e-2)  # a bf16 copy of the target's
        if torch.allclose(mine, theirs, **tol):
            continue
        shifted = mine.shape[0] > 1 and (
            torch.allclose(mine[1:], theirs[:-1], **tol) or torch.allclose(mine[:-1], theirs[1:], **tol)
        )
        untied = what == "LM head" and torch.allclose(mine, embed_VH.float(), **tol)
        why = (
            "its rows are the target's shifted by one token"
            if shifted
            else "it is the target's embedding (tied), but the target's LM head is untied"
            if untied
            else f"it is not the target's {what}"
        )
        out.append(
            Finding(
                "error",
                name,
                f"{why}: engines that borrow the target's {what} give the drafter other rows than it was trained with",
                f"drop {name} from the export so engines use the target's, {RETRAIN}",
            )
        )
    return out
