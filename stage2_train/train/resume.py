"""The one resume policy: which checkpoint a run continues from, and what may differ when it does.

`train.resume`: auto (the newest checkpoint every rank can verify, `Checkpointer.select`), never,
or a path. A checkpoint whose settings change what training computes (COMPATIBILITY_FIELDS) is
refused by name unless `train.resume_force`; every changed setting goes into the `resume` event
either way (`config_changes`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.config import dotted_differences, flatten
from shared.errors import CheckpointError, ConfigError
from stage2_train.observe.config import DetectorConfig

# Fields that change what training computes: resuming with a different value is refused (unless
# forced). Dotted paths into the config dict the trainer stores under state["config"]: its resolved
# run config plus a "resolved" mapping of values known only at run time.
COMPATIBILITY_FIELDS: dict[str, str] = {
    "model.block_size": "the drafter's block, hence anchors, attention and loss weights",
    "loss.gamma": "the position weights of the loss",
    "target.num_feature_layers": "how many target features the drafter fuses",
    "target.layer_ids": "which target layers feed the drafter, as configured",
    "resolved.layer_ids": "which target layers feed the drafter, as resolved against the target",
    "resolved.target_fingerprint": "the target weights the features came from",
    "sampler.micro_batch_tokens": "tokens per micro-batch: with grad_accum and world size, the global batch",
    "sampler.grad_accum": "micro-batches per optimizer step",
    "optim.name": "the optimizer, whose state the checkpoint holds",
    "resolved.world_size": "ranks: the global batch and the per-rank RNG and sampler states",
}

OPTIONAL_FIELDS = {"resolved.target_fingerprint", "optim.name"}  # compared only when both configs carry it

# A setting renamed since a checkpoint was written: its saved value is read under the old name.
RENAMED_FIELDS = {"sampler.micro_batch_tokens": "sampler.micro_batch_tokens"}
# The `doctor` section configures the live detectors: renamed `detectors`, every key kept.
RENAMED_FIELDS.update({f"detectors.{key}": f"doctor.{key}" for key in DetectorConfig.model_fields})


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


def check_compatible(
    saved_config: dict[str, Any], current_config: dict[str, Any], force: bool = False
) -> list[str]:
    """Differences in COMPATIBILITY_FIELDS, as 'field: saved X, now Y'. Raises unless `force`."""
    saved, current = flatten(saved_config), flatten(current_config)
    for new, old in RENAMED_FIELDS.items():
        if new not in saved and old in saved:
            saved[new] = saved[old]
    differences = []
    for key in COMPATIBILITY_FIELDS:
        if key not in saved and key not in current:
            continue
        if key in OPTIONAL_FIELDS and (key not in saved or key not in current):
            continue
        before, now = saved.get(key, _ABSENT), current.get(key, _ABSENT)
        if before != now:
            differences.append(f"{key}: saved {before!r}, now {now!r}")
    if differences and not force:
        raise CheckpointError(
            "cannot resume: "
            + "; ".join(differences)
            + " (these change what training computes; set train.resume_force=true to accept it)"
        )
    return differences


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """Dotted key -> [saved value, current value] for every resolved setting that changed; a saved
    setting renamed since (RENAMED_FIELDS) is compared under its new name."""
    saved = flatten(before)
    for new, old in RENAMED_FIELDS.items():
        if new not in saved and old in saved:
            saved[new] = saved.pop(old)
    return dotted_differences(saved, after)


@dataclass
class ResumePoint:
    """Where a run continues: the checkpoint (None: from scratch), its state, and the fields of the
    `resume` event (None when there is nothing to report)."""

    path: Path | None
    state: dict[str, Any] | None
    event: dict[str, Any] | None


def find_resume_point(choice: str, force: bool, checkpointer: Any, current_config: dict[str, Any], rank: int) -> ResumePoint:
    """`train.resume` applied: auto, never, or a path. Checkpoints passed over (damaged, incomplete)
    are named on stderr (rank 0) and in the event; the chosen one is verified once across ranks
    (`Checkpointer.select`) and its settings compared with this run's before anything is loaded."""
    if choice == "never":
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
        problem = checkpointer.verify(path)
        if problem is not None:
            raise CheckpointError(f"train.resume={choice!r}: {problem}")
        verified = True
    passed_over = [{"path": p, "why": w} for p, w in skipped]
    if path is None:
        return ResumePoint(None, None, {"path": None, "skipped": passed_over} if skipped else None)
    state = checkpointer.load(path, verified=verified)
    forced = check_compatible(state["config"], current_config, force)
    event = {
        "path": str(path),
        "skipped": passed_over,
        "forced_differences": forced,
        "total_steps_before": state["trainer"].get("total_steps"),
        "config_changes": config_changes(state["config"], current_config),
    }
    return ResumePoint(path, state, event)
