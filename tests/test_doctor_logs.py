"""The doctor reads other trainers' logs: a wandb run folder, a TensorBoard folder, CSV and JSONL
history exports, with SpecForge's and speculators' metric names (issue 36 item 2).

    .venv/bin/python -m pytest tests/test_doctor_logs.py -q

One run's history is written in each format by the libraries themselves where there is one (wandb,
torch.utils.tensorboard), by csv/json where the format is an export: 400 steps, 0.5 s each, the loss
x4 at step 300 (a spike), throughput down 70% from step 350 (a drop), and a held-out eval every 25
steps that improves to step 200 and then worsens at every eval (a turn). Each test asserts the exact
events found and the names each detector input was read from.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import sys

import pytest

from shared.errors import InputFileError
from stage2_train.observe.doctor import doctor
from stage2_train.observe.sources import load_log

EVENTS = [("generalisation", 200), ("loss_spike", 300), ("throughput_drop", 350)]


def history(steps: int = 400) -> list[dict]:
    """Canonical values per step; eval values at every 25th step."""
    rows = []
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "elapsed_s": 0.5 * step,
            "loss": (0.6 + 3 * math.exp(-step / 120))
            * (4.0 if step in (300, 301) else 1.0)
            * (1 + 0.01 * math.sin(step)),
            "accuracy": 0.45 * (1 - math.exp(-step / 120)) + 0.003 * math.cos(step),
            "accept_len": 1 + 4 * (1 - math.exp(-step / 120)),
            "lr": 6e-4 * min(1.0, step / 20),
            "grad_norm": 1.0 + 0.1 * math.sin(step),
            "tok_per_s": 9000.0 * (0.3 if step >= 350 else 1.0) * (1 + 0.01 * math.cos(step)),
            "data_wait_frac": 0.02,
        }
        if step % 25 == 0:
            k = step // 25
            up, down = min(k, 8) / 8, max(0, k - 8)  # best at step 200, then worse at every eval
            row["eval"] = {
                "ce": 2.6 - 0.6 * up + 0.05 * down,
                "accuracy": 0.10 + 0.12 * up - 0.008 * down,
                "accept_len": 2.0 + 1.0 * up - 0.06 * down,
            }
        rows.append(row)
    return rows


def found(diagnosis: dict) -> list[tuple[str, int]]:
    return sorted((ev["kind"], ev["step"]) for ev in diagnosis["events"])


def run_doctor(path) -> dict:
    out, _ = doctor(path, as_json=True)
    return json.loads(out)


# ---- SpecForge's names ---------------------------------------------------------------------------
def specforge_row(row: dict) -> dict:
    """SpecForge 0.2.0's names (specforge/training/controller.py, tracking.py, eval/evaluator.py)."""
    out = {
        "train/loss": row["loss"],
        "train/acc": row["accuracy"],
        "train/lr": row["lr"],
        "train/grad_norm": row["grad_norm"],
        "train/perf/optimizer_step_time_s": 0.5,
        "train/perf/data_wait_time_s": 0.5 * row["data_wait_frac"],
        "train/perf/global_samples_per_second": row["tok_per_s"] / 1000,
    }
    if "eval" in row:  # DFlash: simulated_acc_len is avg_acc itself, so it is not an acceptance length
        e = row["eval"]
        out.update(
            {"eval/avg_loss": e["ce"], "eval/avg_acc": e["accuracy"], "eval/simulated_acc_len": e["accuracy"]}
        )
    return out


SPECFORGE_READ_AS = {
    "loss": ["train/loss"],
    "accuracy": ["train/acc"],
    "lr": ["train/lr"],
    "grad_norm": ["train/grad_norm"],
    "samples_per_s": ["train/perf/global_samples_per_second"],
    "data_wait_frac": ["train/perf/data_wait_time_s / train/perf/optimizer_step_time_s"],
    "held-out ce": ["eval/avg_loss"],
    "held-out accuracy": ["eval/avg_acc"],
}


def write_wandb_run(tmp_path, monkeypatch) -> None:
    """A real offline wandb run under tmp_path/wandb, written as SpecForge's tracker writes it."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="dflash", dir=str(tmp_path), mode="offline")
    for row in history():
        run.log(specforge_row(row), step=row["step"], commit=True)
    run.finish()


def test_a_wandb_offline_run_is_read_with_specforge_names(tmp_path, monkeypatch):
    write_wandb_run(tmp_path, monkeypatch)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    for path in (run_dir, tmp_path, tmp_path / "wandb", next(run_dir.glob("run-*.wandb"))):
        diagnosis = run_doctor(path)
        assert found(diagnosis) == EVENTS, path
    s = diagnosis["summary"]
    assert s["format"] == "wandb" and s["read_as"] == SPECFORGE_READ_AS and s["train_rows"] == 400
    assert s["heldout"]["evals"] == 16 and "accept_len" not in s["heldout"]["best"]
    drop = next(ev for ev in diagnosis["events"] if ev["kind"] == "throughput_drop")
    assert drop["details"]["unit"] == "samples/s" and "9 -> 3 samples/s" in doctor(run_dir, False)[0]
    # What SpecForge does not log, the doctor says it cannot judge.
    assert [c.split(":")[0] for c in s["cannot_tell"]] == [
        "epoch boundaries",
        "checkpoint saves and resumes",
        "noise schedule changes",
        "stalls at evals",  # its eval rows do not say how long each eval took
    ]
    # A synced run's folder (wandb/run-DATE-ID) holds the same transaction log.
    synced = tmp_path / "synced" / "wandb" / run_dir.name.replace("offline-run-", "run-")
    shutil.copytree(run_dir, synced)
    assert found(run_doctor(tmp_path / "synced")) == EVENTS


def test_untimed_evals_of_another_trainer_are_not_stalls(tmp_path):
    """SpecForge's eval rows say nothing of how long each eval took, and wandb gives the row the clock
    of its last metric, the eval's end (`_runtime` of the row at the eval's step is 60 s later): each
    of the 16 evals was a stall, exit 1 on a healthy run. A gap that holds an eval is now not judged
    (and the doctor says so); a 60 s gap with no eval is still a stall."""
    rows, late = [], 0.0
    for row in history():
        late += 60.0 if "eval" in row or row["step"] == 140 else 0.0
        rows.append({"_step": row["step"], "_runtime": row["elapsed_s"] + late, **specforge_row(row)})
    path = tmp_path / "history.json"
    path.write_text(json.dumps(rows))
    diagnosis = run_doctor(path)
    assert found(diagnosis) == sorted([*EVENTS, ("stall", 140)])
    assert "stalls at evals: 16 eval row(s) without eval_s, so the gap that holds each eval is not judged" in (
        diagnosis["summary"]["cannot_tell"]
    )


def test_flat_eval_rows_without_kind_are_eval_rows(tmp_path):
    """Hugging Face Trainer's log_history, one row per line: train rows (loss, learning_rate,
    grad_norm, epoch) and, at some of their steps, eval rows (eval_loss, eval_runtime) with no `kind`.
    Read as train rows, each eval's step "went back" to its train row's: exit 3, "two runs in one
    log", and no held-out curve read."""
    rows = []
    for row in history():
        rows.append({"loss": row["loss"], "grad_norm": row["grad_norm"], "learning_rate": row["lr"],
                     "epoch": row["step"] / 100, "step": row["step"]})
        if "eval" in row:
            rows.append({"eval_loss": row["eval"]["ce"], "eval_runtime": 12.5, "epoch": row["step"] / 100,
                         "step": row["step"]})
    path = tmp_path / "log_history.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    diagnosis = run_doctor(path)
    s = diagnosis["summary"]
    assert found(diagnosis) == [("generalisation", 200), ("loss_spike", 300)]
    assert s["eval_rows"] == 16 and s["restarts"] == [] and s["undecided"] == []


def test_a_wandb_run_still_being_written_is_read_to_its_last_record(tmp_path, monkeypatch):
    write_wandb_run(tmp_path, monkeypatch)
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = log.read_bytes()  # killed mid-run: cut inside a history record (a cut between two records
    log.write_bytes(data[: data.index(b"train/grad_norm", len(data) * 2 // 3) + 4])  # is a complete file to any reader)
    diagnosis = run_doctor(log.parent)
    assert 200 < diagnosis["summary"]["train_rows"] < 400
    # wandb's reader says so as an incomplete file or as corrupt data it skipped (a chunk failing its
    # checksum): which one depends on where in wandb's 32 KiB blocks the cut falls, which the run's ids
    # and times move
    notes = diagnosis["summary"]["reader_notes"]
    assert any("incomplete" in note or "skipped corrupt data" in note for note in notes), notes


def test_a_folder_of_two_different_wandb_runs_is_refused_naming_them(tmp_path, monkeypatch):
    write_wandb_run(tmp_path, monkeypatch)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    other = run_dir.parent / "offline-run-20990101_000000-zzzz9999"
    other.mkdir()
    shutil.copy(next(run_dir.glob("run-*.wandb")), other / "run-zzzz9999.wandb")
    with pytest.raises(InputFileError, match=r"2 different wandb runs \(.*\); give one run's folder"):
        load_log(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        InputFileError, match="no training log at .*empty: looked for train_log.jsonl, a wandb run"
    ):
        load_log(tmp_path / "empty")


def test_a_csv_chart_export_with_specforge_names(tmp_path):
    """wandb's "Export CSV" of a chart: Step, then "<run> - <metric>" with __MIN / __MAX columns."""
    rows = [(row["step"], specforge_row(row)) for row in history()]
    metrics = list(rows[-1][1])
    columns = ["Step"] + [f"qwen3-8b-dflash - {m}{s}" for m in metrics for s in ("", "__MIN", "__MAX")]
    path = tmp_path / "export.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for step, values in rows:
            writer.writerow([step] + [values.get(m, "") for m in metrics for _ in range(3)])
    diagnosis = run_doctor(path)
    # No clock in a chart export: no stalls to judge, the rest as from wandb.
    assert found(diagnosis) == EVENTS and diagnosis["summary"]["read_as"] == SPECFORGE_READ_AS
    assert [c.split(":")[0] for c in diagnosis["summary"]["cannot_tell"]] == [
        "epoch boundaries",
        "checkpoint saves and resumes",
        "stalls",
        "noise schedule changes",
    ]
    two = tmp_path / "two.csv"
    two.write_text("Step,a - train/loss,b - train/loss\n1,2.0,2.1\n")
    with pytest.raises(InputFileError, match=r"columns of 2 runs \(a, b\); export one run"):
        load_log(two)


def test_a_csv_chart_export_of_a_metric_without_a_namespace(tmp_path):
    """A chart of a metric logged as plain `loss` exports as Step, "<run> - loss": nothing but the
    Step column marks it as wandb's, and the doctor stopped with "no train rows with a step"."""
    path = tmp_path / "export.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Step", "my-run - loss", "my-run - loss__MIN", "my-run - loss__MAX"])
        for row in history():
            writer.writerow([row["step"]] + [row["loss"]] * 3)
    diagnosis = run_doctor(path)
    assert found(diagnosis) == [("loss_spike", 300)] and diagnosis["summary"]["read_as"] == {"loss": ["loss"]}


# ---- speculators' names --------------------------------------------------------------------------
def speculators_rows(row: dict) -> list[dict]:
    """speculators 0.9.0's metric logger rows (speculators/train/trainer.py, flattened by
    train/logger.py; names from models/dflash/metrics.py), as (step, flat dict)."""
    train = {
        "train/loss": row["loss"],
        "train/full_acc": row["accuracy"],
        "train/eal": row["accept_len"],
        "train/kl_div_loss": row["loss"],
        "profile/step_ms": 500.0,
        "profile/tokens_per_s": row["tok_per_s"],
        "profile/fetch_frac": row["data_wait_frac"],
        "epoch": row["step"] // 200,
        "lr": row["lr"],
        "global_step": row["step"],
    }
    out = [train]
    if "eval" in row:
        e = row["eval"]
        out.append(
            {
                "val/loss_epoch": e["ce"],
                "val/full_acc_epoch": e["accuracy"],
                "val/eal_epoch": e["accept_len"],
                "epoch": row["step"] // 200,
            }
        )
    return out


SPECULATORS_READ_AS = {
    "loss": ["train/loss"],
    "accuracy": ["train/full_acc"],
    "accept_len": ["train/eal"],
    "lr": ["lr"],
    "tok_per_s": ["profile/tokens_per_s"],
    "data_wait_frac": ["profile/fetch_frac"],
    "epoch": ["epoch"],
    "held-out ce": ["val/loss_epoch"],
    "held-out accuracy": ["val/full_acc_epoch"],
    "held-out accept_len": ["val/eal_epoch"],
}


def test_a_tensorboard_folder_written_by_summary_writer_with_speculators_names(tmp_path):
    pytest.importorskip(
        "tensorboard",
        reason="the tensorboard package (the `tensorboard` extra, in `dev`) writes and reads the log",
    )
    from torch.utils.tensorboard import SummaryWriter

    folder = tmp_path / "logs" / "run_2026"
    writer = SummaryWriter(log_dir=str(folder))
    for row in history():
        for flat in speculators_rows(row):
            for tag, value in flat.items():
                writer.add_scalar(tag, value, global_step=row["step"], walltime=1e9 + row["elapsed_s"])
    writer.close()
    diagnosis = run_doctor(tmp_path / "logs")
    s = diagnosis["summary"]
    assert found(diagnosis) == EVENTS and s["format"] == "tensorboard" and s["read_as"] == SPECULATORS_READ_AS
    assert s["sec_per_step"] == pytest.approx(0.5) and s["epochs"] == [0, 2]
    assert [c.split(":")[0] for c in s["cannot_tell"]] == [
        "checkpoint saves and resumes",
        "non-finite gradients",
        "noise schedule changes",
        "stalls at evals",  # no eval time in speculators' eval rows
    ]


def test_a_tensorboard_log_without_the_extra_names_it(tmp_path, monkeypatch):
    (tmp_path / "events.out.tfevents.1.host").write_bytes(b"")
    for name in [m for m in sys.modules if m.split(".")[0] == "tensorboard"] + ["tensorboard"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(
        InputFileError, match=r"needs the tensorboard package: pip install -e '\.\[tensorboard\]'"
    ):
        load_log(tmp_path)


def test_a_csv_history_dump_with_speculators_names(tmp_path):
    """`run.history().to_csv()`: an index column, wandb's _step/_runtime, one column per metric."""
    rows = []
    for row in history():
        merged = {k: v for flat in speculators_rows(row) for k, v in flat.items()}
        rows.append(
            {
                "_step": row["step"],
                "_runtime": row["elapsed_s"],
                "_timestamp": 1e9 + row["elapsed_s"],
                **merged,
            }
        )
    columns = sorted({k for r in rows for k in r})
    path = tmp_path / "history.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["", *columns])
        for i, r in enumerate(rows):
            writer.writerow([i, *(r.get(c, "") for c in columns)])
    diagnosis = run_doctor(path)
    assert found(diagnosis) == EVENTS and diagnosis["summary"]["read_as"] == SPECULATORS_READ_AS
    assert diagnosis["summary"]["sec_per_step"] == pytest.approx(0.5)


def test_jsonl_history_dumps_one_row_per_line_or_one_array(tmp_path):
    """`run.history()` / `scan_history()` rows with the older SpecForge script's names
    (scripts/train_dflash.py: train/loss, train/accuracy, train/lr, eval/loss, eval/accuracy)."""
    rows = []
    for row in history():
        out = {
            "_step": row["step"],
            "_runtime": row["elapsed_s"],
            "train/loss": row["loss"],
            "train/accuracy": row["accuracy"],
            "train/lr": row["lr"],
        }
        if "eval" in row:
            out.update({"eval/loss": row["eval"]["ce"], "eval/accuracy": row["eval"]["accuracy"]})
        rows.append(out)
    lines, array = tmp_path / "history.jsonl", tmp_path / "history.json"
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows))
    array.write_text(json.dumps(rows))
    for path in (lines, array):
        diagnosis = run_doctor(path)
        assert found(diagnosis) == EVENTS[:2], path  # no throughput in that log
        assert diagnosis["summary"]["read_as"] == {
            "loss": ["train/loss"],
            "accuracy": ["train/accuracy"],
            "lr": ["train/lr"],
            "held-out ce": ["eval/loss"],
            "held-out accuracy": ["eval/accuracy"],
        }


# ---- this project's own wandb run --------------------------------------------------------------
def test_our_own_wandb_run_gives_the_same_diagnosis_as_the_jsonl(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from stage2_train.observe.config import LogConfig
    from stage2_train.observe.metrics import MetricsSink

    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = MetricsSink(LogConfig(wandb="offline"), run_dir=tmp_path)
    sink.event("run_start", 0)
    for row in history():
        values = {k: v for k, v in row.items() if k not in ("step", "eval")}
        sink.log(row["step"], values)
        if "eval" in row:
            sink.log(row["step"], row["eval"], kind="eval")
        if row["step"] % 100 == 0:
            sink.event("checkpoint_end", row["step"], blocked_s=0.05, write_s=1.0)
    sink.close()
    from_jsonl = run_doctor(tmp_path)
    os.remove(tmp_path / "train_log.jsonl")
    from_wandb = run_doctor(tmp_path)
    assert from_wandb["summary"]["format"] == "wandb" and found(from_wandb) == found(from_jsonl) == EVENTS
    # The checkpoint events come back from wandb's event/... names; run_start carries no number, so
    # wandb has no row for it.
    assert (from_jsonl["summary"]["event_rows"], from_wandb["summary"]["event_rows"]) == (5, 4)
