"""MetricsSink: the JSONL record of truth, rank gating, wandb mode resolution and forwarding.

    .venv/bin/python -m pytest tests/test_metrics.py -q
"""

from __future__ import annotations

import json
import math
import sys
import types

import numpy as np
import pytest
import torch

from stage2_train.observe.metrics import (
    LogConfig,
    MetricsSink,
    flatten_for_wandb,
    plain,
    read_log,
    resolve_wandb_mode,
)


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_and_events_are_written_and_flushed_at_once(tmp_path):
    sink = MetricsSink(LogConfig(wandb="disabled"), tmp_path)
    sink.event("run_start", 0, config={"optim": {"lr": 6e-4}}, world_size=1)
    sink.log(1, {"loss": torch.tensor(2.5), "acc_per_pos": torch.tensor([0.5, 0.25]), "tokens": np.int64(7)})
    sink.log(1, {"loss": 2.75}, kind="eval")
    rows = lines(tmp_path / "train_log.jsonl")  # read while the sink is still open
    assert [r["kind"] for r in rows] == ["event", "train", "eval"]
    assert rows[0]["event"] == "run_start" and rows[0]["config"] == {"optim": {"lr": 6e-4}}
    assert rows[1]["loss"] == 2.5 and rows[1]["acc_per_pos"] == [0.5, 0.25] and rows[1]["tokens"] == 7
    assert all(isinstance(r["time"], float) and r["step"] in (0, 1) for r in rows)
    sink.close()
    again = MetricsSink(LogConfig(wandb="disabled"), tmp_path)  # a resumed run appends
    again.event("resume", 1, path="ckpt")
    again.close()
    assert [r.get("event") for r in read_log(tmp_path / "train_log.jsonl", "event")] == ["run_start", "resume"]
    assert len(read_log(tmp_path / "train_log.jsonl")) == 4


def test_only_rank_zero_writes(tmp_path):
    sink = MetricsSink(LogConfig(wandb="online"), tmp_path / "run", rank=1)
    sink.log(1, {"loss": 1.0})
    sink.event("epoch_start", 0, epoch=0)
    sink.close()
    assert not sink.active and not (tmp_path / "run").exists()


def test_non_finite_values_stay_valid_json():
    assert plain({"a": float("nan"), "b": [torch.tensor(float("inf"))], "c": (1, 2)}) == {"a": "nan", "b": ["inf"], "c": [1, 2]}
    assert math.isnan(float(plain(float("nan"))))


@pytest.mark.parametrize(
    "requested, env, expected",
    [
        ("auto", {"WANDB_MODE": "disabled", "WANDB_API_KEY": "k"}, "disabled"),
        ("auto", {"WANDB_MODE": "offline"}, "offline"),
        ("auto", {"WANDB_MODE": "dryrun"}, "offline"),
        ("auto", {"WANDB_API_KEY": "k"}, "online"),
        ("auto", {}, "offline"),
        ("online", {"WANDB_MODE": "disabled"}, "online"),
        ("disabled", {"WANDB_API_KEY": "k"}, "disabled"),
    ],
)
def test_wandb_mode_resolution(monkeypatch, requested, env, expected):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert resolve_wandb_mode(requested) == expected


def test_flatten_keeps_numbers_and_expands_lists():
    row = {"loss": 1.5, "acc_per_pos": [0.5, 0.25], "name": "x", "nested": {"a": 1, "b": "s"}, "ok": True}
    assert flatten_for_wandb("train", row) == {
        "train/loss": 1.5, "train/acc_per_pos_1": 0.5, "train/acc_per_pos_2": 0.25, "train/nested/a": 1, "train/ok": True,
    }


class FakeRun:
    def __init__(self, **kwargs):
        self.init = kwargs
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def log(self, data, step):
        self.logged.append((data, step))

    def finish(self):
        self.finished = True


def test_rows_are_forwarded_to_wandb_with_a_stable_run_id(tmp_path, monkeypatch):
    runs: list[FakeRun] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: runs.append(FakeRun(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    sink = MetricsSink(LogConfig(wandb="offline", project="p"), tmp_path / "myrun", run_config={"seed": 0})
    sink.event("run_start", 0, config={"seed": 0}, world_size=2)
    sink.log(3, {"loss": 2.0, "acc_per_pos": [0.5]})
    sink.close()
    run = runs[0]
    run_id = run.init["id"]
    assert run.init["mode"] == "offline" and len(run_id) == 8 and run.init["name"] == "myrun"
    assert run.init["config"] == {"seed": 0} and run.init["project"] == "p" and run.finished
    assert run.logged[0] == ({"event/run_start/world_size": 2}, 0)
    data, step = run.logged[1]
    assert step == 3 and data["train/loss"] == 2.0 and data["train/acc_per_pos_1"] == 0.5
    assert (tmp_path / "myrun" / "wandb_id.txt").read_text().strip() == run_id
    MetricsSink(LogConfig(wandb="offline"), tmp_path / "myrun").close()  # resumed: same id
    assert runs[1].init["id"] == run_id and runs[1].init["resume"] == "allow"


def test_log_config_is_validated():
    with pytest.raises(ValueError, match="log.every_steps must be >= 1"):
        LogConfig(every_steps=0)
    with pytest.raises(ValueError, match="log.wandb must be one of"):
        LogConfig.from_dict({"wandb": "sometimes"})


def test_a_late_event_reaches_wandb_at_the_latest_step_with_its_own(tmp_path):
    """An async checkpoint's checkpoint_end comes after the next step's row; wandb drops a row below a
    step it has seen (it did, in a real default run), so it goes at the latest step, naming its own."""
    class FakeRun:
        def __init__(self):
            self.calls = []

        def log(self, numbers, step):
            assert not self.calls or step >= self.calls[-1][1], "wandb would drop this row"
            self.calls.append((numbers, step))

        def finish(self):
            pass

    sink = MetricsSink(LogConfig(wandb="disabled"), tmp_path)
    sink._wandb_run = run = FakeRun()
    sink.log(301, {"loss": 1.0})
    sink.event("checkpoint_end", 300, blocked_s=0.4)
    sink.log(302, {"loss": 0.9})
    sink.close()
    assert run.calls == [
        ({"train/loss": 1.0}, 301),
        ({"event/checkpoint_end/blocked_s": 0.4, "event/checkpoint_end/step": 300}, 301),
        ({"train/loss": 0.9}, 302),
    ]
    assert [r["step"] for r in lines(tmp_path / "train_log.jsonl")] == [301, 300, 302]  # the record of truth keeps it
