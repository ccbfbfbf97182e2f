"""Detectors that turn a training log into events: stalls, step gaps, loss spikes, accuracy cliffs,
non-finite values, throughput drops, and held-out quality that turns while training improves
(overfitting, `generalisation.py`); and levels that are wrong however smooth the curve: a loss that
slowly diverges, a gradient norm that grows far above its lowest level, or an accuracy that slowly
declines from its best level, an lr stuck at 0, a loader
the steps wait for (input-bound), a run that never learns; and a loss that whips between levels from
row to row (homogeneous batches, `oscillation.py`). One code path serves the offline doctor and the live trainer.

    .venv/bin/python -m pytest tests/test_doctor.py -q

    events = detect(rows)                    # offline: every record of a train_log.jsonl, in order
    live = LiveDetectors()                   # live: feed each record as it is written (eval rows too)
    for ev in live.update({"kind": "train", "step": step, **row}):
        sink.event("warning", ev["step"], **as_warning(ev))
    live.state_dict() / live.load_state_dict(state)     # JSON-able; a resume keeps the history

An event is `{"kind", "step", "size", "details"}`; `size` by kind: stall -> gap seconds, step_gap ->
steps skipped, loss_spike -> loss / level before, accuracy_cliff -> accuracy drop (absolute),
throughput_drop -> fraction of tokens/s (or samples/s) lost, nan -> None, generalisation ->
relative worsening of its first turned metric, loss_divergence -> trailing median loss / its best,
grad_norm_growth -> trailing median grad_norm / its lowest, accuracy_decline -> best trailing median
accuracy minus the current one, lr_zero -> None,
input_bound -> mean data_wait_frac over the window, resume_jump -> the loss's level after a resume / before it,
loss_whiplash -> the typical row-to-row factor of the loss (exp of its swing), not_learning -> the loss's
lowest trailing median / its first. Every judgement is robust: a value is
compared with the median and MAD (sigma = 1.4826 * MAD) of a trailing window of accepted values, and
must also pass a minimum ratio, so noise never fires on its own. Outliers do not enter the window;
a dip must last `sustain_rows` logged rows to be a cliff or a drop. Nothing is judged before
`min_history_rows` values; pace and throughput also skip `warmup_rows` rows at the start and after a
resume (first steps are slow), and learn their level afresh after it (another machine's). Windows hold (step, value): when the steps go backwards (a resume from
an older checkpoint, a restart), entries from the abandoned future are dropped.

The level detectors (`levels.py`) compare with the run's own best level or a fixed bar rather than
a trailing window, which climbs along with a slow divergence; a level that an open spike, cliff or
throughput drop already explains is left to that event.

Records are read leniently (`records.normalize`): kind inferred, field aliases, "nan" strings.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from shared.errors import CheckpointError
from stage2_train.observe.config import DetectorConfig
from stage2_train.observe.episodes import Drop, Spike
from stage2_train.observe.generalisation import Generalisation
from stage2_train.observe.levels import InputBound, Level, LrZero, NotLearning
from stage2_train.observe.oscillation import Whiplash
from stage2_train.observe.pace import Pace
from stage2_train.observe.records import (
    RESET_EVENTS,
    Window,
    finite,
    make_event,
    median,
    normalize,
    r6,
    robust,
)

EVENT_KINDS = (
    "stall",
    "step_gap",
    "loss_spike",
    "accuracy_cliff",
    "nan",
    "throughput_drop",
    "generalisation",
    "loss_divergence",
    "grad_norm_growth",
    "resume_jump",
    "accuracy_decline",
    "lr_zero",
    "input_bound",
    "loss_whiplash",
    "not_learning",
)


def as_warning(event: dict[str, Any]) -> dict[str, Any]:
    """Fields for `sink.event("warning", event["step"], **as_warning(event))`."""
    return {"detector": event["kind"], "size": event["size"], "details": event["details"]}


# ---- all of them (stalls and step gaps: `pace.py`; spikes and drops: `episodes.py`) ----------------
class LiveDetectors:
    """Every detector, fed one record at a time; `update` returns the events that record revealed.

    Feed train rows (required), eval rows (their eval_s is an intended pause, not a stall; their
    metrics feed the generalisation detector) and event rows (a `resume` or `run_start` restarts the
    pace warm-up). An event's step is where the trouble began: a cliff is returned at the row that
    confirms it (`details.confirmed_step`), but carries the step of its first low row; a
    generalisation event is returned at the eval row that confirms it, with the best eval's step.
    `recovery_steps` is filled in later, in place, on the returned dict.
    """

    def __init__(self, cfg: DetectorConfig | None = None):
        self.cfg = cfg or DetectorConfig()
        self.pace = Pace(self.cfg)
        self.loss = Spike(self.cfg)
        self.accuracy = Drop(
            self.cfg, "accuracy_cliff", self.cfg.cliff_k, self.cfg.cliff_min_drop, self.cfg.cliff_min_rel
        )
        self.throughput = Drop(
            self.cfg, "throughput_drop", self.cfg.throughput_k, 0.0, self.cfg.throughput_min_rel
        )
        self.throughput_warmup = self.cfg.warmup_rows
        self.generalisation = Generalisation(self.cfg)
        self.divergence = Level(self.cfg, "loss_divergence", bad_is_up=True)
        self.grad_growth = Level(self.cfg, "grad_norm_growth", bad_is_up=True, ratio=self.cfg.grad_norm_ratio)
        self.decline = Level(self.cfg, "accuracy_decline", bad_is_up=False)
        self.lr_zero = LrZero(self.cfg)
        self.input_bound = InputBound(self.cfg)
        self.whiplash = Whiplash(self.cfg)
        self.not_learning = NotLearning(self.cfg)
        self.in_nan = False
        self.last_step: int | None = None
        self.rows = 0
        self.after_resume: dict[str, Any] | None = None  # the loss level a resume must continue (`_arm_resume_check`)
        self.noise_std = Window(self.cfg.window_rows)  # (step, noise_std) of train rows: the resume check's schedule

    def update(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        row = normalize(record)
        if row["kind"] == "event":
            if row["event"] in RESET_EVENTS and (self.rows > 0 or (row["step"] or 0) > 0):
                self._resumed(row["step"])
            if row["event"] == "run_start":
                self.run_started(record.get("hyperparameters"))
            return []
        if row["kind"] == "eval":
            if finite(row["eval_s"]):
                self.pace.paused_s += row["eval_s"]
            else:
                self.pace.untimed_pause = True
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
        # Candidate-scored accuracy and loss (loss.full_vocab_slots) still say whether training improves,
        # but are not the held-out rows' full-vocabulary ones: no gap is read from them.
        self.generalisation.add_train(step, row["loss"], row["accuracy"], comparable=not finite(row["full_vocab_slots"]))
        events = self._nan(step, row)
        events += self.pace.update(step, row["t"] if finite(row["t"]) else None)
        if finite(row["loss"]) and (ev := self.loss.update(step, row["loss"])):
            events.append(ev)
            self.after_resume = None  # the spike's cause names the resume
        if finite(row["noise_std"]):
            self.noise_std.append(step, row["noise_std"])
        if finite(row["loss"]) and (ev := self._resume_jump(step, row["loss"], row["noise_std"])):
            events.append(ev)
        if finite(row["accuracy"]) and (ev := self.accuracy.update(step, row["accuracy"])):
            events.append(ev)
        if finite(row["loss"]) and (ev := self.divergence.update(step, row["loss"], bool(self.loss.recovering))):
            events.append(ev)
        if finite(row["grad_norm"]) and (
            ev := self.grad_growth.update(step, row["grad_norm"], bool(self.loss.recovering))
        ):
            events.append(ev)
        if finite(row["accuracy"]) and (
            ev := self.decline.update(step, row["accuracy"], bool(self.accuracy.recovering))
        ):
            events.append(ev)
        if finite(row["lr"]) and (ev := self.lr_zero.update(step, row["lr"])):
            events.append(ev)
        if finite(row["loss"]):
            tokens, samples = row["batch_tokens"], row["batch_samples"]
            mean_len = tokens / samples if finite(tokens) and finite(samples) and samples > 0 else None
            if ev := self.whiplash.update(step, row["loss"], mean_len, bool(self.loss.recovering)):
                events.append(ev)
            accuracy, lr = (row[k] if finite(row[k]) else None for k in ("accuracy", "lr"))
            if ev := self.not_learning.update(step, row["loss"], accuracy, lr):
                events.append(ev)
        rate, unit = (row["tok_per_s"], "tok/s") if finite(row["tok_per_s"]) else (row["samples_per_s"], "samples/s")
        if finite(rate):
            if self.throughput_warmup > 0:
                self.throughput_warmup -= 1
            elif ev := self.throughput.update(step, rate):
                ev["details"]["unit"] = unit
                events.append(ev)
        wait = row["data_wait_frac"]
        if finite(wait) and (ev := self.input_bound.update(step, wait, bool(self.throughput.recovering))):
            events.append(ev)
        return events

    def run_started(self, hyperparameters: Any) -> None:
        """A run_start's `hyperparameters` (the trainer calls this after its own run_start event): a run
        from trained weights (init_from) is not held to the from-scratch rule of `NotLearning`."""
        if isinstance(hyperparameters, dict):
            self.not_learning.init_from = hyperparameters.get("init_from") or None
            self.not_learning.start_known = "init_from" in hyperparameters

    def _nan(self, step: int, row: dict[str, Any]) -> list[dict[str, Any]]:
        bad = {
            k: str(row[k]) for k in ("loss", "grad_norm") if row[k] is not None and not math.isfinite(row[k])
        }
        fired = bool(bad) and not self.in_nan
        self.in_nan = bool(bad)
        return [make_event("nan", step, None, fields=bad)] if fired else []

    def _arm_resume_check(self, step: int | None) -> None:
        """A resume continues the run exactly: the median loss of its first sustain_rows rows must be
        back within the spike detector's recovered level (median * (1 + recovery_tol), median + 3 sigma)
        of the rows before it. A jump under spike_min_ratio (2.5x) that fades in tens of steps, the mark
        of optimizer moments or a schedule not restored, was otherwise called healthy.

        Compared only while the logged noise_std holds one level over both windows: inside the noise
        warmup the level before is a median of rows at less noise than the rows after, and a loss that
        grows with the noise's square (flat at first, steep at the ramp's end) is then past the threshold
        though the run continued exactly."""
        window = self.loss.window
        if self.loss.recovering or len(window) < self.cfg.min_history_rows:
            self.after_resume = None
            return
        levels = [v for s, v in self.noise_std.pairs if s >= window.pairs[0][0]]
        if levels and not all(math.isclose(v, levels[0], rel_tol=1e-6, abs_tol=1e-12) for v in levels):
            self.after_resume = None
            return
        med, sigma = robust(window.values())
        self.after_resume = {
            "resumed_at": step, "before": med, "values": [], "noise_std": levels[0] if levels else None,
            "threshold": max(med * (1 + self.cfg.recovery_tol), med + 3 * sigma),
        }

    def _resume_jump(self, step: int, loss: float, noise_std: float | None) -> dict[str, Any] | None:
        check = self.after_resume
        if check is None:
            return None
        if finite(noise_std):
            # No level before (an older checkpoint's state, rows without it): the rows after must still agree.
            level = check.setdefault("noise_std", None)
            if level is not None and not math.isclose(noise_std, level, rel_tol=1e-6, abs_tol=1e-12):
                self.after_resume = None
                return None
            check["noise_std"] = noise_std
        check["values"].append([step, loss])
        if len(check["values"]) < self.cfg.sustain_rows:
            return None
        self.after_resume = None
        after = median(sorted(v for _, v in check["values"]))
        if after <= check["threshold"] or check["before"] <= 0:
            return None
        return make_event(
            "resume_jump", int(check["values"][0][0]), after / check["before"], resumed_at=check["resumed_at"],
            before=r6(check["before"]), after=r6(after), threshold=r6(check["threshold"]),
            rows=len(check["values"]), confirmed_step=int(step),
        )

    def _resumed(self, step: int | None) -> None:
        """A resume at `step` (or a restart): forget what came later, warm the pace up again."""
        self.pace.restart(step)
        self.input_bound.restart(step)
        self.whiplash.restart(None if step is None else step + 1)
        self.throughput_warmup = self.cfg.warmup_rows
        if step is not None:
            for detector in (
                self.loss,
                self.accuracy,
                self.throughput,
                self.generalisation,
                self.divergence,
                self.grad_growth,
                self.decline,
                self.lr_zero,
                self.not_learning,
                self.noise_std,
            ):
                detector.truncate(step + 1)
            self.throughput.window.pairs.clear()  # throughput after a restart is another machine's
            self.last_step = step
        self.in_nan = False
        self._arm_resume_check(step)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able history (bounded by window_rows, plus one small record per held-out eval), for
        the trainer's checkpoint."""
        return copy.deepcopy(
            {
                "version": 3,
                "pace": self.pace.state_dict(),
                "loss": self.loss.state_dict(),
                "accuracy": self.accuracy.state_dict(),
                "throughput": self.throughput.state_dict(),
                "generalisation": self.generalisation.state_dict(),
                "divergence": self.divergence.state_dict(),
                "grad_growth": self.grad_growth.state_dict(),
                "decline": self.decline.state_dict(),
                "lr_zero": self.lr_zero.state_dict(),
                "input_bound": self.input_bound.state_dict(),
                "whiplash": self.whiplash.state_dict(),
                "not_learning": self.not_learning.state_dict(),
                "throughput_warmup": self.throughput_warmup,
                "in_nan": self.in_nan,
                "last_step": self.last_step,
                "rows": self.rows,
                "after_resume": self.after_resume,
                "noise_std": list(self.noise_std.pairs),
            }
        )

    def load_state_dict(self, state: dict[str, Any], *, resumed: bool = True) -> None:
        """Restore the history; `resumed` (the default) also warms the pace up again, as a resume does.
        A version-1 state (checkpoints from before the generalisation detector) has no eval history;
        a version-2 one has no noise sources (see `Generalisation.load_state_dict`). A state from before
        the level detectors (divergence, grad_growth, decline, lr_zero, input_bound) or the whiplash and
        not-learning ones starts them afresh; one without noise_std knows no noise level before the resume."""
        if state.get("version") not in (1, 2, 3):
            raise CheckpointError(
                f"detector state: unknown version {state.get('version')!r} (expected 1, 2 or 3)"
            )
        state = copy.deepcopy(state)
        self.pace.load_state_dict(state["pace"])
        self.loss.load_state_dict(state["loss"])
        self.accuracy.load_state_dict(state["accuracy"])
        self.throughput.load_state_dict(state["throughput"])
        self.generalisation.load_state_dict(state.get("generalisation", {"evals": [], "train": []}))
        fresh = LiveDetectors(self.cfg)  # for a checkpoint from before the level detectors
        for name in ("divergence", "grad_growth", "decline", "lr_zero", "input_bound", "whiplash", "not_learning"):
            setattr(self, name, getattr(fresh, name))
            if name in state:
                getattr(self, name).load_state_dict(state[name])
        self.throughput_warmup, self.in_nan = state["throughput_warmup"], state["in_nan"]
        self.last_step, self.rows = state["last_step"], state["rows"]
        self.after_resume = state.get("after_resume")
        self.noise_std.pairs.clear()
        self.noise_std.pairs.extend(state.get("noise_std", []))  # absent before the resume check read it: no level known
        if resumed:
            self._arm_resume_check(self.last_step)
            self.throughput.window.pairs.clear()  # another machine's, as the doctor reads the resume event
            self.pace.restart(None)
            self.input_bound.restart(None)
            self.whiplash.restart(None)
            self.throughput_warmup = self.cfg.warmup_rows


def detect(records: list[dict[str, Any]], cfg: DetectorConfig | None = None) -> list[dict[str, Any]]:
    """Every event of a whole log (records in file order), recovery filled in."""
    live = LiveDetectors(cfg)
    return [event for record in records for event in live.update(record)]
