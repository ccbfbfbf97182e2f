"""Detectors that turn a training log into events: stalls, step gaps, loss spikes, accuracy cliffs,
non-finite values, throughput drops, and held-out quality that turns while training improves
(overfitting). One code path serves the offline doctor and the live trainer.

    .venv/bin/python -m pytest tests/test_doctor.py -q

    events = detect(rows)                    # offline: every record of a train_log.jsonl, in order
    live = LiveDetectors()                   # live: feed each record as it is written (eval rows too)
    for ev in live.update({"kind": "train", "step": step, **row}):
        sink.event("warning", ev["step"], **as_warning(ev))
    live.state_dict() / live.load_state_dict(state)     # JSON-able; a resume keeps the history

An event is `{"kind", "step", "size", "details"}`; `size` by kind: stall -> gap seconds, step_gap ->
steps skipped, loss_spike -> loss / level before, accuracy_cliff -> accuracy drop (absolute),
throughput_drop -> fraction of tokens/s lost, nan -> None, generalisation -> relative worsening of
its first turned metric. Every judgement is robust: a value is
compared with the median and MAD (sigma = 1.4826 * MAD) of a trailing window of accepted values, and
must also pass a minimum ratio, so noise never fires on its own. Outliers do not enter the window;
a dip must last `sustain_rows` logged rows to be a cliff or a drop. Nothing is judged before
`min_history_rows` values; pace and throughput also skip `warmup_rows` rows at the start and after a
resume (first steps are slow). Windows hold (step, value): when the steps go backwards (a resume from
an older checkpoint, a restart), entries from the abandoned future are dropped.

Generalisation, judged at each held-out eval row (`kind: "eval"`). The metrics: walk_tau when the
row has it, else accept_len, and accuracy (higher is better), and ce (lower is better; an eval row
of another trainer without ce gives its loss). Track the best held-out value so far per metric. A
held-out metric has "turned" when it is worse than its best by more than `generalisation_k` times
the combined standard error sqrt(se_best^2 + se_now^2) for `generalisation_sustain` consecutive
evaluations, while training keeps improving: the training level (median of the train rows since
the previous eval, the last `window_rows` of them, for loss lower / accuracy higher; every one of
the two the log has) is better than it was at the best eval's step. An eval where training did not
improve, or the metric is back within the margin, restarts the count. The standard errors are the
row's `<metric>_se` (over held-out samples). When they are absent (older logs, other trainers) the
noise is derived from the eval's size: for accuracy the binomial SE sqrt(p (1 - p) / n) with
n = num_blocks (blocks, not positions, are the unit: the positions of one block are correlated),
else num_samples; for ce, walk_tau and accept_len |value| / sqrt(num_samples) (a coefficient of
variation of 1 per sample: a deliberately wide guess); and a metric with derived noise must also
be worse than its best by at least `generalisation_min_rel` of it. So a small eval set that merely
jitters never fires. (The held-out set is the same at every eval, so the spread over its samples
bounds the jitter between evals from above: the rule errs on the quiet side.) The event is raised
once, at the eval that confirms the first turned metric; its step is that metric's best eval (where
the turn began); `details` hold every turned metric (best, its step, now, margin), the train and
held-out levels and their gap then and now, and `best_tau` (the eval to keep a checkpoint of). No
new event comes until a metric of the turn makes a new best, which ends the turn and restarts
every count. A resume to an earlier step forgets the evals from after it.

Records are normalised leniently (`normalize`): kind is inferred when missing, and field aliases
(tok_per_sec, acc, elapsed, ...) and "nan" strings (how MetricsSink writes non-finite numbers) are read.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from typing import Any, ClassVar

from shared.config import Section
from shared.errors import CheckpointError

EVENT_KINDS = (
    "stall",
    "step_gap",
    "loss_spike",
    "accuracy_cliff",
    "nan",
    "throughput_drop",
    "generalisation",
)

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
    "epoch": ("epoch",),
    "data_wait_frac": ("data_wait_frac",),
    "eval_s": ("eval_s",),
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
}
RESET_EVENTS = ("resume", "run_start")  # run_start at step 0 after earlier rows: a fresh run


class DetectorConfig(Section):
    section: ClassVar[str] = "doctor"
    window_rows: int = 50
    """Trailing window of accepted values, in logged rows."""
    min_history_rows: int = 20
    """Values in the window before anything is judged."""
    warmup_rows: int = 10
    """Pace/throughput rows ignored at the start and after a resume."""
    sustain_rows: int = 5
    """Consecutive low rows that make a cliff or a throughput drop."""
    spike_k: float = 6.0
    """A loss spike lies above median + spike_k * sigma of the window (and passes spike_min_ratio)."""
    spike_min_ratio: float = 2.5
    """A loss spike also lies above spike_min_ratio * the window's median."""
    recovery_tol: float = 0.15
    """Recovered from a spike: loss <= max(median * (1 + recovery_tol), median + 3 sigma)."""
    stall_k: float = 6.0
    """A stall takes seconds per step above median + stall_k * sigma (and passes the two below)."""
    stall_min_ratio: float = 3.0
    """A stall's gap is also above stall_min_ratio * the expected time."""
    stall_min_s: float = 1.0
    """A stall loses at least this many seconds."""
    step_gap_ratio: float = 4.0
    """Step gap: logged steps jump by more than this ratio * the usual delta (90th percentile)."""
    cliff_k: float = 6.0
    """An accuracy cliff lies below median - cliff_k * sigma (and passes the two below)."""
    cliff_min_drop: float = 0.03
    """An accuracy cliff drops at least this much (absolute)."""
    cliff_min_rel: float = 0.3
    """An accuracy cliff drops at least this fraction of the median."""
    throughput_k: float = 6.0
    """A throughput drop lies below median - throughput_k * sigma of tokens/s."""
    throughput_min_rel: float = 0.4
    """A throughput drop loses at least this fraction of the median tokens/s."""
    generalisation_k: float = 2.0
    """A held-out metric has turned when worse than its best by more than generalisation_k * the
    combined standard error sqrt(se_best^2 + se_now^2) (see the rule in the module docstring)."""
    generalisation_sustain: int = 2
    """Consecutive evals, each worse than the best by that margin while training improved, that
    confirm a turn."""
    generalisation_min_rel: float = 0.05
    """A metric whose eval rows carry no `<metric>_se` (noise derived from the eval's size) must
    also be worse than its best by at least this fraction of it."""

    def validate(self) -> None:
        for key in ("window_rows", "min_history_rows", "sustain_rows", "generalisation_sustain"):
            self.require(getattr(self, key) >= 1, key, "must be >= 1")
        self.require(self.min_history_rows <= self.window_rows, "min_history_rows", "must be <= window_rows")
        self.require(self.warmup_rows >= 0, "warmup_rows", "must be >= 0")
        for key in (
            "spike_k",
            "stall_k",
            "cliff_k",
            "throughput_k",
            "recovery_tol",
            "stall_min_s",
            "cliff_min_drop",
            "generalisation_k",
        ):
            self.require(getattr(self, key) >= 0, key, "must be >= 0")
        for key in ("spike_min_ratio", "stall_min_ratio", "step_gap_ratio"):
            self.require(getattr(self, key) > 1, key, "must be > 1")
        for key in ("cliff_min_rel", "throughput_min_rel", "generalisation_min_rel"):
            self.require(0 < getattr(self, key) < 1, key, "must be in (0, 1)")


# ---- records ---------------------------------------------------------------------------------------
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


def record_kind(record: dict[str, Any]) -> str:
    """train, eval or event; a record without `kind` is an event if it names one, else a train row."""
    kind = record.get("kind")
    if kind in ("train", "eval", "event"):
        return kind
    if isinstance(record.get("event"), str):
        return "event"
    if kind in ("val", "valid", "validation", "test"):
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


def as_warning(event: dict[str, Any]) -> dict[str, Any]:
    """Fields for `sink.event("warning", event["step"], **as_warning(event))`."""
    return {"detector": event["kind"], "size": event["size"], "details": event["details"]}


def robust(values: list[float]) -> tuple[float, float]:
    """(median, sigma) with sigma = 1.4826 * median absolute deviation."""
    ordered = sorted(values)
    med = _median(ordered)
    return med, 1.4826 * _median(sorted(abs(v - med) for v in ordered))


def _median(ordered: list[float]) -> float:
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _event(kind: str, step: int, size: float | None, **details: Any) -> dict[str, Any]:
    return {
        "kind": kind,
        "step": int(step),
        "size": None if size is None else round(size, 4),
        "details": details,
    }


def _r(value: float) -> float:
    return round(value, 6)


# ---- one detector per signal -----------------------------------------------------------------------
class _Window:
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


class _Episodes:
    """What spikes (bad = up) and drops (bad = down) share: the events still recovering, and the
    episode in progress, during which the window is frozen and no new event is raised."""

    def __init__(self, cfg: DetectorConfig, bad_is_up: bool):
        self.cfg, self.bad_is_up = cfg, bad_is_up
        self.window = _Window(cfg.window_rows)
        self.pending: list[list[float]] = []  # bad rows not yet sustained (drops only)
        self.episode: dict[str, Any] | None = None
        self.recovering: list[dict[str, Any]] = []  # {"level", "event"}: until the value is back

    def _back(self, value: float, level: float) -> bool:
        return value <= level if self.bad_is_up else value >= level

    def _settle(self, step: int, value: float) -> bool:
        """Close recovered events; True when the row belongs to an episode (and is handled here)."""
        for rec in list(self.recovering):
            if self._back(value, rec["level"]):
                rec["event"]["details"]["recovery_steps"] = step - rec["event"]["step"]
                self.recovering.remove(rec)
        if self.episode is None:
            return False
        self.episode["rows"] += 1
        if self._back(value, self.episode["release"]):
            self.episode = None
        elif self.episode["rows"] >= self.cfg.window_rows:  # a new level: judge against it from now on
            self.episode = None
            self.window.pairs.clear()
        else:
            return True
        self.window.append(step, value)
        return True

    def _open(self, event: dict[str, Any], level: float, release: float, rows: int) -> dict[str, Any]:
        self.episode = {"rows": rows, "release": release}
        self.recovering = (self.recovering + [{"level": level, "event": event}])[-16:]
        return event

    def truncate(self, step: int) -> None:
        self.window.truncate(step)
        self.pending, self.episode = [], None
        self.recovering = [r for r in self.recovering if r["event"]["step"] < step]

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": list(self.window.pairs),
            "pending": self.pending,
            "episode": self.episode,
            "recovering": self.recovering,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window.pairs.clear()
        self.window.pairs.extend(state["window"])
        self.pending = state.get("pending", [])  # checkpoints from before this field
        self.episode, self.recovering = state["episode"], state["recovering"]


class _Spike(_Episodes):
    """Loss above its recent level; tracks how many steps it takes to come back."""

    def __init__(self, cfg: DetectorConfig):
        super().__init__(cfg, bad_is_up=True)

    def update(self, step: int, value: float) -> dict[str, Any] | None:
        cfg = self.cfg
        if self._settle(step, value):
            return None
        if len(self.window) >= cfg.min_history_rows:
            med, sigma = robust(self.window.values())
            threshold = max(med + cfg.spike_k * sigma, med * cfg.spike_min_ratio)
            if value > threshold and med > 0:
                ev = _event(
                    "loss_spike",
                    step,
                    value / med,
                    loss=_r(value),
                    before=_r(med),
                    threshold=_r(threshold),
                    recovery_steps=None,
                )
                level = max(med * (1 + cfg.recovery_tol), med + 3 * sigma)
                return self._open(ev, level, release=0.5 * (med + threshold), rows=0)
        self.window.append(step, value)
        return None


class _Drop(_Episodes):
    """A value (accuracy, tokens/s) that falls far below its recent level and stays there."""

    def __init__(self, cfg: DetectorConfig, kind: str, k: float, min_abs: float, min_rel: float):
        super().__init__(cfg, bad_is_up=False)
        self.kind, self.k, self.min_abs, self.min_rel = kind, k, min_abs, min_rel

    def update(self, step: int, value: float) -> dict[str, Any] | None:
        cfg = self.cfg
        if self._settle(step, value):
            return None
        if len(self.window) < cfg.min_history_rows:
            self.window.append(step, value)
            return None
        med, sigma = robust(self.window.values())
        threshold = min(med - self.k * sigma, med - self.min_abs, med * (1 - self.min_rel))
        if value >= threshold:  # a dip that did not last is ordinary noise
            for s, v in self.pending:
                self.window.append(s, v)
            self.pending = []
            self.window.append(step, value)
            return None
        self.pending.append([step, value])
        if len(self.pending) < cfg.sustain_rows:
            return None
        low = sorted(v for _, v in self.pending)
        after = _median(low)
        size = med - after if self.kind == "accuracy_cliff" else (1 - after / med if med > 0 else None)
        first_step, first_value = self.pending[0]
        ev = _event(
            self.kind,
            first_step,
            size,
            before=_r(med),
            after=_r(after),
            first_value=_r(first_value),
            threshold=_r(threshold),
            confirmed_step=int(step),
            recovery_steps=None,
        )
        release = 0.5 * (med + threshold)
        rows, self.pending = len(self.pending), []
        return self._open(ev, level=release, release=release, rows=rows)


class _Pace:
    """Wall time and step deltas between consecutive train rows: stalls and step gaps."""

    def __init__(self, cfg: DetectorConfig):
        self.cfg = cfg
        self.sec_per_step = _Window(cfg.window_rows)
        self.step_deltas = _Window(cfg.window_rows)
        self.prev: list[float] | None = None  # [step, t] of the previous train row
        self.paused_s = 0.0  # intended pauses (eval) since the previous row, not counted as stalls
        self.warmup_left = cfg.warmup_rows
        self.outliers = 0  # consecutive stalls: past sustain_rows the pace itself changed

    def restart(self, step: int | None) -> None:
        if step is not None:
            self.sec_per_step.truncate(step + 1)
            self.step_deltas.truncate(step + 1)
        self.prev, self.paused_s, self.warmup_left, self.outliers = None, 0.0, self.cfg.warmup_rows, 0

    def update(self, step: int, t: float | None) -> list[dict[str, Any]]:
        cfg = self.cfg
        prev, paused = self.prev, self.paused_s
        self.prev, self.paused_s = [step, t], 0.0
        if prev is None:
            return []
        delta = step - prev[0]
        if self.warmup_left > 0:
            self.warmup_left -= 1
            return []
        events = []
        if len(self.step_deltas) >= cfg.min_history_rows:
            deltas = sorted(self.step_deltas.values())
            usual = max(deltas[int(0.9 * (len(deltas) - 1))], 1)
            if delta > cfg.step_gap_ratio * usual:
                gap_s = None if t is None or prev[1] is None else _r(t - prev[1])
                events.append(
                    _event(
                        "step_gap", step, delta, from_step=int(prev[0]), usual_delta=int(usual), gap_s=gap_s
                    )
                )
        if not events:
            self.step_deltas.append(step, delta)
        if t is None or prev[1] is None:
            return events
        gap = t - prev[1] - paused
        if gap < 0:  # the clock went back: a new process without a continuous elapsed_s
            self.restart(None)
            self.prev = [step, t]
            return events
        stalled = False
        if len(self.sec_per_step) >= cfg.min_history_rows:
            med, sigma = robust(self.sec_per_step.values())
            expected = delta * med
            lost = gap - expected
            if gap > cfg.stall_min_ratio * expected and lost > max(
                cfg.stall_min_s, cfg.stall_k * sigma * delta
            ):
                stalled = True
                events.append(
                    _event(
                        "stall",
                        step,
                        gap,
                        from_step=int(prev[0]),
                        expected_s=_r(expected),
                        lost_s=_r(lost),
                        sec_per_step=_r(med),
                        paused_s=_r(paused),
                    )
                )
        self.outliers = self.outliers + 1 if stalled else 0
        if not stalled or self.outliers >= cfg.sustain_rows:
            self.sec_per_step.append(step, gap / delta)
        return events

    def state_dict(self) -> dict[str, Any]:
        return {
            "sec_per_step": list(self.sec_per_step.pairs),
            "step_deltas": list(self.step_deltas.pairs),
            "prev": self.prev,
            "paused_s": self.paused_s,
            "warmup_left": self.warmup_left,
            "outliers": self.outliers,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("sec_per_step", "step_deltas"):
            window = getattr(self, name)
            window.pairs.clear()
            window.pairs.extend(state[name])
        self.prev, self.paused_s = state["prev"], state["paused_s"]
        self.warmup_left, self.outliers = state["warmup_left"], state["outliers"]


class _Generalisation:
    """Held-out metrics that turn while training improves (the rule is in the module docstring).

    The state is the evals seen (one small record each) plus the train rows since the last one;
    bests, counts and the open turn are rebuilt from the evals by replay (after a load or a resume)."""

    HIGHER_IS_BETTER: ClassVar[dict[str, bool]] = {
        "walk_tau": True,
        "accept_len": True,
        "accuracy": True,
        "ce": False,
    }
    TRAIN_HIGHER_IS_BETTER: ClassVar[dict[str, bool]] = {"loss": False, "accuracy": True}

    def __init__(self, cfg: DetectorConfig):
        self.cfg = cfg
        self.evals: list[dict[str, Any]] = []  # {"step", "metrics": {name: [value, se, derived]}, "train"}
        self.train: deque[list[Any]] = deque(
            maxlen=cfg.window_rows
        )  # [step, loss, accuracy] since the last eval
        self._reset()

    def _reset(self) -> None:
        self.best: dict[str, dict[str, Any]] = {}  # name -> {"step", "value", "se"}
        self.count: dict[str, int] = {}  # name -> consecutive worse evals while training improved
        self.turn: list[str] | None = None  # the metrics of the event raised, until one makes a new best

    def add_train(self, step: int, loss: float | None, accuracy: float | None) -> None:
        if finite(loss) or finite(accuracy):
            self.train.append([step, loss if finite(loss) else None, accuracy if finite(accuracy) else None])

    def update(self, step: int, row: dict[str, Any]) -> dict[str, Any] | None:
        level = self._train_level()
        self.train.clear()
        names = ("walk_tau" if finite(row["walk_tau"]) else "accept_len", "accuracy", "ce")
        metrics = {name: [row[name], *self._noise(name, row)] for name in names if finite(row[name])}
        if not metrics:
            return None
        record = {"step": step, "metrics": metrics, "train": level}
        self.evals.append(record)
        return self._judge(record)

    def _train_level(self) -> dict[str, float | None]:
        """Median train loss and accuracy since the previous eval; the previous eval's when none came."""
        if not self.train:
            return dict(self.evals[-1]["train"]) if self.evals else {"loss": None, "accuracy": None}
        level: dict[str, float | None] = {}
        for i, name in enumerate(("loss", "accuracy"), start=1):
            values = sorted(r[i] for r in self.train if r[i] is not None)
            level[name] = _r(_median(values)) if values else None
        return level

    def _noise(self, name: str, row: dict[str, Any]) -> tuple[float, bool]:
        """(standard error, derived): the row's `<name>_se`, else one derived from the eval's size."""
        se = row[f"{name}_se"]
        if finite(se):
            return _r(se), False
        value = row[name]
        if name == "accuracy":
            n = next((row[k] for k in ("num_blocks", "num_samples") if finite(row[k]) and row[k] > 0), None)
            return (_r(math.sqrt(max(value * (1 - value), 0.0) / n)) if n else 0.0), True
        n = row["num_samples"]
        return (_r(abs(value) / math.sqrt(n)) if finite(n) and n > 0 else 0.0), True

    def _improved(self, now: dict[str, float | None], then: dict[str, float | None]) -> bool:
        """Training better now than then, on every level (loss, accuracy) both have."""
        both = [k for k in self.TRAIN_HIGHER_IS_BETTER if now.get(k) is not None and then.get(k) is not None]
        return bool(both) and all(
            (now[k] > then[k]) if self.TRAIN_HIGHER_IS_BETTER[k] else (now[k] < then[k]) for k in both
        )

    def _judge(self, record: dict[str, Any]) -> dict[str, Any] | None:
        cfg, step = self.cfg, record["step"]
        turned: dict[str, dict[str, Any]] = {}
        for name, (value, se, derived) in record["metrics"].items():
            sign = 1.0 if self.HIGHER_IS_BETTER[name] else -1.0
            best = self.best.get(name)
            if best is None or (value - best["value"]) * sign > 0:
                self.best[name] = {"step": step, "value": value, "se": se, "derived": derived}
                self.count[name] = 0
                if self.turn is not None and name in self.turn:  # the turn is over: count afresh
                    self.turn = None
                    self.count = dict.fromkeys(self.count, 0)
                continue
            margin = cfg.generalisation_k * math.sqrt(best["se"] ** 2 + se**2)
            if derived or best["derived"]:
                margin = max(margin, cfg.generalisation_min_rel * abs(best["value"]))
            best_train = self._eval_at(best["step"])["train"]
            worse = (best["value"] - value) * sign > margin and self._improved(record["train"], best_train)
            self.count[name] = self.count.get(name, 0) + 1 if worse else 0
            if self.count[name] >= cfg.generalisation_sustain:
                turned[name] = {
                    "best": best["value"],
                    "best_step": best["step"],
                    "now": value,
                    "threshold": _r(margin),
                    "se_best": best["se"],
                    "se_now": se,
                    "se_logged": not (derived or best["derived"]),
                }
        if not turned or self.turn is not None:
            return None
        self.turn = list(turned)
        first = next(iter(turned.values()))
        then = self._eval_at(first["best_step"])
        tau = next((n for n in ("walk_tau", "accept_len") if n in self.best), None)
        return _event(
            "generalisation",
            first["best_step"],
            abs(first["best"] - first["now"]) / abs(first["best"]) if first["best"] else None,
            metrics=turned,
            confirmed_step=int(step),
            train_then=then["train"],
            train_now=record["train"],
            heldout_then={k: v[0] for k, v in then["metrics"].items()},
            heldout_now={k: v[0] for k, v in record["metrics"].items()},
            gap_then=self._gap(then),
            gap_now=self._gap(record),
            best_tau={"metric": tau, "step": self.best[tau]["step"], "value": self.best[tau]["value"]}
            if tau
            else None,
            k=cfg.generalisation_k,
            sustain=cfg.generalisation_sustain,
        )

    def _eval_at(self, step: int) -> dict[str, Any]:
        return next(r for r in reversed(self.evals) if r["step"] == step)

    @staticmethod
    def _gap(record: dict[str, Any]) -> dict[str, float]:
        """Train accuracy minus held-out accuracy, held-out ce minus train loss."""
        train, held = record["train"], record["metrics"]
        gap = {}
        if train.get("accuracy") is not None and "accuracy" in held:
            gap["accuracy"] = _r(train["accuracy"] - held["accuracy"][0])
        if train.get("loss") is not None and "ce" in held:
            gap["loss"] = _r(held["ce"][0] - train["loss"])
        return gap

    def _replay(self) -> None:
        self._reset()
        for record in self.evals:
            self._judge(record)

    def truncate(self, step: int) -> None:
        """Forget the evals and train rows at `step` or later (a resume went back to before them)."""
        self.evals = [r for r in self.evals if r["step"] < step]
        kept = [r for r in self.train if r[0] < step]
        self.train.clear()
        self.train.extend(kept)
        self._replay()

    def state_dict(self) -> dict[str, Any]:
        return {"evals": self.evals, "train": list(self.train)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.evals = state["evals"]
        self.train.clear()
        self.train.extend(state["train"])
        self._replay()


# ---- all of them -----------------------------------------------------------------------------------
class LiveDetectors:
    """Every detector, fed one record at a time; `update` returns the events that record revealed.

    Feed train rows (required), eval rows (their eval_s is an intended pause, not a stall; their
    metrics feed the generalisation detector) and event rows (a `resume` or `run_start` restarts the
    pace warm-up). An event's step is where the trouble began: a cliff is returned at the row that
    confirms it (`details.confirmed_step`), but carries the step of its first low row; a
    generalisation event is returned at the eval row that confirms it, with the best eval's step. `recovery_steps` is filled in later, in place, on the returned dict.
    """

    def __init__(self, cfg: DetectorConfig | None = None):
        self.cfg = cfg or DetectorConfig()
        self.pace = _Pace(self.cfg)
        self.loss = _Spike(self.cfg)
        self.accuracy = _Drop(
            self.cfg, "accuracy_cliff", self.cfg.cliff_k, self.cfg.cliff_min_drop, self.cfg.cliff_min_rel
        )
        self.throughput = _Drop(
            self.cfg, "throughput_drop", self.cfg.throughput_k, 0.0, self.cfg.throughput_min_rel
        )
        self.throughput_warmup = self.cfg.warmup_rows
        self.generalisation = _Generalisation(self.cfg)
        self.in_nan = False
        self.last_step: int | None = None
        self.rows = 0

    def update(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        row = normalize(record)
        if row["kind"] == "event":
            if row["event"] in RESET_EVENTS and (self.rows > 0 or (row["step"] or 0) > 0):
                self._resumed(row["step"])
            return []
        if row["kind"] == "eval":
            if finite(row["eval_s"]):
                self.pace.paused_s += row["eval_s"]
            if row["step"] is None:
                return []
            ev = self.generalisation.update(row["step"], row)
            return [ev] if ev else []
        if row["kind"] != "train" or row["step"] is None:
            return []
        step = row["step"]
        if self.last_step is not None and step <= self.last_step:  # the steps went back: resumed earlier
            self._resumed(step - 1)
        self.last_step = step
        self.rows += 1
        self.generalisation.add_train(step, row["loss"], row["accuracy"])
        events = self._nan(step, row)
        events += self.pace.update(step, row["t"] if finite(row["t"]) else None)
        if finite(row["loss"]) and (ev := self.loss.update(step, row["loss"])):
            events.append(ev)
        if finite(row["accuracy"]) and (ev := self.accuracy.update(step, row["accuracy"])):
            events.append(ev)
        if finite(row["tok_per_s"]):
            if self.throughput_warmup > 0:
                self.throughput_warmup -= 1
            elif ev := self.throughput.update(step, row["tok_per_s"]):
                events.append(ev)
        return events

    def _nan(self, step: int, row: dict[str, Any]) -> list[dict[str, Any]]:
        bad = {
            k: str(row[k]) for k in ("loss", "grad_norm") if row[k] is not None and not math.isfinite(row[k])
        }
        fired = bool(bad) and not self.in_nan
        self.in_nan = bool(bad)
        return [_event("nan", step, None, fields=bad)] if fired else []

    def _resumed(self, step: int | None) -> None:
        """A resume at `step` (or a restart): forget what came later, warm the pace up again."""
        self.pace.restart(step)
        self.throughput_warmup = self.cfg.warmup_rows
        if step is not None:
            for detector in (self.loss, self.accuracy, self.throughput, self.generalisation):
                detector.truncate(step + 1)
            self.throughput.window.pairs.clear()  # throughput after a restart is another machine's
            self.last_step = step
        self.in_nan = False

    def state_dict(self) -> dict[str, Any]:
        """JSON-able history (bounded by window_rows, plus one small record per held-out eval), for
        the trainer's checkpoint."""
        return copy.deepcopy(
            {
                "version": 2,
                "pace": self.pace.state_dict(),
                "loss": self.loss.state_dict(),
                "accuracy": self.accuracy.state_dict(),
                "throughput": self.throughput.state_dict(),
                "generalisation": self.generalisation.state_dict(),
                "throughput_warmup": self.throughput_warmup,
                "in_nan": self.in_nan,
                "last_step": self.last_step,
                "rows": self.rows,
            }
        )

    def load_state_dict(self, state: dict[str, Any], *, resumed: bool = True) -> None:
        """Restore the history; `resumed` (the default) also warms the pace up again, as a resume does.
        A version-1 state (checkpoints from before the generalisation detector) has no eval history."""
        if state.get("version") not in (1, 2):
            raise CheckpointError(
                f"detector state: unknown version {state.get('version')!r} (expected 1 or 2)"
            )
        state = copy.deepcopy(state)
        self.pace.load_state_dict(state["pace"])
        self.loss.load_state_dict(state["loss"])
        self.accuracy.load_state_dict(state["accuracy"])
        self.throughput.load_state_dict(state["throughput"])
        self.generalisation.load_state_dict(state.get("generalisation", {"evals": [], "train": []}))
        self.throughput_warmup, self.in_nan = state["throughput_warmup"], state["in_nan"]
        self.last_step, self.rows = state["last_step"], state["rows"]
        if resumed:
            self.pace.restart(None)
            self.throughput_warmup = self.cfg.warmup_rows


def detect(records: list[dict[str, Any]], cfg: DetectorConfig | None = None) -> list[dict[str, Any]]:
    """Every event of a whole log (records in file order), recovery filled in."""
    live = LiveDetectors(cfg)
    return [event for record in records for event in live.update(record)]
