"""The one resume policy: which checkpoint a run continues from, and what may differ when it does.

`train.resume`: auto (the newest checkpoint every rank can verify, `Checkpointer.select`), never,
or a path. Auto never starts a trained run over by itself: when no checkpoint passes its checks, or
checkpoint.dir moved away from the run's last checkpoints, it is refused, naming train.resume=never.
A checkpoint whose settings change what training computes (COMPATIBILITY_FIELDS), or whose drafter
(its drafter.json) differs from this run's in any field, is refused by name unless
`train.resume_force`; every changed setting goes into the `resume` event either way
(`config_changes`, and `forced_differences` when forced). A checkpoint saved before micro-batches had
a block budget cannot rebuild its batch plan: refused, or under `train.resume_force` its epoch is
re-planned from the start (`replanned` in the event). What `train.resume_force` cannot carry is
refused with or without it, naming the ways to start anew (`start_anew`): weights of another shape
(WEIGHT_SHAPE_FIELDS), another optimizer's state (optim.name), or a batch plan the sampler cannot
continue (other samples after `reprocess`, another split or budget: its `plan_difference`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shared.config import dotted_differences, flatten
from shared.errors import CheckpointError, ConfigError
from shared.files import write_atomic
from shared.paths import RunPaths
from stage2_train.data.sampler import start_anew
from stage2_train.model.description import VARIANT_FIELDS
from stage2_train.observe.config import DetectorConfig
from stage2_train.train.checkpoint.format import step_name
from stage2_train.train.checkpoint.select import best_pointer, latest_checkpoint

# Fields that change what training computes: resuming with a different value is refused (unless
# forced). Dotted paths into the config dict the trainer stores under state["config"]: its resolved
# run config plus a "resolved" mapping of values known only at run time.
COMPATIBILITY_FIELDS: dict[str, str] = {
    "model.block_size": "the drafter's block, hence anchors, attention and loss weights",
    "model.num_layers": "the drafter's architecture (its weights would not fit)",
    "model.intermediate_size": "the drafter's architecture (its weights would not fit)",
    "model.feature_projection": "the drafter's architecture (its weights would not fit)",
    "model.projection_dim": "the drafter's architecture (its weights would not fit)",
    "model.layer_types": "the drafter's attention layout",
    "model.sliding_window": "the drafter's attention layout",
    "model.is_causal": "the drafter's attention layout",
    "model.variant": "the drafter's architecture and its labels (dspark predicts one token further)",
    "model.markov_rank": "the DSpark heads (their weights would not fit)",
    "model.markov_head": "the DSpark heads (each kind has its own modules: their weights would not fit)",
    "model.confidence_head": "the DSpark heads (with or without the confidence head: their weights would not fit)",
    "model.conv_kernel_size": "the DFlash2 convolutions (their weights would not fit)",
    "model.conv_group_size": "the DFlash2 convolutions (their weights would not fit)",
    "model.selector_rank": "the DFlash2 selector (its weights would not fit)",
    "model.selector_top_k": "the DFlash2 selector's candidates",
    "loss.gamma": "the position weights of the loss",
    "loss.weighting": "the position weights of the loss (decay or D-PACE)",
    "loss.dpace_alpha": "the position weights of the loss (D-PACE smoothing)",
    "loss.ce_weight": "the objective (the cross-entropy term's weight)",
    "loss.kl_weight": "the objective (the top-k KL term's weight)",
    "loss.full_vocab_slots": "the objective (which slots score the whole vocabulary)",
    "loss.confidence_weight": "the objective (DSpark's confidence term)",
    "loss.selector_weight": "the objective (DFlash2's selector term)",
    "loss.selector_misses": "the objective (DFlash2's selector labels)",
    "loss.distill_positions": "where anchors are drawn",
    "target.num_feature_layers": "how many target features the drafter fuses",
    "target.layer_ids": "which target layers feed the drafter, as configured",
    "resolved.layer_ids": "which target layers feed the drafter, as resolved against the target",
    "resolved.target_fingerprint": "the target weights the features came from",
    "resolved.mask_token_id": "the mask token filling the drafter's blocks (target.mask_token_id)",
    "resolved.store_digest": "the store's contents (reprocessed, or another store): the samples and the batch plan",
    "seed": "the batch plan, the anchors and the noise",
    "eval.holdout_fraction": "the held-out split, hence which samples train and the batch plan",
    "eval.split_seed": "the held-out split, hence which samples train and the batch plan",
    "sampler.micro_batch_tokens": "tokens per micro-batch: with grad_accum and world size, the global batch",
    "train.grad_accum": "micro-batches per optimizer step",
    "sampler.max_samples_per_batch": "the batch plan",
    "sampler.window_slack": "the batch plan",
    "sampler.max_anchors_per_seq": "the anchors drawn per sample",
    "optim.name": "the optimizer, whose state the checkpoint holds",
    "resolved.world_size": "ranks: the global batch and the per-rank RNG and sampler states",
}

# Settings (and fields of the drafter's description) whose change gives the checkpoint's weights
# another shape, or other modules, than this run's drafter: neither train.resume_force nor
# model.init_from can use them. A change in the number of target layers is one too (`_reshaped`).
WEIGHT_SHAPE_FIELDS = (
    "model.num_layers", "model.intermediate_size", "model.feature_projection", "model.projection_dim", "model.variant",
    "model.markov_rank", "model.markov_head", "model.confidence_head", "model.conv_kernel_size", "model.conv_group_size", "model.selector_rank",
    "target.num_feature_layers",
)
DESCRIPTION_SHAPE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")

# Compared only when both configs carry it (checkpoints written before the field was recorded).
OPTIONAL_FIELDS = {
    "resolved.target_fingerprint", "optim.name", "resolved.store_digest", "model.layer_types", "model.sliding_window",
    "model.is_causal", "model.feature_projection", "model.projection_dim", "loss.distill_positions",
    "resolved.mask_token_id", "model.variant", "model.markov_rank", "model.markov_head", "model.confidence_head",
    "model.conv_kernel_size", "model.conv_group_size", "model.selector_rank", "model.selector_top_k",
    "loss.weighting", "loss.dpace_alpha", "loss.ce_weight", "loss.kl_weight", "loss.full_vocab_slots",
    "loss.confidence_weight", "loss.selector_weight", "loss.selector_misses",
}

# The drafter's description (drafter.json) is compared field by field too. A field one of the settings
# above decides is reported once, under that setting; the others name what sets them.
_MODEL_FIELDS = ("num_layers", "block_size", "intermediate_size", "layer_types", "sliding_window", "is_causal",
                 "feature_projection", "projection_dim", "variant", "markov_rank", "markov_head", "confidence_head",
                 "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DESCRIPTION_COMPARED_AS = {
    **{f: f"model.{f}" for f in _MODEL_FIELDS},
    "target_layer_ids": "resolved.layer_ids", "target_weights_sha256": "resolved.target_fingerprint",
    "mask_token_id": "resolved.mask_token_id",
}
DESCRIPTION_SET_BY = {
    **{f: f"model.{f}" for f in _MODEL_FIELDS},
    "target_layer_ids": "target.layer_ids", "target_weights_sha256": "target.path", "mask_token_id": "target.mask_token_id",
}

# A variant's own description fields: when model.variant changed, they are reported as that change.
_VARIANT_ONLY = {name for names in VARIANT_FIELDS.values() for name in names}

# Sampler state a checkpoint saved before micro-batches had a block budget lacks: its plan cannot be rebuilt.
BLOCK_BUDGET_KEYS = ("micro_batch_blocks", "blocks_digest")

# Settings renamed since a checkpoint may have been written: new dotted key -> the old one. A saved
# config is read under the new names before anything is compared.
RENAMED_FIELDS = {
    "sampler.micro_batch_tokens": "sampler.token_budget",
    "train.grad_accum": "sampler.grad_accum",
    "eval.offline_batch_tokens": "eval.offline_token_budget",
}
# The `doctor` section configures the live detectors: renamed `detectors`, every key kept.
RENAMED_FIELDS.update({f"detectors.{key}": f"doctor.{key}" for key in DetectorConfig.model_fields})


def upgrade_saved(saved_config: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's saved config, flattened, with renamed keys under their new names."""
    flat = flatten(saved_config)
    for new, old in RENAMED_FIELDS.items():
        if old in flat and new not in flat:
            flat[new] = flat.pop(old)
    return flat


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


def _unread(key: str, saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """A setting neither run's drafter reads (another variant's head or loss term, a projection size
    with no projection, a window with no sliding layer): changing it changes nothing to resume."""
    from stage2_train.model.config import VARIANT_FIELDS, VARIANT_LOSS_FIELDS

    variants = {saved.get("model.variant", "dflash"), current.get("model.variant", "dflash")}
    for owner, names in VARIANT_FIELDS.items():
        if key in {f"model.{n}" for n in names} | {f"loss.{n}" for n in VARIANT_LOSS_FIELDS.get(owner, ())}:
            return owner not in variants
    if key == "model.projection_dim":
        return "pca" not in {saved.get("model.feature_projection"), current.get("model.feature_projection")}
    if key == "model.sliding_window":
        return not any(t and "sliding_attention" in t for t in (saved.get("model.layer_types"), current.get("model.layer_types")))
    return False


def check_compatible(
    saved_config: dict[str, Any], current_config: dict[str, Any], force: bool = False,
    saved_drafter: dict[str, Any] | None = None, drafter: dict[str, Any] | None = None,
    *, plan: str | None = None, checkpoint: str = "<its step folder>",
) -> list[str]:
    """Differences in COMPATIBILITY_FIELDS, as 'field: saved X, now Y', then those of the drafter's
    description (`saved_drafter`, `drafter`: drafter.json's fields) that no setting above reported.
    Raises unless `force`, and even then when force cannot resume: weights of another shape, or
    `plan` (the sampler's `plan_difference`: the batch plan cannot be continued). The message names
    resume_force only where it would work, and the ways to start anew (`checkpoint`'s weights)."""
    saved, current = upgrade_saved(saved_config), flatten(current_config)
    differences, changed, reshaped = [], set(), []
    for key in COMPATIBILITY_FIELDS:
        if key not in saved and key not in current:
            continue
        if key in OPTIONAL_FIELDS and (key not in saved or key not in current):
            continue
        if _unread(key, saved, current):
            continue
        before, now = saved.get(key, _ABSENT), current.get(key, _ABSENT)
        if before != now and not _same_drafter(key, saved_drafter, drafter):
            changed.add(key)
            differences.append(f"{key}: saved {before!r}, now {now!r} ({COMPATIBILITY_FIELDS[key]})")
    if saved_drafter is not None and drafter is not None:  # a checkpoint from before drafter.json: its config only
        for key, now in drafter.items():
            before = saved_drafter.get(key, _ABSENT)
            if key == "version" or before == now or DESCRIPTION_COMPARED_AS.get(key) in changed:
                continue
            if key in _VARIANT_ONLY and "model.variant" in changed:
                continue
            set_by = DESCRIPTION_SET_BY.get(key, "the target's shape (target.path)")
            differences.append(f"drafter.{key}: saved {before!r}, now {now!r} (the drafter's description, set by {set_by})")
            reshaped += [f"drafter.{key}"] if key in DESCRIPTION_SHAPE_FIELDS else []
    if not differences:
        return differences
    reshaped = [key for key in WEIGHT_SHAPE_FIELDS if key in changed] + _other_layer_count(saved, current) + reshaped
    unforceable = (
        ([f"its weights do not fit this drafter ({', '.join(reshaped)})"] if reshaped else [])
        + (["its optimizer state is another optimizer's, over other parameters (optim.name)"] if "optim.name" in changed else [])
        + ([f"the batch plan cannot be continued ({plan})"] if plan else [])
    )
    anew = start_anew(checkpoint, weights_fit=not reshaped)
    if unforceable:
        raise CheckpointError(
            f"cannot resume: {'; '.join(differences)} (these change what training computes, and train.resume_force "
            f"cannot resume this checkpoint: {'; '.join(unforceable)}). {anew}"
        )
    if not force:
        raise CheckpointError(
            f"cannot resume: {'; '.join(differences)} (these change what training computes; set train.resume_force=true "
            f"to accept it and resume with them). {anew}"
        )
    return differences


# Settings whose value only names what the drafter's description records (null: the target's width, the
# DFlash rule's ids, every layer full): written out as that very value, the drafter is the same one.
_SPELLED_IN_DESCRIPTION: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "model.intermediate_size": ("intermediate_size", lambda v: v),
    "model.layer_types": ("layer_types", list),
    "model.projection_dim": ("projection_dim", lambda v: v),
    "target.layer_ids": ("target_layer_ids", list),
    "target.num_feature_layers": ("target_layer_ids", len),
}


def _same_drafter(key: str, saved_drafter: dict[str, Any] | None, drafter: dict[str, Any] | None) -> bool:
    """Whether a changed `key` still describes the checkpoint's drafter (both drafter.json records agree on
    what the setting decides): a value spelled out, not a change."""
    if key not in _SPELLED_IN_DESCRIPTION or saved_drafter is None or drafter is None:
        return False
    field, read = _SPELLED_IN_DESCRIPTION[key]
    return field in saved_drafter and field in drafter and read(saved_drafter[field]) == read(drafter[field])


def _other_layer_count(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """["resolved.layer_ids"] when the drafter reads another number of target layers (its input
    projection another shape), whatever setting chose them."""
    before, now = saved.get("resolved.layer_ids"), current.get("resolved.layer_ids")
    if isinstance(before, (list, tuple)) and isinstance(now, (list, tuple)) and len(before) != len(now):
        return ["resolved.layer_ids"]
    return []


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """Dotted key -> [saved value, current value] for every resolved setting that changed (a renamed
    key is one setting, not two)."""
    return dotted_differences(upgrade_saved(before), flatten(after))


@dataclass
class ResumePoint:
    """Where a run continues: the checkpoint (None: from scratch), its state, and the fields of the
    `resume` event (None when there is nothing to report)."""

    path: Path | None
    state: dict[str, Any] | None
    event: dict[str, Any] | None


def find_resume_point(
    choice: str, force: bool, checkpointer: Any, info: dict[str, Any], rank: int,
    plan_difference: Callable[[dict[str, Any]], str | None] | None = None,
) -> ResumePoint:
    """`train.resume` applied: auto, never, or a path. Checkpoints passed over (damaged, incomplete)
    are named on stderr (rank 0) and in the event; the chosen one is verified once across ranks
    (`Checkpointer.select`) and its settings, drafter and batch plan (`plan_difference`: the
    sampler's, given the saved sampler state) compared with this run's (`info`: its `run_info`, the
    resolved config and the drafter's description) before anything is loaded."""
    current_config = info["config"]
    if choice == "never":
        start_afresh(checkpointer, rank)
        return ResumePoint(None, None, None)
    skipped: list[tuple[str, str]] = []
    verified = False
    if choice == "auto":
        selection = checkpointer.select()
        path, skipped, verified = selection.path, selection.skipped, True
        for where, why in skipped:
            if rank == 0:
                print(f"warning: skipping checkpoint {where}: {why}", file=sys.stderr)
    else:
        path = Path(choice)
        if not path.is_dir():
            raise ConfigError(f"train.resume={choice!r}: no checkpoint directory at {path}")
        checkpointer.refuse_other_world_size(path)  # before verify: another rank count is not damage
        problem = checkpointer.verify(path)
        if problem is not None:
            raise CheckpointError(f"train.resume={choice!r}: {problem}")
        verified = True
    passed_over = [{"path": p, "why": w} for p, w in skipped]
    if choice == "auto" and path is None:
        refuse_checkpoints_left_behind(current_config, checkpointer)
    if path is None and skipped:  # this run's history, unreadable: starting over would later replace it
        raise CheckpointError(
            f"train.resume=auto: no checkpoint in {checkpointer.dir} passes its checks ("
            + "; ".join(f"{where}: {why}" for where, why in skipped)
            + "), and starting over would train this run again from step 0 and later replace them. Restore them (from a "
            "copy, or wait for the file system to show every rank the same files) and run the same command, or start over "
            "(train.resume=never)"
        )
    if path is None:
        return ResumePoint(None, None, None)
    state = checkpointer.load(path, verified=verified)
    plan = saved_plan_difference(state, plan_difference)
    forced = check_compatible(
        state["config"], current_config, force, state.get("drafter"), info.get("drafter"), plan=plan, checkpoint=str(path)
    )
    if plan:  # nothing the config records changed, yet the plan did (a checkpoint that predates a field)
        raise CheckpointError(
            f"cannot resume {path}: sampler state: {plan}; the batch plan would differ, so resuming exactly is "
            f"impossible, train.resume_force included. {start_anew(str(path))}"
        )
    replanned = replan_before_block_budget(state, path, force)
    before, now = state["trainer"].get("total_steps"), info.get("hyperparameters", {}).get("total_steps")
    if rank == 0 and None not in (before, now) and before != now:  # allowed, but the lr jumps here: say so
        print(f"note: resuming {path} under a learning-rate schedule of {now} steps, not its {before} (train.max_steps, "
              f"train.epochs): from step {state['trainer']['step']} on, the lr is this schedule's", file=sys.stderr)
    if rank == 0 and (forced or replanned):
        what = forced + ([f"epoch {replanned['epoch']} re-planned from its start"] if replanned else [])
        print(f"warning: train.resume_force: resuming {path} with " + "; ".join(what), file=sys.stderr)
    event = {
        "path": str(path),
        "skipped": passed_over,
        "forced_differences": forced,
        "total_steps_before": state["trainer"].get("total_steps"),
        "config_changes": config_changes(state["config"], current_config),
        **({"replanned": replanned} if replanned else {}),
    }
    return ResumePoint(path, state, event)


def start_afresh(checkpointer: Any, rank: int) -> None:
    """train.resume=never in a folder of another run's checkpoints: that run is abandoned. Its `best` is
    forgotten (`export --checkpoint best` reads the pointer whatever checkpoint.keep_best says, and its
    value would keep this run's checkpoints from being named) and `latest` is moved before its steps, so
    `eval`, `export` and `train.resume=auto` after a crash before this run's first save do not take its
    newest; its folders are replaced as this run saves the same steps."""
    pointer = best_pointer(checkpointer.dir) if rank == 0 else None
    if rank == 0 and checkpointer.best_step is None and pointer is not None:
        checkpointer.best_step, checkpointer.best_metric, checkpointer.best_value = pointer["step"], pointer.get("metric", "walk_tau"), pointer.get("value")
    if checkpointer.best_step is not None:
        checkpointer.forget_best(0, "starting afresh (train.resume=never)")
    if rank == 0 and checkpointer.latest() is not None:
        write_atomic(Path(checkpointer.dir) / "latest", step_name(0) + "\n")


def refuse_checkpoints_left_behind(config: dict[str, Any], checkpointer: Any) -> None:
    """train.resume=auto found no checkpoint in checkpoint.dir: refused when this run_dir's last training
    (its train_config.yaml) saved checkpoints in another folder that still holds them (checkpoint.dir
    changed, as a full disk's error advises), which would train the run again from step 0. Agreed by
    every rank (another node may not see the run_dir), so all raise or none do."""
    run_dir = Path(config["run_dir"])
    try:
        before = yaml.safe_load(RunPaths(run_dir).train_config.read_text()) or {}
    except (OSError, yaml.YAMLError):
        before = {}
    old = RunPaths(run_dir, checkpoint_dir=(before.get("checkpoint") or {}).get("dir")).checkpoints if before else None
    newest = latest_checkpoint(old) if old is not None and old.resolve() != Path(checkpointer.dir).resolve() else None
    if checkpointer.agree(newest is None):
        return
    where, one = (f"in {old} (newest {newest.name})", f"train.resume={newest}") if newest else ("elsewhere", "train.resume=<one>")
    raise CheckpointError(
        f"train.resume=auto: no checkpoint in {checkpointer.dir} (checkpoint.dir), but {run_dir}'s last training saved its "
        f"checkpoints {where}: resuming here would train the run again from step 0. Move them there (mv {old}/* "
        f"{checkpointer.dir}/) and run the same command, resume from one ({one}), or start over (train.resume=never)"
    )


def saved_plan_difference(
    state: dict[str, Any], plan_difference: Callable[[dict[str, Any]], str | None] | None
) -> str | None:
    """What of the checkpoint's batch plan the sampler cannot continue, even under train.resume_force
    (which re-plans a checkpoint from before the block budget: its missing budget keys are not compared)."""
    sampler = state.get("loader" if "loader" in state else "sampler")
    if plan_difference is None or not isinstance(sampler, dict):
        return None
    if any(key not in sampler for key in BLOCK_BUDGET_KEYS):
        sampler = {**sampler, "replan": True}
    return plan_difference(sampler)


def replan_before_block_budget(state: dict[str, Any], path: Path, force: bool) -> dict[str, Any] | None:
    """A checkpoint saved before micro-batches had a block budget (its sampler state lacks
    BLOCK_BUDGET_KEYS): its batch plan cannot be rebuilt, so it is refused, or under `force` its
    sampler state is moved to the start of its epoch, re-planned under today's budget (the steps
    already done in that epoch are trained again, on other batches). Returns the event's `replanned`."""
    name = "loader" if "loader" in state else "sampler"  # the component's name before the rename
    sampler = state.get(name)
    missing = [k for k in BLOCK_BUDGET_KEYS if isinstance(sampler, dict) and k not in sampler]
    if not missing:
        return None
    epoch, step = int(sampler["epoch"]), int(sampler["step_in_epoch"])
    if not force:
        raise CheckpointError(
            f"cannot resume {path}: it was saved before micro-batches had a block budget (its sampler state lacks "
            f"{', '.join(missing)}), so its batch plan cannot be rebuilt; set train.resume_force=true to re-plan its epoch "
            f"{epoch} from the start (the {step} step(s) already done in that epoch are trained again), or start a new "
            f"run from its weights: model.init_from={path} run_dir=<another folder>"
        )
    state[name] = {**sampler, "step_in_epoch": 0, "micro_step": 0, "replan": True}
    return {"epoch": epoch, "saved_step_in_epoch": step, "saved_micro_step": int(sampler["micro_step"]), "missing": missing}
