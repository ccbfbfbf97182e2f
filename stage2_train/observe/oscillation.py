"""Loss whiplash: a loss that jumps between levels from one logged row to the next (0.6x, 1x, 2x),
the mark of homogeneous batches (each step drawn from one length bucket: BRIEF section 1's failed
run, "trimodal step loss"). Neither a spike (each jump is under spike_min_ratio) nor a level (the
median stays put), so the other detectors call it healthy. Used by `detectors.LiveDetectors`.

The swing of a row is d_i = ln(loss_i / loss_i-1); the detector's measure is the upper quartile of
|d_i - median(d)| over window_rows rows. Centring on the median keeps a steady fall (early training,
a coarse logging interval) from counting; a quartile keeps a spike (two large swings, up and back)
from counting. The upper quartile rather than the median: with one bucket in most steps (70%), about
half the swings are near 0 and a median sees nothing, while the quartile still sees the jumps. Above
`whiplash_bound` for `whiplash_rows` rows in a row, it is named, with the batches' mean sample length
(tokens / samples, where the rows log both) beside the loss; it closes after as many rows back under.
"""

from __future__ import annotations

import math
from typing import Any

from stage2_train.observe.config import DetectorConfig
from stage2_train.observe.records import Window, make_event, median, r6


def rank_correlation(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rho (ties ranked in order of appearance: the lengths are floats, ties are rare)."""
    n = len(xs)
    if n < 3:
        return None

    def ranks(values: list[float]) -> list[int]:
        order = sorted(range(n), key=lambda i: values[i])
        out = [0] * n
        for rank, i in enumerate(order):
            out[i] = rank
        return out

    rx, ry = ranks(xs), ranks(ys)
    mean = (n - 1) / 2
    cov = sum((a - mean) * (b - mean) for a, b in zip(rx, ry))
    var = sum((a - mean) ** 2 for a in rx)
    return cov / var if var > 0 else None


class Whiplash:
    """The loss's step-to-step swing over window_rows rows above whiplash_bound, for whiplash_rows
    rows in a row. The event stays open, its last swing updated in place, until the swing is back
    under the bound for whiplash_rows rows in a row (one window of short runs in one bucket is not
    a fix)."""

    def __init__(self, cfg: DetectorConfig):
        self.cfg = cfg
        self.swings = Window(cfg.window_rows)  # (step, ln(loss / previous loss))
        self.batches = Window(cfg.window_rows)  # (step, [loss, mean sample length or None])
        self.prev: float | None = None  # the previous row's loss
        self.run: list[float] | None = None  # [first step, rows]: swings above the bound in a row
        self.calm = 0  # rows in a row back under the bound while open: as many as opened it close it
        self.open: dict[str, Any] | None = None

    def update(self, step: int, loss: float, mean_len: float | None, explained: bool) -> dict[str, Any] | None:
        """`mean_len`: the step's tokens / samples, when logged. `explained`: a spike not yet back."""
        prev, self.prev = self.prev, loss
        if prev is None or loss <= 0 or prev <= 0:
            return None
        self.swings.append(step, math.log(loss / prev))
        self.batches.append(step, [loss, mean_len])
        if len(self.swings) < self.cfg.window_rows:
            return None
        swing = self.swing()
        bad = swing > self.cfg.whiplash_bound
        if self.open is not None:
            self.calm = 0 if bad else self.calm + 1
            if bad:
                self.open["details"].update(last=r6(swing), last_step=int(step))
            elif self.calm >= self.cfg.whiplash_rows:  # the window holds calm rows only by now, nearly
                self.open["details"]["recovery_steps"] = step - self.open["step"]
                self.open = None
            return None
        if not bad or explained:
            self.run = None
            return None
        self.run = [step, 1] if self.run is None else [self.run[0], self.run[1] + 1]
        if self.run[1] < self.cfg.whiplash_rows:
            return None
        # The run is this event's: after it closes, another must last whiplash_rows rows of its own.
        start, self.run, self.calm = int(self.run[0]), None, 0
        losses = sorted(v[0] for v in self.batches.values())
        self.open = make_event(
            "loss_whiplash",
            start,  # where the window's swing first crossed the bound
            math.exp(swing),
            swing=r6(swing),
            bound=self.cfg.whiplash_bound,
            window_rows=self.cfg.window_rows,
            loss_p10=r6(losses[len(losses) // 10]),
            loss_median=r6(median(losses)),
            loss_p90=r6(losses[(9 * len(losses)) // 10]),
            **self.lengths(),
            confirmed_step=int(step),
            last=r6(swing),
            last_step=int(step),
            recovery_steps=None,
        )
        return self.open

    def swing(self) -> float:
        d = sorted(self.swings.values())
        mid = median(d)
        spread = sorted(abs(v - mid) for v in d)
        return spread[(3 * (len(spread) - 1)) // 4]

    def lengths(self) -> dict[str, Any]:
        """The window's mean sample length per step (p10, p90) and its rank correlation with the loss:
        batches of one length range each show as a wide spread that the loss follows."""
        pairs = [(loss, n) for loss, n in self.batches.values() if n is not None and n > 0]
        if len(pairs) < self.cfg.min_history_rows:
            return {"mean_len_p10": None, "mean_len_p90": None, "len_loss_rho": None}
        lens = sorted(n for _, n in pairs)
        rho = rank_correlation([n for _, n in pairs], [loss for loss, _ in pairs])
        return {
            "mean_len_p10": r6(lens[len(lens) // 10]),
            "mean_len_p90": r6(lens[(9 * len(lens)) // 10]),
            "len_loss_rho": None if rho is None else round(rho, 3),
        }

    def restart(self, step: int | None) -> None:
        """A resume: the first row after it is not one step's swing from the last row before it."""
        self.prev, self.run, self.calm = None, None, 0
        if step is not None:
            self.swings.truncate(step)
            self.batches.truncate(step)
            if self.open is not None and self.open["step"] >= step:
                self.open = None

    def state_dict(self) -> dict[str, Any]:
        return {"swings": list(self.swings.pairs), "batches": list(self.batches.pairs), "prev": self.prev,
                "run": self.run, "calm": self.calm, "open": self.open}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("swings", "batches"):
            window = getattr(self, name)
            window.pairs.clear()
            window.pairs.extend(state[name])
        self.prev, self.run, self.calm, self.open = state["prev"], state["run"], state["calm"], state["open"]
