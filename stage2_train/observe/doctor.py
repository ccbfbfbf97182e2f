"""The training doctor: every stall, spike, cliff, NaN, slowdown and held-out turn (overfitting) of a
run, and every level that is wrong however smooth the curve (a slow loss divergence or accuracy
decline, lr at 0, an input-bound loader), with its likely cause, from any trainer's log.

    python -m stage2_train doctor runs/default                 # text; exit 1 with events, 3 cannot tell, else 0
    python -m stage2_train doctor runs/default --json          # {"events": [...], "summary": {...}}
    python -m stage2_train doctor wandb/offline-run-...        # a wandb run; a TensorBoard folder; a CSV

`doctor(path)` reads the log (`sources.load_log`: this project's JSONL, a wandb run, a TensorBoard
folder, CSV or JSONL history exports, other trainers' metric names mapped by `peers.py`), then
`diagnose(records)` runs the detectors (`detectors.py`, `generalisation.py`) and explains each event
from what the log says happened near it (`explain.py`). Each event gets `likely_cause` (one string)
and `near` (everything found in its window). What the log cannot tell is listed in
`summary.cannot_tell`: each detector whose input the log lacks, and each held-out metric that fell
far from its best where no rule could judge it, or every undecided one when no metric could be
judged, and steps that go back with no resume event (two runs in one log?); either makes
`summary.verdict` "cannot tell", not "healthy" (`summary.undecided` says which).
`summary.read_as` names the log's own metric behind each detector input; `summary.heldout` gives
the best and last held-out values. `diagnose(records, source=path)` names the log in its errors.
A log that every rank of a run appended to (rows with several `rank` values, or each step's train
row repeated as many times in a row) is read as one rank's, and `summary.ranks` says so.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.errors import DataError
from stage2_train.observe.config import DetectorConfig
from stage2_train.observe.detectors import LiveDetectors
from stage2_train.observe.explain import context_points, describe, explain
from stage2_train.observe.records import finite, normalize, number, record_kind
from stage2_train.observe.schedule_check import Expected, off_schedule
from stage2_train.observe.sources import load_log

CANNOT_TELL_EXIT = 3  # 2 is argparse's usage error


# ---- the whole log -------------------------------------------------------------------------------
def one_rank(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None]:
    """(the rows of one rank, a note) when several ranks appended their train rows to one log, else
    (records, None). Rows with a `rank` field: the lowest rank's (rows without one are kept). Without
    it: train steps that each come k >= 2 times in a row (the last may be cut short by a crash) are
    read as one row each, each field's first value (a log that writes each step's metrics in several
    rows loses none). Read as they are, each rank's row is another judgement of the same step: one
    spike becomes one event per rank, and every step "goes back" k - 1 times."""
    kinds = [record_kind(r) for r in records]
    ranks = {r["rank"] for r, kind in zip(records, kinds) if kind == "train" and isinstance(r.get("rank"), int)}
    if len(ranks) > 1:
        keep = min(ranks)
        kept = [r for r in records if not isinstance(r.get("rank"), int) or r["rank"] == keep]
        return kept, f"{len(ranks)} ranks wrote their train rows (their rank field): read rank {keep}'s only"
    steps = [(i, normalize(r)["step"]) for i, (r, kind) in enumerate(zip(records, kinds)) if kind == "train"]
    runs: list[list[int]] = []  # record indices of consecutive train rows of one step
    for (i, step), prev in zip(steps, [None, *steps]):
        if prev is not None and step is not None and step == prev[1]:
            runs[-1].append(i)
        else:
            runs.append([i])
    k = len(runs[0]) if runs else 1
    if k < 2 or len(runs) < 3 or any(len(run) != k for run in runs[:-1]) or len(runs[-1]) > k:
        return records, None
    merged: dict[int, dict[str, Any]] = {}  # first record index of a run -> its rows, first values kept
    for run in runs:
        merged[run[0]] = {key: value for i in reversed(run) for key, value in records[i].items()}
    repeats = {i for run in runs for i in run[1:]}
    kept = [merged.get(i, r) for i, r in enumerate(records) if i not in repeats]
    return kept, f"every train step comes {k} times in a row (one row per rank, or its metrics in several rows): read as one row per step"


def cannot_tell(
    train: list[dict[str, Any]], has_events: bool, has_epoch_events: bool, cfg: DetectorConfig, num_evals: int = 0
) -> list[str]:
    def present(fields: str) -> bool:
        return any(r[f] is not None for r in train for f in fields.split())

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
        ("t", "stalls: no clock (elapsed_s or time; wandb's _runtime, TensorBoard's wall time)"),
        ("loss", "loss spikes: no loss field"),
        ("accuracy", "accuracy cliffs: no accuracy field"),
        ("tok_per_s samples_per_s", "throughput drops: no tokens/s (or samples/s) field"),
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
    records: list[dict[str, Any]], cfg: DetectorConfig | None = None, source: str | Path | None = None,
    schedule: Callable[[dict[str, Any]], Expected | None] | None = None,
) -> dict[str, Any]:
    """{"events": [...], "summary": {...}} for the records of one log, in file order; `source` (the
    log's path) names the log in errors; `schedule` (run_start's hyperparameters -> the lr and noise
    each step should log: `train/curves.expected_at`) holds the log against its own config."""
    cfg = cfg or DetectorConfig()
    records, ranks = one_rank(records)
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
    untimed = sum(1 for r in evals if not finite(r["eval_s"]))
    info = {
        "interval": interval,
        "has_events": has_events,
        "cannot_tell": cannot_tell(train, has_events, has_epoch_events, cfg, len(evals)),
        "data_wait": {},
        "schedule": run_start_hyperparameters(event_rows),
    }
    if untimed and any(finite(r["t"]) for r in train):
        info["cannot_tell"].append(
            f"stalls at evals: {untimed} eval row(s) without eval_s, so the gap that holds each eval is not judged"
        )
    live = LiveDetectors(cfg)
    events = [dict(ev) for record in records for ev in live.update(record)]
    undecided = live.generalisation.undecided()
    info["cannot_tell"] += [f"overfitting: {why}" for why in undecided]
    if schedule is not None:
        off, note = off_schedule(rows, schedule)
        events = sorted(events + off, key=lambda ev: ev["step"])
        info["cannot_tell"] += [note] if note else []
    for ev in events:
        if ev["kind"] == "throughput_drop":
            info["data_wait"][ev["step"]] = data_wait_note(train, ev)
    points = context_points(rows, train)
    for ev in events:
        ev["likely_cause"], ev["near"] = explain(ev, points, events, info)
    back = restarts(rows)
    # Steps that go back with no resume or run_start before them: two runs appending to one log, or a
    # resume nobody logged. Every curve after it may be another run's, so no verdict can vouch for it.
    unlogged = [b for b in back if not b["with_resume_event"]]
    info["cannot_tell"] += [
        f"one run or two: steps went back from {b['from_step']} to {b['to_step']} with no resume or run_start "
        "event (two runs writing one log, or a resume not logged); the curves after it may be another run's"
        for b in unlogged
    ]
    undecided_about = (["overfitting"] if undecided else []) + (["one run from two"] if unlogged else [])
    counts: dict[str, int] = {}
    for ev in events:
        counts[ev["kind"]] = counts.get(ev["kind"], 0) + 1
    last = train[-1]
    epochs = [r["epoch"] for r in train if r["epoch"] is not None]
    summary = {
        "verdict": "events" if events else ("cannot tell" if undecided_about else "healthy"),
        "healthy": not events and not undecided_about,
        "undecided": undecided_about,
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
        "restarts": back,
        "ranks": ranks,
        "final": {
            k: last[k] if math.isfinite(last[k]) else str(last[k])
            for k in ("loss", "accuracy", "accept_len")
            if last[k] is not None
        },
        "heldout": heldout_summary(evals),
        "variant_heads": variant_heads([raw for r, raw in rows if r["kind"] == "train" and r["step"] is not None]),
        "cannot_tell": info["cannot_tell"],
        "recipe_departures": recipe_departures(event_rows),
        "metric_notes": candidate_note(train),
    }
    return {"events": events, "summary": summary}


def candidate_note(train: list[dict[str, Any]]) -> list[str]:
    """Why train accuracy and loss are not set against held-out ones, when the run scored drafts over candidates."""
    slots = next((r["full_vocab_slots"] for r in reversed(train) if finite(r["full_vocab_slots"])), None)
    if slots is None:
        return []
    return [f"train accuracy and loss score the drafts past slot {int(slots)} among the target's stored top-k only "
            f"(loss.full_vocab_slots={int(slots)}): upper bounds of the full-vocabulary figures the held-out evals give, "
            f"so no train/held-out gap is read from them"]


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


def variant_heads(train_raw: list[dict[str, Any]], last: int = 20) -> list[str]:
    """What a DSpark or DFlash2 run's own metrics say over its last `last` train rows (medians): whether
    the confidence head predicts the acceptance it is trained on (eval.confidence_stop stops on its
    numbers), and whether the selector picks the target's token more often than the unary argmax."""

    def level(name: str) -> float | None:
        values = sorted(v for r in train_raw[-last:] if finite(v := number(r.get(name))))
        return values[len(values) // 2] if values else None

    notes = []
    predicted, rate, error = level("confidence_pred_mean"), level("accept_rate"), level("confidence_abs_error")
    if predicted is not None and rate is not None:
        note = (f"dspark confidence head: predicts {predicted:.3f} per slot where the top-k overlap is {rate:.3f} "
                f"(mean |error| {error if error is not None else float('nan'):.3f})")
        if abs(predicted - rate) > 0.1:
            note += "; miscalibrated by more than 0.1: an early stop (eval.confidence_stop) would cut on wrong numbers"
        notes.append(note)
    selector, unary, recall = level("selector_accuracy"), level("unary_top1_accuracy"), level("candidate_recall")
    if selector is not None and unary is not None:
        note = (f"dflash2 selector: picks the target's top-1 on {selector:.3f} of slots, the unary argmax on {unary:.3f} "
                f"(lift {selector - unary:+.3f}); the top-1 is among the candidates on {recall if recall is not None else float('nan'):.3f}")
        if selector < unary - 0.01:
            note += "; the selector loses to the argmax it reranks: train longer, or lower loss.selector_weight"
        notes.append(note)
    return notes


def run_start_hyperparameters(event_rows: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """The last run_start's `hyperparameters` (optim.lr, warmup_steps, total_steps, recipe_warnings...)."""
    found: dict[str, Any] = {}
    for row, raw in event_rows:
        if row["event"] == "run_start" and isinstance(raw.get("hyperparameters"), dict):
            found = raw["hyperparameters"]
    return found


def recipe_departures(event_rows: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[str]:
    """The last run_start's departures from the published recipe (a gamma or betas that differ from
    the paper's is a setting to see beside the curve, not an event)."""
    return [str(w) for w in (run_start_hyperparameters(event_rows).get("recipe_warnings") or [])]


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
    if s.get("read_as"):
        lines.append(f"read as ({s['format']}): " + "; ".join(f"{k} <- {', '.join(v)}" for k, v in s["read_as"].items()))
    lines += [f"  {note}" for note in s.get("reader_notes", []) + s.get("metric_notes", [])]
    if s.get("ranks"):
        lines.append(f"  {s['ranks']}")
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
    if s.get("variant_heads"):
        lines.append("the variant's heads (last rows):")
        lines += [f"  {note}" for note in s["variant_heads"]]
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
        verdict = f"no events, but cannot tell {' or '.join(s['undecided'])} (see above)"
    else:
        verdict = "healthy: no events"
    lines.append(f"{verdict}" + (f" (final {final})" if final else ""))
    return "\n".join(lines)


def doctor(
    log_path: Path, as_json: bool, cfg: DetectorConfig | None = None,
    schedule: Callable[[dict[str, Any]], Expected | None] | None = None,
) -> tuple[str, int]:
    """(text to print, exit code): 0 healthy, 1 when the log shows any event, 3 when it shows none but
    cannot tell (a held-out metric fell far from its best where no rule could judge it, or the steps go
    back with no resume event: two runs in one log): a script that
    gates on the doctor does not read that as healthy. The thresholds are the `detectors` section's, the same the trainer's
    live detectors use.

    `log_path` is anything `sources.load_log` reads: a run directory, a JSONL or CSV file, a wandb
    run, a TensorBoard folder."""
    log = load_log(log_path)
    diagnosis = diagnose(log.records, cfg, source=log.path, schedule=schedule)
    summary = diagnosis["summary"]
    summary.update(log=str(log.path), format=log.kind, unreadable_lines=log.unreadable, read_as=log.names)
    summary["reader_notes"] = log.notes
    code = 1 if summary["num_events"] else (CANNOT_TELL_EXIT if summary["verdict"] == "cannot tell" else 0)
    if as_json:
        return json.dumps(diagnosis, indent=1, allow_nan=False, default=str), code
    return format_text(diagnosis, log.path), code
