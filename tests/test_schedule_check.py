"""The doctor holds a log's lr and noise_std against the schedule its own run_start records: the
failed run's no-op noise warmup, a scheduler stepped per micro-batch or restarted at a resume show no
shape a curve detector could see, and are named here with the mistake their values follow."""

from __future__ import annotations

import json

from stage2_train import commands
from stage2_train.observe.doctor import diagnose
from stage2_train.train.config import OptimConfig
from stage2_train.train.curves import expected_at, lr_factor, noise_std_at

HYPER = {"optim.lr": 1e-3, "optim.schedule": "cosine", "optim.warmup_ratio": 0.1, "optim.min_lr_ratio": 0.0,
         "total_steps": 100, "warmup_steps": 10, "grad_accum": 4, "noise.std": 0.05, "noise.warmup_steps": 20}
OPTIM = OptimConfig(lr=1e-3, warmup_ratio=0.1)


def lr(step: int) -> float:  # what the trainer logs at 1-based step `step`
    return 1e-3 * lr_factor(step - 1, 100, OPTIM)


def noise(step: int) -> float:
    return noise_std_at(step - 1, 0.05, 20)


def start(step: int = 0) -> dict:
    return {"kind": "event", "event": "run_start", "step": step, "hyperparameters": HYPER}


def rows(steps, lr_of=lr, noise_of=noise) -> list[dict]:
    return [{"kind": "train", "step": s, "loss": 2.0, "lr": lr_of(s), "noise_std": noise_of(s)} for s in steps]


def schedule_events(records: list[dict]) -> list[dict]:
    diagnosis = diagnose(records, schedule=expected_at)
    return [e for e in diagnosis["events"] if e["kind"].endswith("_off_schedule")]


def test_a_log_on_its_schedule_has_no_event_and_another_trainers_log_cannot_be_judged():
    assert schedule_events([start(), *rows(range(1, 101))]) == []
    # a resume that continues the schedule: judged by the run_start after it
    resumed = [start(), *rows(range(1, 51)), {"kind": "event", "event": "resume", "step": 50}, start(50), *rows(range(51, 101))]
    assert schedule_events(resumed) == []
    peer = diagnose(rows(range(1, 101)), schedule=expected_at)
    assert "lr against its configured schedule: 100 rows log an lr but no run_start records the schedule " \
           "(another trainer's log, or an older one)" in peer["summary"]["cannot_tell"]


def test_a_scheduler_stepped_per_micro_batch_is_named():
    events = schedule_events([start(), *rows(range(1, 101), lr_of=lambda s: lr((s - 1) * 4 + 1))])
    assert [(e["kind"], e["step"], e["details"]["to_step"], e["details"]["rows"]) for e in events] == [("lr_off_schedule", 2, 100, 99)]
    d = events[0]["details"]
    assert (d["logged"], d["expected"]) == (lr(5), lr(2))
    assert events[0]["likely_cause"] == ("the logged lr follows this mistake's curve: the scheduler stepped once per "
                                         "micro-batch (x4: train.grad_accum), not once per optimizer step")


def test_a_schedule_restarted_at_a_resume_is_named():
    records = [start(), *rows(range(1, 51)), {"kind": "event", "event": "resume", "step": 50}, start(50),
               *rows(range(51, 101), lr_of=lambda s: lr(s - 50))]
    events = schedule_events(records)
    assert [(e["kind"], e["step"], e["details"]["to_step"]) for e in events] == [("lr_off_schedule", 51, 100)]
    assert "restarted from its warmup at the resume from step 50" in events[0]["likely_cause"]


def test_a_no_op_noise_warmup_is_named_and_the_text_says_where():
    events = schedule_events([start(), *rows(range(1, 101), noise_of=lambda s: 0.05)])
    assert [(e["kind"], e["step"], e["details"]["to_step"]) for e in events] == [("noise_off_schedule", 1, 20)]
    assert events[0]["likely_cause"] == ("the logged noise_std follows this mistake's curve: the noise warmup is a no-op: "
                                         "std 0.05 from the first step, not warmed up over 20 steps")


def test_an_lr_off_schedule_with_no_known_mistake_exits_1_with_its_line(tmp_path):
    """The resume bug this check found: the first step after a resume under more steps took the old
    schedule's lr (0 at its end) instead of this run's."""
    hyper_short = {**HYPER, "total_steps": 50}
    records = [{**start(), "hyperparameters": hyper_short},
               *rows(range(1, 51), lr_of=lambda s: 1e-3 * lr_factor(s - 1, 50, OPTIM)),
               {"kind": "event", "event": "resume", "step": 50}, start(50),
               {**rows([51])[0], "lr": 0.0}, *rows(range(52, 101))]
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text, code = commands.cmd_doctor(tmp_path, as_json=False)
    assert code == 1
    assert (f"  lr off its schedule at step 51 (1 rows): 0 logged at step 51, {lr(51):.4g} expected (optim.lr 0.001, "
            "cosine, warmup 10 of 100 steps, min_lr_ratio 0.0)") in text.splitlines()
    assert ("      likely cause: the optimizer updates are not the ones the run's config asks for (run_start: optim.lr "
            "0.001, cosine, warmup 10 of 100 steps, min_lr_ratio 0.0): a scheduler stepped elsewhere, or total steps "
            "that changed since run_start") in text.splitlines()


def test_the_report_draws_a_log_off_its_schedule(tmp_path):
    """`report` (which runs the same schedule check) stopped with a KeyError on any off-schedule event:
    the failed run's no-op noise warmup had its doctor line but no report."""
    (tmp_path / "train_log.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in [start(), *rows(range(1, 101), noise_of=lambda s: 0.05)])
    )
    out = commands.cmd_report(tmp_path, tmp_path / "report")
    assert out["num_events"] == 1 and not out["healthy"]
    assert "noise_std off its schedule at steps 1-20" in (tmp_path / "report" / "report.md").read_text()
