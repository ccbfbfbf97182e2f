"""Records of a training log, read leniently: one canonical view per row (`normalize`), and the
small helpers every detector shares (robust statistics, the event dict, the trailing `Window`).

    row = normalize({"step": 12, "tok_per_sec": 26000.0, "loss": "nan"})
    row["kind"], row["tok_per_s"], row["loss"]       # "train", 26000.0, nan

Kind is inferred when missing (a row naming an `event` is an event, `val`/`test` kinds are eval
rows, anything else a train row); every ALIASES field is read under its first name present, and
"nan"/"inf" strings (how MetricsSink writes non-finite numbers) are numbers. Rows of other trainers
whose metric names carry a namespace (`train/loss`, `eval/avg_acc`, `profile/tokens_per_s`) are
translated to these names when the log is read (`peers.py`), before they come here.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

# Canonical field -> the names other trainers use for it, tried in order.
ALIASES: dict[str, tuple[str, ...]] = {
    "step": ("step", "global_step", "iteration", "iter", "train/step"),
    # elapsed_s first: it excludes the start-up of a resumed run; `time` is MetricsSink's wall clock.
    "t": ("elapsed_s", "elapsed", "wall_s", "time_s", "time", "timestamp"),
    "loss": ("loss", "train_loss", "train/loss"),
    "accuracy": ("accuracy", "acc", "train_acc", "train/accuracy"),
    "accept_len": ("accept_len", "eal", "acceptance_length", "expected_acceptance_length", "tau"),
    "lr": ("lr", "learning_rate", "train/lr"),
    "noise_std": ("noise_std", "noise"),
    "grad_norm": ("grad_norm", "gnorm", "grad-norm", "total_norm"),
    "tok_per_s": ("tok_per_s", "tok_per_sec", "tokens_per_s", "tokens_per_sec", "throughput"),
    "samples_per_s": ("samples_per_s", "samples_per_sec"),  # the throughput detector's input without tok_per_s
    "epoch": ("epoch",),
    # The step's batch, all ranks: tokens / samples is its mean sample length (the whiplash detector's cause).
    "batch_tokens": ("tokens",),
    "batch_samples": ("samples",),
    "data_wait_frac": ("data_wait_frac",),
    # Set on train rows whose drafts past the first N are scored among the target's top-k candidates.
    "full_vocab_slots": ("full_vocab_slots",),
    "eval_s": ("eval_s", "eval_runtime"),  # eval_runtime: Hugging Face Trainer's seconds per eval
    "blocked_s": ("blocked_s",),
    "write_s": ("write_s",),
    # Held-out eval rows: ce falls back to the eval's loss (other trainers log val loss as `loss`).
    "ce": ("ce", "val_loss", "eval_loss", "loss"),
    "walk_tau": ("walk_tau",),
    "ce_se": ("ce_se",),
    "accuracy_se": ("accuracy_se",),
    "accept_len_se": ("accept_len_se",),
    "walk_tau_se": ("walk_tau_se",),
    "num_samples": ("num_samples",),
    "num_blocks": ("num_blocks",),
    "num_tokens": ("num_tokens", "num_scored", "scored_tokens"),
}
RESET_EVENTS = ("resume", "run_start")  # run_start at step 0 after earlier rows: a fresh run


def number(value: Any) -> float | None:
    """A float from a logged value ("nan" and "inf" strings included); None when absent or not a number."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


# A flat row without `kind` that holds only held-out metrics (Hugging Face Trainer's log_history:
# eval_loss, eval_runtime at the step of the train row before it) is an eval row. Read as a train row,
# each one's step "went back" to its train row's: a resume at every eval, two runs in one log (exit 3).
EVAL_NAME_PREFIXES = ("eval_", "val_", "valid_", "validation_", "test_")
TRAIN_METRIC_NAMES = ("loss", "train_loss", "train/loss", "accuracy", "acc", "train_acc", "lr", "learning_rate")


def record_kind(record: dict[str, Any]) -> str:
    """train, eval or event; a record without `kind` is an event if it names one, an eval row if it
    holds held-out metrics and no train one, else a train row."""
    kind = record.get("kind")
    if kind in ("train", "eval", "event"):
        return kind
    if isinstance(record.get("event"), str):
        return "event"
    if kind in ("val", "valid", "validation", "test"):
        return "eval"
    if kind is None and any(k.startswith(EVAL_NAME_PREFIXES) for k in record):
        if not any(k in record for k in TRAIN_METRIC_NAMES):
            return "eval"
    return "train" if kind is None else str(kind)


def normalize(record: dict[str, Any]) -> dict[str, Any]:
    """Canonical view of one record: kind, event name, and every ALIASES field (None when missing)."""
    out: dict[str, Any] = {"kind": record_kind(record), "event": record.get("event")}
    for name, aliases in ALIASES.items():
        out[name] = next((number(record[a]) for a in aliases if a in record), None)
    if out["step"] is not None and finite(out["step"]):
        out["step"] = int(out["step"])
    else:
        out["step"] = None
    if finite(out["epoch"]):
        out["epoch"] = int(out["epoch"])
    return out


def robust(values: list[float]) -> tuple[float, float]:
    """(median, sigma) with sigma = 1.4826 * median absolute deviation."""
    ordered = sorted(values)
    med = median(ordered)
    return med, 1.4826 * median(sorted(abs(v - med) for v in ordered))


def median(ordered: list[float]) -> float:
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def make_event(kind: str, step: int, size: float | None, **details: Any) -> dict[str, Any]:
    return {
        "kind": kind,
        "step": int(step),
        "size": None if size is None else round(size, 4),
        "details": details,
    }


def r6(value: float) -> float:
    return round(value, 6)


class Window:
    """Trailing (step, value) pairs plus the bookkeeping every detector shares."""

    def __init__(self, size: int):
        self.pairs: deque[list[float]] = deque(maxlen=size)

    def values(self) -> list[float]:
        return [v for _, v in self.pairs]

    def append(self, step: int, value: float) -> None:
        self.pairs.append([step, value])

    def truncate(self, step: int) -> None:
        """Drop entries logged at `step` or later (the steps went back to before them)."""
        kept = [p for p in self.pairs if p[0] < step]
        self.pairs.clear()
        self.pairs.extend(kept)

    def __len__(self) -> int:
        return len(self.pairs)
