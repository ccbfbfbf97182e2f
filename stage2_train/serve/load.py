"""Reading drafters back: from a training checkpoint or a drafter folder (ours, z-lab's, SpecForge's,
speculators'), always as the drafter that was saved.

    loaded = load_drafter("runs/default/checkpoints", target)     # or a step folder, or an export folder
    loaded.drafter, loaded.description, loaded.weights_file, loaded.trained_on
    weights = init_weights_for(folder, cfg.model, target)         # model.init_from, checked against this run

A checkpoint's `drafter.json` (or, for checkpoints written before it existed, the model section of the
run config it saved) and a folder's config.json describe the drafter; the description decides what is
built, and the command line's model section only says how to run it (`model/description.py`). A
drafter whose description records other target weights than the target's (another model or revision
of the same shape) is refused unless model.allow_other_target.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.errors import CheckpointError
from shared.hub import is_hub_id, resolve_hub
from shared.target import TargetArch, TargetInfo, dflash_layer_ids
from shared.target_parts import load_embed_and_head
from stage2_train.model.config import DrafterConfig
from stage2_train.model.description import VARIANT_FIELDS, DrafterDescription, describe
from stage2_train.model.drafter import DFlashDrafter, build_drafter
from stage2_train.serve.export import CONFIG_NAME, EXPORT_FORMAT_VERSION, WEIGHTS_NAME
from stage2_train.serve.peer_config import SPECULATORS_TYPES, from_speculators, refuse_unsupported, variant_of
from stage2_train.serve.trained_on import TrainedOn, read_trained_on
from stage2_train.train.checkpoint.format import DESCRIPTION_FILE, read_weights, saved_run_config
from stage2_train.train.checkpoint.select import select_checkpoint


@dataclass
class LoadedDrafter:
    drafter: DFlashDrafter
    description: DrafterDescription
    weights_file: Path  # the model.safetensors read
    trained_on: TrainedOn | None = None  # its held-out split and store, where recorded (`serve/trained_on.py`)


def load_drafter(
    source: str | os.PathLike,
    target: TargetInfo,
    *,
    runtime: DrafterConfig | None = None,
    parts: tuple[torch.Tensor, torch.Tensor] | None = None,
    frozen_dtype: torch.dtype | None = None,
    allow_other_target: bool | None = None,
) -> LoadedDrafter:
    """The drafter saved at `source`: a checkpoint step folder, a checkpoints folder (the newest
    checkpoint that verifies), or a drafter folder with config.json. Built as its description says,
    checked against `target` (width, vocabulary, layers, and the weights it was trained against unless
    `allow_other_target`, by default runtime's model.allow_other_target), with the target's frozen
    embedding and LM head (`parts`, read from the target's safetensors when not given); `runtime`
    says how to run it."""
    path = saved_drafter_path(source)
    if (path / CONFIG_NAME).is_file() and not (path / "meta.json").is_file():
        description, (weights, file) = folder_description(path), read_weights(path / WEIGHTS_NAME)
    else:
        weights, file = read_weights(path)  # verified against the checkpoint's checksums
        description = checkpoint_description(file.parent, target)
    if allow_other_target is None:
        allow_other_target = runtime is not None and runtime.allow_other_target
    description.check_target(target, str(path), allow_other_target=allow_other_target)
    embed_VH, lm_head_VH = parts if parts is not None else load_embed_and_head(target.target_dir)
    drafter = build_drafter(description, embed_VH, lm_head_VH, runtime=runtime, weights=weights, frozen_dtype=frozen_dtype)
    return LoadedDrafter(drafter.eval(), description, file, read_trained_on(file.parent))


def saved_drafter_path(source: str | os.PathLike) -> Path:
    """The folder `source` names: a checkpoint step folder or a drafter folder as given (a Hub id's
    snapshot), a checkpoints folder resolved to its newest checkpoint that verifies."""
    path = drafter_folder(source)
    if path.is_file() and path.name == WEIGHTS_NAME:  # a folder's weights file named: the folder (its description)
        path = path.parent
    if path.is_dir() and not (path / WEIGHTS_NAME).is_file() and not (path / CONFIG_NAME).is_file():
        selection = select_checkpoint(path)
        if selection.path is None:
            reasons = "; ".join(f"{p}: {why}" for p, why in selection.skipped) or "none saved yet"
            raise CheckpointError(f"no usable checkpoint in {path} ({reasons}); train first (`make train`)")
        path = selection.path
    return path


def drafter_folder(source: str | os.PathLike, setting: str = "model.init_from") -> Path:
    """A local path as given, or a Hub id's snapshot in the local Hugging Face cache (z-lab/...)."""
    if isinstance(source, str) and is_hub_id(source):
        return resolve_hub(source, setting).folder
    return Path(source)


def checkpoint_description(step_dir: Path, target: TargetInfo) -> DrafterDescription:
    """A checkpoint's drafter.json; for one written before descriptions were saved, the description
    rebuilt from the run config it saved (its model section and the layer ids and mask it resolved; where
    those were not recorded, resolved again from its saved target section, never from today's config)."""
    if (step_dir / DESCRIPTION_FILE).is_file():
        return DrafterDescription.from_dict(json.loads((step_dir / DESCRIPTION_FILE).read_text()), str(step_dir / DESCRIPTION_FILE))
    saved = saved_run_config(step_dir)
    if saved is None or "model" not in saved:
        raise CheckpointError(f"{step_dir}: no {DESCRIPTION_FILE} and no saved run config to describe its drafter")
    resolved = saved.get("resolved") or {}
    model = DrafterConfig.from_dict({k: v for k, v in saved["model"].items() if k in DrafterConfig.model_fields})
    layer_ids, mask_token_id = resolved.get("layer_ids"), resolved.get("mask_token_id")
    if layer_ids is None or mask_token_id is None:
        # Not recorded (an older checkpoint): resolved again from the target settings its run saved, never from
        # this command line's (a target.mask_token_id given today would become the drafter's own).
        from shared.target import TargetConfig, cached_tokenizer, default_mask_token_id, resolve_layer_ids

        fields = {k: v for k, v in (saved.get("target") or {}).items() if k in ("layer_ids", "num_feature_layers", "mask_token_id")}
        trained = TargetConfig.from_dict({"path": target.path, **fields})
        if layer_ids is None:
            layer_ids = resolve_layer_ids(trained, target.arch)
        if mask_token_id is None:
            mask_token_id = default_mask_token_id(trained, target.arch, cached_tokenizer(str(target.target_dir))[0])
    legacy = TargetInfo(
        path=target.path, target_dir=target.target_dir, arch=target.arch,
        layer_ids=list(layer_ids), mask_token_id=mask_token_id,
        weights_sha256=resolved.get("target_fingerprint", ""), tokenizer_sha256="", chat_template_sha256="",
    )
    return describe(model, legacy)


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


def folder_description(folder: str | os.PathLike) -> DrafterDescription:
    """What a drafter folder holds (ours, z-lab's in either layout, SpecForge's, speculators'), read
    from its config.json; what DFlashDrafter cannot compute is refused naming the field (YaRN or
    other scaled RoPE, a sliding layer without a window, biases, ...). Our own exports carry the
    description itself (`dflash_pipeline.drafter`), checked against the fields the loaders read, so
    a hand-edited config.json cannot silently describe another drafter."""
    config = read_export_config(folder)
    where = Path(folder) / CONFIG_NAME
    version = (config.get("dflash_pipeline") or {}).get("format_version", EXPORT_FORMAT_VERSION)
    if not isinstance(version, int) or version > EXPORT_FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: dflash_pipeline.format_version {version!r}, this code reads up to {EXPORT_FORMAT_VERSION} (an export "
            f"of a newer dflash-pipeline, whose fields may mean other things): update dflash-pipeline"
        )
    kind = config.get("speculators_model_type")
    if kind is not None:
        if kind not in SPECULATORS_TYPES:
            raise CheckpointError(
                f"{where}: speculators_model_type={kind!r} is not a block drafter this pipeline builds ({', '.join(SPECULATORS_TYPES)})"
            )
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
    heads = _count(config, "num_attention_heads", where)
    # Absent or null means "one per attention head" (and hidden_size // heads), as in transformers; a
    # 0 is not that, and read as it would be it would build a drafter of another shape.
    kv_heads = _count(config, "num_key_value_heads", where, heads, "num_attention_heads")
    if heads % kv_heads:
        raise CheckpointError(f"{where}: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}: each kv head "
                              f"serves a whole group of attention heads")
    arch = TargetArch(
        model_type=(config.get("dflash_pipeline") or {}).get("target", {}).get("model_type", "unknown"),
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=num_target_layers if isinstance(num_target_layers, int) else max(layer_ids) + 3,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=_count(config, "head_dim", where, config["hidden_size"] // heads, "hidden_size // num_attention_heads"),
        vocab_size=config.get("vocab_size", 0),
        rms_norm_eps=_number(config.get("rms_norm_eps", 1e-6), "rms_norm_eps", where),
        rope_theta=_number(rope.get("rope_theta", config.get("rope_theta", 10000.0)), "rope_theta", where),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=False,
    )
    block_size = value("block_size", 16)
    types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    sliding = "sliding_attention" in types
    described = _described(
        where,
        **variant_of(config, value, where),
        block_size=block_size,
        num_layers=config["num_hidden_layers"],
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta,
        max_position_embeddings=arch.max_position_embeddings,
        vocab_size=arch.vocab_size,
        layer_types=tuple(types),
        sliding_window=config.get("sliding_window") if sliding else None,
        is_causal=config.get("is_causal"),
        target_layer_ids=tuple(layer_ids),
        num_target_layers=arch.num_hidden_layers,
        mask_token_id=mask_token_id,
        target_model_type=arch.model_type,
        target_weights_sha256=(config.get("dflash_pipeline") or {}).get("target", {}).get("weights_sha256"),
    )
    own = (config.get("dflash_pipeline") or {}).get("drafter")
    if own is None:
        return described
    recorded = DrafterDescription.from_dict(own, f"{where}: dflash_pipeline.drafter")
    differ = [k for k, v in described.to_dict().items() if k in _READ_BY_LOADERS and recorded.to_dict()[k] != v
              and not (k == "is_causal" and _attention(described) == _attention(recorded))]
    if differ:
        k = differ[0]
        raise CheckpointError(
            f"{where}: the fields serving engines read say {k}={described.to_dict()[k]!r}, but the drafter's own "
            f"description (dflash_pipeline.drafter) says {recorded.to_dict()[k]!r}: config.json was edited after "
            f"export; export again, or make them agree"
        )
    return recorded


def _described(where: Path, **fields: Any) -> DrafterDescription:
    """The description config.json gives, its refusal naming the file."""
    try:
        return DrafterDescription(**fields)
    except CheckpointError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def _count(config: dict[str, Any], name: str, where: Path, default: int | None = None, absent: str = "") -> int:
    """config[name], a positive integer; `default` where it is absent or null (what `absent` says)."""
    value = config.get(name)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        fix = f"; leave it out to mean {absent}" if absent else ""
        raise CheckpointError(f"{where}: {name} is {value!r}, not an integer >= 1{fix}")
    return value


def _number(value: Any, name: str, where: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise CheckpointError(f"{where}: {name} is {value!r}, not a number > 0")
    return float(value)


def _attention(d: DrafterDescription) -> list[Any]:
    """Each layer's attention rule: is_causal unset and false are one rule for full layers (bidirectional
    in the block), and speculators' config, which runs full layers so, has no is_causal to write."""
    from stage2_train.model.attention import layer_kinds

    return layer_kinds(d.layer_types, d.num_layers, d.sliding_window, d.is_causal)


# What the engines read from config.json, which must agree with our own description of the drafter.
_READ_BY_LOADERS = (
    "variant", "markov_rank", "markov_head", "confidence_head", "conv_kernel_size", "conv_group_size", "selector_rank",
    "selector_top_k", "block_size", "num_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "layer_types", "sliding_window", "is_causal", "target_layer_ids", "mask_token_id", "rope_theta", "rms_norm_eps",
)


def load_exported(folder: str | os.PathLike, embed_VH: torch.Tensor, lm_head_VH: torch.Tensor) -> DFlashDrafter:
    """A drafter folder (ours, z-lab's, SpecForge's, speculators') as a DFlashDrafter; weights keep their dtype."""
    weights, _ = read_weights(Path(folder) / WEIGHTS_NAME)
    return build_drafter(folder_description(folder), embed_VH, lm_head_VH, weights=weights).eval()


def init_weights_for(folder: str | os.PathLike, cfg: DrafterConfig, target: Any) -> dict[str, torch.Tensor]:
    """The weights of a published or exported drafter, or of a training checkpoint's step folder, to
    start training from (`model.init_from`), after checking it fits this target and model config; every
    mismatch names the field to set. Other target weights than it was trained against are refused
    unless model.allow_other_target."""
    folder = drafter_folder(folder)
    where = f"model.init_from={str(folder)!r}"
    checkpoint = (folder / "meta.json").is_file()
    theirs = checkpoint_description(folder, target) if checkpoint else folder_description(folder)
    if theirs.feature_projection != "none":  # a checkpoint's projection is not folded into fc (an export's is)
        raise CheckpointError(
            f"{where}: this checkpoint's drafter has feature_projection={theirs.feature_projection}; export it "
            f"(`python -m stage2_train export --checkpoint {folder} --out DIR`) and start from DIR"
        )
    ours = describe(cfg.model_copy(update={"feature_projection": "none"}), target)
    checks = [
        ("hidden_size", theirs.hidden_size, ours.hidden_size, "the target's hidden size"),
        ("target_layer_ids", theirs.target_layer_ids, ours.target_layer_ids, "target.layer_ids"),
        ("mask_token_id", theirs.mask_token_id, ours.mask_token_id, "target.mask_token_id"),
        ("num_hidden_layers", theirs.num_layers, ours.num_layers, "model.num_layers"),
        ("block_size", theirs.block_size, ours.block_size, "model.block_size"),
        ("layer_types", theirs.layer_types, ours.layer_types, "model.layer_types"),
        ("sliding_window", theirs.sliding_window, ours.sliding_window, "model.sliding_window"),
        ("is_causal", theirs.is_causal, ours.is_causal, "model.is_causal"),
        ("intermediate_size", theirs.intermediate_size, ours.intermediate_size, "model.intermediate_size"),
        ("variant", theirs.variant, ours.variant, "model.variant"),
        *((name, getattr(theirs, name), getattr(ours, name), f"model.{name}") for name in VARIANT_FIELDS[theirs.variant]),
        ("num_attention_heads", theirs.num_attention_heads, ours.num_attention_heads, "the target's heads"),
        ("num_key_value_heads", theirs.num_key_value_heads, ours.num_key_value_heads, "the target's kv heads"),
        ("head_dim", theirs.head_dim, ours.head_dim, "the target's head_dim"),
        # Not shapes, so no weight would show them: the run computes its drafter with the target's.
        ("rope_theta", theirs.rope_theta, ours.rope_theta, "the target's rope_theta"),
        ("rms_norm_eps", theirs.rms_norm_eps, ours.rms_norm_eps, "the target's rms_norm_eps"),
    ]
    for name, have, want, setting in checks:
        have, want = (list(v) if isinstance(v, tuple) else v for v in (have, want))
        if name == "is_causal" and _attention(theirs) == _attention(ours):
            continue  # unset and false are one rule for full layers (speculators' config has no is_causal)
        if have != want:
            fix = f"set {setting}={have!r} or start" if setting.startswith(("model.", "target.")) else \
                "its weights were trained for another target: start"
            raise CheckpointError(
                f"{where}: the drafter has {name}={have!r} but this run has {want!r} ({setting}); "
                f"{fix} from another drafter"
            )
    theirs.check_target(target, where, allow_other_target=cfg.allow_other_target)
    weights, _ = read_weights(folder if checkpoint else folder / WEIGHTS_NAME)
    return weights


def run_init_weights(cfg: Any, manifest: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """`train`'s model.init_from: its weights, checked against this run (`init_weights_for`) and its
    held-out split against the store (`init_split_problem`). A run that resumes a checkpoint takes that
    checkpoint's weights, so a folder no longer readable (a scratch export cleaned up) is said, not refused."""
    import sys

    from shared.errors import ConfigError
    from shared.target import resolve_target
    from stage2_train.serve.trained_on import init_split_problem

    weights = None
    try:
        weights = init_weights_for(cfg.model.init_from, cfg.model, resolve_target(cfg.target))
    except (CheckpointError, FileNotFoundError) as exc:
        if not resumes(cfg):
            raise
        print(f"note: model.init_from={cfg.model.init_from} is not readable ({exc}); the run resumes from its checkpoint, "
              f"whose weights replace it", file=sys.stderr)
    problem = init_split_problem(cfg, read_trained_on(drafter_folder(cfg.model.init_from)), manifest)
    if problem:
        raise ConfigError(problem)
    return weights


def resumes(cfg: Any) -> bool:
    """Whether `train` will continue a checkpoint (train.resume a path, or auto with one saved)."""
    from shared.paths import RunPaths
    from stage2_train.train.checkpoint.select import latest_checkpoint

    if cfg.train.resume == "never":
        return False
    return cfg.train.resume != "auto" or latest_checkpoint(RunPaths.of(cfg).checkpoints) is not None
