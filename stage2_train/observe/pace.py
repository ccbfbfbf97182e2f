"""The pace of a run: wall time and step deltas between consecutive train rows, whose outliers are
stalls (a step that took far longer than the usual) and step gaps (rows missing between two logged
steps). Used by `detectors.LiveDetectors`; thresholds in `config.DetectorConfig` (stall_*, step_gap_ratio).
"""

from __future__ import annotations

from typing import Any

from stage2_train.observe.config import DetectorConfig
from stage2_train.observe.records import Window, make_event, r6, robust


class Pace:
    """Wall time and step deltas between consecutive train rows: stalls and step gaps.

    A step gap is held for one row and named at the next (its `confirmed_step`): when that row's delta
    is as long, the logging interval changed (a resume with another log.every_steps, a peer's run
    resumed in wandb), no rows were lost, and both deltas join the window. Named at once, every row
    after an interval change of 10 -> 100 steps was a step gap (50 on a 6,000-step log). A gap on the
    log's last row has no next row to confirm it and is not named."""

    def __init__(self, cfg: DetectorConfig):
        self.cfg = cfg
        self.sec_per_step = Window(cfg.window_rows)
        self.step_deltas = Window(cfg.window_rows)
        self.prev: list[float] | None = None  # [step, t] of the previous train row
        self.paused_s = 0.0  # intended pauses (eval) since the previous row, not counted as stalls
        # An eval of unknown length (its row has no eval_s: another trainer's) since the previous row: the
        # gap holds an intended pause of unknown size, so it is not judged (every eval was a stall).
        self.untimed_pause = False
        self.warmup_left = cfg.warmup_rows
        self.outliers = 0  # consecutive stalls: past sustain_rows the pace itself changed
        self.held_gap: dict[str, Any] | None = None  # a step gap waiting for the next row's delta

    def restart(self, step: int | None) -> None:
        """A resume or a new process: its seconds per step are another machine's (as its throughput is),
        so they are learned afresh; judged against the old pace, a resume on a 4x slower machine named
        a stall at every row for 29 rows."""
        self.sec_per_step.pairs.clear()
        if step is not None:
            self.step_deltas.truncate(step + 1)
        self.prev, self.paused_s, self.warmup_left, self.outliers = None, 0.0, self.cfg.warmup_rows, 0
        self.untimed_pause = False

    def update(self, step: int, t: float | None) -> list[dict[str, Any]]:
        cfg = self.cfg
        prev, paused, untimed = self.prev, self.paused_s, self.untimed_pause
        self.prev, self.paused_s, self.untimed_pause = [step, t], 0.0, False
        held, self.held_gap = self.held_gap, None
        if prev is None:
            return confirmed(held, step)
        delta = step - prev[0]
        if self.warmup_left > 0:
            self.warmup_left -= 1
            return confirmed(held, step)
        long = False
        if len(self.step_deltas) >= cfg.min_history_rows:
            deltas = sorted(self.step_deltas.values())
            usual = max(deltas[int(0.9 * (len(deltas) - 1))], 1)
            long = delta > cfg.step_gap_ratio * usual
            if long and held is not None:  # two long deltas in a row: a new logging interval
                self.step_deltas.append(held["step"], held["size"])
                held, long = None, False
            elif long:
                gap_s = None if t is None or prev[1] is None else r6(t - prev[1])
                self.held_gap = make_event(
                    "step_gap", step, delta, from_step=int(prev[0]), usual_delta=int(usual), gap_s=gap_s
                )
        events = confirmed(held, step)
        if not long:
            self.step_deltas.append(step, delta)
        if t is None or prev[1] is None or untimed:
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
                    make_event(
                        "stall",
                        step,
                        gap,
                        from_step=int(prev[0]),
                        expected_s=r6(expected),
                        lost_s=r6(lost),
                        sec_per_step=r6(med),
                        paused_s=r6(paused),
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
            "untimed_pause": self.untimed_pause,
            "warmup_left": self.warmup_left,
            "outliers": self.outliers,
            "held_gap": self.held_gap,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("sec_per_step", "step_deltas"):
            window = getattr(self, name)
            window.pairs.clear()
            window.pairs.extend(state[name])
        self.prev, self.paused_s = state["prev"], state["paused_s"]
        self.untimed_pause = state.get("untimed_pause", False)  # absent from checkpoints before it
        self.warmup_left, self.outliers = state["warmup_left"], state["outliers"]
        self.held_gap = state.get("held_gap")  # absent from checkpoints before it


def confirmed(gap: dict[str, Any] | None, step: int) -> list[dict[str, Any]]:
    """The held step gap, named at the row that confirms it."""
    if gap is None:
        return []
    gap["details"]["confirmed_step"] = int(step)
    return [gap]
