"""The doctor on curves with no single bad row: a loss that whips between levels from row to row
(homogeneous batches), a run that never learns, and a log that holds two runs. Each was called
healthy, exit 0, before its check.

    .venv/bin/python -m pytest tests/test_doctor_shapes.py -q

Logs are built by the test in our trainer's format (`tests/test_doctor.trainer_records`); each test
asserts the exact (kind, step) of every event found.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from stage2_train.observe.config import DetectorConfig
from stage2_train.observe.detectors import LiveDetectors, detect
from stage2_train.observe.doctor import diagnose
from stage2_train.observe.doctor import doctor as cmd_doctor
from stage2_train.observe.explain import describe
from stage2_train.observe.report import report as cmd_report
from tests.test_doctor import found, noisy_healthy_records, trainer_records, write_log

BUCKETS = ((0.6, 120.0), (1.0, 600.0), (2.0, 3000.0))  # (loss factor, mean sample length) per length bucket


def whiplash_records(start: int = 400, buckets=BUCKETS) -> list[dict]:
    """From step `start` (400), every step's batch is one length bucket, drawn at random: the loss is
    0.6x, 1x or 2x its level (BRIEF section 1's trimodal step loss), the step's mean sample length
    120, 600 or 3,000 tokens. No row is a spike (2x < spike_min_ratio), the median does not move."""
    rng = random.Random(11)

    def change(step, row):
        factor, length = rng.choice(buckets) if step > start else (1.0, 600.0)
        row["loss"] *= factor
        row["samples"] = max(1, round(row["tokens"] / (length * rng.uniform(0.9, 1.1))))

    return trainer_records(1200, change=change)


def test_a_whiplash_that_closes_must_last_its_rows_again_before_it_is_named_again():
    """The run of rows that opened a whiplash outlived it: once closed, the next row above the bound
    named a second event at once, with the first one's start step (two events at step 9 here, the
    second confirmed on its first bad row). A new event now needs whiplash_rows rows of its own."""
    from stage2_train.observe.oscillation import Whiplash

    cfg = DetectorConfig(window_rows=8, min_history_rows=4, whiplash_rows=3)
    whiplash = Whiplash(cfg)
    swinging = [1.0 if i % 2 else 2.0 for i in range(12)]
    levels = swinging + [1.0] * 6 + swinging  # the calm rows close it; the row after them swings again
    events = [ev for step, loss in enumerate(levels, 1) if (ev := whiplash.update(step, loss, None, False))]
    assert [(ev["step"], ev["details"]["confirmed_step"]) for ev in events] == [(9, 11), (21, 23)]


def flat_records(num_steps: int = 1000) -> list[dict]:
    """Loss 6.0 and accuracy 0.01 for the whole run, at the usual lr (warmup to 6e-4), 5% noise."""
    rng = random.Random(5)
    return trainer_records(
        num_steps,
        change=lambda step, row: row.update(loss=6.0 * rng.lognormvariate(0, 0.05), accuracy=0.01 + rng.gauss(0, 0.003)),
    )


def two_runs_records() -> list[dict]:
    """Two runs appending to one log: a second run's rows from step 150 follow the first's to 300,
    with no resume or run_start event between them."""
    first = [r for r in trainer_records(300) if r["kind"] == "train"]
    second = [r for r in trainer_records(300, seed=2) if r["kind"] == "train" and r["step"] > 150]
    return first + second


# ---- loss whiplash -------------------------------------------------------------------------------
def test_a_loss_that_whips_between_levels_is_named_with_the_batches_lengths(tmp_path):
    diagnosis = diagnose(whiplash_records())
    assert found(diagnosis) == [("loss_whiplash", 420)]
    ev = diagnosis["events"][0]
    d = ev["details"]
    assert 0.5 < d["swing"] < 1.2 and ev["size"] == pytest.approx(math.exp(d["swing"]), abs=1e-3)
    assert (d["bound"], d["confirmed_step"], d["last_step"], d["recovery_steps"]) == (0.35, 444, 1200, None)
    assert d["mean_len_p10"] < 150 and d["mean_len_p90"] > 2500 and d["len_loss_rho"] > 0.8
    assert ev["likely_cause"].startswith("the loss jumps between levels from one row to the next")
    assert "homogeneous batches" in ev["likely_cause"] and "loss follows it (rank correlation +0." in ev["likely_cause"]
    assert describe(ev).startswith("loss whiplash from step 420: the loss swings x2.16 row to row")
    text, code = cmd_doctor(write_to(tmp_path, whiplash_records()), as_json=False)
    assert code == 1 and text.splitlines()[-1].startswith("1 event(s): 1 loss_whiplash")
    # Without length fields (the failed run's log) the cause still names the batches.
    bare = [{k: v for k, v in r.items() if k != "samples"} for r in whiplash_records()]
    (ev,) = diagnose(bare)["events"]
    assert ev["details"]["len_loss_rho"] is None and "mean sample length" not in ev["likely_cause"]
    # Swings the batch lengths do not explain (mixed batches, a loss that is mostly noise step to step):
    # the cause names small steps, not homogeneous batches.
    rng = random.Random(3)
    noise = whiplash_records(buckets=((1.0, 600.0),))
    noise = [{**r, "loss": r["loss"] * rng.choice((0.6, 1.0, 2.0))} if r["kind"] == "train" and r["step"] > 400 else r for r in noise]
    (ev,) = diagnose(noise)["events"]
    assert abs(ev["details"]["len_loss_rho"]) < 0.3 and "more likely steps so small" in ev["likely_cause"]
    # Two buckets close together (0.9x / 1.1x) swing less than the bound; the bound is detectors.whiplash_bound.
    mild = whiplash_records(buckets=((0.9, 500.0), (1.1, 700.0)))
    assert found(diagnose(mild)) == []
    assert found(diagnose(whiplash_records(), DetectorConfig(whiplash_bound=1.5))) == []
    with pytest.raises(ValueError, match="detectors.whiplash_bound must be > 0"):
        DetectorConfig(whiplash_bound=0.0)


def test_healthy_logs_are_far_from_the_whiplash_bound():
    """The noisy healthy log (8% lognormal noise per row, 2% of rows x1.5, a resume) swings 0.229 at
    most, 0.14 typically; the bound is 0.35."""
    live = LiveDetectors()
    swings = []
    for r in noisy_healthy_records():
        assert live.update(r) == []
        if len(live.whiplash.swings) == live.cfg.window_rows:
            swings.append(live.whiplash.swing())
    assert max(swings) < 0.7 * live.cfg.whiplash_bound


def write_to(tmp_path, records):
    write_log(tmp_path / "train_log.jsonl", records)
    return tmp_path / "train_log.jsonl"


# ---- a run that never learns ---------------------------------------------------------------------
def test_a_run_that_never_learns_is_named_with_its_causes(tmp_path):
    start = {"kind": "event", "event": "run_start", "step": 0, "hyperparameters": {"optim.lr": 6e-4}}
    diagnosis = diagnose([start, *flat_records()])
    assert found(diagnosis) == [("not_learning", 1)]
    ev = diagnosis["events"][0]
    d = ev["details"]
    assert (d["first_step"], d["rows"], d["confirmed_step"], d["recovery_steps"]) == (50, 300, 300, None)
    assert d["first_loss"] == pytest.approx(6.0, rel=0.02) and d["best_loss"] > 0.95 * d["first_loss"]
    assert d["best_accuracy"] < 0.02 and d["peak_lr"] == 6e-4
    assert ev["likely_cause"].startswith("in 300 rows at lr up to 0.0006 the loss never fell 10% below its first level")
    assert "optim.lr 0.0006 in run_start" in ev["likely_cause"] and "frozen" in ev["likely_cause"]
    assert "wrong loss mask" in ev["likely_cause"] and "init_from" not in ev["likely_cause"]
    # init_from weights that start at accuracy 0.01 were no trained drafter for this data: still named, and the cause says so
    warm = {**start, "hyperparameters": {"optim.lr": 6e-4, "init_from": "runs/a/checkpoints/best"}}
    assert "starts from model.init_from runs/a/checkpoints/best, yet" in diagnose([warm, *flat_records()])["events"][0]["likely_cause"]
    assert describe(ev).startswith("not learning from step 1: the loss's median of 50 rows 5.98 at first, 5.83 at its lowest, after 300 rows")
    text, code = cmd_doctor(write_to(tmp_path, flat_records()), as_json=False)
    assert code == 1 and text.splitlines()[-1].startswith("1 event(s): 1 not_learning")


def test_learning_runs_short_logs_and_late_slices_are_not_called_not_learning():
    assert found(diagnose(flat_records(250))) == []  # under learn_rows: too early to say
    # A loss that falls 15% by row 300 has learned (slowly); one that falls 1% has not.
    def slow(drop):
        rng = random.Random(5)
        return trainer_records(1000, change=lambda step, row: row.update(
            loss=6.0 * (1 - drop * step / 1000) * rng.lognormvariate(0, 0.05), accuracy=0.01))

    assert found(diagnose(slow(0.5))) == []
    assert found(diagnose(slow(0.02))) == [("not_learning", 1)]
    # Accuracy that rises while the loss does not fall (a loss dominated by an unlearnable term) is learning.
    rising = [{**r, "accuracy": 0.01 + 0.3 * r["step"] / 1000} if r["kind"] == "train" else r for r in flat_records()]
    assert found(diagnose(rising)) == []
    # A slice of a long run's flat stretch (its first row at step 5,001) is not judged.
    late = [{**r, "step": r["step"] + 5000} for r in flat_records() if r["kind"] == "train"]
    assert found(diagnose(late)) == []
    # lr 0 is lr_zero's: its rows are not counted here.
    assert found(diagnose([{**r, "lr": 0.0} if r["kind"] == "train" else r for r in flat_records()])) == [("lr_zero", 1)]
    assert found(diagnose(flat_records(), DetectorConfig(learn_rows=2000))) == []
    with pytest.raises(ValueError, match="detectors.learn_min_drop must be in"):
        DetectorConfig(learn_min_drop=1.0)


# ---- two runs in one log -------------------------------------------------------------------------
def test_steps_going_back_with_no_resume_event_cannot_be_called_healthy(tmp_path):
    diagnosis = diagnose(two_runs_records())
    s = diagnosis["summary"]
    assert found(diagnosis) == [] and s["verdict"] == "cannot tell" and not s["healthy"]
    assert s["undecided"] == ["one run from two"]
    assert s["restarts"] == [{"from_step": 300, "to_step": 151, "with_resume_event": False}]
    assert s["cannot_tell"][-1].startswith("one run or two: steps went back from 300 to 151 with no resume")
    text, code = cmd_doctor(write_to(tmp_path, two_runs_records()), as_json=False)
    assert code == 3 and text.splitlines()[-1].startswith("no events, but cannot tell one run from two (see above)")
    # The same rows after a resume event are one run resumed: healthy.
    first, second = two_runs_records()[:300], two_runs_records()[300:]
    resumed = [*first, {"kind": "event", "event": "resume", "step": 150}, *second]
    assert diagnose(resumed)["summary"]["verdict"] == "healthy"
    # The report says so too.
    out = cmd_report(write_to(tmp_path, two_runs_records()), tmp_path / "report")
    assert "**no events, cannot tell one run from two**" in (tmp_path / "report" / "report.md").read_text()
    assert out["num_events"] == 0


# ---- the live path and the report ----------------------------------------------------------------
@pytest.mark.parametrize("build", [whiplash_records, flat_records])
def test_live_detectors_agree_with_the_offline_pass_through_checkpoints(build):
    records = build()
    live, fired = LiveDetectors(), []
    for i, record in enumerate(records):
        fired += live.update(record)
        if i % 97 == 0:
            live_state = json.loads(json.dumps(live.state_dict(), allow_nan=False))
            live = LiveDetectors()
            live.load_state_dict(live_state, resumed=False)
    assert [(e["kind"], e["step"], e["size"]) for e in fired] == [(e["kind"], e["step"], e["size"]) for e in detect(records)]
    assert fired


def test_a_detector_state_from_before_these_detectors_resumes():
    live = LiveDetectors()
    records = flat_records()
    for r in records[:100]:
        live.update(r)
    state = live.state_dict()
    del state["whiplash"], state["not_learning"]
    restored = LiveDetectors()
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert found([ev for r in records[100:] for ev in restored.update(r)]) == [("not_learning", 99)]


@pytest.mark.slow  # matplotlib (5 s); test_doctor.py's report tests draw in the default run
def test_the_report_draws_both_events(tmp_path):
    records = whiplash_records()
    flat = [r for r in flat_records() if r["kind"] == "train"]
    out = cmd_report(write_to(tmp_path, records), tmp_path / "a")
    assert out["num_events"] == 1 and "| 420 | loss_whiplash |" in (tmp_path / "a" / "report.md").read_text()
    out = cmd_report(write_to(tmp_path, flat), tmp_path / "b")
    assert out["num_events"] == 1 and "| 1 | not_learning |" in (tmp_path / "b" / "report.md").read_text()


# ---- a fine-tune from trained weights ------------------------------------------------------------
def warm_start_records(accuracy: float | None = 0.45, init_from: str | None = "runs/a/checkpoints/best") -> list[dict]:
    """A drafter started from trained weights (model.init_from) on the data it was trained on: loss 1.0
    and accuracy 0.45 (its trained level) from the first row, flat with 5% noise, for 1,000 steps."""
    rng = random.Random(5)

    def change(step, row):
        row.update(loss=1.0 * rng.lognormvariate(0, 0.05), accuracy=accuracy and accuracy + rng.gauss(0, 0.01))
        if accuracy is None:
            del row["accuracy"]

    records = trainer_records(1000, change=change)
    start = {"kind": "event", "event": "run_start", "step": 0, "hyperparameters": {"optim.lr": 6e-4, "init_from": init_from}}
    return [start, *records[1:]]


def test_a_fine_tune_from_trained_weights_is_not_called_not_learning(tmp_path):
    """Started at its trained level, its loss has nothing to fall from: the from-scratch rule named it
    not_learning and the doctor exited 1 on a healthy fine-tune."""
    diagnosis = diagnose(warm_start_records())
    assert found(diagnosis) == [] and diagnosis["summary"]["verdict"] == "healthy"
    text, code = cmd_doctor(write_to(tmp_path, warm_start_records()), as_json=False)
    assert code == 0, text
    assert found(diagnose(warm_start_records(accuracy=None))) == []  # no accuracy: nothing says it started untrained
    # The same curve from scratch (no init_from) never learned: still named.
    assert found(diagnose(warm_start_records(init_from=None))) == [("not_learning", 1)]
    # init_from weights whose accuracy starts untrained (another target's drafter) must learn as from scratch.
    (ev,) = diagnose(warm_start_records(accuracy=0.01))["events"]
    assert (ev["kind"], ev["details"]["init_from"]) == ("not_learning", "runs/a/checkpoints/best")
    assert "yet its accuracy began untrained (under 5%)" in ev["likely_cause"]


def test_a_fine_tune_in_a_log_that_does_not_say_where_it_started_is_not_called_not_learning():
    """Another trainer's log has no run_start recording init_from: a fine-tune there (accuracy 0.45,
    its trained level, from the first row) was named not_learning, exit 1. A drafter that drafts from
    its first rows did not start from scratch; one at accuracy 0.01 still never learned."""
    peer = [r for r in warm_start_records() if r["kind"] != "event"]
    diagnosis = diagnose(peer)
    assert found(diagnosis) == [] and diagnosis["summary"]["verdict"] == "healthy"
    assert found(diagnose([r for r in warm_start_records(accuracy=0.01) if r["kind"] != "event"])) == [("not_learning", 1)]
    # Without accuracy nothing says where it started: a flat loss is still named.
    assert found(diagnose([r for r in warm_start_records(accuracy=None) if r["kind"] != "event"])) == [("not_learning", 1)]


def test_a_warm_start_is_kept_through_checkpoints_and_old_states_load():
    """Live, the trainer calls run_started after its run_start event, after a resume has loaded the
    state; a state saved before init_from was kept loads, and the run_start that follows sets it."""
    records = [r for r in warm_start_records() if r["kind"] == "train"]
    live = LiveDetectors()
    live.run_started({"init_from": "runs/a/checkpoints/best"})
    fired = []
    for i, r in enumerate(records):
        fired += live.update(r)
        if i % 97 == 0:
            state = json.loads(json.dumps(live.state_dict(), allow_nan=False))
            assert state["not_learning"]["init_from"] == "runs/a/checkpoints/best"
            if i == 194:
                del state["not_learning"]["init_from"]  # a checkpoint from before the key
            live = LiveDetectors()
            live.load_state_dict(state)
            if i == 194:
                assert live.not_learning.init_from is None
                live.run_started({"init_from": "runs/a/checkpoints/best", "optim.lr": 6e-4})
    assert found(fired) == []
    live.run_started(None)  # a run_start without hyperparameters (another trainer) changes nothing
    assert live.not_learning.init_from == "runs/a/checkpoints/best"
