"""An exported DFlash drafter folder and its target, as the export doctor reads them.

    view = read_export(folder)                      # config.json in any layout: z-lab / SpecForge, speculators, ours
    view.get("target_layer_ids"), view.name("target_layer_ids")   # [1, 9, 17, 25, 33], "dflash_config.target_layer_ids"
    target = open_target(TargetConfig(path="Qwen/Qwen3-8B"))     # shape, tokenizer, mask token, content hashes

`ExportView` puts each layout's fields in one place and remembers the key the file spells each one
with, so a finding names the field a user edits (`aux_hidden_state_layer_ids` in speculators' file,
`dflash_config.target_layer_ids` in z-lab's). Layer ids are z-lab's convention in every layout
(decoder layer i's output, HF hidden_states[i + 1]; speculators writes i + 1). Nothing here raises
on a bad export beyond a missing or unreadable config.json: the checks (`export_checks.py`,
`export_fit.py`) turn every problem into a `Finding`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.fingerprints import weights_fingerprint
from shared.target import (
    TargetArch,
    TargetConfig,
    TargetInfo,
    cached_tokenizer,
    default_mask_token_id,
    resolve_target_dir,
    target_source,
)
from stage2_train.serve.load import read_export_config

RETRAIN = "or retrain the drafter against this target"


@dataclass(frozen=True)
class Finding:
    severity: str  # "error": serving computes something else than training did; "warning": probably so
    field: str  # as config.json (or the store's manifest) spells it
    problem: str
    fix: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# The two sides


@dataclass
class ExportView:
    """An export's config.json in one view, whatever its layout; `fields` maps each value to the
    key the file spells it with. Layer ids are z-lab's (decoder layer i's output) in every layout."""

    folder: Path
    layout: str  # "z-lab" (z-lab, SpecForge, ours by default) or "speculators"
    config: dict[str, Any]
    values: dict[str, Any] = field(default_factory=dict)
    fields: dict[str, str] = field(default_factory=dict)
    # Our own exports record the drafter's description and its target (dflash_pipeline.drafter, .target).
    recorded: dict[str, Any] | None = None
    recorded_target: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str) -> Any:
        return self.values.get(key)

    def name(self, key: str) -> str:
        return self.fields.get(key, key)

    def written(self, key: str, value: Any) -> Any:
        """A value as the file writes it (speculators' layer ids are id + 1)."""
        if key == "target_layer_ids" and self.layout == "speculators" and value is not None:
            return [i + 1 for i in value]
        return list(value) if isinstance(value, tuple) else value


ARCH_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "layer_types",
    "sliding_window",
    "is_causal",
    "rms_norm_eps",
)


def read_export(folder: Path) -> ExportView:
    """config.json of a drafter folder (CheckpointError only when there is no readable config.json)."""
    config = read_export_config(folder)
    own = config.get("dflash_pipeline") or {}
    if config.get("speculators_model_type") is not None:
        view = ExportView(folder, "speculators", config)
        arch, prefix = config.get("transformer_layer_config") or {}, "transformer_layer_config."
        dflash = config.get("dflash_config") or {}
        aux = config.get("aux_hidden_state_layer_ids")
        view.values["target_layer_ids"] = [i - 1 for i in aux] if _int_list(aux) else None
        view.values["target_layer_ids_as_written"] = aux
        view.fields["target_layer_ids"] = "aux_hidden_state_layer_ids"
        for key in ("mask_token_id", "block_size"):
            inside = key in dflash and key not in config
            view.values[key] = dflash.get(key) if inside else config.get(key)
            view.fields[key] = f"dflash_config.{key}" if inside else key
        view.values["num_target_layers"] = None  # not part of speculators' format
        view.values["mask_token"] = None  # vLLM's speculators path reads the id alone
    else:
        view = ExportView(folder, "z-lab", config)
        arch, prefix = config, ""
        dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
        for key in ("target_layer_ids", "mask_token_id", "mask_token", "block_size", "num_target_layers"):
            # z-lab's newer layout keeps these in dflash_config; a missing one is named there.
            inside = key in dflash or (
                key not in config and key in ("target_layer_ids", "mask_token_id", "mask_token")
            )
            view.values[key] = dflash.get(key) if inside else config.get(key)
            view.fields[key] = f"dflash_config.{key}" if inside else key
        view.values["target_layer_ids_as_written"] = view.values["target_layer_ids"]
        if not _int_list(view.values["target_layer_ids"]):
            view.values["target_layer_ids"] = None
    for key in ARCH_KEYS:
        view.values[key] = arch.get(key)
        view.fields[key] = prefix + key
    if (
        view.values["head_dim"] is None
        and isinstance(arch.get("hidden_size"), int)
        and arch.get("num_attention_heads")
    ):
        view.values["head_dim"] = arch["hidden_size"] // arch["num_attention_heads"]
    if view.values["num_key_value_heads"] is None:
        view.values["num_key_value_heads"] = arch.get("num_attention_heads")
    view.values.update(rope_settings(arch))
    for key in ("rope_theta", "partial_rotary_factor"):
        view.fields[key] = prefix + (key if key in arch else f"rope_parameters.{key}")
    view.fields["rope_type"] = prefix + (
        "rope_scaling" if arch.get("rope_scaling") else "rope_parameters.rope_type"
    )
    view.recorded = own.get("drafter") if isinstance(own.get("drafter"), dict) else None
    view.recorded_target = own.get("target") if isinstance(own.get("target"), dict) else {}
    return view


def rope_settings(config: dict[str, Any]) -> dict[str, Any]:
    """rope_theta, the scaling type ('default' when none) and partial_rotary_factor, wherever the
    transformers version that wrote the file put them (top level, rope_scaling, rope_parameters)."""
    params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    scaling = config.get("rope_scaling") if isinstance(config.get("rope_scaling"), dict) else {}
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type") or "default"
    return {
        "rope_theta": float(config.get("rope_theta", params.get("rope_theta", 10000.0))),
        "rope_type": kind,
        "partial_rotary_factor": float(
            config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
        ),
    }


@dataclass
class TargetSide:
    """The target as the doctor needs it: shape, tokenizer, mask token and content hashes, read from
    its folder without loading the model (its weights are hashed once and cached)."""

    cfg: TargetConfig
    folder: Path
    arch: TargetArch
    config: dict[str, Any]
    tokenizer: Any
    mask_token_id: int | None  # the target's mask (target.mask_token_id, or its known reserved token)
    weights_sha256: str
    tokenizer_sha256: str
    chat_template_sha256: str

    def info(self, layer_ids: list[int]) -> TargetInfo:
        """The TargetInfo `load_drafter` checks a drafter against, with the drafter's own layer ids."""
        return TargetInfo(
            path=self.cfg.path,
            target_dir=self.folder,
            arch=self.arch,
            layer_ids=list(layer_ids),
            mask_token_id=self.mask_token_id if self.mask_token_id is not None else 0,
            weights_sha256=self.weights_sha256,
            tokenizer_sha256=self.tokenizer_sha256,
            chat_template_sha256=self.chat_template_sha256,
            source=target_source(self.cfg),
        )

    def token(self, token_id: int) -> str:
        return (
            self.tokenizer.convert_ids_to_tokens(token_id)
            if 0 <= token_id < len(self.tokenizer)
            else "outside the tokenizer"
        )


def open_target(cfg: TargetConfig) -> TargetSide:
    folder = resolve_target_dir(cfg)
    arch = TargetArch.from_dir(folder)
    tokenizer, hashes = cached_tokenizer(str(folder))
    try:
        mask = default_mask_token_id(cfg, arch, tokenizer)
    except ConfigError:
        mask = None  # no known reserved token: the drafter's own is judged on its own
    return TargetSide(
        cfg,
        folder,
        arch,
        json.loads((folder / "config.json").read_text()),
        tokenizer,
        mask,
        weights_fingerprint(folder),
        hashes["tokenizer_sha256"],
        hashes["chat_template_sha256"],
    )


def _int_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )
