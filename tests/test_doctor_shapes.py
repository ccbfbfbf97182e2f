"""The doctor on logs with no single bad row that still are not healthy: a log that holds two runs.
It was called healthy, exit 0, before its check.

    .venv/bin/python -m pytest tests/test_doctor_shapes.py -q

Logs are built by the test in our trainer's format (`tests/test_doctor.trainer_records`); each test
asserts the exact (kind, step) of every event found.
"""

from __future__ import annotations

from stage2_train.observe.doctor import diagnose
from stage2_train.observe.doctor import doctor as cmd_doctor
from stage2_train.observe.report import report as cmd_report
from tests.test_doctor import found, trainer_records, write_log


def two_runs_records() -> list[dict]:
    """Two runs appending to one log: a second run's rows from step 150 follow the first's to 300,
    with no resume or run_start event between them."""
    first = [r for r in trainer_records(300) if r["kind"] == "train"]
    second = [r for r in trainer_records(300, seed=2) if r["kind"] == "train" and r["step"] > 150]
    return first + second


def write_to(tmp_path, records):
    write_log(tmp_path / "train_log.jsonl", records)
    return tmp_path / "train_log.jsonl"


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
