"""The training doctor: every stall, spike, cliff, NaN, slowdown and held-out turn (overfitting) of a
run, with its likely cause.

    python -m stage2_train doctor runs/default/train_log.jsonl          # text; exit 1 with events, else 0
    python -m stage2_train doctor runs/default/train_log.jsonl --json   # {"events": [...], "summary": {...}}

`diagnose(records)` runs the detectors of `detectors.py` over the log, then explains each event
from what the log says happened near it: a checkpoint save, a resume, an eval, an epoch boundary
(epoch field or epoch events), a stall, a non-finite loss, an lr or noise schedule change (warmup
ending, a jump), a starved data loader. A generalisation event (held-out quality turning while
training improves) gets the advice against memorising, and the epoch boundaries near the turn.
Each event gets `likely_cause` (one string) and `near` (everything found in its window). Logs
of other trainers work too: kind is inferred, field aliases are read, and what the log cannot tell
is listed in `summary.cannot_tell` (overfitting, without two held-out evals or more); a log without
event rows has its stalls taken for probable checkpoint saves. `summary.heldout` gives the best and
last held-out values. `diagnose(records, source=path)` names the log in its errors.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from shared.errors import DataError, InputFileError
from stage2_train.observe.config import DetectorConfig
from stage2_train.observe.detectors import LiveDetectors
from stage2_train.observe.explain import context_points, describe, explain
from stage2_train.observe.metrics import read_records
from stage2_train.observe.records import finite, normalize


def resolve_log(path: Path) -> Path:
    path = Path(path)
    if path.is_dir():
        path = path / "train_log.jsonl"
    if not path.is_file():
        raise InputFileError(f"no training log at {path}")
    return path


# ---- the whole log -------------------------------------------------------------------------------
def cannot_tell(
    train: list[dict[str, Any]], has_events: bool, has_epoch_events: bool, cfg: DetectorConfig, num_evals: int = 0
) -> list[str]:
    def present(field: str) -> bool:
        return any(r[field] is not None for r in train)

    out = []
    needed = cfg.warmup_rows + cfg.min_history_rows + 1
    if len(train) < needed:
        out.append(
            f"most events: only {len(train)} train rows, and the detectors judge a row only after "
            f"{cfg.min_history_rows} earlier ones ({needed - 1} for stalls and throughput)"
        )
    if not present("epoch") and not has_epoch_events:
        out.append("epoch boundaries: no epoch field and no epoch events")
    if not has_events:
        out.append("checkpoint saves and resumes: no event rows (stalls are taken for probable saves)")
    for field, what in (
        ("t", "stalls: no elapsed_s or time field"),
        ("loss", "loss spikes: no loss field"),
        ("accuracy", "accuracy cliffs: no accuracy field"),
        ("tok_per_s", "throughput drops: no tok_per_s field"),
        ("grad_norm", "non-finite gradients: no grad_norm field"),
        ("lr", "lr schedule changes: no lr field"),
        ("noise_std", "noise schedule changes: no noise_std field"),
        ("data_wait_frac", "data-loader starvation: no data_wait_frac field"),
    ):
        if not present(field):
            out.append(what)
    if num_evals == 0:
        out.append("overfitting: no held-out eval rows")
    elif num_evals == 1:
        out.append("overfitting: only one held-out evaluation, a curve needs several")
    return out


def diagnose(
    records: list[dict[str, Any]], cfg: DetectorConfig | None = None, source: str | Path | None = None
) -> dict[str, Any]:
    """{"events": [...], "summary": {...}} for the records of one log, in file order; `source` (the
    log's path) names the log in errors."""
    cfg = cfg or DetectorConfig()
    rows = [(normalize(r), r) for r in records]
    train = [r for r, _ in rows if r["kind"] == "train" and r["step"] is not None]
    if not train:
        where = f"{source}: " if source is not None else ""
        raise DataError(f"{where}the log has no train rows with a step: nothing to diagnose")
    evals = [r for r, _ in rows if r["kind"] == "eval" and r["step"] is not None]
    event_rows = [(r, raw) for r, raw in rows if r["kind"] == "event"]
    has_events = any(r["event"] != "warning" for r, _ in event_rows)
    has_epoch_events = any(str(r["event"]).startswith("epoch") for r, _ in event_rows)
    deltas = [b["step"] - a["step"] for a, b in zip(train, train[1:]) if b["step"] > a["step"]]
    interval = int(statistics.median(deltas)) if deltas else 1
    pace = [
        (b["t"] - a["t"]) / (b["step"] - a["step"])
        for a, b in zip(train, train[1:])
        if b["step"] > a["step"] and finite(a["t"]) and finite(b["t"]) and b["t"] >= a["t"]
    ]
    info = {
        "interval": interval,
        "has_events": has_events,
        "cannot_tell": cannot_tell(train, has_events, has_epoch_events, cfg, len(evals)),
        "data_wait": {},
    }
    live = LiveDetectors(cfg)
    events = [dict(ev) for record in records for ev in live.update(record)]
    undecided = live.generalisation.undecided()
    info["cannot_tell"] += [f"overfitting: {why}" for why in undecided]
    for ev in events:
        if ev["kind"] == "throughput_drop":
            info["data_wait"][ev["step"]] = data_wait_note(train, ev)
    points = context_points(rows, train)
    for ev in events:
        ev["likely_cause"], ev["near"] = explain(ev, points, events, info)
    counts: dict[str, int] = {}
    for ev in events:
        counts[ev["kind"]] = counts.get(ev["kind"], 0) + 1
    last = train[-1]
    epochs = [r["epoch"] for r in train if r["epoch"] is not None]
    summary = {
        "verdict": "events" if events else ("cannot tell" if undecided else "healthy"),
        "healthy": not events and not undecided,
        "num_events": len(events),
        "events_by_kind": counts,
        "rows": len(records),
        "train_rows": len(train),
        "eval_rows": sum(1 for r, _ in rows if r["kind"] == "eval"),
        "event_rows": len(event_rows),
        "live_warnings": sum(1 for r, _ in event_rows if r["event"] == "warning"),
        "steps": [train[0]["step"], last["step"]],
        "log_every_steps": interval,
        "sec_per_step": round(statistics.median(pace), 4) if pace else None,
        "epochs": [min(epochs), max(epochs)] if epochs else None,
        "restarts": restarts(rows),
        "final": {
            k: last[k] if math.isfinite(last[k]) else str(last[k])
            for k in ("loss", "accuracy", "accept_len")
            if last[k] is not None
        },
        "heldout": heldout_summary(evals),
        "cannot_tell": info["cannot_tell"],
        "recipe_departures": recipe_departures(event_rows),
    }
    return {"events": events, "summary": summary}


def heldout_summary(evals: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The held-out evals at a glance: the best of each metric (value, step) and the last eval's."""
    if not evals:
        return None
    best, final = {}, {}
    for name, higher in (("walk_tau", True), ("accept_len", True), ("accuracy", True), ("ce", False)):
        series = [(r[name], r["step"]) for r in evals if finite(r[name])]
        if series:
            value, step = (max if higher else min)(series, key=lambda vs: vs[0])
            best[name] = {"value": value, "step": step}
        if finite(evals[-1][name]):
            final[name] = evals[-1][name]
    return {"evals": len(evals), "best": best, "final": final, "final_step": evals[-1]["step"]}


def recipe_departures(event_rows: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[str]:
    """The last run_start's departures from the published recipe (a gamma or betas that differ from
    the paper's is a setting to see beside the curve, not an event)."""
    found: list[str] = []
    for row, raw in event_rows:
        if row["event"] == "run_start":
            hyper = raw.get("hyperparameters")
            if isinstance(hyper, dict):
                found = [str(w) for w in (hyper.get("recipe_warnings") or [])]
    return found


def restarts(rows: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every place where the logged train steps go back (a run restarted from an older checkpoint,
    or two runs writing one log): the steps redone are trained twice, and the curve doubles back."""
    out, last, resumed_to = [], None, None
    for row, _ in rows:
        if row["kind"] == "event" and row["event"] in ("resume", "run_start"):
            resumed_to = row["step"]
        if row["kind"] != "train" or row["step"] is None:
            continue
        if last is not None and row["step"] <= last:
            out.append({"from_step": last, "to_step": row["step"], "with_resume_event": resumed_to is not None})
        last, resumed_to = row["step"], None
    return out


def data_wait_note(train: list[dict[str, Any]], ev: dict[str, Any]) -> str | None:
    """'data loader starved ...' when the waiting fraction rose with the drop."""
    before = [r["data_wait_frac"] for r in train if r["step"] < ev["step"] and finite(r["data_wait_frac"])][
        -20:
    ]
    after = [
        r["data_wait_frac"]
        for r in train
        if ev["step"] <= r["step"] <= ev["details"]["confirmed_step"] and finite(r["data_wait_frac"])
    ]
    if not before or not after:
        return None
    b, a = statistics.median(before), statistics.median(after)
    if a > 0.2 and a > 2 * b:
        return f"data loader starved: data_wait_frac {b:.2f} -> {a:.2f}"
    return None


def format_text(diagnosis: dict[str, Any], log_path: Path) -> str:
    s = diagnosis["summary"]
    pace = f", {s['sec_per_step']:.3g} s/step" if s["sec_per_step"] is not None else ""
    lines = [
        f"{log_path}: {s['train_rows']} train rows, steps {s['steps'][0]}-{s['steps'][1]}, "
        f"logged every {s['log_every_steps']} step(s){pace}; {s['event_rows']} event rows"
    ]
    for ev in diagnosis["events"]:
        lines.append(f"  {describe(ev)}")
        lines.append(f"      likely cause: {ev['likely_cause']}")
    for back in s["restarts"]:
        how = "after a resume/run_start event" if back["with_resume_event"] else "with no resume event (two runs in one log?)"
        lines.append(f"  steps went back from {back['from_step']} to {back['to_step']} {how}")
    if s.get("unreadable_lines"):
        lines.append(
            f"  {s['unreadable_lines']} unreadable line(s) skipped (torn or not UTF-8: a crash mid-write leaves one)"
        )
    if s.get("recipe_departures"):
        lines.append("departures from the published recipe (run_start):")
        lines += [f"  {w}" for w in s["recipe_departures"]]
    if s["cannot_tell"]:
        lines.append("cannot tell:")
        lines += [f"  {c}" for c in s["cannot_tell"]]
    final = ", ".join(
        f"{k} {v:.4g}" for k, v in s["final"].items() if isinstance(v, float) and math.isfinite(v)
    )
    if s.get("heldout") and s["heldout"]["final"]:
        final += "; held-out " + ", ".join(f"{k} {v:.4g}" for k, v in s["heldout"]["final"].items())
    if s["verdict"] == "events":
        verdict = f"{s['num_events']} event(s): " + ", ".join(f"{n} {k}" for k, n in s["events_by_kind"].items())
    elif s["verdict"] == "cannot tell":
        verdict = "no events, but cannot tell overfitting (see above)"
    else:
        verdict = "healthy: no events"
    lines.append(f"{verdict}" + (f" (final {final})" if final else ""))
    return "\n".join(lines)


def doctor(log_path: Path, as_json: bool, cfg: DetectorConfig | None = None) -> tuple[str, int]:
    """(text to print, exit code): 0 when the log shows no event (healthy, or overfitting it cannot
    tell), 1 when it shows any. The thresholds are the `detectors` section's, the same the trainer's
    live detectors use.

    `log_path` may be a run directory (its train_log.jsonl is read)."""
    path = resolve_log(log_path)
    records, unreadable = read_records(path)
    diagnosis = diagnose(records, cfg, source=path)
    diagnosis["summary"]["unreadable_lines"] = unreadable
    diagnosis["summary"]["log"] = str(path)
    code = 1 if diagnosis["summary"]["num_events"] else 0
    if as_json:
        return json.dumps(diagnosis, indent=1, allow_nan=False, default=str), code
    return format_text(diagnosis, path), code
