"""Choosing a checkpoint: one rule for resume, eval and export.

The newest complete `step_N` directory not newer than `latest` whose files all match the sizes and
sha256 sums in its meta.json; every one passed over is reported with the reason. Updating
`latest` is the commit: directories newer than it are not trusted (a crash between the rename and
the pointer update, or checkpoints of a run abandoned by resuming from an older step). Pruning
keeps the `keep_latest_k` newest complete checkpoints up to the one just written and never
touches newer ones (an abandoned future).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.errors import CheckpointError
from stage2_train.train.checkpoint.format import (
    MODEL_FILE,
    STEP_DIR,
    checkpoint_problem,
    read_meta,
    read_weights,
    step_name,
)


@dataclass
class Selection:
    """The checkpoint to use and the ones passed over on the way, each with its reason."""

    path: Path | None
    skipped: list[tuple[str, str]] = field(default_factory=list)

def _step_of(path: Path) -> int:
    return int(STEP_DIR.fullmatch(path.name).group(1))

def complete_checkpoints(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Complete `step_N` directories (sizes as meta.json says), oldest first."""
    return [p for p in step_dirs(ckpt_dir) if read_meta(p) is not None]

def step_dirs(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Every `step_N` directory, complete or not, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted((p for p in ckpt_dir.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir()), key=_step_of)

def candidates(ckpt_dir: str | os.PathLike) -> list[Path]:
    """`step_N` directories not newer than `latest`, oldest first, complete or not (a resume says
    why it passes over an incomplete one).

    Updating `latest` is the commit. Directories newer than it are not trusted: a crash between the
    rename and the pointer update, or checkpoints of a run abandoned by resuming from an older step.
    Without a pointer, every directory."""
    found = step_dirs(ckpt_dir)
    try:
        pointer = STEP_DIR.fullmatch((Path(ckpt_dir) / "latest").read_text().strip())
    except OSError:
        pointer = None
    if pointer is not None:
        found = [p for p in found if _step_of(p) <= int(pointer.group(1))]
        named = Path(ckpt_dir) / pointer.group(0)
        # A listing NFS cached on a node that did not write the folder (a relaunch that put rank 0 on
        # another node) can lack the newest step: the pointer names it, and a lookup asks the server.
        if named not in found and named.is_dir():
            found.append(named)
    return found

def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest complete candidate (sizes as meta.json says; checksums are `select_checkpoint`'s)."""
    complete = [p for p in candidates(ckpt_dir) if read_meta(p) is not None]
    return complete[-1] if complete else None

# {"step": N, "metric": "walk_tau", "value": x, "basis": {...}}: the best held-out checkpoint (checkpoint.keep_best)
BEST = "best"


def prunable(ckpt_dir: Path, step: int, keep: int) -> list[Path]:
    """Complete checkpoints older than the `keep` newest up to `step`; newer ones and the `best`
    one are never touched."""
    upto = [p for p in complete_checkpoints(ckpt_dir) if _step_of(p) <= step]
    best = best_pointer(ckpt_dir)
    old = upto[: max(0, len(upto) - keep)]
    return [p for p in old if best is None or _step_of(p) != best["step"]]


def best_saved_with(path: Path) -> dict | None:
    """The `best` record the checkpoint at `path` was saved with (the best eval up to its step), when
    that checkpoint is still complete beside it; None otherwise (older checkpoints record none)."""
    best = (read_meta(path) or {}).get("best")
    if not isinstance(best, dict) or not isinstance(best.get("step"), int) or best["step"] > _step_of(path):
        return None
    return best if read_meta(path.parent / step_name(best["step"])) is not None else None


def best_pointer(ckpt_dir: str | os.PathLike) -> dict | None:
    try:
        pointer = json.loads((Path(ckpt_dir) / BEST).read_text())
        return pointer if isinstance(pointer, dict) and isinstance(pointer.get("step"), int) else None
    except (OSError, ValueError):
        return None


def resolve_checkpoint(arg: str | None, ckpt_dir: str | os.PathLike) -> Path:
    """What eval and export read: a path as given, `best` (the keep_best pointer), or (None) the
    checkpoints folder, where the newest checkpoint that verifies is chosen."""
    if arg != BEST:
        return Path(arg) if arg else Path(ckpt_dir)
    pointer = best_pointer(ckpt_dir)
    if pointer is None:
        raise CheckpointError(f"{Path(ckpt_dir) / BEST}: no best checkpoint recorded; train with checkpoint.keep_best=true and eval.every_steps > 0")
    return Path(ckpt_dir) / f"step_{pointer['step']:06d}"

def select_checkpoint(ckpt_dir: str | os.PathLike, rank: int = 0) -> Selection:
    """The newest checkpoint (not newer than `latest`) whose files all verify, and those skipped."""
    selection = Selection(None)
    for path in reversed(candidates(ckpt_dir)):
        problem = checkpoint_problem(path, rank)
        if problem is None:
            selection.path = path
            return selection
        selection.skipped.append((str(path), problem))
    return selection

def read_model_weights(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], Path]:
    """(drafter weights, the file read) from a `model.safetensors`, a folder holding one (a
    checkpoint step or an export), or a checkpoints folder (`select_checkpoint`'s choice)."""
    path = Path(path)
    if path.is_dir() and not (path / MODEL_FILE).is_file():
        selection = select_checkpoint(path)
        if selection.path is None:
            reasons = "; ".join(f"{p}: {why}" for p, why in selection.skipped) or "none saved yet"
            raise CheckpointError(f"no usable checkpoint in {path} ({reasons}); train first (`make train`)")
        path = selection.path
    return read_weights(path)
