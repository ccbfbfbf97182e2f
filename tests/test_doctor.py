"""The training doctor: detectors, causes, the live path, the report.

    .venv/bin/python -m pytest tests/test_doctor.py -q

Every log here is built by the test: the failed run of BRIEF section 1 (no kind, no epoch, no event
rows, logged every 1-2 steps), and logs in our trainer's format with one planted trouble each.
Each test asserts the exact (kind, step) of every event found, so a missed event and a false
positive both fail.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from stage2_train.observe.config import DetectorConfig
from stage2_train.observe.detectors import LiveDetectors, as_warning, detect
from stage2_train.observe.doctor import diagnose, format_text
from stage2_train.observe.doctor import doctor as cmd_doctor
from stage2_train.observe.explain import describe
from stage2_train.observe.records import normalize
from stage2_train.observe.report import report as cmd_report


def found(diagnosis_or_events) -> list[tuple[str, int]]:
    events = diagnosis_or_events["events"] if isinstance(diagnosis_or_events, dict) else diagnosis_or_events
    return [(ev["kind"], ev["step"]) for ev in events]


def write_log(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def walk(rng: random.Random, start: int, end: int) -> list[int]:
    """Steps after `start` up to exactly `end`, 1 or 2 apart (the failed run's logging)."""
    steps, step = [], start
    while step < end:
        step = min(step + rng.choice((1, 2)), end)
        steps.append(step)
    return steps


# ---- the failed run (BRIEF section 1) ------------------------------------------------------------
def failed_run_records() -> list[dict]:
    """5 s/step logged every 1-2 steps; a 167.2 s stall 2000->2002 then loss 0.8 -> 13 with a slow
    recovery; an unlogged stretch 4001->4019 (112 s) then loss 0.7 -> 7.2; an accuracy cliff
    0.1606 -> 0.0916 -> 0.0371 -> 0.0356 -> ~0 from step 4230 with no stall."""
    rng = random.Random(0)
    steps = walk(rng, 0, 2000) + [2002, 2004] + walk(rng, 2004, 4001) + [4019, 4021]
    steps += walk(rng, 4021, 4229) + [4230, 4232, 4233] + walk(rng, 4233, 4600)
    cliff = {4229: 0.1606, 4230: 0.0916, 4232: 0.0371, 4233: 0.0356}
    records, elapsed, prev = [], 0.0, 0
    for step in steps:
        delta = step - prev
        took = {2002: 167.2, 4019: 112.0}.get(step, 5.0 * delta * rng.uniform(0.97, 1.03))
        elapsed += took
        loss = 0.65 + 0.25 * math.exp(-step / 3000) + 6 * math.exp(-step / 250)
        loss *= rng.uniform(0.95, 1.05)
        if step >= 2004:
            loss += 12.2 * math.exp(-(step - 2004) / 40)
        if step >= 4021:
            loss += 6.5 * math.exp(-(step - 4021) / 30)
        acc = 0.17 * (1 - math.exp(-step / 300)) * rng.uniform(0.97, 1.03)
        acc = cliff.get(step, acc if step < 4229 else rng.uniform(0.0, 0.004))
        lr = (
            6e-4
            * min(step / 200, 1.0)
            * (0.5 * (1 + math.cos(math.pi * max(step - 200, 0) / 4400)) if step > 200 else 1.0)
        )
        records.append(
            {
                "step": step,
                "loss": round(loss, 5),
                "accuracy": round(acc, 5),
                "avg_streak": round(acc * 2, 4),
                "lr": lr,
                "noise_std": 0.05,
                "tgt_batch_rate": 1.0,
                "dft_batch_rate": 1.0,
                "tok_per_sec": 26000.0 * 5.0 * delta / took,
                "hs_queue_depth": rng.randint(0, 4),
                "elapsed_s": round(elapsed, 3),
            }
        )
        prev = step
    return records


FAILED_RUN_EVENTS = [
    ("stall", 2002),
    ("loss_spike", 2004),
    ("step_gap", 4019),
    ("loss_spike", 4021),
    ("accuracy_cliff", 4230),
]


# ---- our trainer's format ------------------------------------------------------------------------
def trainer_records(
    num_steps: int,
    *,
    seed: int = 1,
    steps_per_epoch: int = 1000,
    save_every: int = 400,
    eval_every: int = 0,
    noise_warmup: int = 0,
    change=None,
) -> list[dict]:
    """Rows as MetricsSink writes them (kind, epoch, events), 0.5 s/step, logged every step.

    `change(step, row)` may edit a row (and its "dt") to plant trouble."""
    rng = random.Random(seed)
    records = [{"kind": "event", "event": "run_start", "step": 0, "time": 1e9}]
    elapsed = 0.0
    for step in range(1, num_steps + 1):
        epoch, step_in_epoch = divmod(step - 1, steps_per_epoch)
        if step_in_epoch == 0:
            records.append({"kind": "event", "event": "epoch_start", "step": step - 1, "epoch": epoch})
        lr = 6e-4 * min(step / 120, 1.0)
        row = {
            "kind": "train",
            "step": step,
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "loss": (1.0 + 5 * math.exp(-step / 150)) * rng.uniform(0.95, 1.05),
            "accuracy": 0.45 * (1 - math.exp(-step / 150)) + rng.gauss(0, 0.01),
            "accept_len": 1 + 3.0 * (1 - math.exp(-step / 150)) + rng.gauss(0, 0.05),
            "lr": lr,
            "noise_std": 0.05 * min(step / noise_warmup, 1.0) if noise_warmup else 0.05,
            "grad_norm": rng.uniform(0.5, 1.5),
            "tokens": 13000,
            "tok_per_s": 26000 * rng.uniform(0.95, 1.05),
            "data_wait_frac": rng.uniform(0.01, 0.05),
            "dt": 0.5 * rng.uniform(0.9, 1.1),
        }
        if change is not None:
            change(step, row)
        elapsed += row.pop("dt")
        row["elapsed_s"] = round(elapsed, 4)
        row["time"] = 1e9 + elapsed
        records.append(row)
        if eval_every and step % eval_every == 0:
            records.append(
                {
                    "kind": "eval",
                    "step": step,
                    "loss": row["loss"],
                    "accuracy": row["accuracy"],
                    "eval_s": 15.0,
                }
            )
            elapsed += 15.0
        if step_in_epoch == steps_per_epoch - 1:
            records.append({"kind": "event", "event": "epoch_end", "step": step, "epoch": epoch})
        if step % save_every == 0:
            records.append({"kind": "event", "event": "checkpoint_start", "step": step, "waited_s": 0.0})
            records.append(
                {
                    "kind": "event",
                    "event": "checkpoint_end",
                    "step": step,
                    "blocked_s": 0.05,
                    "write_s": 2.0,
                    "mode": "async",
                }
            )
            elapsed += 0.05
    return records


def noisy_healthy_records() -> list[dict]:
    """Heavy but healthy noise, slow first steps, evals, epoch boundaries, a crash and a resume."""
    rng = random.Random(7)

    def change(step, row):
        row["loss"] *= rng.lognormvariate(0, 0.08) * (1.5 if rng.random() < 0.02 else 1.0)
        row["accuracy"] += rng.gauss(0, 0.015) - (0.06 if rng.random() < 0.03 else 0.0)
        row["tok_per_s"] *= rng.lognormvariate(0, 0.05) * (0.6 if rng.random() < 0.03 else 1.0)
        row["dt"] *= rng.lognormvariate(0, 0.1) * (2.0 if rng.random() < 0.02 else 1.0)
        row["grad_norm"] *= rng.lognormvariate(0, 0.5)
        if step <= 3:
            row["dt"] = 20.0  # compilation and warm caches
        if step_in_epoch_start(step):
            row["accuracy"] -= 0.05  # one-row dip at each epoch boundary

    def step_in_epoch_start(step):
        return step > 1 and (step - 1) % 1000 == 0

    records = trainer_records(3000, seed=3, eval_every=500, noise_warmup=300, change=change)
    # A crash after step 1530 and a resume from the checkpoint at 1200 (save_every=400): the log
    # keeps steps 1201-1530 of the lost run, then replays them; the first step back is slow.
    cut = next(i for i, r in enumerate(records) if r.get("kind") == "train" and r["step"] == 1530) + 1
    saved = (
        next(i for i, r in enumerate(records) if r.get("event") == "checkpoint_end" and r["step"] == 1200) + 1
    )
    replay = [dict(r) for r in records[saved:]]
    for r in replay:
        if r["kind"] == "train":  # elapsed_s goes on from the checkpoint, 30 s later (slow first step)
            r["elapsed_s"] = round(r["elapsed_s"] + 30.0, 4)
    resume = [
        {"kind": "event", "event": "resume", "step": 1200, "path": "ckpt/step_001200"},
        {"kind": "event", "event": "run_start", "step": 1200},
    ]
    return records[:cut] + resume + replay


# ---- detectors and causes ------------------------------------------------------------------------
def test_failed_run_stall_then_slow_recovery():
    diagnosis = diagnose(failed_run_records())
    assert found(diagnosis) == FAILED_RUN_EVENTS
    events = {(ev["kind"], ev["step"]): ev for ev in diagnosis["events"]}
    stall = events["stall", 2002]
    assert stall["size"] == pytest.approx(167.2, abs=0.01) and stall["details"]["from_step"] == 2000
    assert stall["details"]["expected_s"] == pytest.approx(10.0, rel=0.05)
    assert "likely checkpoint save (no event rows in this log)" in stall["likely_cause"]
    assert "step 2000" in stall["likely_cause"]  # a round step: saves come every N steps
    gap = events["step_gap", 4019]
    assert gap["size"] == 18 and gap["details"]["gap_s"] == pytest.approx(112.0)
    assert "likely checkpoint save" in gap["likely_cause"]
    spike = events["loss_spike", 2004]
    assert spike["details"]["before"] == pytest.approx(0.78, abs=0.05) and spike["size"] > 14
    assert 150 <= spike["details"]["recovery_steps"] <= 230  # slow: exp(-t/40) back to within 15%
    assert (
        spike["likely_cause"].startswith("follows the stall at step 2002")
        and "likely a checkpoint save" in spike["likely_cause"]
    )
    second = events["loss_spike", 4021]
    assert second["size"] == pytest.approx(7.2 / 0.72, rel=0.15)
    assert second["likely_cause"].startswith("follows the step gap at step 4019")
    cliff = events["accuracy_cliff", 4230]
    assert cliff["details"]["first_value"] == 0.0916 and cliff["details"]["before"] == pytest.approx(
        0.165, abs=0.01
    )
    assert cliff["details"]["recovery_steps"] is None  # it never came back
    assert cliff["likely_cause"] == (
        "no logged cause in steps 4210-4232 (no save, resume, stall, epoch boundary or schedule change); "
        "this log cannot tell epoch boundaries, checkpoint saves and resumes"
    )


def test_a_new_logging_interval_is_not_a_step_gap_at_every_row():
    """A log written every 10 steps to step 1,000, then every 100 (a resume with another
    log.every_steps; a peer's run resumed in wandb, with no event): each row after the change was a
    step gap, 50 events on a healthy run. A step gap is now confirmed by the next row's delta; the
    failed run's lost stretch 4001 -> 4019, followed by the usual 2 steps, is still one."""
    rows = [r for r in trainer_records(6000) if r["kind"] == "train"]
    every = [r for r in rows if r["step"] % (10 if r["step"] <= 1000 else 100) == 0]
    assert found(diagnose(every)) == []
    resumed = [*every[:100], {"kind": "event", "event": "run_start", "step": 1000}, *every[100:]]
    assert found(diagnose(resumed)) == []
    gap = next(ev for ev in diagnose(failed_run_records())["events"] if ev["kind"] == "step_gap")
    assert (gap["step"], gap["details"]["from_step"], gap["details"]["confirmed_step"]) == (4019, 4001, 4021)


def test_log_without_event_rows_or_epoch_says_what_it_cannot_tell():
    records = failed_run_records()
    assert all("kind" not in r and "epoch" not in r for r in records)
    summary = diagnose(records)["summary"]
    blind = [c.split(":")[0] for c in summary["cannot_tell"]]
    assert blind == [
        "epoch boundaries",
        "checkpoint saves and resumes",
        "non-finite gradients",
        "data-loader starvation",
        "overfitting",  # no held-out eval rows
    ]
    assert summary["epochs"] is None and summary["steps"] == [2, 4600] and summary["event_rows"] == 0
    assert summary["log_every_steps"] in (1, 2) and summary["sec_per_step"] == pytest.approx(5.0, rel=0.05)
    assert summary["final"].keys() == {"loss", "accuracy"}  # no accept_len in that log


def test_noisy_but_healthy_run_reports_nothing():
    records = noisy_healthy_records()
    diagnosis = diagnose(records)
    assert found(diagnosis) == []
    assert diagnosis["summary"]["healthy"] and diagnosis["summary"]["cannot_tell"] == []
    assert diagnosis["summary"]["epochs"] == [0, 2]


def test_cliff_without_stall():
    def change(step, row):
        if step >= 1500:
            row["accuracy"] = 0.05 + (row["accuracy"] - 0.45)
            row["loss"] *= 1.3

    diagnosis = diagnose(trainer_records(2500, change=change))
    assert found(diagnosis) == [("accuracy_cliff", 1500)]
    cliff = diagnosis["events"][0]
    assert cliff["size"] == pytest.approx(0.40, abs=0.02) and cliff["details"]["confirmed_step"] == 1504
    assert cliff["likely_cause"].startswith("no logged cause in steps 1490-1501")
    assert [p["what"] for p in cliff["near"]] == []


def test_epoch_boundary_drop_names_the_epoch():
    def change(step, row):
        if 1001 <= step <= 1020:
            row["accuracy"] -= 0.23  # dips when epoch 1 starts (steps 1000 done), then comes back

    diagnosis = diagnose(trainer_records(1600, save_every=300, change=change))
    assert found(diagnosis) == [("accuracy_cliff", 1001)]
    cliff = diagnosis["events"][0]
    assert cliff["likely_cause"] == "epoch 1 began at step 1000"
    assert cliff["details"]["recovery_steps"] == 20


def test_nan_and_the_cliff_it_causes():
    def change(step, row):
        if step >= 850:
            row.update(loss="nan", grad_norm="inf", accuracy=0.0, accept_len=1.0)  # as MetricsSink writes them

    diagnosis = diagnose(trainer_records(1000, change=change))
    assert found(diagnosis) == [("nan", 850), ("accuracy_cliff", 850)]
    nan, cliff = diagnosis["events"]
    assert nan["details"]["fields"] == {"loss": "nan", "grad_norm": "inf"} and nan["size"] is None
    assert cliff["likely_cause"] == "non-finite loss=nan, grad_norm=inf at step 850"
    assert diagnosis["summary"]["final"]["loss"] == "nan"


def test_throughput_drop_from_a_starved_loader():
    def change(step, row):
        if step >= 1200:
            row["tok_per_s"] *= 11 / 26
            row["dt"] *= 26 / 11  # slower steps, but a new pace rather than a stall
            row["data_wait_frac"] = 0.6

    diagnosis = diagnose(trainer_records(1600, change=change))
    assert found(diagnosis) == [("throughput_drop", 1200)]
    drop = diagnosis["events"][0]
    assert drop["size"] == pytest.approx(1 - 11 / 26, abs=0.03)
    # A save at step 1200 too, but the loader's waiting says more.
    assert drop["likely_cause"] == "data loader starved: data_wait_frac 0.03 -> 0.60 (also near: checkpoint)"


def test_spike_at_the_end_of_noise_warmup_and_a_blocking_save():
    def change(step, row):
        if step in (402, 403):
            row["loss"] *= 3.0
        if step == 901:
            row["dt"] = 40.0  # the save at step 900 blocked the loop
        if step == 1205:
            row["loss"] *= 4.0

    records = trainer_records(1400, noise_warmup=400, save_every=300, change=change)
    for r in records:  # the save at 900 was synchronous
        if r.get("event") == "checkpoint_end" and r["step"] == 900:
            r.update(blocked_s=39.5, mode="sync")
    diagnosis = diagnose(records)
    assert found(diagnosis) == [("loss_spike", 402), ("stall", 901), ("loss_spike", 1205)]
    noise, stall, after_save = diagnosis["events"]
    assert noise["likely_cause"] == "noise_std warmup ended at step 400 (noise_std 0.05)"
    assert noise["details"]["recovery_steps"] == 2
    assert stall["likely_cause"] == "checkpoint save at step 900 (blocked 39.5 s, write 2.0 s, sync)"
    assert after_save["likely_cause"].startswith("follows the checkpoint save at step 1200")


# ---- levels: wrong however smooth the curve -------------------------------------------------------
def lr_zero_records() -> list[dict]:
    """lr 0 at every step (a warmup longer than the run, lr 0 in the config): the loss stays flat."""
    return trainer_records(600, change=lambda step, row: row.update(lr=0.0, loss=6.0 * (1 + 0.01 * math.sin(step))))


def diverging_records() -> list[dict]:
    """From step 500 the loss climbs (x2 by step 800, x3.3 by 1200) and accuracy falls to 0 by step
    1100, each a little per step: no row stands out from the trailing window before it."""

    def change(step, row):
        if step > 500:
            row["loss"] *= 1 + (step - 500) / 300
            row["accuracy"] -= 0.45 * min(1.0, (step - 500) / 600)

    return trainer_records(1200, change=change)


def input_bound_records() -> list[dict]:
    """The loader waits 80% of every step, from the first: no drop, the run is slow all along."""
    return trainer_records(600, change=lambda step, row: row.update(data_wait_frac=0.8 + 0.1 * math.sin(step)))


def test_lr_at_zero_is_named_and_a_decay_into_zero_is_not(tmp_path):
    start = {
        "kind": "event",
        "event": "run_start",
        "step": 0,
        "hyperparameters": {"optim.lr": 6e-4, "warmup_steps": 120, "total_steps": 600},
    }
    diagnosis = diagnose([start, *lr_zero_records()])
    assert found(diagnosis) == [("lr_zero", 1)]
    ev = diagnosis["events"][0]
    assert ev["details"] == {"lr": 0.0, "peak_before": None, "confirmed_step": 10, "to_step": 600}
    assert ev["likely_cause"] == (
        "the optimizer applies no update at lr 0, the weights do not change: run_start records optim.lr 0.0006, "
        "warmup 120 of 600 steps, so the logged lr is not the schedule's: a scheduler never stepped, or a param "
        "group with lr 0"
    )
    write_log(tmp_path / "train_log.jsonl", lr_zero_records())
    text, code = cmd_doctor(tmp_path, as_json=False)
    assert code == 1 and "  lr 0 at steps 1-600: no update applied" in text
    assert text.splitlines()[-1].startswith("1 event(s): 1 lr_zero")
    # An lr that drops to 0 in one row mid-run is named, from the row it dropped.
    dropped = diagnose(trainer_records(600, change=lambda step, row: row.update(lr=0.0) if step > 300 else None))
    assert found(dropped) == [("lr_zero", 301)] and dropped["events"][0]["details"]["peak_before"] == 6e-4
    # A schedule that decays into 0 and stays there for its last 50 steps is the schedule's end.
    def decay(step, row):
        if step > 400:
            row["lr"] = max(0.0, 6e-4 * (1 - (step - 400) / 150))

    assert found(diagnose(trainer_records(600, change=decay))) == []


def test_an_lr_schedule_that_ends_long_before_the_run_is_named():
    """A cosine over 1,000 steps of a 3,000-step run (total steps set for one epoch of three): lr 0 for
    the last 2,000 steps, no update applied. Taken for a schedule's end (it decayed into 0), it was
    called healthy; it is named once the zero stretch outlasts the decay from the peak (880 rows).
    The same cosine over the whole run, its lr rounded to 6 decimals (its last rows written as 0),
    is still a schedule's end."""

    def cosine(end, digits=None):
        def change(step, row):
            lr = 6e-4 * min(step / 120, 1.0) * 0.5 * (1 + math.cos(math.pi * min(max(step - 120, 0) / (end - 120), 1.0)))
            row["lr"] = lr if digits is None else round(lr, digits)

        return change

    diagnosis = diagnose(trainer_records(3000, change=cosine(1000)))
    assert found(diagnosis) == [("lr_zero", 1000)]
    ev = diagnosis["events"][0]
    assert ev["details"] == {
        "lr": 0.0, "peak_before": 6e-4, "confirmed_step": 1879, "to_step": 3000, "decay_rows": 879,
    }
    assert "the schedule ended long before the run" in ev["likely_cause"]
    assert found(diagnose(trainer_records(3000, change=cosine(3000, digits=6)))) == []


def test_a_slow_divergence_and_decline_are_named():
    """The spike and cliff detectors compare each row with a trailing window that climbs along with
    the loss: they see nothing here. The trailing median against the run's best level does."""
    diagnosis = diagnose(diverging_records())
    assert found(diagnosis) == [("accuracy_decline", 713), ("loss_divergence", 749)]
    decline, divergence = diagnosis["events"]
    assert divergence["size"] == pytest.approx(1.61, abs=0.01)
    d = divergence["details"]
    assert (d["best_step"], d["confirmed_step"], d["last_step"], d["window_rows"]) == (513, 798, 1200, 50)
    assert d["best"] == pytest.approx(1.21, abs=0.01) and d["threshold"] == pytest.approx(1.5 * d["best"], abs=1e-5)
    assert d["last"] == pytest.approx(3.26, abs=0.01) and d["recovery_steps"] is None
    assert divergence["likely_cause"].startswith(
        "the training loss left its best level (steps up to 513) and stayed there: usually an lr too high"
    )
    assert decline["size"] == pytest.approx(0.433 - 0.266, abs=0.002) and decline["details"]["best_step"] == 512
    assert describe(divergence) == (
        "loss diverging from step 749: median of 50 rows 1.21 at best (step 513) -> 1.96 (x1.61) at step 798, "
        "3.26 at step 1200, never back"
    )
    # The thresholds are the detectors section's.
    assert found(diagnose(diverging_records(), DetectorConfig(divergence_ratio=4.0))) == [("accuracy_decline", 713)]
    assert found(diagnose(diverging_records(), DetectorConfig(divergence_rows=500))) == []  # lasts ~450 rows
    with pytest.raises(ValueError, match="detectors.divergence_ratio must be > 1"):
        DetectorConfig(divergence_ratio=1.0)
    with pytest.raises(ValueError, match="detectors.decline_rel must be in"):
        DetectorConfig(decline_rel=0.0)


def test_a_level_that_closes_must_last_its_rows_again_before_it_is_named_again():
    """A level event (loss_divergence, accuracy_decline, grad_norm_growth) kept the run of rows that
    opened it after it closed: a median hovering at its threshold (one row back under it, the next over)
    named a new event on that one row, with the first event's start step. A new event now needs
    divergence_rows rows of its own."""
    from stage2_train.observe.levels import Level

    cfg = DetectorConfig(window_rows=1, min_history_rows=1, divergence_rows=3, divergence_ratio=10.0)
    growth = Level(cfg, "grad_norm_growth", bad_is_up=True, ratio=cfg.divergence_ratio)
    norms = [1.0] * 3 + [20.0] * 4 + [5.0] + [20.0] * 4  # over 10x the lowest, once back under it, over again
    events = [ev for step, norm in enumerate(norms, 1) if (ev := growth.update(step, norm, False))]
    assert [(ev["step"], ev["details"]["confirmed_step"]) for ev in events] == [(4, 6), (9, 11)]


def test_growing_gradients_are_named_before_the_nan():
    """The gradient norm grows 30x from step 600 while the loss has barely moved (clipping bounds the
    update): no spike, cliff or NaN yet, and the doctor called it healthy. Its trailing median against
    its lowest names it; the noisy healthy log (grad_norm x lognormal(0, 0.5)) stays healthy."""

    def change(step, row):
        if step > 600:
            row["grad_norm"] *= 30
            row["loss"] *= 1.1

    diagnosis = diagnose(trainer_records(1200, change=change))
    assert found(diagnosis) == [("grad_norm_growth", 625)]
    ev = diagnosis["events"][0]
    d = ev["details"]
    assert ev["size"] > 10 and d["best"] == pytest.approx(0.9, abs=0.1) and d["recovery_steps"] is None
    assert d["best_step"] < 625 < d["confirmed_step"] and d["last_step"] == 1200
    assert ev["likely_cause"].startswith("the gradient norm left its lowest level")
    assert describe(ev).startswith("grad_norm growing from step 625: median of 50 rows")
    assert found(diagnose(trainer_records(1200, change=change), DetectorConfig(grad_norm_ratio=40.0))) == []
    assert found(diagnose(noisy_healthy_records())) == []


def resumed_records(jump: float) -> list[dict]:
    """A resume at step 800 (no steps redone) whose loss comes back x(1 + jump), fading over ~20 steps:
    under the spike detector's 2.5x, too short for a divergence. An exact resume shows nothing."""
    out = []
    for r in trainer_records(1200):
        if r.get("kind") == "train" and r["step"] == 801:
            out.append({"kind": "event", "event": "resume", "step": 800, "path": "ckpt/step_000800"})
        if r.get("kind") == "train" and r["step"] > 800:
            r = {**r, "loss": r["loss"] * (1 + jump * math.exp(-(r["step"] - 800) / 20))}
        out.append(r)
    return out


def test_a_loss_that_jumps_after_a_resume_is_named():
    diagnosis = diagnose(resumed_records(1.0))
    assert found(diagnosis) == [("resume_jump", 801)]
    ev = diagnosis["events"][0]
    d = ev["details"]
    assert (d["resumed_at"], d["rows"], d["confirmed_step"]) == (800, 5, 805)
    assert d["before"] == pytest.approx(1.02, abs=0.05) and ev["size"] == pytest.approx(1.9, abs=0.1)
    assert ev["likely_cause"].startswith("the run does not continue where it stopped at step 800")
    assert describe(ev).startswith("loss jump after the resume at step 800: 1.0")
    assert diagnose(resumed_records(1.0))["summary"]["verdict"] == "events"
    assert found(diagnose(resumed_records(0.0))) == []
    # Live: a trainer restores the detectors' state at a resume, and the first rows are held against it.
    records = resumed_records(1.0)
    cut = next(i for i, r in enumerate(records) if r.get("event") == "resume")
    live = LiveDetectors()
    for r in records[:cut]:
        live.update(r)
    restored = LiveDetectors()
    restored.load_state_dict(json.loads(json.dumps(live.state_dict())))
    assert found([ev for r in records[cut + 1 :] for ev in restored.update(r)]) == [("resume_jump", 801)]


def noise_warmup_resume_records(jump: float = 0.0) -> list[dict]:
    """noise.warmup_steps=30 and a resume at step 25 (no steps redone) that continues exactly. The loss
    grows with the noise's square (x1.5 at full noise): flat at first, steep at the ramp's end, so the
    25 rows before the resume sit at less noise than the 5 after. `jump` plants a real one at step 801."""
    records = trainer_records(1200, noise_warmup=30)
    out = []
    for r in records:
        if r.get("kind") == "train":
            r = {**r, "loss": r["loss"] * (1 + 0.5 * (r["noise_std"] / 0.05) ** 2)}
            if r["step"] > 800:
                r["loss"] *= 1 + jump * math.exp(-(r["step"] - 800) / 20)
            if r["step"] in (26, 801):
                out.append({"kind": "event", "event": "resume", "step": r["step"] - 1})
        out.append(r)
    return out


def test_a_resume_inside_the_noise_warmup_is_not_a_jump():
    """The loss after the resume is x1.21 the level before it, all of it the schedule's: the resume
    check named it resume_jump. It compares only rows at one noise level; past the warmup it still does."""
    assert found(diagnose(noise_warmup_resume_records())) == []
    assert found(diagnose(noise_warmup_resume_records(jump=1.0))) == [("resume_jump", 801)]
    # Live, through the checkpoint saved at the resume; one from before the noise window was kept
    # (no level before) still sees the noise move over the rows after.
    records = noise_warmup_resume_records()
    cut = next(i for i, r in enumerate(records) if r.get("event") == "resume")
    live = LiveDetectors()
    for r in records[:cut]:
        live.update(r)
    for drop in (False, True):
        state = json.loads(json.dumps(live.state_dict()))
        assert len(state["noise_std"]) == 25
        if drop:
            del state["noise_std"]
        restored = LiveDetectors()
        restored.load_state_dict(state)
        assert found([ev for r in records[cut + 1 :] for ev in restored.update(r)]) == []
    # An old state still names a real jump where the noise is constant.
    records = resumed_records(1.0)
    cut = next(i for i, r in enumerate(records) if r.get("event") == "resume")
    live = LiveDetectors()
    for r in records[:cut]:
        live.update(r)
    state = json.loads(json.dumps(live.state_dict()))
    del state["noise_std"]
    restored = LiveDetectors()
    restored.load_state_dict(state)
    assert found([ev for r in records[cut + 1 :] for ev in restored.update(r)]) == [("resume_jump", 801)]


def test_an_input_bound_loader_is_named_with_the_fix():
    diagnosis = diagnose(input_bound_records())
    assert found(diagnosis) == [("input_bound", 11)]  # the first row after warmup_rows
    ev = diagnosis["events"][0]
    assert ev["size"] == pytest.approx(0.80, abs=0.005)
    assert {k: ev["details"][k] for k in ("rows", "threshold", "confirmed_step", "to_step", "recovery_steps")} == {
        "rows": 50,
        "threshold": 0.5,
        "confirmed_step": 60,
        "to_step": 600,
        "recovery_steps": None,
    }
    assert ev["likely_cause"].startswith(
        "the loader cannot keep up: the steps wait for data 80% of their time; more loader threads "
        "(train.num_data_threads), a deeper prefetch (train.prefetch_micro_batches)"
    )
    # A loader that waits 30% of each step is below the bar; the bar is detectors.input_bound_frac.
    waiting = trainer_records(600, change=lambda step, row: row.update(data_wait_frac=0.3))
    assert found(diagnose(waiting)) == []
    assert found(diagnose(waiting, DetectorConfig(input_bound_frac=0.25))) == [("input_bound", 11)]


def test_every_rank_appending_to_one_log_is_read_as_one_rank():
    """8 ranks each wrote every train row: read as they are, one spike is one event per rank and every
    step "goes back" 7 times. With a rank field, and without (the same step 8 times in a row)."""

    def change(step, row):
        if 301 <= step <= 305:
            row["loss"] *= 4.0

    one = trainer_records(600, change=change)
    by_rank = [{**r, "rank": rank} for r in one for rank in (range(8) if r["kind"] == "train" else [None])]
    by_rank = [{k: v for k, v in r.items() if v is not None} for r in by_rank]
    unnamed = [{k: v for k, v in r.items() if k != "rank"} for r in by_rank]
    for records, note in (
        (by_rank, "8 ranks wrote their train rows (their rank field): read rank 0's only"),
        (unnamed, "every train step comes 8 times in a row (one row per rank, or its metrics in several rows): read as one row per step"),
    ):
        diagnosis = diagnose(records)
        assert found(diagnosis) == found(diagnose(one)) == [("loss_spike", 301)]
        s = diagnosis["summary"]
        assert s["ranks"] == note and s["restarts"] == [] and s["train_rows"] == 600
        assert f"\n  {note}\n" in format_text(diagnosis, "train_log.jsonl")
    assert diagnose(one)["summary"]["ranks"] is None


# ---- the live path -------------------------------------------------------------------------------
def nan_records() -> list[dict]:
    return trainer_records(1000, change=lambda step, row: row.update(loss="nan") if step >= 800 else None)


@pytest.mark.parametrize(
    "build",
    [failed_run_records, noisy_healthy_records, nan_records, lr_zero_records, diverging_records, input_bound_records],
)
def test_live_detectors_fire_on_the_same_rows_as_the_offline_pass(build):
    records = build()
    offline = detect(records)
    live, fired = LiveDetectors(), []
    for i, record in enumerate(records):
        for ev in live.update(record):
            assert ev["details"].get("confirmed_step", ev["step"]) == normalize(record)["step"]  # at once
            fired.append(ev)
            warning = as_warning(ev)
            assert warning["detector"] == ev["kind"] and "step" not in warning and json.dumps(warning)
        if i % 97 == 0:  # a checkpoint and a restore: the history goes through JSON
            state = json.loads(json.dumps(live.state_dict(), allow_nan=False))
            live = LiveDetectors()
            live.load_state_dict(state, resumed=False)
    assert [(e["kind"], e["step"], e["size"]) for e in fired] == [
        (e["kind"], e["step"], e["size"]) for e in offline
    ]
    assert bool(fired) == (build is not noisy_healthy_records)


def test_a_detector_state_from_before_the_level_detectors_resumes():
    """A checkpoint's detector state without the level detectors' keys starts them afresh: the lr at 0
    is still named, counted from the resume."""
    records = lr_zero_records()
    live = LiveDetectors()
    for r in records[:100]:
        live.update(r)
    state = live.state_dict()
    for key in ("divergence", "grad_growth", "decline", "lr_zero", "input_bound"):
        del state[key]
    restored = LiveDetectors()
    restored.load_state_dict(json.loads(json.dumps(state)))
    fired = [ev for r in records[100:] for ev in restored.update(r)]
    first = next(r["step"] for r in records[100:] if r["kind"] == "train")
    assert found(fired) == [("lr_zero", first)] and restored.state_dict()["lr_zero"]["open"] is not None


def test_a_resume_on_a_slower_machine_is_not_a_stall_at_every_row():
    """Resumed at step 1,000 on a machine 4x slower: its throughput window was another machine's and
    cleared, its seconds per step were not, and each of its next 29 rows was a stall (exit 1 on a
    healthy run). Offline (the resume event) and live (a restored state) alike."""

    def slower(step, row):
        if step > 1000:
            row["dt"] *= 4
            row["tok_per_s"] /= 4

    records = trainer_records(2000, change=slower)
    at = next(i for i, r in enumerate(records) if r["kind"] == "train" and r["step"] == 1001)
    records.insert(at, {"kind": "event", "event": "resume", "step": 1000})
    assert found(diagnose(records)) == []
    live = LiveDetectors()
    for r in records[:at]:
        live.update(r)
    restored = LiveDetectors()
    restored.load_state_dict(json.loads(json.dumps(live.state_dict())))
    # Live, the restored throughput window was the old machine's: a drop the doctor did not name.
    assert [ev for r in records[at + 1 :] for ev in restored.update(r)] == []


def test_resume_warms_the_pace_up_again():
    records = [r for r in trainer_records(500) if r["kind"] == "train"]
    slow = dict(records[-1], step=501, elapsed_s=records[-1]["elapsed_s"] + 30.0)
    for resumed, expected in ((True, []), (False, [("stall", 501)])):
        live = LiveDetectors()
        for r in records:
            assert live.update(r) == []
        restored = LiveDetectors()
        restored.load_state_dict(live.state_dict(), resumed=resumed)
        assert found(restored.update(slow)) == expected
    with pytest.raises(ValueError, match="unknown version"):
        LiveDetectors().load_state_dict({"version": 9})
    with pytest.raises(ValueError, match="detectors.min_history_rows must be <= window_rows"):
        DetectorConfig(min_history_rows=80)


# ---- the commands --------------------------------------------------------------------------------
def test_cmd_doctor_text_json_and_exit_codes(tmp_path):
    write_log(tmp_path / "train_log.jsonl", failed_run_records())
    with (tmp_path / "train_log.jsonl").open("a") as f:
        f.write('{"step": 4601, "loss": 0.7')  # a torn last line
    text, code = cmd_doctor(tmp_path, as_json=False)  # a run directory works too
    assert code == 1
    assert (
        "stall at step 2002: 167.2 s since step 2000" in text
        and "likely cause: likely checkpoint save" in text
    )
    assert "cannot tell:" in text and text.splitlines()[-1].startswith("5 event(s): 1 stall, 2 loss_spike")
    out, code = cmd_doctor(tmp_path / "train_log.jsonl", as_json=True)
    diagnosis = json.loads(out)
    assert code == 1 and found(diagnosis) == FAILED_RUN_EVENTS
    assert set(diagnosis["events"][0]) == {"kind", "step", "size", "details", "likely_cause", "near"}
    assert diagnosis["summary"]["unreadable_lines"] == 1
    write_log(tmp_path / "healthy.jsonl", noisy_healthy_records())
    text, code = cmd_doctor(tmp_path / "healthy.jsonl", as_json=False)
    assert code == 0 and text.splitlines()[-1].startswith("healthy: no events")
    with pytest.raises(FileNotFoundError):
        cmd_doctor(tmp_path / "missing.jsonl", as_json=False)


def test_cmd_report_writes_pngs_and_markdown(tmp_path):
    log = tmp_path / "run" / "train_log.jsonl"
    log.parent.mkdir()
    write_log(log, failed_run_records())
    out = cmd_report(log, None)
    folder = tmp_path / "run" / "doctor"
    names = ["overview", "events", "loss", "accuracy", "lr", "noise_std", "throughput"]
    assert out["out_dir"] == str(folder) and out["not_in_log"] == ["accept_len"]
    assert out["plots"] == [str(folder / f"{n}.png") for n in names] and out["num_events"] == 5
    for name in names:
        data = (folder / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    md = (folder / "report.md").read_text()
    for name in names:
        assert f"![{name}]({name}.png)" in md
    for kind, step in FAILED_RUN_EVENTS:
        assert f"| {step} | {kind} |" in md
    assert "Not in this log, so not plotted: accept_len." in md and "## What this log cannot tell" in md


def test_report_draws_and_lists_the_level_events(tmp_path):
    records = diverging_records()
    for r in records:
        if r["kind"] == "train":
            r.update(data_wait_frac=0.9, lr=0.0 if r["step"] > 1100 else r["lr"])
    log = tmp_path / "run" / "train_log.jsonl"
    log.parent.mkdir()
    write_log(log, records)
    out = cmd_report(log, None)
    kinds = [("input_bound", 11), ("accuracy_decline", 713), ("loss_divergence", 749), ("lr_zero", 1101)]
    assert out["num_events"] == 4 and str(tmp_path / "run" / "doctor" / "events.png") in out["plots"]
    md = (tmp_path / "run" / "doctor" / "report.md").read_text()
    for kind, step in kinds:
        assert f"| {step} | {kind} |" in md


def test_departures_from_the_recipe_are_listed_beside_the_events(tmp_path):
    """The failed run's gamma 4.0 for block size 16 was a setting nobody saw: the run_start row
    carries every departure and the doctor prints the last run's."""
    gamma = "loss.gamma=4 departs from the recipe: 7 for model.block_size=16"
    start = {"kind": "event", "event": "run_start", "step": 0, "hyperparameters": {"recipe_warnings": [gamma]}}
    write_log(tmp_path / "train_log.jsonl", [start, *noisy_healthy_records()])
    text, code = cmd_doctor(tmp_path, as_json=False)
    assert code == 0 and f"departures from the published recipe (run_start):\n  {gamma}" in text
    assert diagnose([start, *noisy_healthy_records()])["summary"]["recipe_departures"] == [gamma]
    assert diagnose(noisy_healthy_records())["summary"]["recipe_departures"] == []


def test_report_panels_read_at_a_glance():
    """Loss on a log scale (step 1's ~80 would flatten the rest), integer step ticks, epoch lines
    thinned on a short run of many epochs, and two held-out series on one panel side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stage2_train.observe.report import MAX_EPOCH_LINES, draw_panel

    train = [{"step": s, "loss": 80.0 if s == 1 else 2.0 - s / 100, "accept_len": 1.0 + s / 100} for s in range(1, 41)]
    evals = [{"step": s, "accept_len": 1.2, "walk_tau": 1.2, "accept_len_se": None, "walk_tau_se": None} for s in (10, 20, 30, 40)]
    context = [{"step": s, "what": "epoch"} for s in range(1, 41)]  # 40 epochs in 40 steps
    fig, (loss_ax, accept_ax) = plt.subplots(2, 1)
    draw_panel(loss_ax, ("loss", "loss", "loss"), [{**r, "accept_len": None} for r in train], [], [], context)
    assert loss_ax.get_yscale() == "log"
    assert loss_ax.xaxis.get_major_locator()._integer
    epoch_lines = [line for line in loss_ax.get_lines() if line.get_linestyle() == "--"]
    assert 0 < len(epoch_lines) <= MAX_EPOCH_LINES
    draw_panel(accept_ax, ("accept_len", "accept_len", "accept_len"), [{**r, "loss": None} for r in train], evals, [], [])
    series = [line for line in accept_ax.get_lines() if line.get_label().startswith("held-out")]
    assert len(series) == 2 and all(a != b for a, b in zip(series[0].get_xdata(), series[1].get_xdata()))
    plt.close(fig)


def test_the_doctor_reads_a_variants_own_heads():
    """A DSpark run whose confidence head over-predicts, a DFlash2 run whose selector loses to its own
    argmax: each said with its numbers; a DFlash run's log says nothing of either."""
    rows = trainer_records(60)
    dspark = [{**r, "confidence_pred_mean": 0.62, "accept_rate": 0.41, "confidence_abs_error": 0.25} if r.get("kind") == "train" else r for r in rows]
    dflash2 = [{**r, "selector_accuracy": 0.30, "unary_top1_accuracy": 0.34, "candidate_recall": 0.9} if r.get("kind") == "train" else r for r in rows]
    assert diagnose(rows)["summary"]["variant_heads"] == []
    (note,) = diagnose(dspark)["summary"]["variant_heads"]
    assert note.startswith("dspark confidence head: predicts 0.620 per slot where the top-k overlap is 0.410 (mean |error| 0.250)")
    assert "miscalibrated" in note
    (note,) = diagnose(dflash2)["summary"]["variant_heads"]
    assert "selector: picks the target's top-1 on 0.300 of slots, the unary argmax on 0.340 (lift -0.040)" in note
    assert "loses to the argmax" in note
    calibrated = [{**r, "accept_rate": 0.6} for r in dspark]
    assert "miscalibrated" not in diagnose(calibrated)["summary"]["variant_heads"][0]
