"""The detectors of a value against its own recent level: a loss spike (bad is up) and a drop of
accuracy or throughput (bad is down), with what they share (`Episodes`: the events still recovering,
and the episode in progress, during which the window is frozen and no new event is raised). Used by
`detectors.LiveDetectors`; thresholds in `config.DetectorConfig`.
"""

from __future__ import annotations

from typing import Any

from stage2_train.observe.config import DetectorConfig
from stage2_train.observe.records import Window, make_event, median, r6, robust


class Episodes:
    """What spikes (bad = up) and drops (bad = down) share: the events still recovering, and the
    episode in progress, during which the window is frozen and no new event is raised."""

    def __init__(self, cfg: DetectorConfig, bad_is_up: bool):
        self.cfg, self.bad_is_up = cfg, bad_is_up
        self.window = Window(cfg.window_rows)
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


class Spike(Episodes):
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
                ev = make_event(
                    "loss_spike",
                    step,
                    value / med,
                    loss=r6(value),
                    before=r6(med),
                    threshold=r6(threshold),
                    recovery_steps=None,
                )
                level = max(med * (1 + cfg.recovery_tol), med + 3 * sigma)
                return self._open(ev, level, release=0.5 * (med + threshold), rows=0)
        self.window.append(step, value)
        return None


class Drop(Episodes):
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
        after = median(low)
        size = med - after if self.kind == "accuracy_cliff" else (1 - after / med if med > 0 else None)
        first_step, first_value = self.pending[0]
        ev = make_event(
            self.kind,
            first_step,
            size,
            before=r6(med),
            after=r6(after),
            first_value=r6(first_value),
            threshold=r6(threshold),
            confirmed_step=int(step),
            recovery_steps=None,
        )
        release = 0.5 * (med + threshold)
        rows, self.pending = len(self.pending), []
        return self._open(ev, level=release, release=release, rows=rows)
