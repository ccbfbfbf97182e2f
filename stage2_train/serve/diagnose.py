"""The export doctor: "good training metrics, poor acceptance in serving", checked before serving.

    python -m stage2_train doctor --export runs/default/export --target Qwen/Qwen3-8B [--store PATH] [--prompts 4] [--json]

    report = diagnose_export("runs/default/export", TargetConfig(path=...), store=..., settings=DecodeSettings(...))
    text = format_text(report)        # one line per finding: severity, field, what is wrong, the fix

Any DFlash-family drafter folder (z-lab's or SpecForge's layout, speculators', ours; a Hub id is read
from the local cache, `serve/export_view.py`) is checked against the target it will serve with
(`serve/export_checks.py`: target layer ids, num_target_layers, the mask token, fields edited after
export; `serve/export_fit.py`: width, vocabulary and heads, rotary settings, the weights' shapes, an
embedding or LM head shipped with it, the target weights it was trained against) and, when a store is given, the store against the target (`serve/template_drift.py`: its
target, tokenizer and chat template, and the stored prompts against today's rendering, thinking
mode included). A drafter with no error is then decoded on a few prompts (the store's held-out
split, else built-in questions) with the project's speculative loop, beside the n-gram drafter:
tau with its 95% interval over prompts, and whether every output equals the target's own greedy
output. Exit 1 when anything is found; 3 when nothing is, but the drafter could not be decoded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import UserError
from shared.target import TargetConfig
from stage2_train.serve.export_checks import check_export
from stage2_train.serve.export_fit import check_weights, weight_shapes
from stage2_train.serve.export_view import ExportView, TargetSide, open_target, read_export
from stage2_train.serve.load import drafter_folder
from stage2_train.serve.template_drift import store_findings

# A handful of short questions, rendered with the target's own chat template, when no store is given.
BUILTIN_QUESTIONS = (
    "Explain in two sentences what a hash table is.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three differences between TCP and UDP.",
    "What is 17 times 23? Show the steps.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "Translate 'good morning, how are you?' into French and German.",
    "Give a haiku about autumn rain.",
    "Why does ice float on water?",
)


@dataclass(frozen=True)
class DecodeSettings:
    """How the drafter that passes is decoded (the `eval` section's online settings and split)."""

    num_prompts: int = 4
    max_new_tokens: int = 64
    dtype: str = "fp32"
    holdout_fraction: float = 0.02
    split_seed: int = 0
    device: str = "cpu"


def diagnose_export(
    export: str,
    target_cfg: TargetConfig,
    *,
    store: str | None = None,
    data: str | None = None,
    settings: DecodeSettings = DecodeSettings(),
) -> dict[str, Any]:
    """The doctor's report on `export` against the target of `target_cfg` (see the module docstring)."""
    folder = drafter_folder(export, "--export")
    view = read_export(folder)
    target = open_target(target_cfg)
    shapes = weight_shapes(folder)
    findings = check_export(view, target, shapes) + check_weights(view, shapes, target)
    notes = describe_layout(view)
    reader = None
    if store is not None:
        from shared.reader import StoreReader

        reader = StoreReader(store)
        more, store_notes = store_findings(reader, target, view.get("target_layer_ids"), data=data)
        findings += more
        notes += store_notes
    else:
        notes.append(
            "no store given (--store PATH, or a config whose store exists): the chat template was not checked"
        )
    errors = [f for f in findings if f.severity == "error"]
    acceptance = undecided = None
    if settings.num_prompts > 0:
        if errors:
            notes.append("not decoded: fix the errors first (acceptance would measure them)")
        else:
            try:
                acceptance = decode(folder, view, target, reader, settings)
            except UserError as exc:  # a folder this pipeline cannot build: no verdict on what it serves
                undecided = f"not decoded: {exc}"
                notes.append(undecided)
    return {
        "export": str(folder),
        "layout": view.layout,
        "written_by": "dflash-pipeline" if view.recorded is not None else "another trainer",
        "target": {
            "path": target_cfg.path,
            "folder": str(target.folder),
            "model_type": target.arch.model_type,
            "num_hidden_layers": target.arch.num_hidden_layers,
            "hidden_size": target.arch.hidden_size,
            "vocab_size": target.arch.vocab_size,
            "mask_token_id": target.mask_token_id,
        },
        "store": store,
        "findings": [f.to_dict() for f in findings],
        "num_errors": len(errors),
        "num_warnings": len(findings) - len(errors),
        "notes": notes,
        "acceptance": acceptance,
        "undecided": undecided,
    }


def describe_layout(view: ExportView) -> list[str]:
    ids = view.get("target_layer_ids")
    out = [
        f"{view.layout} layout; block_size {view.get('block_size')}, {view.get('num_hidden_layers')} drafter layer(s), "
        f"target layers {ids} (decoder layer i's output, HF hidden_states[i + 1]), mask token {view.get('mask_token_id')}"
    ]
    block = view.get("block_size")
    names = view.config.get("architectures") or []
    if view.config.get("speculators_model_type") == "dflash2" or "DFlash2DraftModel" in names:
        # as the model card says (serve/card.py serving_lines): engines would run it without its convolutions
        out.append("no engine serves DFlash2 drafters as released (vLLM's loader drops the attention convolution: vllm "
                   "#53428, #53612); measure it with this doctor's decode or `python -m stage2_train eval`")
    elif view.config.get("speculators_model_type") == "dspark" and isinstance(block, int):
        out.append(f"serve with {block} speculative tokens (vLLM method dspark, num_speculative_tokens={block}: DSpark drafts every slot)")
    elif isinstance(block, int):
        out.append(
            f"serve with {block - 1} speculative tokens (vLLM num_speculative_tokens={block - 1}; SGLang reads "
            f"block_size={block})"
        )
    return out


def decode(
    folder: Path, view: ExportView, target: TargetSide, reader: Any, settings: DecodeSettings
) -> dict[str, Any]:
    """The drafter and the n-gram drafter decoding the same prompts with the target (greedy)."""
    import torch

    from shared.target import stop_token_ids
    from stage2_train.data.view import split_indices
    from stage2_train.serve.load import load_drafter
    from stage2_train.serve.online_eval import bootstrap_tau, heldout_prompts, load_online_target, online_eval
    from stage2_train.serve.speculative import DFlashProposer, NgramProposer

    loaded = load_drafter(folder, target.info(view.get("target_layer_ids") or []))
    drafter = loaded.drafter.to(settings.device)
    layer_ids = list(loaded.description.target_layer_ids)
    if reader is not None:  # the split our export recorded it was trained with (`serve/trained_on.py`), else the config's
        record = loaded.trained_on
        fraction = record.holdout_fraction if record and record.holdout_fraction is not None else settings.holdout_fraction
        seed = record.split_seed if record and record.split_seed is not None else settings.split_seed
        _, heldout = split_indices(reader, fraction, seed)
        prompts = [p for _, p in heldout_prompts(reader, heldout, settings.num_prompts)]
        source = f"{len(prompts)} held-out store prompts"
    else:
        # rendered as the drafter's data was (a no-think drafter decoded in thinking mode would score low)
        prompts = builtin_prompts(target.tokenizer, settings.num_prompts, (loaded.trained_on and loaded.trained_on.chat_template_kwargs))
        source = f"{len(prompts)} built-in prompts"
    if not prompts:
        raise UserError("no prompt to decode (the store's held-out split has no sample with a prompt)")
    model = load_online_target(target.cfg, settings.dtype, settings.device)
    proposers = {
        "drafter": DFlashProposer(drafter, layer_ids, feature_dtype=torch.bfloat16, name="drafter"),
        "ngram": NgramProposer(loaded.description.max_draft),  # as many as the drafter drafts, as `eval` gives it
    }
    online = online_eval(
        model,
        proposers,
        prompts,
        max_new_tokens=settings.max_new_tokens,
        eos_token_ids=stop_token_ids(target.tokenizer, model),
    )
    out = {"prompts": source, "max_new_tokens": settings.max_new_tokens, "proposers": {}}
    for name, entry in online["proposers"].items():
        interval = bootstrap_tau(entry["per_prompt"])
        out["proposers"][name] = {
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in interval.items()},  # lo/hi None: too few prompts
            "exact": entry["exact"],
            "num_exact": entry["num_exact"],
            "num_decoded": len(entry["per_prompt"]),
            "accept_hist": entry["accept_hist"],
        }
    return out


def builtin_prompts(tokenizer: Any, count: int, template_kwargs: dict[str, Any] | None = None) -> list[list[int]]:
    from shared.conversations import render

    out = []
    for question in BUILTIN_QUESTIONS[:count]:
        text = render(tokenizer, [{"role": "user", "content": question}], add_generation_prompt=True, template_kwargs=template_kwargs)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def format_text(report: dict[str, Any]) -> str:
    from stage2_train.serve.online_eval import interval_text

    target = report["target"]
    lines = [
        f"export doctor: {report['export']} ({report['written_by']}) against {target['path']} "
        f"({target['model_type']}, {target['num_hidden_layers']} layers, hidden {target['hidden_size']}, vocab {target['vocab_size']})"
    ]
    for f in report["findings"]:
        lines.append(f"{f['severity'].upper():<7} {f['field']}: {f['problem']} | fix: {f['fix']}")
    lines += [f"note: {n}" for n in report["notes"]]
    acceptance = report["acceptance"]
    if acceptance:
        parts = [
            f"{name} tau {interval_text(p)}"
            + ("" if p["exact"] else f" (NOT EXACT: {p['num_decoded'] - p['num_exact']} of {p['num_decoded']} outputs differ from greedy)")
            for name, p in acceptance["proposers"].items()
        ]
        lines.append(
            f"acceptance ({acceptance['prompts']}, {acceptance['max_new_tokens']} new tokens, greedy): "
            + " | ".join(parts)
        )
    if report["findings"]:
        lines.append(
            f"verdict: errors {report['num_errors']}, warnings {report['num_warnings']}: each line names the field and the fix"
        )
    elif report.get("undecided"):
        lines.append("verdict: cannot tell: no mismatch found, but the drafter could not be decoded here (the note above says why)")
    else:
        lines.append(
            "verdict: no mismatch found between the drafter, its target"
            + (" and its store" if report["store"] else "")
        )
    return "\n".join(lines)


def doctor_export(as_json: bool, **kwargs: Any) -> tuple[str, int]:
    """(text to print, exit code): 1 when there is any finding, 3 when there is none but the drafter
    could not be decoded (as the log doctor's "cannot tell": a script gating on it must not take it
    for healthy), else 0."""
    report = diagnose_export(**kwargs)
    code = 1 if report["findings"] else 3 if report["undecided"] else 0
    return (json.dumps(report, indent=1, default=str) if as_json else format_text(report)), code
