"""The log held against the schedule its own run_start records: every logged `lr` and `noise_std` of
a train row is the configured schedule's at that step, or an event says where it is not and which
mistake fits (a scheduler stepped once per micro-batch, one restarted at a resume, a noise warmup that
is a no-op: the failed run's, which no curve shape shows).

    events, note = off_schedule(rows, expected_at)     # rows: (normalized, raw) in file order

`expected_at(hyperparameters)` comes from the caller (`stage2_train/train/curves.py` through
`commands.py`: this room imports no trainer); it returns a step -> {"lr", "noise_std"} function or
None for a record without the schedule. Each run_start judges the rows after it (a resumed run's
steps by the run that logged them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stage2_train.observe.records import finite, make_event

Expected = Callable[[int], dict[str, float]]
REL_TOL = 1e-3  # logged floats are the scheduler's own: any real mistake is far larger
MIN_FIT_ROWS = 3  # a mistake is named only when its curve matches this many off rows (one row fits many by chance)


def close(logged: float, want: float) -> bool:
    return abs(logged - want) <= REL_TOL * max(abs(want), 1e-12)


def off_schedule(
    rows: list[tuple[dict[str, Any], dict[str, Any]]], expected_at: Callable[[dict[str, Any]], Expected | None]
) -> tuple[list[dict[str, Any]], str | None]:
    """(one event per field and stretch of consecutive train rows off the schedule, a cannot-tell
    note when rows log an lr but no run_start records the schedule to hold it against)."""
    expected: Expected | None = None
    hyper: dict[str, Any] = {}
    restart = 0  # the step of the last run_start or resume: a scheduler restarted there counts from it
    open_: dict[str, dict[str, Any] | None] = {"lr": None, "noise_std": None}
    events: list[dict[str, Any]] = []
    unjudged = 0
    for row, raw in rows:
        if row["kind"] == "event" and row["event"] in ("run_start", "resume"):
            restart = row["step"] or 0
            if row["event"] == "run_start" and isinstance(raw.get("hyperparameters"), dict):
                hyper = raw["hyperparameters"]
                expected = expected_at(hyper)
                open_ = dict.fromkeys(open_)  # a stretch off the old run's schedule ends with it
            continue
        if row["kind"] != "train" or row["step"] is None:
            continue
        step = int(row["step"])
        if expected is None:
            unjudged += finite(row["lr"])
            continue
        want = expected(step)
        for field in open_:
            logged = row[field]
            if field not in want or not finite(logged):
                continue
            if close(logged, want[field]):
                open_[field] = None
                continue
            if open_[field] is None:
                ev = make_event(f"{field.split('_')[0]}_off_schedule", step, None, field=field, logged=logged,
                                expected=want[field], to_step=step, rows=0, fits=[], schedule=schedule_text(hyper, field))
                ev["details"]["_tests"] = hypotheses(field, hyper, expected, restart)
                events.append(ev)
                open_[field] = ev
            d = open_[field]["details"]
            d["to_step"], d["rows"] = step, d["rows"] + 1
            d["_tests"] = {name: test for name, test in d["_tests"].items() if close(logged, test(step))}
    for ev in events:
        fits = list(ev["details"].pop("_tests"))
        ev["details"]["fits"] = fits if ev["details"]["rows"] >= MIN_FIT_ROWS else []
    note = None
    if unjudged:
        note = (f"lr against its configured schedule: {unjudged} rows log an lr but no run_start records the schedule "
                "(another trainer's log, or an older one)")
    return events, note


def hypotheses(field: str, hyper: dict[str, Any], base: Expected, restart: int) -> dict[str, Callable[[int], float]]:
    """Mistakes whose curve the logged values may follow (`base`: the run's schedule), each as step ->
    the value it would log."""
    tests: dict[str, Callable[[int], float]] = {}
    if field == "lr":
        accum = hyper.get("grad_accum")
        if isinstance(accum, int) and accum > 1:
            tests[f"the scheduler stepped once per micro-batch (x{accum}: train.grad_accum), not once per optimizer step"] = (
                lambda s: base((s - 1) * accum + 1)["lr"])
        ranks = hyper.get("world_size")
        if isinstance(ranks, int) and ranks > 1:
            tests[f"the scheduler stepped once per rank (x{ranks}: a scheduler handed to Accelerate's prepare steps on "
                  "every process)"] = lambda s: base((s - 1) * ranks + 1)["lr"]
        if restart > 0:
            tests[f"the schedule restarted from its warmup at the resume from step {restart} (the scheduler's state "
                  "was not restored)"] = lambda s: base(s - restart)["lr"]
        tests["the lr logged is the next step's (logged after the scheduler stepped)"] = lambda s: base(s + 1)["lr"]
    else:
        std = hyper.get("noise.std")
        if isinstance(std, (int, float)) and hyper.get("noise.warmup_steps"):
            tests[f"the noise warmup is a no-op: std {std:g} from the first step, not warmed up over "
                  f"{hyper['noise.warmup_steps']} steps"] = lambda s: float(std)
        if restart > 0:
            tests[f"the noise warmup restarted at the resume from step {restart}"] = lambda s: base(s - restart).get("noise_std", -1.0)
    return tests


def schedule_text(hyper: dict[str, Any], field: str) -> str:
    if field == "lr":
        return (f"optim.lr {hyper.get('optim.lr')}, {hyper.get('optim.schedule')}, warmup {hyper.get('warmup_steps')} "
                f"of {hyper.get('total_steps')} steps, min_lr_ratio {hyper.get('optim.min_lr_ratio')}")
    return f"noise.std {hyper.get('noise.std')}, warmup {hyper.get('noise.warmup_steps')} steps"


def schedule_cause(ev: dict[str, Any]) -> str:
    d = ev["details"]
    if d["fits"]:
        return f"the logged {d['field']} follows this mistake's curve: {d['fits'][0]}"
    what = "optimizer updates" if d["field"] == "lr" else "feature noise"
    return (f"the {what} are not the ones the run's config asks for (run_start: {d['schedule']}): a scheduler stepped "
            "elsewhere, or total steps that changed since run_start")


def describe_off_schedule(ev: dict[str, Any]) -> str:
    d = ev["details"]
    span = f"steps {ev['step']}-{d['to_step']}" if d["to_step"] != ev["step"] else f"step {ev['step']}"
    return (f"{d['field']} off its schedule at {span} ({d['rows']} rows): {d['logged']:.4g} logged at step {ev['step']}, "
            f"{d['expected']:.4g} expected ({d['schedule']})")
