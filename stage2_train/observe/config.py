"""The observe room's config sections: the training log (`log`) and the live detectors' thresholds
(`detectors`, read by the trainer and by the doctor). No torch here, so `check` and the doctor
validate a config without loading anything.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from shared.config import Section


class LogConfig(Section):
    section: ClassVar[str] = "log"
    every_steps: int = 1
    """Optimizer steps between train rows (and progress-bar updates)."""
    wandb: Literal["auto", "online", "offline", "disabled"] = "auto"
    """auto: $WANDB_MODE, else online when $WANDB_API_KEY is set, else offline (a local run, no network)."""
    project: str = "dflash"
    """wandb project."""
    entity: str | None = None
    """wandb entity (team or user); null = wandb's default."""
    run_name: str | None = None
    """None: the run directory's name."""

    def validate(self) -> None:
        self.require(self.every_steps >= 1, "every_steps", "must be >= 1")
        self.require(bool(self.project), "project", "must be a non-empty string")


class DetectorConfig(Section):
    section: ClassVar[str] = "detectors"
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
    divergence_ratio: float = 1.5
    """Slow divergence: the loss's trailing median (window_rows rows) above divergence_ratio times the
    lowest trailing median earlier in the run, for divergence_rows rows in a row (the spike detector's
    trailing window climbs along with a slow rise; this compares with the run's best level). Real CPU
    runs stay within 1.08 of their best."""
    decline_rel: float = 0.3
    """Slow decline: accuracy's trailing median below its highest earlier one by this fraction of it
    (and by at least cliff_min_drop), for divergence_rows rows in a row. Real CPU runs stay within 6%."""
    grad_norm_ratio: float = 10.0
    """Growing gradients: the grad_norm's trailing median (window_rows rows) above grad_norm_ratio times
    the lowest trailing median earlier in the run, for divergence_rows rows in a row (a NaN is its usual
    end; clipping bounds the update, not the norm logged). Single clipped outliers do not move a median."""
    divergence_rows: int = 50
    """Rows in a row a divergence or decline must last to be named (a spike still recovering, or a
    cliff not yet back, is that event's, and pauses the count)."""
    lr_zero_rows: int = 10
    """Rows in a row with lr 0 (not the end of a decay) that make an lr_zero event: no update applied."""
    input_bound_frac: float = 0.5
    """Input-bound: the mean data_wait_frac over window_rows rows (after warmup_rows) at or above this,
    the steps wait for their data that much of the time. Real CPU runs stay below 0.17."""
    whiplash_bound: float = 0.35
    """Loss whiplash: the upper quartile of |d - median(d)| over window_rows rows, d the step-to-step
    log-ratio of the loss (ln(loss_i / loss_i-1)), above this for whiplash_rows rows in a row: the loss
    jumps between levels from one row to the next (homogeneous, length-bucketed batches). 0.35 is a
    swing of x1.42 between consecutive rows; batches of 0.6x / 1x / 2x loss give 0.54-1.16, the noisy
    healthy test log (8% noise per row) 0.23 at most, real CPU runs 0.08 (docs/doctor.md)."""
    whiplash_rows: int = 25
    """Rows in a row the swing must stay above whiplash_bound to be named, and back under it to close
    (the quartile already spans window_rows rows: a few bad rows do not move it)."""
    learn_rows: int = 300
    """Not learning: after this many rows with lr > 0, the loss's lowest trailing median (window_rows
    rows) has never fallen learn_min_drop below its first one, nor accuracy's highest risen
    cliff_min_drop above its first. Judged only on logs that begin within learn_rows steps of the
    run's start (a slice of a late, flat stretch has nothing to say about it)."""
    learn_min_drop: float = 0.1
    """Not learning: the fraction of its first trailing median the loss must fall by at some point. By
    row 300 the healthy test logs' loss is at 0.30-0.40 of it and a real CPU run's at 0.44; a flat
    loss with 5% noise reaches 0.97 (docs/doctor.md)."""
    generalisation_k: float = 2.0
    """A held-out metric has turned when worse than its best by more than generalisation_k * the
    combined standard error sqrt(se_best^2 + se_now^2) (the rules are in generalisation.py)."""
    generalisation_sustain: int = 2
    """Consecutive evals, each worse than the best by that margin (or each passing the trend test)
    while training improved, that confirm a turn."""
    generalisation_min_rel: float = 0.05
    """A metric whose eval rows carry no `<metric>_se` (noise derived from the eval's size) must
    also be worse than its best by at least this fraction of it; so must the last eval of a trend."""
    generalisation_far_rel: float = 0.3
    """A held-out metric below its best by at least this fraction of it, which neither rule could judge
    (no noise known, too few evals since the best), is named under "cannot tell" even while another
    metric improves. On logs without noise whose held-out level jitters by 7.5% of itself per eval,
    0 of 200 logs reach it."""
    generalisation_trend_alpha: float = 0.002
    """The trend rule's test level: the evals since a metric's best fall with a one-sided Mann-Kendall
    p-value at most this (divided by k at the k-th test since the best), at generalisation_sustain
    consecutive evals (with 0.002: six evals after the best at least, seven to confirm)."""

    def validate(self) -> None:
        for key in (
            "window_rows",
            "min_history_rows",
            "sustain_rows",
            "generalisation_sustain",
            "divergence_rows",
            "lr_zero_rows",
            "whiplash_rows",
            "learn_rows",
        ):
            self.require(getattr(self, key) >= 1, key, "must be >= 1")
        self.require(self.min_history_rows <= self.window_rows, "min_history_rows", "must be <= window_rows")
        self.require(self.warmup_rows >= 0, "warmup_rows", "must be >= 0")
        self.require(self.whiplash_bound > 0, "whiplash_bound", "must be > 0")
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
        for key in ("spike_min_ratio", "stall_min_ratio", "step_gap_ratio", "divergence_ratio", "grad_norm_ratio"):
            self.require(getattr(self, key) > 1, key, "must be > 1")
        for key in (
            "cliff_min_rel",
            "throughput_min_rel",
            "generalisation_min_rel",
            "generalisation_trend_alpha",
            "generalisation_far_rel",
            "decline_rel",
            "input_bound_frac",
            "learn_min_drop",
        ):
            self.require(0 < getattr(self, key) < 1, key, "must be in (0, 1)")
