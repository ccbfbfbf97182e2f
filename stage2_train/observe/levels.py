"""Levels that are wrong however smooth the curve: a loss that slowly diverges or an accuracy that
slowly declines from the run's best level, an lr stuck at 0, a loader the steps wait for. Fed by
`LiveDetectors` (detectors.py), so the trainer warns live and the doctor finds the same events.

    .venv/bin/python -m pytest tests/test_doctor.py -q -k "lr_at_zero or divergence or input_bound"

The spike, cliff and drop detectors compare each row with a trailing window, which climbs along with a
slow divergence; these compare with the run's own best level or a fixed bar (the `detectors`
section's divergence_ratio, decline_rel, divergence_rows, lr_zero_rows, input_bound_frac). An event
stays open, its last values updated in place, until the level is back; `recovery_steps` says when.
"""

from __future__ import annotations

from typing import Any

from stage2_train.observe.config import DetectorConfig
from stage2_train.observe.records import Window, make_event, median, r6

DECAY_TAIL = 0.5  # an lr that reaches 0 from below this fraction of its peak is a schedule's end, not a fault
# A drafter right on fewer than 5% of its slots drafts nothing (tau ~1.05): whatever init_from says, it starts untrained.
UNTRAINED_ACCURACY = 0.05


class Level:
    """A trailing median (window_rows values) far worse than the best trailing median earlier in the
    run, for divergence_rows rows in a row: the loss diverging slowly (bad = up: above divergence_ratio
    times its best), the gradient norm growing (above grad_norm_ratio times its lowest) or accuracy
    declining (bad = down: below its best by decline_rel of it). The event
    stays open, its `last` value updated in place, until the median is back within the threshold.

    Only the best (its step, its median) outlives the window: a resume to before the best forgets it,
    and the best is found again from the rows that follow."""

    def __init__(self, cfg: DetectorConfig, kind: str, bad_is_up: bool, ratio: float | None = None):
        self.cfg, self.kind, self.bad_is_up = cfg, kind, bad_is_up
        self.ratio = ratio if ratio is not None else cfg.divergence_ratio  # bad = up: how far above the best
        self.window = Window(cfg.window_rows)
        self.best: list[float] | None = None  # [step at the window's end, median]
        self.run: list[float] | None = None  # [first step, rows]: worse medians in a row
        self.open: dict[str, Any] | None = None

    def _threshold(self, best: float) -> float | None:
        if self.bad_is_up:
            return best * self.ratio if best > 0 else None
        return best - max(self.cfg.decline_rel * best, self.cfg.cliff_min_drop)

    def update(self, step: int, value: float, explained: bool) -> dict[str, Any] | None:
        """`explained`: a spike (cliff) is still not back, so the level is that event's: not counted."""
        self.window.append(step, value)
        if len(self.window) < self.cfg.window_rows:
            return None
        med = median(sorted(self.window.values()))
        if self.best is None or (med < self.best[1] if self.bad_is_up else med > self.best[1]):
            self.best = [step, med]
        threshold = self._threshold(self.best[1])
        worse = threshold is not None and (med > threshold if self.bad_is_up else med < threshold)
        if self.open is not None:
            if worse:
                self.open["details"].update(last=r6(med), last_step=int(step))
            else:
                self.open["details"]["recovery_steps"] = step - self.open["step"]
                self.open = None
            return None
        if not worse or explained:
            self.run = None
            return None
        self.run = [step, 1] if self.run is None else [self.run[0], self.run[1] + 1]
        if self.run[1] < self.cfg.divergence_rows:
            return None
        # The run is this event's: after it closes, another must last divergence_rows rows of its own.
        (best_step, best), start, self.run = self.best, self.run[0], None
        self.open = make_event(
            self.kind,
            start,
            med / best if self.bad_is_up else best - med,
            best=r6(best),
            best_step=int(best_step),
            now=r6(med),
            threshold=r6(threshold),
            window_rows=self.cfg.window_rows,
            confirmed_step=int(step),
            last=r6(med),
            last_step=int(step),
            recovery_steps=None,
        )
        return self.open

    def truncate(self, step: int) -> None:
        self.window.truncate(step)
        if self.best is not None and self.best[0] >= step:
            self.best = None
        if self.open is not None and self.open["step"] >= step:
            self.open = None
        self.run = None

    def state_dict(self) -> dict[str, Any]:
        return {"window": list(self.window.pairs), "best": self.best, "run": self.run, "open": self.open}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window.pairs.clear()
        self.window.pairs.extend(state["window"])
        self.best, self.run, self.open = state["best"], state["run"], state["open"]


class LrZero:
    """lr 0 (or below) for lr_zero_rows rows in a row: the optimizer applies no update. An lr that
    decayed into 0 (its last positive value below DECAY_TAIL of its peak: a cosine or linear schedule's
    last steps) is the schedule's end, not this event, for as many rows as the decay took from the
    peak: a schedule that ends with the run puts only its last rows at 0 (those a rounded log writes
    as 0), one whose total steps are fewer than the run's leaves it at 0 for the rest of the run (a
    cosine over 1,000 steps of a 3,000-step run was called healthy). `to_step` is updated in place
    while lr stays 0."""

    def __init__(self, cfg: DetectorConfig):
        self.cfg = cfg
        self.peak = 0.0
        self.last_positive: float | None = None
        self.decay_rows = 0  # rows with lr > 0 since the last one at the peak
        self.run: list[Any] | None = None  # [first step, rows, decayed into it, decay rows before it]
        self.open: dict[str, Any] | None = None

    def update(self, step: int, lr: float) -> dict[str, Any] | None:
        if lr > 0:
            self.decay_rows = 0 if lr >= self.peak else self.decay_rows + 1
            self.peak, self.last_positive = max(self.peak, lr), lr
            self.run = self.open = None
            return None
        if self.open is not None:
            self.open["details"]["to_step"] = int(step)
            return None
        if self.run is None:
            decayed = self.last_positive is not None and self.last_positive < DECAY_TAIL * self.peak
            self.run = [step, 0, decayed, self.decay_rows]
        self.run[1] += 1
        decay_rows = self.run[3] if len(self.run) > 3 else None  # None: a state from before it, no bound
        if self.run[1] < self.cfg.lr_zero_rows or (self.run[2] and (decay_rows is None or self.run[1] <= decay_rows)):
            return None
        self.open = make_event(
            "lr_zero",
            self.run[0],
            None,
            lr=lr,
            peak_before=r6(self.peak) if self.peak > 0 else None,
            confirmed_step=int(step),
            to_step=int(step),
            **({"decay_rows": decay_rows} if self.run[2] else {}),
        )
        return self.open

    def truncate(self, step: int) -> None:
        self.run = None
        if self.open is not None and self.open["step"] >= step:
            self.open = None

    def state_dict(self) -> dict[str, Any]:
        return {"peak": self.peak, "last_positive": self.last_positive, "decay_rows": self.decay_rows,
                "run": self.run, "open": self.open}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.peak, self.last_positive = state["peak"], state["last_positive"]
        self.decay_rows = state.get("decay_rows", 0)  # absent from checkpoints before it
        self.run, self.open = state["run"], state["open"]


class InputBound:
    """The steps wait for their data: the mean data_wait_frac over window_rows rows at or above
    input_bound_frac. Skips warmup_rows rows at the start and after a resume (a cold loader); a
    throughput drop not yet back explains the wait already (its cause names the starved loader)."""

    def __init__(self, cfg: DetectorConfig):
        self.cfg = cfg
        self.window = Window(cfg.window_rows)
        self.warmup_left = cfg.warmup_rows
        self.open: dict[str, Any] | None = None

    def update(self, step: int, frac: float, explained: bool) -> dict[str, Any] | None:
        if self.warmup_left > 0:
            self.warmup_left -= 1
            return None
        self.window.append(step, frac)
        if len(self.window) < self.cfg.window_rows:
            return None
        mean = sum(self.window.values()) / len(self.window)
        bound = mean >= self.cfg.input_bound_frac
        if self.open is not None:
            if bound:
                self.open["details"].update(to_step=int(step), last_mean=r6(mean))
            else:
                self.open["details"]["recovery_steps"] = step - self.open["step"]
                self.open = None
            return None
        if not bound or explained:
            return None
        first = int(self.window.pairs[0][0])
        self.open = make_event(
            "input_bound",
            first,
            mean,
            mean=r6(mean),
            rows=len(self.window),
            threshold=self.cfg.input_bound_frac,
            confirmed_step=int(step),
            to_step=int(step),
            last_mean=r6(mean),
            recovery_steps=None,
        )
        return self.open

    def restart(self, step: int | None) -> None:
        """A resume: another process's loader, warming up again."""
        self.window.pairs.clear()
        self.warmup_left = self.cfg.warmup_rows
        if step is not None and self.open is not None and self.open["step"] > step:
            self.open = None

    def state_dict(self) -> dict[str, Any]:
        return {"window": list(self.window.pairs), "warmup_left": self.warmup_left, "open": self.open}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window.pairs.clear()
        self.window.pairs.extend(state["window"])
        self.warmup_left, self.open = state["warmup_left"], state["open"]


class NotLearning:
    """A run that never learns: after learn_rows rows with lr > 0, the loss's lowest trailing median
    (window_rows rows) is still within learn_min_drop of its first one, and accuracy's highest trailing
    median (where logged) is not cliff_min_drop above its first. Rows at lr 0 are lr_zero's and are
    not counted. Fires once; closed (`recovery_steps`) if the loss falls after all.

    Judged only on a log that begins within learn_rows steps of the run's start: a slice of a late,
    flat stretch (a history export from step 10,000) says nothing of whether the run learned. A run
    started from trained weights (`init_from`, from run_start) is at its level from its first row, so a
    flat loss is what a healthy one shows: judged only when its first accuracy median says the start
    was untrained after all (under UNTRAINED_ACCURACY), never when accuracy is not logged. A log that
    does not say where the run started (no run_start with init_from: another trainer's) is judged by
    that accuracy alone: a drafter that drafts from its first rows did not start from scratch (a peer's
    fine-tune, accuracy 0.45 from the first row, was named not_learning)."""

    def __init__(self, cfg: DetectorConfig):
        self.cfg = cfg
        self.loss = Window(cfg.window_rows)
        self.accuracy = Window(cfg.window_rows)
        self.first: dict[str, Any] | None = None  # first trailing medians: {"step", "loss", "accuracy"}
        self.best: dict[str, Any] = {}  # lowest loss and highest accuracy trailing medians since
        self.rows = 0
        self.start_step: int | None = None  # the first row counted: where a run that never learns began
        self.peak_lr = 0.0
        self.judged = False  # fired, or the log began too late to judge
        self.open: dict[str, Any] | None = None
        self.init_from: str | None = None  # the trained weights the run started from (run_start)
        self.start_known = False  # a run_start said where the run started (init_from, None: from scratch)

    def update(self, step: int, loss: float, accuracy: float | None, lr: float | None) -> dict[str, Any] | None:
        if lr is not None and lr <= 0:
            return None
        if self.rows == 0:
            self.start_step = int(step)
            self.judged = self.judged or step > self.cfg.learn_rows
        self.rows += 1
        self.peak_lr = max(self.peak_lr, lr or 0.0)
        self.loss.append(step, loss)
        if accuracy is not None:
            self.accuracy.append(step, accuracy)
        if len(self.loss) < self.cfg.window_rows:
            return None
        loss_med = median(sorted(self.loss.values()))
        acc_med = median(sorted(self.accuracy.values())) if len(self.accuracy) >= self.cfg.window_rows else None
        if self.first is None:
            self.first = {"step": int(step), "loss": loss_med, "accuracy": acc_med}
        if self.first["accuracy"] is None and acc_med is not None:
            self.first["accuracy"] = acc_med
        self.best["loss"] = min(self.best.get("loss", loss_med), loss_med)
        if acc_med is not None:
            self.best["accuracy"] = max(self.best.get("accuracy", acc_med), acc_med)
        learned = self.learned()
        if self.open is not None:
            if learned:
                self.open["details"]["recovery_steps"] = step - self.open["step"]
                self.open = None
            return None
        if self.judged or self.rows < self.cfg.learn_rows or learned:
            return None
        self.judged = True
        first = self.first
        trained_start = first["accuracy"] is not None and first["accuracy"] >= UNTRAINED_ACCURACY
        if (self.init_from and (first["accuracy"] is None or trained_start)) or (not self.start_known and trained_start):
            return None
        self.open = make_event(
            "not_learning",
            self.start_step,
            self.best["loss"] / first["loss"] if first["loss"] > 0 else None,
            first_loss=r6(first["loss"]),
            first_step=first["step"],
            best_loss=r6(self.best["loss"]),
            first_accuracy=None if first["accuracy"] is None else r6(first["accuracy"]),
            best_accuracy=r6(self.best["accuracy"]) if "accuracy" in self.best else None,
            min_drop=self.cfg.learn_min_drop,
            rows=self.rows,
            lr=lr,
            peak_lr=r6(self.peak_lr) if self.peak_lr > 0 else None,
            window_rows=self.cfg.window_rows,
            init_from=self.init_from,
            confirmed_step=int(step),
            recovery_steps=None,
        )
        return self.open

    def learned(self) -> bool:
        first, best = self.first, self.best
        if first is None:
            return False
        fell = best["loss"] < (1 - self.cfg.learn_min_drop) * first["loss"]
        rose = first["accuracy"] is not None and best["accuracy"] > first["accuracy"] + self.cfg.cliff_min_drop
        return fell or rose

    def truncate(self, step: int) -> None:
        """A resume to before the first trailing median starts afresh; a later one keeps it (the best
        may then be a forgotten row's: a loss that fell once has learned, whatever came after)."""
        self.loss.truncate(step)
        self.accuracy.truncate(step)
        if self.first is not None and self.first["step"] >= step:
            self.first, self.best, self.rows = None, {}, len(self.loss)
            self.start_step = int(self.loss.pairs[0][0]) if self.loss.pairs else None
        if self.open is not None and self.open["step"] >= step:
            self.open, self.judged = None, False

    def state_dict(self) -> dict[str, Any]:
        return {"loss": list(self.loss.pairs), "accuracy": list(self.accuracy.pairs), "first": self.first,
                "best": self.best, "rows": self.rows, "start_step": self.start_step, "peak_lr": self.peak_lr, "judged": self.judged,
                "open": self.open, "init_from": self.init_from, "start_known": self.start_known}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("loss", "accuracy"):
            window = getattr(self, name)
            window.pairs.clear()
            window.pairs.extend(state[name])
        self.first, self.best, self.rows = state["first"], state["best"], state["rows"]
        self.start_step = state["start_step"]
        self.peak_lr, self.judged, self.open = state["peak_lr"], state["judged"], state["open"]
        self.init_from = state.get("init_from")  # absent from checkpoints before it: the run_start that follows sets it
        self.start_known = state.get("start_known", False)
