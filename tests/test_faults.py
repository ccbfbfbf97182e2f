"""Faults and bad input: locked writers, damaged files named with their fix, bad rows and configs.

    .venv/bin/python -m pytest tests/test_faults.py -q

Each test reproduces a case that lost or silently corrupted data, or crashed without naming the
file, before the fix.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.config import load_run_config
from shared.errors import BusyError, ConfigError
from shared.lock import LOCK_NAME, LeaseLock, exclusive
from stage1_extract import pipeline as stage1
from tests.conftest import chat_rows, stage1_overrides, write_jsonl

REPO = Path(__file__).resolve().parents[1]

HOLD_LOCK = """
import sys, time
from shared.lock import exclusive
with exclusive(sys.argv[1], sys.argv[2]):
    print("HELD", flush=True)
    time.sleep(60)
"""


def hold_lock_in_another_process(folder: Path, command: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(folder), command],
        cwd=REPO,
        stdout=subprocess.PIPE,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.stdout.readline() == b"HELD\n"
    return proc


@pytest.fixture
def small_data(tmp_path) -> Path:
    return write_jsonl(tmp_path / "chat.jsonl", chat_rows(12))


def test_a_second_extract_on_a_store_is_refused_naming_the_holder(tiny_target_dir, small_data, tmp_path):
    cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, small_data, tmp_path / "run"))
    store = Path(cfg.store.url(cfg.run_dir))
    holder = hold_lock_in_another_process(store, "stage1_extract extract")
    try:
        with pytest.raises(BusyError, match=rf"{store} is in use by `stage1_extract extract` \(pid {holder.pid} on "):
            stage1.cmd_extract(cfg, progress=False)
        assert not (store / "plan.json").exists() and not (store / "shards").exists()  # touched nothing
    finally:
        holder.kill()
        holder.wait()
    summary = stage1.cmd_extract(cfg, progress=False)  # the holder died: its lock went with it
    assert summary["num_samples"] == 12 and (store / LOCK_NAME).exists()


def test_a_second_train_on_a_run_dir_is_refused(tmp_path):
    from stage2_train.commands import cmd_train

    run_dir = tmp_path / "run"
    holder = hold_lock_in_another_process(run_dir, "stage2_train train")
    try:
        cfg = load_run_config("configs/default.yaml", [f"run_dir={run_dir}", "log.wandb=disabled"])
        with pytest.raises(BusyError, match=r"is in use by `stage2_train train`"):
            cmd_train(cfg, progress=False)
        assert not (run_dir / "train_config.yaml").exists() and not (run_dir / "train_log.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()


def test_the_object_store_lease_refuses_a_live_holder_and_takes_an_expired_one():
    url = f"memory://lease-{time.time_ns()}"
    first = LeaseLock(url, lease_s=0.3)
    first.acquire("stage1_extract extract")
    with pytest.raises(BusyError, match=r"in use by `stage1_extract extract`.*lease until"):
        LeaseLock(url).acquire("stage1_extract reprocess")
    first._stop.set()  # the holder dies without releasing: no more renewals
    first._renewer.join()
    time.sleep(0.35)
    second = LeaseLock(url)
    second.acquire("stage1_extract reprocess")  # the lease expired
    second.release()
    with exclusive(url, "again"):
        pass


# ---- configs ---------------------------------------------------------------------------------------
def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_inherit_loops_lists_and_duplicate_keys(tmp_path):
    write(tmp_path / "a.yaml", "inherit: b.yaml\nseed: 1\n")
    write(tmp_path / "b.yaml", "inherit: a.yaml\n")
    with pytest.raises(ConfigError, match=r"a\.yaml: `inherit` loops back to itself \(a\.yaml -> b\.yaml -> a\.yaml\)"):
        load_run_config(tmp_path / "a.yaml")
    write(tmp_path / "base.yaml", "train:\n  epochs: 2\nseed: 3\n")
    write(tmp_path / "more.yaml", "train:\n  max_steps: 9\n")
    write(tmp_path / "both.yaml", "inherit: [base.yaml, more.yaml]\ntrain:\n  epochs: 4\n")
    cfg = load_run_config(tmp_path / "both.yaml")
    assert (cfg.train.epochs, cfg.train.max_steps, cfg.seed) == (4, 9, 3)
    write(tmp_path / "dup.yaml", "train:\n  epochs: 2\n  epochs: 5\n")
    with pytest.raises(ConfigError, match=r"dup\.yaml: key 'epochs' appears twice \(lines 2 and 3\)"):
        load_run_config(tmp_path / "dup.yaml")
    write(tmp_path / "bad.yaml", "inherit: {x: 1}\n")
    with pytest.raises(ConfigError, match=r"inherit must name a file or a list of files"):
        load_run_config(tmp_path / "bad.yaml")


@pytest.mark.parametrize("entry", ["stage1_extract", "stage2_train"])
def test_every_section_is_validated_whichever_stage_runs(entry):
    done = subprocess.run(
        [sys.executable, "-m", entry, "check", "extract.top_kk=8"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "error: extract.top_kk: unknown key (known keys: top_k," in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", entry, "check", "train.epochs=0"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 2 and "error: train.epochs must be >= 1, got 0" in done.stderr


def test_check_explain_prints_every_key_with_its_documentation():
    done = subprocess.run(
        [sys.executable, "-m", "stage2_train", "check", "--explain", "loss.gamma=7"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )
    out = done.stdout
    assert "loss.kl_weight = 0.0   : float" in out and "Top-k KL against the stored target distribution" in out
    assert "train.epochs = 3   : int   (default 6)" in out  # the preset's value, and the default beside it
    assert "store.dtype = 'bf16'" in out and "fp8 e4m3 with a per-token, per-layer scale" in out


def test_an_internal_error_keeps_its_traceback(tmp_path, monkeypatch, capsys):
    """Only UserError is one line: a bug (here a TypeError) surfaces with its traceback."""
    from stage2_train import __main__ as entry

    def broken(*args, **kwargs):
        raise TypeError("an internal bug")

    monkeypatch.setattr(entry.commands, "cmd_batches", broken)
    with pytest.raises(TypeError, match="an internal bug"):
        entry.main(["batches", f"run_dir={tmp_path}"])


def test_json_summaries_never_print_nan():
    from shared.cli import to_json

    text = to_json({"final_train": {"loss": float("nan"), "acc": [float("inf"), 0.5]}})
    assert json.loads(text) == {"final_train": {"loss": "nan", "acc": ["inf", 0.5]}}
