"""Held-out quality that turns while training improves (overfitting): the `generalisation` detector.

    .venv/bin/python -m pytest tests/test_generalisation.py -q

Judged at each held-out eval row (`kind: "eval"`). The metrics: walk_tau when the row has it, else
accept_len, and accuracy (higher is better), and ce (lower is better; an eval row of another trainer
without ce gives its loss). Track the best held-out value so far per metric. A metric has turned,
while training keeps improving (the training level, the median of the train rows since the previous
eval for loss lower / accuracy higher, on every one of the two the log has, is better than it was at
the best eval's step), by either of two rules:

- distance: worse than its best by more than `generalisation_k` times the combined standard error
  sqrt(se_best^2 + se_now^2), for `generalisation_sustain` consecutive evaluations (an eval where
  training did not improve, or the metric is back within the margin, restarts the count);
- trend: the evals since the best fall steadily, even when each step is within the noise: a
  one-sided Mann-Kendall test on them (exact for up to 12 evals, the normal approximation beyond;
  the best eval itself is left out, it is the maximum by selection) passes at
  `generalisation_sustain` consecutive evals, and the eval is worse than the best by at least
  `generalisation_min_rel` of it. The k-th test since the best passes at p <=
  `generalisation_trend_alpha` / k: a long plateau is tested at every eval, and without the 1/k it
  would, by chance, fall once (a real fall's p-value shrinks much faster than 1/k). Rank-based, it
  needs no noise model. With 0.002 and 2 it needs six evals after the best and confirms at the
  seventh. Its false alarms, measured on logs of pure noise (a flat held-out level, three metrics,
  independent evals, training improving): 1 of 300 logs of 30 evals, 1 of 100 of 200 evals
  (tests/test_generalisation.py).

The standard errors are the row's `<metric>_se` (over held-out samples). When they are absent (older
logs, other trainers) they are derived from the eval's size, from the best unit the row counts:
`num_blocks` (the positions of one block are correlated, so a block is the unit), else `num_tokens`
/ 16 (a DFlash block of 16 slots counted once), else `num_samples` (wide: an eval of 64 samples
averages thousands of blocks). For accuracy the binomial SE sqrt(p (1 - p) / n), for ce, walk_tau and
accept_len |value| / sqrt(n) (a coefficient of variation of 1 per unit: a deliberately wide guess);
such a metric must also be worse by at least `generalisation_min_rel` of its best. Without any of
them only the trend rule can judge. (The held-out set is the same at every eval, so the spread over
its samples bounds the jitter between evals from above: the distance rule errs on the quiet side.)

The event is raised once, at the eval that confirms the first turned metric; its step is that
metric's best eval (where the turn began); `details` hold every turned metric (best, its step, now,
the rule, its margin or p-value), the train and held-out levels and their gap then and now, and
`best_tau` (the eval to keep a checkpoint of). No new event comes until a metric of the turn makes a
new best, which ends the turn and restarts every count. A resume to an earlier step forgets the
evals from after it. `undecided()` says, at the end of a log, which metrics neither rule could judge
(noise too wide for the distance rule and too few evals since the best for the trend rule; or no
noise known and half the best lost in a drop that then holds): the doctor reports them as "cannot
tell" rather than calling the run healthy. It judges each metric on its own: a metric that fell far
(`generalisation_far_rel` of its best, and past its derived noise) is named even while another one
improves; smaller falls only when no metric is at its best or judged.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from typing import Any, ClassVar

from stage2_train.observe.config import DetectorConfig
from stage2_train.observe.records import finite, make_event, median, r6

TOKENS_PER_UNIT = 16  # scored tokens counted as one independent unit: a DFlash block's slots are correlated
UNITS = ("num_blocks", "num_tokens", "num_samples")  # the eval-size fields, best unit first
BLIND_REL = 0.5  # a distance margin above this fraction of the best could not see the metric halve


# ---- the trend test --------------------------------------------------------------------------------
@functools.cache
def _inversion_counts(n: int) -> tuple[int, ...]:
    """How many permutations of n distinct values have k inversions, for k = 0..n(n-1)/2."""
    counts = [1]
    for i in range(2, n + 1):  # multiply by 1 + x + ... + x^(i-1)
        grown = [0] * (len(counts) + i - 1)
        for k, c in enumerate(counts):
            for j in range(i):
                grown[k + j] += c
        counts = grown
    return tuple(counts)


def kendall_s(values: list[float], start: int = 0, s: int = 0) -> int:
    """Mann-Kendall S = sum over pairs i < j of sign(v_j - v_i), given S of values[:start] (an eval
    adds its n - 1 pairs, so a run's statistic costs n, not n^2, per eval)."""
    for j in range(max(start, 1), len(values)):
        s += sum((values[j] > a) - (values[j] < a) for a in values[:j])
    return s


def falling_p_value(values: list[float], s: int | None = None) -> float:
    """One-sided Mann-Kendall p-value that `values` (in time order) fall: P(S <= s) under
    exchangeable noise. Ties count 0, which only makes the p-value larger (the quiet side)."""
    n = len(values)
    if n < 2:
        return 1.0
    s = kendall_s(values) if s is None else s
    pairs = n * (n - 1) // 2
    if n <= 12:  # exact: S = pairs - 2 * inversions; S <= s means inversions >= (pairs - s) / 2
        counts = _inversion_counts(n)
        return sum(counts[math.ceil((pairs - s) / 2) :]) / math.factorial(n)
    sd = math.sqrt(n * (n - 1) * (2 * n + 5) / 18)
    return 0.5 * math.erfc(-min(s + 1, 0) / sd / math.sqrt(2))  # continuity-corrected normal


def min_trend_evals(alpha: float) -> int:
    """Fewest evals after the best whose steady fall can reach p <= alpha (one order in n!)."""
    n = 2
    while 1 / math.factorial(n) > alpha:
        n += 1
    return n


# ---- the detector ----------------------------------------------------------------------------------
class Generalisation:
    """Held-out metrics that turn while training improves (the rules are in the module docstring).

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
        # {"step", "metrics": {name: [value, se or None, noise source or None]}, "train": level}
        self.evals: list[dict[str, Any]] = []
        self.train: deque[list[Any]] = deque(
            maxlen=cfg.window_rows
        )  # [step, loss, accuracy] since the last eval
        self._reset()

    def _reset(self) -> None:
        self.best: dict[str, dict[str, Any]] = {}  # name -> {"index", "step", "value", "se", "source"}
        self.count: dict[
            str, int
        ] = {}  # name -> consecutive evals past the distance margin while training improved
        self.trend_count: dict[str, int] = {}  # name -> consecutive evals whose trend test passed
        self.trend_s: dict[str, tuple[int, int]] = {}  # name -> (evals since the best counted, their S)
        self.turn: list[str] | None = None  # the metrics of the event raised, until one makes a new best

    def add_train(self, step: int, loss: float | None, accuracy: float | None, comparable: bool = True) -> None:
        """`comparable`: the row's accuracy and loss are over the whole vocabulary, as the held-out rows'."""
        if finite(loss) or finite(accuracy):
            self.train.append([step, loss if finite(loss) else None, accuracy if finite(accuracy) else None, comparable])

    def update(self, step: int, row: dict[str, Any]) -> dict[str, Any] | None:
        level = self._train_level()
        self.train.clear()
        names = ("walk_tau" if finite(row["walk_tau"]) else "accept_len", "accuracy", "ce")
        metrics = {name: [row[name], *self._noise(name, row)] for name in names if finite(row[name])}
        if not metrics:
            return None
        self.evals.append({"step": step, "metrics": metrics, "train": level})
        return self._judge(len(self.evals) - 1)

    def _train_level(self) -> dict[str, float | None]:
        """Median train loss and accuracy since the previous eval; the previous eval's when none came."""
        if not self.train:
            return dict(self.evals[-1]["train"]) if self.evals else {"loss": None, "accuracy": None}
        level: dict[str, float | None] = {}
        for i, name in enumerate(("loss", "accuracy"), start=1):
            values = sorted(r[i] for r in self.train if r[i] is not None)
            level[name] = r6(median(values)) if values else None
        if not all(r[3] if len(r) > 3 else True for r in self.train):
            level["comparable"] = False  # candidate-scored rows (`add_train`): improvement yes, gap no
        return level

    @staticmethod
    def _noise(name: str, row: dict[str, Any]) -> tuple[float | None, str | None]:
        """(standard error, where it came from): the row's `<name>_se` ("logged"), else one derived
        from the eval's size (the unit's name), else (None, None)."""
        se = row[f"{name}_se"]
        if finite(se):
            return r6(se), "logged"
        unit = next((k for k in UNITS if finite(row[k]) and row[k] > 0), None)
        if unit is None:
            return None, None
        n = row[unit] / TOKENS_PER_UNIT if unit == "num_tokens" else row[unit]
        value = row[name]
        if name == "accuracy":
            return r6(math.sqrt(max(value * (1 - value), 0.0) / n)), unit
        return r6(abs(value) / math.sqrt(n)), unit

    def _improved(self, now: dict[str, float | None], then: dict[str, float | None]) -> bool:
        """Training better now than then, on every level (loss, accuracy) both have."""
        both = [k for k in self.TRAIN_HIGHER_IS_BETTER if now.get(k) is not None and then.get(k) is not None]
        return bool(both) and all(
            (now[k] > then[k]) if self.TRAIN_HIGHER_IS_BETTER[k] else (now[k] < then[k]) for k in both
        )

    def _margin(self, best: dict[str, Any], se: float | None, source: str | None) -> float | None:
        """The distance rule's margin, None when either eval's noise is unknown."""
        if best["se"] is None or se is None:
            return None
        margin = self.cfg.generalisation_k * math.sqrt(best["se"] ** 2 + se**2)
        if not source == best["source"] == "logged":
            margin = max(margin, self.cfg.generalisation_min_rel * abs(best["value"]))
        return margin

    def _since_best(self, name: str, index: int) -> list[float]:
        """The metric's values at the evals after its best, up to eval `index`, in time order."""
        return [
            r["metrics"][name][0]
            for r in self.evals[self.best[name]["index"] + 1 : index + 1]
            if name in r["metrics"]
        ]

    def _judge(self, index: int) -> dict[str, Any] | None:
        cfg, record = self.cfg, self.evals[index]
        step = record["step"]
        turned: dict[str, dict[str, Any]] = {}
        for name, (value, se, source) in record["metrics"].items():
            sign = 1.0 if self.HIGHER_IS_BETTER[name] else -1.0
            best = self.best.get(name)
            if best is None or (value - best["value"]) * sign > 0:
                self.best[name] = {"index": index, "step": step, "value": value, "se": se, "source": source}
                self.count[name] = self.trend_count[name] = 0
                self.trend_s[name] = (0, 0)
                if self.turn is not None and name in self.turn:  # the turn is over: count afresh
                    self.turn = None
                    self.count = dict.fromkeys(self.count, 0)
                    self.trend_count = dict.fromkeys(self.trend_count, 0)
                continue
            fall = (best["value"] - value) * sign
            improved = self._improved(record["train"], self._eval_at(best["step"])["train"])
            margin = self._margin(best, se, source)
            worse = margin is not None and fall > margin and improved
            self.count[name] = self.count.get(name, 0) + 1 if worse else 0
            common = {"best": best["value"], "best_step": best["step"], "now": value}
            if self.count[name] >= cfg.generalisation_sustain:
                turned[name] = {
                    **common,
                    "rule": "distance",
                    "threshold": r6(margin),
                    "se_best": best["se"],
                    "se_now": se,
                    "se_logged": source == best["source"] == "logged",
                }
                continue
            since = [v * sign for v in self._since_best(name, index)]
            counted, stat = self.trend_s.get(name, (0, 0))
            self.trend_s[name] = (len(since), kendall_s(since, counted, stat))
            floor = cfg.generalisation_min_rel * abs(best["value"])
            looks = len(since) - min_trend_evals(cfg.generalisation_trend_alpha) + 1  # tests since the best
            p = falling_p_value(since, self.trend_s[name][1]) if looks >= 1 else 1.0
            falling = (
                improved and fall >= floor and looks >= 1 and p <= cfg.generalisation_trend_alpha / looks
            )
            self.trend_count[name] = self.trend_count.get(name, 0) + 1 if falling else 0
            if self.trend_count[name] >= cfg.generalisation_sustain:
                turned[name] = {
                    **common,
                    "rule": "trend",
                    "threshold": r6(floor),
                    "evals_since_best": len(since),
                    "p_value": r6(p),
                }
        if not turned or self.turn is not None:
            return None
        self.turn = list(turned)
        first = next(iter(turned.values()))
        then = self._eval_at(first["best_step"])
        tau = next((n for n in ("walk_tau", "accept_len") if n in self.best), None)
        return make_event(
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

    def undecided(self) -> list[str]:
        """What the rules could not judge at the last eval, one line per held-out metric below its best.
        Undecided: noise too wide (or unknown) for the distance rule to see the metric halve, and too
        few evals since the best for the trend rule; or, with no noise known at all, a metric that lost
        half its best in a fall too unsteady for the trend rule (a drop that then holds).

        Per metric, whatever the others do: an undecided metric that fell at least
        generalisation_far_rel of its best (and beyond its derived noise margin, when it has one), or
        lost half of it, is named even while another metric improves (a ce that keeps improving does
        not vouch for a walk_tau that halved). Smaller falls are named only when no metric is at its
        best or judged. Empty while a turn is open (the event says more)."""
        if self.turn is not None or len(self.evals) < 2:
            return []
        need = min_trend_evals(self.cfg.generalisation_trend_alpha) + self.cfg.generalisation_sustain - 1
        judged, lines = False, []  # lines: (named whatever the other metrics do, line)
        for name, best in self.best.items():
            since = self._since_best(name, len(self.evals) - 1)
            value, se, source = next(r for r in reversed(self.evals) if name in r["metrics"])["metrics"][name]
            margin = self._margin(best, se, source)
            top = abs(best["value"])
            fall = (best["value"] - value) * (1.0 if self.HIGHER_IS_BETTER[name] else -1.0)
            halved = margin is None and top > 0 and fall >= BLIND_REL * top
            if not since or (margin is not None and margin < BLIND_REL * top) or (len(since) >= need and not halved):
                judged = True  # at its best now, or a rule could judge it
                continue
            if margin is None:
                noise = "no standard errors or eval sizes (num_blocks, num_tokens, num_samples) in the eval rows"
            else:
                origin = "its logged standard errors" if source == "logged" else f"its noise derived from {source}"
                noise = f"{origin} need a worsening of {margin:.3g} to count, more than half the best"
            if len(since) >= need:
                evals = f"{len(since)} eval(s) since, {100 * fall / top:.0f}% below it with no steady fall for the trend rule"
            else:
                evals = f"{len(since)} eval(s) since (the trend rule needs {need})"
            far = halved or (
                fall > 0 and fall >= self.cfg.generalisation_far_rel * top and (margin is None or fall > margin)
            )
            line = f"{name} {value:.4g}, best {best['value']:.4g} at step {best['step']}, {evals}; {noise}"
            lines.append((far, line))
        return [line for far, line in lines if far or not judged]

    def _eval_at(self, step: int) -> dict[str, Any]:
        return next(r for r in reversed(self.evals) if r["step"] == step)

    @staticmethod
    def _gap(record: dict[str, Any]) -> dict[str, float]:
        """Train accuracy minus held-out accuracy, held-out ce minus train loss."""
        train, held = record["train"], record["metrics"]
        gap: dict[str, float] = {}
        if train.get("comparable") is False:
            return gap
        if train.get("accuracy") is not None and "accuracy" in held:
            gap["accuracy"] = r6(train["accuracy"] - held["accuracy"][0])
        if train.get("loss") is not None and "ce" in held:
            gap["loss"] = r6(held["ce"][0] - train["loss"])
        return gap

    def _replay(self) -> None:
        self._reset()
        for index in range(len(self.evals)):
            self._judge(index)

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
        """A state from before noise sources (detector state version 2: [value, se, derived]) is read
        with its derived noise of unknown unit ("size"), and a zero derived SE as unknown."""
        self.evals = state["evals"]
        for record in self.evals:
            for name, (value, se, source) in record["metrics"].items():
                if isinstance(source, bool):
                    record["metrics"][name] = (
                        [value, se, "size"]
                        if source and se
                        else ([value, None, None] if source else [value, se, "logged"])
                    )
        self.train.clear()
        self.train.extend(state["train"])
        self._replay()
