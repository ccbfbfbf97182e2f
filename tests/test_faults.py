"""Faults and bad input: locked writers, damaged files named with their fix, bad rows and configs.

    .venv/bin/python -m pytest tests/test_faults.py -q

Each test reproduces a case that lost or silently corrupted data, or crashed without naming the
file, before the fix.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

from shared.config import load_run_config
from shared.errors import BusyError, ConfigError
from shared.lock import LOCK_NAME, LeaseLock, exclusive
from stage1_extract import commands as stage1
from testkit.data import chat_rows, stage1_overrides, train_overrides_for, write_jsonl

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


def test_a_second_train_on_a_run_dir_is_refused(tmp_path, store, tiny_target_dir):
    from stage2_train.commands import cmd_train

    run_dir = tmp_path / "run"
    holder = hold_lock_in_another_process(run_dir, "stage2_train train")
    try:
        cfg = train_config(tiny_target_dir, store[1], run_dir)
        with pytest.raises(BusyError, match=r"is in use by `stage2_train train`"):
            cmd_train(cfg, progress=False)
        assert not (run_dir / "train_config.yaml").exists() and not (run_dir / "train_log.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()


def test_the_object_store_lease_refuses_a_live_holder_and_takes_an_expired_one():
    url = f"memory://lease-{time.time_ns()}"
    now = [1_000_000.0]  # an injected clock: expiry is decided by it, not by how long the test takes
    clock = lambda: now[0]  # noqa: E731
    first = LeaseLock(url, lease_s=300, clock=clock)
    first.acquire("stage1_extract extract")
    with pytest.raises(BusyError, match=r"in use by `stage1_extract extract`.*lease until"):
        LeaseLock(url, clock=clock).acquire("stage1_extract reprocess")
    first._stop.set()  # the holder dies without releasing: no more renewals
    first._renewer.join()
    now[0] += 299.0
    with pytest.raises(BusyError):
        LeaseLock(url, clock=clock).acquire("stage1_extract reprocess")  # not yet expired
    now[0] += 2.0
    second = LeaseLock(url, clock=clock)
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


@pytest.mark.parametrize(
    "entry, own, other",
    [("stage1_extract", "extract.top_kk=8", "train.epochs=0"), ("stage2_train", "train.epochs=0", "extract.top_kk=8")],
)
def test_each_stage_validates_its_sections_and_make_checks_both(entry, own, other):
    """An entry point refuses a bad key of its own sections by name; the other stage's sections it
    keeps as given and says who validates them; `make preflight` (run by `make extract`) checks both."""
    done = subprocess.run([sys.executable, "-m", entry, "check", own], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert ("error: extract.top_kk: unknown key (known keys: top_k," in done.stderr) or (
        "error: train.epochs must be >= 1, got 0" in done.stderr
    )
    done = subprocess.run([sys.executable, "-m", entry, "check", other], cwd=REPO, capture_output=True, text=True)
    owner = "stage2_train" if entry == "stage1_extract" else "stage1_extract"
    # the command it names is spelled for this run (its --config and overrides)
    assert done.returncode == 0 and f"are {owner}'s: `python -m {owner} check --config default {other}` validates them" in done.stderr
    done = subprocess.run(["make", "-s", "preflight", f"ARGS={other}"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode != 0 and "error: " in done.stderr


def test_check_refuses_layer_ids_the_target_does_not_have(tiny_target_dir):
    """Where the target folder exists, check reads its config.json: no waiting for extract to say so."""
    done = subprocess.run(
        [sys.executable, "-m", "stage1_extract", "check", "--quiet", f"target.path={tiny_target_dir}", "target.layer_ids=[999]"],
        cwd=REPO, capture_output=True, text=True,
    )
    assert done.returncode == 2 and "target.layer_ids [999] names layer 999, but the target has 6 layers" in done.stderr


def test_a_renamed_key_names_its_new_name():
    with pytest.raises(ConfigError, match=r"sampler.token_budget: renamed to sampler.micro_batch_tokens"):
        load_run_config("configs/default.yaml", ["sampler.token_budget=4096"])
    with pytest.raises(ConfigError, match=r"extract.token_budget: renamed to extract.batch_tokens"):
        load_run_config("configs/default.yaml", ["extract.token_budget=4096"])
    with pytest.raises(ConfigError, match=r"eval.offline_token_budget: renamed to eval.offline_batch_tokens"):
        load_run_config("configs/default.yaml", ["eval.offline_token_budget=4096"])
    # Names that say what they mean (units, the section that owns the setting, one spelling).
    for old, new in (
        ("sampler.grad_accum=2", r"sampler.grad_accum: moved to train.grad_accum"),
        ("loss.ce_chunk=64", r"loss.ce_chunk: renamed to loss.ce_chunk_blocks"),
        ("extract.lm_head_chunk=64", r"extract.lm_head_chunk: renamed to extract.lm_head_chunk_tokens"),
        ("extract.max_batch_samples=8", r"extract.max_batch_samples: renamed to extract.max_samples_per_batch"),
        ("generate.chunk_size=8", r"generate.chunk_size: renamed to generate.rows_per_part"),
        ("train.prefetch=2", r"train.prefetch: renamed to train.prefetch_micro_batches"),
    ):
        with pytest.raises(ConfigError, match=new):
            load_run_config("configs/default.yaml", [old])
    # A whole section renamed: the live detectors' thresholds were the `doctor` section.
    with pytest.raises(ConfigError, match=r"^doctor: section renamed to detectors .*; write detectors:"):
        load_run_config("configs/default.yaml", ["doctor.spike_k=8"])
    assert load_run_config("configs/default.yaml", ["detectors.spike_k=8"]).detectors.spike_k == 8.0


def test_a_preset_is_found_by_name_from_any_folder(tmp_path, hub_8b):
    done = subprocess.run(
        [sys.executable, "-m", "stage2_train", "check", "--config", "qwen3-8b", "--quiet"],
        cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "stage2_train", "check", "--config", "no-such-preset"],
        cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 2 and "a path, or a preset name: cpu-long, default, llama-3.1-8b, qwen3-8b, recipe" in done.stderr


def test_check_explain_prints_every_key_with_its_documentation():
    done = subprocess.run(
        [sys.executable, "-m", "stage2_train", "check", "--explain", "loss.gamma=7"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )
    out = done.stdout
    assert "loss.kl_weight = 1.0   : float   (default 0.0)" in out and "Top-k KL against the stored target distribution" in out
    assert "train.epochs = 31   : int   (default 6)" in out  # the preset's value, and the default beside it
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


# ---- a small store shared by the tests below --------------------------------------------------------
@pytest.fixture(scope="module")
def store(tiny_target_dir, tmp_path_factory):
    """(stage-1 config, store path) of 24 chats from the tiny target, with two exact duplicates."""
    root = tmp_path_factory.mktemp("faults")
    rows = chat_rows(22)
    rows += [rows[3], rows[7]]  # copies: they must land on one side of the held-out split
    data = write_jsonl(root / "chat.jsonl", rows)
    cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, root / "run"))
    stage1.cmd_extract(cfg, progress=False)
    return cfg, Path(cfg.store.url(cfg.run_dir))


def train_overrides(target_dir, store_path, run_dir, **extra) -> list[str]:
    base = {
        "sampler.micro_batch_tokens": 512, "sampler.max_anchors_per_seq": 4, "model.block_size": 8, "loss.gamma": 4.0,
        "optim.lr": 3e-3, "train.max_steps": 6, "train.num_data_threads": 1, "checkpoint.every_steps": 2,
        "eval.holdout_fraction": 0.2, "eval.offline_max_samples": 3, "log.wandb": "disabled",
    }
    base.update(extra)
    return train_overrides_for(target_dir, store_path, run_dir, base)


def train_config(target_dir, store_path, run_dir, **extra):
    return load_run_config("configs/default.yaml", train_overrides(target_dir, store_path, run_dir, **extra))


def test_duplicates_are_counted_and_kept_on_one_side_of_the_split(store):
    import numpy as np

    from shared.reader import StoreReader
    from stage2_train.data.split import heldout_mask

    _, path = store
    reader = StoreReader(str(path))
    assert reader.manifest["num_duplicates"] == 2
    keys = reader.split_keys
    copies = [(3, 22), (7, 23)]  # input rows: original and copy
    where = {int(sid): i for i, sid in enumerate(reader.sample_ids)}
    for a, b in copies:
        assert keys[where[a]] == keys[where[b]]
    for seed in range(40):  # whatever the split, a copy never sits on the other side
        held = heldout_mask(keys, 0.3, seed)
        assert all(held[where[a]] == held[where[b]] for a, b in copies)
    assert len(np.unique(keys)) == len(keys) - 2


def test_nan_losses_stop_training_and_the_good_checkpoints_survive(store, tiny_target_dir, tmp_path, monkeypatch):
    from shared.errors import DivergedError
    from stage2_train.commands import cmd_train
    from stage2_train.train import trainer as trainer_mod
    from stage2_train.train.checkpoint.format import load_checkpoint
    from stage2_train.train.checkpoint.select import complete_checkpoints

    real = trainer_mod.dflash_loss
    calls = []

    def poisoned(*args, **kwargs):
        calls.append(1)
        loss, metrics = real(*args, **kwargs)
        return (loss * float("nan"), metrics) if len(calls) > 3 else (loss, metrics)

    monkeypatch.setattr(trainer_mod, "dflash_loss", poisoned)
    cfg = train_config(tiny_target_dir, store[1], tmp_path, **{"train.max_steps": 12, "train.max_nonfinite_steps": 2})
    with pytest.raises(DivergedError, match=r"3 optimizer steps in a row \(up to step 6\) had a non-finite loss"):
        cmd_train(cfg, progress=False)
    events = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    skipped = [e["step"] for e in events if e.get("event") == "nonfinite_step"]
    assert skipped == [4, 5, 6]
    # Step 4's save came after a skipped update: the weights of step 3, finite, as every one kept.
    kept = [p.name for p in complete_checkpoints(tmp_path / "checkpoints")]
    assert kept == ["step_000002", "step_000004"]
    for name in kept:
        weights = load_checkpoint(tmp_path / "checkpoints" / name)["model"]
        assert all(bool(w.isfinite().all()) for w in weights.values())


def test_the_count_of_non_finite_steps_in_a_row_survives_a_resume(store, tiny_target_dir, tmp_path, monkeypatch):
    """A diverging run relaunched (a preemption, a crash loop) must still stop at
    train.max_nonfinite_steps: its count in a row is carried in the checkpoint, not begun anew."""
    from shared.errors import DivergedError
    from stage2_train.commands import cmd_train
    from stage2_train.train import trainer as trainer_mod

    real, calls = trainer_mod.dflash_loss, []

    def poisoned(*args, **kwargs):
        calls.append(1)
        loss, metrics = real(*args, **kwargs)
        return (loss * float("nan"), metrics) if len(calls) > 3 else (loss, metrics)

    monkeypatch.setattr(trainer_mod, "dflash_loss", poisoned)
    settings = {"train.max_nonfinite_steps": 2, "train.resume": "auto"}
    cmd_train(train_config(tiny_target_dir, store[1], tmp_path, **{"train.max_steps": 4, **settings}), progress=False)
    # Step 4 was skipped and saved; the relaunch's steps 5 and 6 are the second and third in a row.
    with pytest.raises(DivergedError, match=r"3 optimizer steps in a row \(up to step 6\)"):
        cmd_train(train_config(tiny_target_dir, store[1], tmp_path, **{"train.max_steps": 12, **settings}), progress=False)


def test_resume_skips_a_damaged_checkpoint_and_says_so(store, tiny_target_dir, tmp_path, capfd):
    from stage2_train.commands import cmd_train

    cfg = train_config(tiny_target_dir, store[1], tmp_path, **{"train.max_steps": 4, "train.resume": "auto"})
    cmd_train(cfg, progress=False)
    newest = tmp_path / "checkpoints" / "step_000004" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[-100:-36] = bytes(64)  # same size, other bytes
    newest.write_bytes(bytes(data))
    more = train_config(tiny_target_dir, store[1], tmp_path, **{"train.max_steps": 6, "train.resume": "auto"})
    summary = cmd_train(more, progress=False)
    err = capfd.readouterr().err
    assert f"warning: skipping checkpoint {newest.parent}: model.safetensors does not match its checksum" in err
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    resume = [r for r in log if r.get("event") == "resume"][-1]
    assert resume["path"].endswith("step_000002") and resume["skipped"][0]["path"] == str(newest.parent)
    assert summary["steps"] == 6


def test_a_finished_run_run_again_trains_and_rewrites_nothing(store, tiny_target_dir, tmp_path):
    from stage2_train.commands import cmd_train

    cfg = train_config(tiny_target_dir, store[1], tmp_path, **{"train.max_steps": 4, "train.resume": "auto"})
    first = cmd_train(cfg, progress=False)
    final = tmp_path / "checkpoints" / "step_000004"
    stamp = {p.name: p.stat().st_mtime_ns for p in final.iterdir()}
    again = cmd_train(cfg, progress=False)
    assert again["already_complete"] and again["steps"] == 4
    assert again["final_train"] == first["final_train"] and again["final_train"]["loss"] is not None
    assert {p.name: p.stat().st_mtime_ns for p in final.iterdir()} == stamp


def test_a_refused_resume_leaves_train_config_yaml_as_it_was(store, tiny_target_dir, tmp_path):
    from shared.errors import CheckpointError
    from stage2_train.commands import cmd_train

    cfg = train_config(tiny_target_dir, store[1], tmp_path, **{"train.max_steps": 2, "train.resume": "auto"})
    cmd_train(cfg, progress=False)
    saved = (tmp_path / "train_config.yaml").read_text()
    other = train_config(tiny_target_dir, store[1], tmp_path, **{"train.resume": "auto", "loss.gamma": 5.0})
    with pytest.raises(CheckpointError, match=r"cannot resume: loss\.gamma: saved 4\.0, now 5\.0"):
        cmd_train(other, progress=False)
    assert (tmp_path / "train_config.yaml").read_text() == saved


@pytest.mark.parametrize(
    "change, named",
    [
        ({"eval.split_seed": 1}, r"eval\.split_seed: saved 0, now 1 \(the held-out split"),
        ({"eval.holdout_fraction": 0.3}, r"eval\.holdout_fraction: saved 0\.2, now 0\.3"),
        ({"model.num_layers": 2}, r"model\.num_layers: saved 1, now 2 \(the drafter's architecture"),
        ({"model.intermediate_size": 96}, r"model\.intermediate_size: saved None, now 96"),
        ({"model.feature_projection": "pca"}, r"model\.feature_projection: saved 'none', now 'pca'"),
        ({"loss.weighting": "decay"}, r"loss\.weighting: saved 'dpace', now 'decay' \(the position weights"),
        ({"loss.kl_weight": 0.0}, r"loss\.kl_weight: saved 1\.0, now 0\.0 \(the objective"),
    ],
)
def test_a_refused_resume_names_the_config_key_that_changed(store, tiny_target_dir, tmp_path, change, named):
    """Not the component that trips over it ("sampler state: num_samples was 20", a load_state_dict
    traceback): the setting the user changed, with both values."""
    from shared.errors import CheckpointError
    from stage2_train.commands import cmd_train

    cmd_train(train_config(tiny_target_dir, store[1], tmp_path, **{"train.max_steps": 2}), progress=False)
    other = train_config(tiny_target_dir, store[1], tmp_path, **{"train.max_steps": 4, **change})
    with pytest.raises(CheckpointError, match=named):
        cmd_train(other, progress=False)


def test_init_from_a_tensor_of_the_wrong_shape_is_named_with_both_shapes(store, tiny_target_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from shared.errors import CheckpointError
    from stage2_train.commands import cmd_export, cmd_train

    first = train_config(tiny_target_dir, store[1], tmp_path / "a", **{"train.max_steps": 1})
    cmd_train(first, progress=False)
    out = Path(cmd_export(first)["out_dir"])
    weights = load_file(out / "model.safetensors")
    wanted = tuple(weights["layers.0.mlp.up_proj.weight"].shape)
    weights["layers.0.mlp.up_proj.weight"] = weights["layers.0.mlp.up_proj.weight"][:-8].contiguous()
    save_file(weights, out / "model.safetensors")
    bad = train_config(tiny_target_dir, store[1], tmp_path / "b", **{"model.init_from": str(out)})
    shape = (wanted[0] - 8, wanted[1])
    with pytest.raises(CheckpointError, match=re.escape(f"layers.0.mlp.up_proj.weight has shape {shape}, this drafter's is {wanted}")):
        cmd_train(bad, progress=False)


def test_a_block_size_longer_than_every_sample_is_refused(store, tiny_target_dir, tmp_path):
    from stage2_train.commands import cmd_train

    cfg = train_config(tiny_target_dir, store[1], tmp_path, **{"model.block_size": 200, "loss.gamma": 7.0})
    with pytest.raises(ConfigError, match=r"model\.block_size=200 is longer than every sample .*\(the longest has \d+ tokens"):
        cmd_train(cfg, progress=False)
    with pytest.raises(ConfigError, match=r"model\.block_size must be in 2\.\.256"):
        load_run_config("configs/default.yaml", ["model.block_size=100000"])


def test_an_epoch_without_a_single_block_stops(store, tiny_target_dir, tmp_path, monkeypatch):
    from shared.errors import DataError
    from shared.reader import StoreReader
    from stage2_train.commands import cmd_train
    from stage2_train.data import anchors

    monkeypatch.setattr(anchors.AnchorSampler, "anchors", lambda self, mask, *, sample_id, epoch: mask.nonzero()[:0, 0])
    monkeypatch.setattr(StoreReader, "supervised_pairs", lambda self: 0 * self.lengths)  # the budget's counts agree
    cfg = train_config(tiny_target_dir, store[1], tmp_path, **{"train.max_steps": 50, "checkpoint.every_steps": 0})
    with pytest.raises(DataError, match=r"epoch 0 gave no block to train on"):
        cmd_train(cfg, progress=False)


# ---- damaged stores --------------------------------------------------------------------------------
@pytest.fixture
def store_copy(store, tmp_path):
    import shutil

    cfg, path = store
    copy = Path(shutil.copytree(path, tmp_path / "store"))
    (copy / LOCK_NAME).unlink(missing_ok=True)
    overrides = stage1_overrides(Path(cfg.target.path), Path(cfg.data.path), Path(cfg.run_dir), **{"store.path": str(copy)})
    return load_run_config("configs/default.yaml", overrides), copy


def edit_record(text: str, position: int, **edits) -> str:
    """manifest.json with shards[position]'s fields edited: None drops one, a callable maps its value."""
    manifest = json.loads(text)
    record = manifest["shards"][position]
    for field, edit in edits.items():
        if edit is None:
            del record[field]
        else:
            record[field] = edit(record[field])
    return json.dumps(manifest)


@pytest.mark.parametrize(
    "damage, what",
    [
        (lambda text: text[: len(text) // 2], "not valid JSON"),
        (lambda text: "[1, 2, 3]", "a JSON list, not an object"),
        (lambda text: json.dumps({**json.loads(text), "shards": None}), "'shards' missing or not a list"),
        (lambda text: edit_record(text, 0, sample_ids=None), r"shards\[0\] \(shard-000000-\w+\) has no 'sample_ids'"),
        (lambda text: edit_record(text, 0, lengths=lambda v: v[:-1]), r"shards\[0\] \(shard-000000-\w+\)\.lengths has \d+ entries, num_samples is \d+"),
        (lambda text: edit_record(text, 0, num_tokens=lambda v: str(v)), r"shards\[0\] \(shard-000000-\w+\)\.num_tokens is '\d+', not an integer"),
        (lambda text: edit_record(text, 0, lengths=lambda v: [v[0] + 5] + v[1:]), r"shards\[0\] \(\S+\)\.lengths sum to \d+, num_tokens is \d+"),
        (lambda text: edit_record(text, 0, supervised_pairs=lambda v: v[:-1]), r"shards\[0\] \(\S+\)\.supervised_pairs has \d+ entries, num_samples is \d+"),
        (lambda text: edit_record(text, 0, supervised_pairs=lambda v: [-1] + v[1:]), r"shards\[0\] \(\S+\)\.supervised_pairs\[0\] is -1, outside 0\.\.\d+"),
    ],
    ids=["torn", "a-list", "no-shards", "no-sample_ids", "lengths-short", "num_tokens-a-string", "lengths-sum", "pairs-short", "pairs-negative"],
)
def test_a_damaged_manifest_is_named_and_reprocess_rebuilds_it(store_copy, damage, what):
    from shared.errors import StoreError
    from shared.reader import StoreReader
    from shared.store import read_manifest

    cfg, copy = store_copy
    good = read_manifest(str(copy))
    manifest = copy / "manifest.json"
    manifest.write_text(damage(manifest.read_text()))
    with pytest.raises(StoreError, match=rf"manifest\.json is damaged \({what}.*run `python -m stage1_extract reprocess`"):
        StoreReader(str(copy))
    report = stage1.cmd_status(cfg)
    assert report["manifest_damaged"] and report["counts"]["missing"] == len(good["shards"])
    out = stage1.cmd_reprocess(cfg, progress=False)
    assert out["shards_extracted_here"] == 0  # the part records were intact: nothing re-extracted
    assert read_manifest(str(copy))["shards"] == good["shards"]


def test_a_shard_missing_an_array_is_named_with_its_fix(store_copy):
    import shutil

    from shared.errors import StoreError
    from shared.reader import StoreReader

    _, copy = store_copy
    reader = StoreReader(str(copy))
    name = reader.manifest["shards"][0]["name"]
    shutil.rmtree(copy / "shards" / name / "hidden")
    with pytest.raises(StoreError, match=rf"shard {name} lacks the array\(s\) \['hidden'\]; run `python -m stage1_extract verify --repair`"):
        StoreReader(str(copy))[0]


# ---- bad rows ---------------------------------------------------------------------------------------
def bad_row_config(tiny_target_dir, data, tmp_path, **extra):
    return load_run_config(
        "configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "run", **extra)
    )


def test_a_non_utf8_row_is_named_and_skippable(tiny_target_dir, tmp_path):
    from shared.errors import DataError

    rows = [json.dumps(r) for r in chat_rows(6)]
    data = tmp_path / "chat.jsonl"
    data.write_bytes(("\n".join(rows[:3]) + "\n").encode() + b'{"prompt": "caf\xe9"}\n' + ("\n".join(rows[3:]) + "\n").encode())
    with pytest.raises(DataError, match=r"chat\.jsonl: row 3: not UTF-8 \(byte 0xe9 at column 16\)"):
        stage1.cmd_plan(bad_row_config(tiny_target_dir, data, tmp_path))
    plan = stage1.cmd_plan(bad_row_config(tiny_target_dir, data, tmp_path, **{"data.on_bad_row": "skip"}))
    assert plan["samples"] == 6 and plan["bad_rows_skipped"] == 1


def test_a_row_with_nothing_to_supervise_respects_on_bad_row_and_names_truncation(tiny_target_dir, tmp_path):
    from shared.errors import DataError

    rows = chat_rows(4) + [{"messages": [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ok"}]}]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(DataError, match=r"row 4: no assistant tokens left to supervise after truncating to data\.max_length=256"):
        stage1.cmd_plan(bad_row_config(tiny_target_dir, data, tmp_path))
    plan = stage1.cmd_plan(bad_row_config(tiny_target_dir, data, tmp_path, **{"data.on_bad_row": "skip"}))
    assert plan["samples"] == 4 and plan["bad_rows_skipped"] == 1


def test_parquet_with_other_columns_or_not_parquet_at_all_is_named(tiny_target_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shared.errors import DataError

    wrong = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"question": ["a"], "answer": ["b"]}), wrong)
    with pytest.raises(DataError, match=r"wrong\.parquet: needs a `messages` column .* it has \['question', 'answer'\]"):
        stage1.cmd_plan(bad_row_config(tiny_target_dir, wrong, tmp_path))
    fake = tmp_path / "fake.parquet"
    fake.write_text('{"prompt": "this is JSON"}\n')
    with pytest.raises(DataError, match=r"fake\.parquet: not a readable Parquet file"):
        stage1.cmd_plan(bad_row_config(tiny_target_dir, fake, tmp_path))


def test_the_first_runs_max_samples_does_not_pin_small_shards(tiny_target_dir, tmp_path):
    from shared.store import StoreFiles

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(40))
    quick = bad_row_config(tiny_target_dir, data, tmp_path, **{"data.max_samples": 3, "store.shard_mb": 64})
    stage1.cmd_extract(quick, progress=False)
    pinned = StoreFiles(quick.store.url(quick.run_dir)).read_json("plan.json")["samples_per_shard"]
    assert pinned > 3  # computed from store.shard_mb, not the first shard's 3 rows


# ---- the doctor ---------------------------------------------------------------------------------------
def test_the_doctor_survives_a_torn_or_non_utf8_last_line_and_flags_steps_going_back(tmp_path):
    from stage2_train.observe.doctor import doctor
    from tests.test_doctor import trainer_records, write_log

    records = trainer_records(300)
    log = tmp_path / "train_log.jsonl"
    write_log(log, records[:200] + records[150:])  # a restart from step ~150 without a resume event
    with log.open("ab") as fh:
        fh.write(b'{"kind": "train", "step": 301, "loss": 0.5, "acc\xc3')  # a crash mid-character
    text, code = doctor(log, as_json=False)
    assert "1 unreadable line(s) skipped" in text
    assert "steps went back from" in text and "with no resume event" in text
    diagnosis = json.loads(doctor(log, as_json=True)[0])
    assert diagnosis["summary"]["unreadable_lines"] == 1 and len(diagnosis["summary"]["restarts"]) == 1


def test_the_doctor_uses_the_configured_thresholds(tmp_path):
    from stage2_train.observe.config import DetectorConfig
    from stage2_train.observe.doctor import doctor
    from tests.test_doctor import failed_run_records, write_log

    log = tmp_path / "train_log.jsonl"
    write_log(log, failed_run_records())
    strict = json.loads(doctor(log, True)[0])["summary"]["num_events"]
    lenient = json.loads(doctor(log, True, DetectorConfig(spike_k=1000, stall_k=1000, cliff_k=1000, throughput_k=1000))[0])
    assert strict > 0 and lenient["summary"]["num_events"] < strict


# ---- targets ------------------------------------------------------------------------------------------
def test_pickle_only_targets_are_refused_and_the_target_folder_is_never_written(tiny_target_dir, tmp_path):
    import shutil

    import torch

    from shared.fingerprints import weights_fingerprint
    from shared.target import TargetConfig
    from shared.target_model import load_target_model

    before = sorted(p.name for p in tiny_target_dir.iterdir())
    weights_fingerprint(tiny_target_dir)
    assert sorted(p.name for p in tiny_target_dir.iterdir()) == before  # no fingerprint file in the target
    pickled = Path(shutil.copytree(tiny_target_dir, tmp_path / "pickled"))
    from safetensors.torch import load_file

    state = load_file(pickled / "model.safetensors")
    (pickled / "model.safetensors").unlink()
    torch.save(state, pickled / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"holds only pickle \(\.bin\) weights.*target\.allow_pickle_weights=true"):
        load_target_model(TargetConfig(path=str(pickled)))
    assert load_target_model(TargetConfig(path=str(pickled), allow_pickle_weights=True)) is not None


def test_ranks_starting_together_hash_the_target_once(tiny_target_dir, tmp_path, monkeypatch):
    """Eight ranks of a fresh node each hashing a 16 GB target read it eight times over: the first
    hashes, the others wait for its cache entry."""
    import threading
    import time

    import shared.fingerprints as target_mod

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    real, hashed = target_mod.file_sha256, []

    def slow_sha256(path):
        hashed.append(path.name)
        time.sleep(0.2)  # long enough for every rank to arrive while the first hashes
        return real(path)

    monkeypatch.setattr(target_mod, "file_sha256", slow_sha256)
    values = []
    ranks = [threading.Thread(target=lambda: values.append(target_mod.weights_fingerprint(tiny_target_dir))) for _ in range(4)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()
    weights = sorted(p.name for p in tiny_target_dir.iterdir() if p.suffix in (".safetensors", ".bin"))
    assert len(values) == 4 and len(set(values)) == 1 and sorted(hashed) == weights


def test_an_fp32_target_on_a_gpu_with_flash_attn_installed_runs_sdpa(tiny_target_dir, monkeypatch):
    """flash-attn refuses fp32 at the first forward (transformers only warns at load): `eval`'s online
    target (eval.online_dtype fp32 by default) on a node with the gpu extra would die after the
    offline eval. auto picks SDPA for fp32; asking for flash-attn in fp32 is refused by name."""
    import importlib.util
    from types import SimpleNamespace

    import transformers

    from shared.target import TargetConfig
    from shared.target_model import pick_attn_implementation
    from stage2_train.serve.online_eval import load_online_target

    real_find_spec, loaded = importlib.util.find_spec, []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real_find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "flash_attn", ModuleType("flash_attn"))

    class Model(SimpleNamespace):
        def to(self, device):
            return self

        def eval(self):
            return self

        def requires_grad_(self, flag):
            return self

    def from_pretrained(path, **kwargs):
        loaded.append((kwargs["dtype"], kwargs["attn_implementation"]))
        return Model()

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    load_online_target(TargetConfig(path=str(tiny_target_dir)), "fp32", "cuda")
    load_online_target(TargetConfig(path=str(tiny_target_dir)), "bf16", "cuda")
    assert loaded == [(torch.float32, "sdpa"), (torch.bfloat16, "flash_attention_2")]
    with pytest.raises(ConfigError, match="flash_attention_2 cannot run an fp32 target.*target.attn_implementation=sdpa"):
        load_online_target(TargetConfig(path=str(tiny_target_dir), attn_implementation="flash_attention_2"), "fp32", "cuda")
    assert pick_attn_implementation("auto", "cpu", "bf16") == "sdpa"


def test_a_flash_attn_that_is_found_but_does_not_import_is_not_chosen(monkeypatch):
    """A flash-attn built for another torch is found on the path and fails at import (undefined
    symbol). auto picked it from find_spec alone and pinned flash-attn and packed batches into a new
    store's header; the target's load then failed, and a rerun with sdpa was refused as a changed setting."""
    import importlib.util

    from shared.target_model import pick_attn_implementation, runnable_problem

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real_find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import raises ImportError, as a broken build does
    assert pick_attn_implementation("auto", "cuda:0", "bf16") == "sdpa"
    assert "flash-attn package, importable" in runnable_problem({"attn_implementation": "flash_attention_2"}, "cuda:0")


def test_stop_tokens_come_from_tokenizer_and_generation_config_and_may_be_none():
    from types import SimpleNamespace

    from shared.target import stop_token_ids

    llama = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[128001, 128008, 128009]))
    assert stop_token_ids(SimpleNamespace(eos_token_id=128009), llama) == [128001, 128008, 128009]
    bare = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))
    assert stop_token_ids(SimpleNamespace(eos_token_id=None), bare) == []


def test_the_token_a_chat_template_ends_a_turn_with_stops_generation(tiny_target_dir):
    """A checkpoint whose EOS and generation config name another token than its chat template's turn
    end (a base model under a ChatML template) generated past the turn's end to max_new_tokens: the
    made-up next turn stored inside the answer, counted only as cut."""
    from transformers import AutoTokenizer

    from shared.target import stop_token_ids, turn_end_token_id

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokenizer.eos_token = "<|endoftext|>"
    assert turn_end_token_id(tokenizer) == im_end
    assert stop_token_ids(tokenizer) == sorted({tokenizer.eos_token_id, im_end})
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"  # no special end
    assert turn_end_token_id(tokenizer) is None


def test_training_can_start_from_an_exported_drafter(store, tiny_target_dir, tmp_path):
    """model.init_from: the export of one run is where the next run starts (a published drafter
    adapted to new data works the same way)."""
    from safetensors.torch import load_file

    from stage2_train.commands import cmd_export, cmd_train

    first = train_config(tiny_target_dir, store[1], tmp_path / "a", **{"train.max_steps": 2})
    cmd_train(first, progress=False)
    out = cmd_export(first)["out_dir"]
    exported = load_file(Path(out) / "model.safetensors")
    extra = {"train.max_steps": 1, "model.init_from": out, "optim.lr": 1e-12, "checkpoint.every_steps": 1}
    second = train_config(tiny_target_dir, store[1], tmp_path / "b", **extra)
    cmd_train(second, progress=False)
    started = load_file(tmp_path / "b" / "checkpoints" / "step_000001" / "model.safetensors")
    for name, tensor in exported.items():
        assert torch.allclose(started[name], tensor.float(), atol=1e-6), name
    start = [json.loads(x) for x in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()][0]
    assert start["hyperparameters"]["init_from"] == out
    card = (Path(cmd_export(second)["out_dir"]) / "README.md").read_text()
    assert f"| training | 1 optimizer steps, started from `{out}` (its own steps not counted) |" in card
    bad = train_config(tiny_target_dir, store[1], tmp_path / "c", **{"model.init_from": out, "model.num_layers": 2})
    from shared.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"num_hidden_layers=1 but this run has 2 \(model\.num_layers\)"):
        cmd_train(bad, progress=False)
    # On the same store with another split, the new run's held-out samples would be ones the first
    # drafter trained on: refused naming its split (from the export's record and from a checkpoint's).
    from shared.errors import ConfigError

    for source in (out, str(tmp_path / "a" / "checkpoints" / "step_000002")):
        other_split = train_config(tiny_target_dir, store[1], tmp_path / "d", **{"model.init_from": source, "eval.split_seed": 7})
        with pytest.raises(ConfigError, match=r"trained on this store with eval\.holdout_fraction=0\.2, eval\.split_seed=0 .* "
                                              r"would hold out samples it trained on\. Set eval\.holdout_fraction=0\.2 eval\.split_seed=0"):
            cmd_train(other_split, progress=False)


def test_a_missing_data_file_is_named_by_every_command(tiny_target_dir, tmp_path):
    """A config that reads another run's answers before that run made them."""
    from shared.errors import InputFileError

    missing = tmp_path / "runs" / "default" / "data" / "generated.parquet"
    cfg = bad_row_config(tiny_target_dir, missing, tmp_path)
    for command in (stage1.cmd_plan, stage1.cmd_extract):
        with pytest.raises(InputFileError, match=r"generated\.parquet"):
            command(cfg)


# ---- preemption -------------------------------------------------------------------------------------
def start_training(args, env_extra, tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests' / 'hooks'}:{REPO}", "OMP_NUM_THREADS": "1", **env_extra}
    return subprocess.Popen(
        [sys.executable, "-m", "stage2_train", "train", "--json", "--no-progress", *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def wait_until(condition, proc, timeout_s=120.0):
    """Until `condition()` holds (the test's own clock, generous: a slow machine only waits longer)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the condition never came"
        time.sleep(0.05)


def train_steps_logged(log):
    from stage2_train.observe.metrics import read_log

    return [r["step"] for r in read_log(log, "train")] if log.exists() else []


@pytest.mark.parametrize("signal_name", ["SIGTERM", pytest.param("SIGUSR1", marks=pytest.mark.slow)])
def test_a_preempted_run_saves_its_step_and_resumes_with_none_lost_or_repeated(tiny_target_dir, store, tmp_path, signal_name):
    """SIGTERM (or SLURM's SIGUSR1) mid-epoch: the step finishes, a checkpoint of it is written, a
    `preempted` event and marker say so, the exit code is 75; the rerun continues from that step
    and its losses equal an uninterrupted run's, every step logged exactly once."""
    import signal as signals

    from stage2_train import commands as stage2
    from stage2_train.observe.metrics import read_log
    from stage2_train.train.preemption import EXIT_PREEMPTED

    _, path = store
    extra = {"train.max_steps": 8, "checkpoint.every_steps": 5, "train.resume": "auto", "eval.every_steps": 1}
    reference = tmp_path / "reference"
    stage2.cmd_train(train_config(tiny_target_dir, path, reference, **extra), progress=False)
    run = tmp_path / "run"
    args = train_overrides(tiny_target_dir, path, run, **extra)
    proc = start_training(args, {"DFLASH_STEP_SLEEP_S": "0.3"}, tmp_path)
    wait_until(lambda: len(train_steps_logged(run / "train_log.jsonl")) >= 2, proc)
    proc.send_signal(getattr(signals, signal_name))
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, stderr[-3000:]
    events = read_log(run / "train_log.jsonl", "event")
    preempted = [e for e in events if e["event"] == "preempted"]
    assert len(preempted) == 1 and preempted[0]["signal"] == signal_name
    stopped = preempted[0]["step"]
    assert 2 <= stopped < 8 and (run / "checkpoints" / f"step_{stopped:06d}" / "meta.json").is_file()
    assert json.loads((run / "preempted.json").read_text())["step"] == stopped
    assert f"stopped by {signal_name} after step {stopped}" in stderr and "Traceback" not in stderr
    again = start_training(args, {}, tmp_path)
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr[-3000:]
    assert not (run / "preempted.json").exists()
    steps = train_steps_logged(run / "train_log.jsonl")
    assert steps == list(range(1, 9))  # none lost, none twice
    want = {r["step"]: r for r in read_log(reference / "train_log.jsonl", "train")}
    for row in read_log(run / "train_log.jsonl", "train"):
        assert row["loss"] == want[row["step"]]["loss"] and row["lr"] == want[row["step"]]["lr"], row["step"]
    # The eval due at the stopped step ran first on resume, and every epoch_end counts its whole epoch.
    def evals_and_epochs(log):
        rows = read_log(log)
        return ([r["step"] for r in rows if r["kind"] == "eval"],
                [(r["step"], r["blocks"]) for r in rows if r.get("event") == "epoch_end"])

    assert evals_and_epochs(run / "train_log.jsonl") == evals_and_epochs(reference / "train_log.jsonl")
    skipped = [e for e in read_log(run / "train_log.jsonl", "event") if e["event"] == "eval_skipped"]
    assert [(e["step"], e["reason"]) for e in skipped] == [(stopped, "preempted: the resumed run evaluates this step first")]


@pytest.mark.slow
def test_a_second_sigterm_during_the_save_leaves_the_previous_checkpoint(tiny_target_dir, store, tmp_path):
    """The first SIGTERM starts the final save; a second (or the cluster's SIGKILL) ends the process
    mid-write: the commit protocol keeps the previous checkpoint, which the rerun resumes from."""
    import signal as signals

    from stage2_train.train.checkpoint.select import latest_checkpoint, select_checkpoint

    _, path = store
    run = tmp_path / "run"
    saving = tmp_path / "saving"
    args = train_overrides(tiny_target_dir, path, run, **{"train.max_steps": 12, "checkpoint.every_steps": 2, "train.resume": "auto"})
    hooks = {"DFLASH_STEP_SLEEP_S": "0.2", "DFLASH_SAVE_SLEEP_S": "0.5", "DFLASH_SAVING_MARKER": str(saving)}
    proc = start_training(args, hooks, tmp_path)
    wait_until(lambda: latest_checkpoint(run / "checkpoints") is not None, proc)
    before = latest_checkpoint(run / "checkpoints").name
    saving.unlink(missing_ok=True)
    proc.send_signal(signals.SIGTERM)
    wait_until(saving.exists, proc)  # the preemption's save (or a periodic one) is writing now
    proc.send_signal(signals.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == -signals.SIGTERM  # killed, not a clean exit
    chosen = select_checkpoint(run / "checkpoints")
    assert chosen.path is not None and chosen.path.name >= before and chosen.skipped == []
    again = start_training(args, {}, tmp_path)
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr[-3000:]
    assert train_steps_logged(run / "train_log.jsonl")[-1] == 12


def test_train_before_extract_names_the_command_and_creates_nothing(tmp_path, tiny_target_dir):
    from shared.errors import StoreError
    from stage2_train.commands import cmd_train

    run_dir = tmp_path / "never-extracted"
    cfg = load_run_config("configs/default.yaml", [f"run_dir={run_dir}", f"target.path={tiny_target_dir}", "target.num_feature_layers=3"])
    with pytest.raises(StoreError, match=r"no store was extracted here: build it with `python -m stage1_extract generate`, "
                                         r"then `python -m stage1_extract extract` \(`make extract` runs both"):
        cmd_train(cfg, progress=False)
    assert not run_dir.exists()  # no log, no lock file, no wandb run, no folder
