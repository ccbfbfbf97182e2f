"""Checkpointer: exact round trip, bit-exact resume, non-blocking saves, atomicity, pruning, refusals.

.venv/bin/python -m pytest tests/test_checkpoint.py -q
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from shared.errors import CheckpointError, DivergedError
from stage2_train.train.checkpoint import format as ckpt_format
from stage2_train.train.checkpoint import saver as ckpt_mod
from stage2_train.train.checkpoint.format import (
    load_optimizer_state,
    optimizer_state,
    rng_state,
    set_rng_state,
)
from stage2_train.train.checkpoint.saver import Checkpointer, CheckpointWriteError
from stage2_train.train.checkpoint.select import (
    complete_checkpoints,
    latest_checkpoint,
    read_model_weights,
    select_checkpoint,
)
from stage2_train.train.config import CheckpointConfig
from stage2_train.train.resume import check_compatible, find_resume_point

REPO = Path(__file__).resolve().parents[1]


class RecordingSink:
    def __init__(self):
        self.events: list[tuple[str, int, dict]] = []

    def event(self, kind: str, step: int, **fields) -> None:
        self.events.append((kind, step, fields))

    def of(self, kind: str) -> list[tuple[int, dict]]:
        return [(step, fields) for k, step, fields in self.events if k == kind]


def make_checkpointer(path: Path, sink=None, **cfg) -> Checkpointer:
    return Checkpointer(CheckpointConfig(**cfg), path, sink)


# ---- a tiny training loop that uses all three RNGs ----------------------------------------------
class Run:
    def __init__(self, seed: int):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1.0 + 0.1 * s))
        self.step = 0

    def train_step(self) -> float:
        x = torch.from_numpy(np.random.randn(4, 8).astype(np.float32)) * random.uniform(0.5, 1.5)
        y = torch.randn(4, 4)
        loss = nn.functional.mse_loss(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.step += 1
        return loss.item()

    def state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": optimizer_state(self.opt),
            "scheduler": self.sched.state_dict(),
            "rng": rng_state(),
            "trainer": {"step": self.step, "epoch": 0},
            "config": {"model": {"block_size": 16}, "loss": {"gamma": 7.0}},
        }

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        load_optimizer_state(self.opt, state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.step = state["trainer"]["step"]


def assert_same(a, b, path="state"):
    """Equal values and equal types all the way down (a state dict's OrderedDict comes back a dict,
    a tuple a list; key order is not kept)."""
    if isinstance(a, OrderedDict):
        assert type(b) is dict, path
    elif isinstance(a, tuple):
        assert type(b) is list, path
    else:
        assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and b.device.type == "cpu", path
        assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def test_round_trip_is_exact(tmp_path):
    run = Run(0)
    for _ in range(3):
        run.train_step()
    state = run.state()
    state["extra"] = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "int64": torch.arange(6).view(2, 3).t(),  # not contiguous
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "bools": torch.tensor([True, False]),
        "nested": {"a": [1, 2.0, "x", None, [True, [3]]], "b": {"c": {"__tensor__": "a key that looks like a tag"}}},
        "list_of_dicts": [{"lr": 0.1, "params": [0, 1]}],
        "floats": [0.1, -0.0, 1e-310, float("inf"), float("nan"), 2**70],
        "none": None,
    }
    sink = RecordingSink()
    ckpt = make_checkpointer(tmp_path, sink)
    assert ckpt.save(3, lambda: state, blocking=True)
    path = tmp_path / "step_000003"
    assert ckpt.latest() == path
    assert (tmp_path / "latest").read_text() == "step_000003\n"
    assert sorted(p.name for p in path.iterdir()) == [
        "meta.json",
        "model.safetensors",
        "rank_00000.json",
        "rank_00000.safetensors",
        "shared.json",
        "shared.safetensors",
    ]
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 3 and meta["world_size"] == 1 and meta["keys"] == list(state)

    loaded = ckpt.load(path)
    assert_same(state, loaded)
    # the drafter weights under the model's own names, readable by any safetensors loader
    model_file = load_file(path / "model.safetensors")
    assert sorted(model_file) == sorted(state["model"])
    assert_same(dict(state["model"]), {name: model_file[name] for name in state["model"]})
    ((step, end),) = sink.of("checkpoint_end")
    assert step == 3 and end["mode"] == "sync" and end["path"] == str(path)
    assert end["bytes"] == sum(p.stat().st_size for p in path.iterdir())
    assert sink.of("checkpoint_start") == [(3, {"waited_s": 0.0})]


def test_resume_is_bit_exact_and_saving_changes_nothing(tmp_path):
    reference = Run(0)
    ref_losses = [reference.train_step() for _ in range(12)]

    first = Run(0)
    ckpt = make_checkpointer(tmp_path, every_steps=3)
    losses = []
    for _ in range(6):
        losses.append(first.train_step())
        ckpt.maybe_save(first.step, first.state)  # async: training goes on while it writes
    ckpt.finalize()
    assert losses == ref_losses[:6]

    resumed = Run(123)  # other seeds, other weights: everything must come from the checkpoint
    path = ckpt.latest()
    assert path.name == "step_000006"
    resumed.load(ckpt.load(path))
    assert [resumed.train_step() for _ in range(6)] == ref_losses[6:]
    for (name, a), b in zip(reference.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def big_state(num_mb: int) -> dict:
    weight = torch.arange(num_mb * 2**18, dtype=torch.float32)
    return {"model": {"w": weight}, "optimizer": {"state": {"0": {"exp_avg": weight * 2}}, "param_groups": []}}


def test_async_save_returns_before_the_write_and_snapshots_a_copy(tmp_path, monkeypatch):
    state = big_state(32)  # 64 MB of tensors
    release = threading.Event()
    real_write = ckpt_mod.write_part

    def held_write(*args):
        assert release.wait(20)
        return real_write(*args)

    monkeypatch.setattr(ckpt_mod, "write_part", held_write)
    sink = RecordingSink()
    ckpt = make_checkpointer(tmp_path, sink, every_steps=1)
    assert ckpt.maybe_save(1, lambda: state)
    assert ckpt.busy  # returned while the writer is still held
    state["model"]["w"].fill_(-1.0)  # the loop changes its tensors at once
    state["optimizer"]["state"]["0"]["exp_avg"].zero_()
    release.set()
    ckpt.finalize()
    loaded = ckpt.load(ckpt.latest())
    expected = big_state(32)
    assert torch.equal(loaded["model"]["w"], expected["model"]["w"])
    assert torch.equal(
        loaded["optimizer"]["state"]["0"]["exp_avg"], expected["optimizer"]["state"]["0"]["exp_avg"]
    )
    ((_, end),) = sink.of("checkpoint_end")
    assert end["mode"] == "async" and end["blocked_s"] < end["write_s"]


def test_buffers_are_allocated_in_the_background_before_the_first_save(tmp_path):
    state = big_state(4)
    sink = RecordingSink()
    ckpt = make_checkpointer(tmp_path, sink, every_steps=3)
    assert not ckpt.maybe_save(1, lambda: state)  # allocates, off the loop
    ckpt.finalize()
    buffers = dict(ckpt._snapshots.buffers)
    assert sorted(buffers) == ["model/w", "shared/optimizer/state/0/exp_avg"]
    assert ckpt.maybe_save(3, lambda: state)
    ckpt.finalize()
    assert all(ckpt._snapshots.buffers[k] is buffers[k] for k in buffers)  # the snapshot used them
    assert torch.equal(ckpt.load(ckpt.latest())["model"]["w"], state["model"]["w"])
    assert [kind for kind, _, _ in sink.events] == ["checkpoint_start", "checkpoint_end"]


def test_due_save_waits_for_the_one_in_flight_and_logs_it(tmp_path, monkeypatch):
    real_write = ckpt_mod.write_part
    release = threading.Event()

    def held_write(*args):
        release.wait()  # step 1's write stays in flight until the test lets it go
        return real_write(*args)

    monkeypatch.setattr(ckpt_mod, "write_part", held_write)
    sink = RecordingSink()
    ckpt = make_checkpointer(tmp_path, sink, every_steps=1)
    state = big_state(1)
    assert ckpt.maybe_save(1, lambda: state)
    second = threading.Thread(target=lambda: ckpt.maybe_save(2, lambda: state))
    second.start()  # due while step 1 writes: waits, never skips
    second.join(timeout=0.2)
    assert second.is_alive(), "the due save did not wait for the one in flight"
    release.set()
    second.join()
    ckpt.finalize()
    kinds = [(kind, step) for kind, step, _ in sink.events]
    assert kinds == [
        ("checkpoint_start", 1),
        ("checkpoint_end", 1),
        ("checkpoint_start", 2),
        ("checkpoint_end", 2),
    ]
    waited = sink.of("checkpoint_start")[1][1]["waited_s"]
    assert waited > 0.1 and sink.of("checkpoint_end")[1][1]["blocked_s"] >= waited
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000001", "step_000002"]
    assert not ckpt.save(2, lambda: state)  # the final save of an already saved step is skipped


def test_writer_error_surfaces_on_the_next_call_naming_the_path(tmp_path, monkeypatch):
    ckpt = make_checkpointer(tmp_path, every_steps=2)
    state = big_state(1)
    ckpt.maybe_save(2, lambda: state)
    ckpt.finalize()

    def failing_write(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_mod, "write_part", failing_write)
    assert ckpt.maybe_save(4, lambda: state)
    ckpt._thread.join()  # the background write has failed; the next call reports it
    with pytest.raises(CheckpointWriteError, match="step_000004") as info:
        ckpt.maybe_save(5, lambda: state)
    assert isinstance(info.value.__cause__, OSError)
    # A full disk says what is free and what to change, and the partial save is gone at once.
    assert "GiB are free on" in str(info.value) and "checkpoint.dir" in str(info.value)
    assert not (tmp_path / ".tmp-step_000004").exists()
    assert ckpt.latest().name == "step_000002"


def test_finalize_reraises_a_writer_error(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_mod, "write_part", lambda *a: 1 / 0)
    ckpt = make_checkpointer(tmp_path)
    ckpt.save(7, lambda: big_state(1))
    with pytest.raises(CheckpointWriteError, match="step_000007"):
        ckpt.finalize()


CRASH_SCRIPT = """
import os, sys, time, torch
from stage2_train.train.checkpoint import format as ckpt_format
from stage2_train.train.checkpoint import saver as ckpt_mod
ckpt = ckpt_mod.Checkpointer(ckpt_mod.CheckpointConfig(every_steps=5), sys.argv[1])
state = {"model": {"w": torch.arange(1000.0)}, "optimizer": {"step": 5}, "trainer": {"step": 5}}
ckpt.maybe_save(5, lambda: state)
ckpt.finalize()
real_write = ckpt_mod.write_part
def dying_write(directory, stem, *rest):
    if stem == "model":
        return real_write(directory, stem, *rest)
    with open(directory / (stem + ".safetensors"), "wb") as f:
        f.write(b"half a file")
    print("WRITING", flush=True)
    time.sleep(60)
ckpt_mod.write_part = dying_write
state["trainer"]["step"] = 10
ckpt.maybe_save(10, lambda: state)
time.sleep(60)
"""


def test_sigkill_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASH_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout.readline() == b"WRITING\n"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    assert (tmp_path / ".tmp-step_000010" / "model.safetensors").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000005"
    ckpt = make_checkpointer(tmp_path)
    assert not list(tmp_path.glob(".tmp-*"))
    state = ckpt.load(ckpt.latest())
    assert state["trainer"] == {"step": 5} and torch.equal(state["model"]["w"], torch.arange(1000.0))


def test_keep_latest_k_prunes_and_latest_falls_back(tmp_path):
    ckpt = make_checkpointer(tmp_path, every_steps=1, keep_latest_k=2)
    for step in range(1, 6):
        ckpt.maybe_save(step, lambda: big_state(1))
    ckpt.finalize()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000004", "step_000005"]

    (tmp_path / "step_000005" / "rank_00000.json").unlink()  # damaged: latest falls back
    assert ckpt.latest().name == "step_000004"
    with pytest.raises(CheckpointError, match="incomplete"):
        ckpt.load(tmp_path / "step_000005")
    (tmp_path / "latest").write_text("step_000004\n")
    ckpt.save(6, lambda: big_state(1), blocking=True)
    ckpt.save(7, lambda: big_state(1), blocking=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step_000005",
        "step_000006",
        "step_000007",
    ]
    (tmp_path / "latest").write_text("step_000006\n")  # a newer directory than the pointer is not trusted
    assert ckpt.latest().name == "step_000006"


def test_resuming_from_an_older_step_prunes_nothing_newer(tmp_path):
    ckpt = make_checkpointer(tmp_path, every_steps=1, keep_latest_k=2)
    for step in (10, 20, 30, 21):  # 21: a run resumed from step 20
        ckpt.save(step, lambda: big_state(1), blocking=True)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000020", "step_000021", "step_000030"]
    assert ckpt.latest().name == "step_000021"
    ckpt.save(22, lambda: big_state(1), blocking=True)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000021", "step_000022", "step_000030"]


def test_compatibility_refusal_names_the_field_and_both_values():
    saved = {
        "model": {"block_size": 16},
        "loss": {"gamma": 7.0},
        "sampler": {"micro_batch_tokens": 8192},
        "train": {"grad_accum": 4},
        "target": {"layer_ids": None},
        "resolved": {"layer_ids": [1, 14, 27], "world_size": 8},
    }
    assert check_compatible(saved, json.loads(json.dumps(saved)), force=False) == []
    current = json.loads(json.dumps(saved))
    current["model"]["block_size"] = 8
    current["resolved"]["world_size"] = 2
    with pytest.raises(
        ValueError, match=r"model\.block_size: saved 16, now 8.*resolved\.world_size: saved 8, now 2"
    ):
        check_compatible(saved, current, force=False)
    assert len(check_compatible(saved, current, force=True)) == 2
    # tuples and lists compare equal; the fingerprint is compared only when both runs recorded one
    current = json.loads(json.dumps(saved))
    current["resolved"]["layer_ids"] = (1, 14, 27)
    current["resolved"]["target_fingerprint"] = "abc"
    assert check_compatible(saved, current) == []
    saved["resolved"]["target_fingerprint"] = "def"
    with pytest.raises(ValueError, match="resolved.target_fingerprint: saved 'def', now 'abc'"):
        check_compatible(saved, current)
    del current["train"]["grad_accum"]
    with pytest.raises(ValueError, match="train.grad_accum: saved 4, now <absent>"):
        check_compatible(saved, current, force=False)


def test_another_variant_is_reported_once_as_the_variant():
    """A DSpark run resuming a DFlash checkpoint: model.variant names it; the heads its description
    gains (markov_rank, ...) are not reported again as the drafter's description."""
    saved = {"model": {"variant": "dflash", "markov_rank": 256, "block_size": 16}}
    current = {"model": {"variant": "dspark", "markov_rank": 256, "block_size": 16}}
    before = {"variant": "dflash", "block_size": 16}
    now = {"variant": "dspark", "block_size": 16, "markov_rank": 256, "markov_head": "vanilla", "confidence_head": True}
    # refused even when forced (its weights do not fit), naming the variant once and what starts anew
    with pytest.raises(CheckpointError) as refused:
        check_compatible(saved, current, force=True, saved_drafter=before, drafter=now)
    message = str(refused.value)
    assert message.startswith("cannot resume: model.variant: saved 'dflash', now 'dspark' (the drafter's architecture and its "
                              "labels (dspark predicts one token further))")
    assert "markov_rank" not in message and "train.resume=never" in message
    # the same variant with other head sizes: once, as its setting
    resized = {"model": {**current["model"], "markov_rank": 64}}
    with pytest.raises(CheckpointError, match=r"cannot resume: model\.markov_rank: saved 256, now 64 \(the DSpark heads \(their weights "
                                              r"would not fit\)\) \("):
        check_compatible(current, resized, force=True, saved_drafter=now, drafter={**now, "markov_rank": 64})


@pytest.mark.parametrize("field, before, after", [("markov_head", "vanilla", "gated"), ("confidence_head", True, False)])
def test_another_dspark_head_kind_is_refused_even_when_forced(field, before, after):
    """A vanilla and a gated Markov head, a drafter with and without a confidence head, hold other modules:
    the refusal offered train.resume_force and model.init_from, and the forced resume then failed to load
    the checkpoint's weights (check_fit: missing markov_head.gate_proj.*)."""
    from stage2_train.model.config import DrafterConfig
    from stage2_train.model.description import describe_parts
    from stage2_train.model.drafter import build_drafter
    from tests.test_model import MASK_ID, tiny_arch

    saved = {"model": {"variant": "dspark", "block_size": 16, field: before}}
    current = {"model": {"variant": "dspark", "block_size": 16, field: after}}
    with pytest.raises(CheckpointError) as refused:
        check_compatible(saved, current, force=True, checkpoint="ckpt/step_000002")
    message = str(refused.value)
    assert f"its weights do not fit this drafter (model.{field})" in message
    assert "set train.resume_force=true" not in message and "model.init_from" not in message
    arch = tiny_arch()
    keys = [set(build_drafter(describe_parts(DrafterConfig(variant="dspark", num_layers=1, markov_rank=4, **{field: v}), arch,
                                             [1, 3], MASK_ID), torch.zeros(arch.vocab_size, arch.hidden_size),
                              torch.zeros(arch.vocab_size, arch.hidden_size)).state_dict()) for v in (before, after)]
    assert keys[0] != keys[1]  # the reason: other weight names


def test_another_optimizer_is_refused_even_when_forced_naming_the_weights_as_a_start():
    """The checkpoint's optimizer state is its optimizer's: Muon's momentum over the matrices and AdamW's
    moments over the rest, or AdamW's over every parameter. train.resume_force cannot load it into
    another optimizer (it crashed there, after the forced resume was announced): refused by name,
    offering the weights."""
    saved = {"optim": {"name": "muon"}, "model": {"block_size": 16}}
    current = {"optim": {"name": "adamw"}, "model": {"block_size": 16}}
    for before, now in ((saved, current), (current, saved)):
        with pytest.raises(CheckpointError) as refused:
            check_compatible(before, now, force=True, checkpoint="ckpt/step_000002")
        message = str(refused.value)
        assert "optim.name" in message and "model.init_from=ckpt/step_000002" in message
        assert "set train.resume_force=true" not in message


def test_a_setting_neither_drafter_reads_is_no_change_to_resume():
    """model.markov_rank on a DFlash run, projection_dim with no projection, a window with no sliding
    layer: `check` says they do nothing, so resuming across them is no change (it was refused as
    weights that do not fit, even when forced)."""
    base = {"model": {"variant": "dflash", "markov_rank": 256, "projection_dim": None, "feature_projection": "none",
                      "sliding_window": None, "layer_types": None}, "loss": {"selector_weight": 1.0}}
    for change in ({"markov_rank": 64}, {"projection_dim": 32}, {"sliding_window": 8}):
        assert check_compatible(base, {**base, "model": {**base["model"], **change}}) == []
    assert check_compatible(base, {**base, "loss": {"selector_weight": 2.0}}) == []


def test_a_checkpoint_saved_before_a_rename_resumes_under_the_new_name():
    """A config saved by a checkpoint before sampler.token_budget became sampler.micro_batch_tokens
    (eval.offline_token_budget -> offline_batch_tokens): the same value is no change, another is
    refused naming the new key, and the resume event lists one change, not a removal and an addition."""
    from stage2_train.train.resume import config_changes

    written_then = {"sampler": {"token_budget": 8192, "grad_accum": 4}, "eval": {"offline_token_budget": 4096}}
    now = {"sampler": {"micro_batch_tokens": 8192}, "train": {"grad_accum": 4}, "eval": {"offline_batch_tokens": 4096}}
    assert check_compatible(written_then, now) == [] and config_changes(written_then, now) == {}
    now["sampler"]["micro_batch_tokens"] = 4096
    with pytest.raises(ValueError, match=r"sampler\.micro_batch_tokens: saved 8192, now 4096"):
        check_compatible(written_then, now)
    assert config_changes(written_then, now) == {"sampler.micro_batch_tokens": [8192, 4096]}


def test_a_resume_across_the_doctor_to_detectors_rename_sees_no_change():
    """Checkpoints written before the `doctor` section became `detectors` hold the thresholds under
    the old name: the resume is accepted and its event lists only what really changed."""
    from stage2_train.observe.config import DetectorConfig
    from stage2_train.train.resume import config_changes

    thresholds = DetectorConfig().to_dict()
    saved = {"model": {"block_size": 16}, "doctor": dict(thresholds, spike_k=8.0)}
    current = {"model": {"block_size": 16}, "detectors": dict(thresholds)}
    assert check_compatible(saved, current) == []
    assert config_changes(saved, current) == {"detectors.spike_k": [8.0, 6.0]}


def test_config_is_validated_and_state_is_plain_data(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint\.keep_latest_k must be >= 2"):
        CheckpointConfig(keep_latest_k=1)
    with pytest.raises(ValueError, match=r"checkpoint\.every_steps"):
        CheckpointConfig.from_dict({"every_steps": -1})
    with pytest.raises(ValueError, match=r"checkpoint\.every: unknown key"):
        CheckpointConfig.from_dict({"every": 5})
    assert CheckpointConfig().resolve_dir("runs/x") == Path("runs/x/checkpoints")
    ckpt = make_checkpointer(tmp_path)
    for bad, where in (
        ({"sampler": {"obj": object()}}, r"sampler/obj: cannot store a object"),
        ({"optimizer": {"state": {0: {}}}}, r"optimizer/state: key 0 must be a string"),
        ({"rng": {"numpy": np.arange(3)}}, r"rng/numpy: cannot store a ndarray"),
        ({"rng": {"cuda": [torch.zeros(2)]}}, r"rng/cuda/0: a tensor inside a list"),
    ):
        with pytest.raises(TypeError, match=where):
            ckpt.save(1, lambda bad=bad: bad, blocking=True)
    assert not ckpt.maybe_save(1, lambda: {})  # every_steps=0: only the trainer's final save


DDP_SCRIPT = """
import sys, torch, torch.distributed as dist
from stage2_train.train.checkpoint import format as ckpt_format
from stage2_train.train.checkpoint import saver as ckpt_mod
rank, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
ckpt = ckpt_mod.Checkpointer(ckpt_mod.CheckpointConfig(every_steps=1), path, None, rank, 2)
def state(step):
    return {"model": {"w": torch.full((4,), float(step))}, "optimizer": {"lr": 0.1},
            "rng": {"torch": torch.full((3,), 10 * rank + step, dtype=torch.uint8)}, "trainer": {"step": step}}
for step in (1, 2):
    ckpt.maybe_save(step, lambda: state(step))
ckpt.finalize()
loaded = ckpt.load(ckpt.latest())
assert loaded["rng"]["torch"].tolist() == [10 * rank + 2] * 3 and loaded["model"]["w"].tolist() == [2.0] * 4
if rank == 1:
    ckpt_mod.write_part = lambda *a: 1 / 0
ckpt.maybe_save(3, lambda: state(3))
try:
    ckpt.finalize()
except ckpt_mod.CheckpointWriteError as exc:
    print("FAILED", rank, exc.__cause__, flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow  # two fresh interpreters importing torch on 2 shared cores: ~12 s
def test_two_ranks_write_their_own_state_and_agree_before_commit(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DDP_SCRIPT, str(rank), str(port), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err.decode()[-2000:] for _, err in outs]
    assert outs[0][0].decode() == "FAILED 0 another rank failed to write its part\n"
    assert outs[1][0].decode() == "FAILED 1 division by zero\n"
    path = latest_checkpoint(tmp_path)
    assert path.name == "step_000002"  # step 3 was never committed
    assert sorted(p.name for p in path.iterdir()) == [
        "meta.json",
        "model.safetensors",
        "rank_00000.json",
        "rank_00000.safetensors",
        "rank_00001.json",
        "rank_00001.safetensors",
        "shared.json",
        "shared.safetensors",
    ]
    for rank in (0, 1):
        state = ckpt_mod.load_checkpoint(path, rank)
        assert state["rng"]["torch"].tolist() == [10 * rank + 2] * 3
        assert state["optimizer"] == {"lr": 0.1} and state["trainer"] == {"step": 2}
    with pytest.raises(CheckpointError, match="saved by 2 rank"):
        ckpt_mod.load_checkpoint(path, 2)


# ---- damaged checkpoints: one rule everywhere (issue: faults and bad input) ---------------------------
def damage(path: Path, offset: int = 200, size: int = 64) -> None:
    """Overwrite bytes inside a file without changing its size (a silent disk or copy error)."""
    data = bytearray(path.read_bytes())
    data[offset : offset + size] = os.urandom(size)
    path.write_bytes(bytes(data))


def test_damaged_tensor_bytes_are_caught_by_the_checksum_and_skipped_with_a_reason(tmp_path):
    ckpt = make_checkpointer(tmp_path, every_steps=1, keep_latest_k=3)
    for step in (1, 2):
        ckpt.save(step, lambda step=step: {"model": {"w": torch.full((4096,), float(step))}, "trainer": {"step": step}}, blocking=True)
    damage(tmp_path / "step_000002" / "model.safetensors", offset=1000)  # same size: looks complete
    assert latest_checkpoint(tmp_path).name == "step_000002"  # sizes alone cannot tell
    with pytest.raises(CheckpointError, match=r"step_000002: model.safetensors does not match its checksum"):
        ckpt.load(tmp_path / "step_000002")
    selection = select_checkpoint(tmp_path)
    assert selection.path.name == "step_000001"
    assert selection.skipped == [(str(tmp_path / "step_000002"), "model.safetensors does not match its checksum (damaged)")]
    weights, source = read_model_weights(tmp_path)  # export and eval choose the same way
    assert source == tmp_path / "step_000001" / "model.safetensors" and weights["w"][0] == 1.0


def test_a_damaged_header_and_a_truncated_file_are_skipped_too(tmp_path):
    ckpt = make_checkpointer(tmp_path, keep_latest_k=4)
    for step in (1, 2, 3):
        ckpt.save(step, lambda: big_state(1), blocking=True)
    damage(tmp_path / "step_000003" / "model.safetensors", offset=0, size=8)  # the safetensors header
    path = tmp_path / "step_000002" / "rank_00000.json"
    path.write_bytes(path.read_bytes()[:-3])  # truncated
    selection = select_checkpoint(tmp_path)
    assert selection.path.name == "step_000001"
    assert [why for _, why in selection.skipped] == [
        "model.safetensors does not match its checksum (damaged)",
        "incomplete: meta.json missing or damaged, or a file missing or truncated",
    ]


def test_non_finite_weights_are_never_saved_and_earlier_checkpoints_stay(tmp_path):
    ckpt = make_checkpointer(tmp_path, every_steps=1)
    ckpt.save(1, lambda: big_state(1), blocking=True)
    bad = big_state(1)
    bad["model"]["w"][7] = float("nan")
    with pytest.raises(DivergedError, match=r"refusing to save step 2: model weight w holds 1 non-finite"):
        ckpt.save(2, lambda: bad, blocking=True)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000001"]
    assert latest_checkpoint(tmp_path).name == "step_000001"


@pytest.mark.parametrize("keep", [2, 3, 5])
def test_pruning_keeps_exactly_keep_latest_k_and_never_more_than_it_should_delete(tmp_path, keep):
    ckpt = make_checkpointer(tmp_path, keep_latest_k=keep)
    kept = []
    for step in range(1, 8):
        ckpt.save(step, lambda: big_state(1), blocking=True)
        kept = [p.name for p in complete_checkpoints(tmp_path)]
        expected = [f"step_{s:06d}" for s in range(max(1, step - keep + 1), step + 1)]
        assert kept == expected, (step, kept)


def test_keep_best_points_at_the_best_eval_and_pruning_never_takes_it(tmp_path):
    """checkpoint.keep_best: an eval whose walk_tau beats the earlier ones saves its step and points
    `best` at it once committed; later saves prune around it; eval/export resolve `best`."""
    from stage2_train.train.checkpoint.select import resolve_checkpoint

    sink = RecordingSink()
    ckpt = make_checkpointer(tmp_path, sink, every_steps=2, keep_latest_k=2, keep_best=True)
    state = lambda: big_state(1)  # noqa: E731
    for step, walk_tau in ((2, 1.10), (4, 1.30), (6, 1.20), (8, 1.25)):
        ckpt.note_eval(step, walk_tau, state)
        ckpt.maybe_save(step, state)
        ckpt.finalize()
    for step in (10, 12):
        ckpt.maybe_save(step, state)
        ckpt.finalize()
    assert json.loads((tmp_path / "best").read_text()) == {"step": 4, "metric": "walk_tau", "value": 1.3}
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000004", "step_000010", "step_000012"]
    assert resolve_checkpoint("best", tmp_path).name == "step_000004"
    assert [step for step, _ in sink.of("best_checkpoint")] == [2, 4]
    again = make_checkpointer(tmp_path, every_steps=2, keep_best=True)  # a resume remembers the best value
    assert again.best_value == 1.3 and not again.note_eval(14, 1.29, state)
    # evals that sample anchors have no walk_tau: the pointer switches metric instead of comparing across
    assert again.note_eval(14, 1.05, state, metric="accept_len") and again.best_metric == "accept_len"
    (tmp_path / "best").write_text(json.dumps({"step": 4, "walk_tau": 1.3}))  # a pointer written before it named its metric
    older = make_checkpointer(tmp_path, every_steps=2, keep_best=True)
    assert (older.best_metric, older.best_value) == ("walk_tau", 1.3)


def test_a_checkpoint_of_another_rank_count_is_refused_not_skipped(tmp_path):
    """Skipping it would start afresh and later overwrite it at the same step numbers: every rank
    reads the same meta.json and refuses alike, naming the launch that resumes it."""
    ckpt = make_checkpointer(tmp_path, every_steps=1)
    ckpt.save(3, lambda: big_state(1), blocking=True)
    meta_path = tmp_path / "step_000003" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["world_size"] = 4  # as a 4-rank run would have written it
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"saved by 4 rank\(s\), this run has 1.*--nproc_per_node 4"):
        make_checkpointer(tmp_path).select()
    # named by path (train.resume=<dir>) alike, not loaded, nor called damaged
    with pytest.raises(CheckpointError, match=r"saved by 4 rank\(s\), this run has 1.*--nproc_per_node 4"):
        find_resume_point(str(tmp_path / "step_000003"), False, make_checkpointer(tmp_path), {"config": {}}, 0)


def test_best_is_pointed_at_a_save_that_committed_while_the_eval_ran(tmp_path, monkeypatch):
    """The final eval names step S the best while the writer thread, having committed S, is still
    busy (pruning, agreeing with the other ranks): the pointer must still be written, once."""
    real_commit = Checkpointer._commit

    def commit_then_linger(self, job, tmp):
        real_commit(self, job, tmp)
        time.sleep(0.3)  # the thread has read _best_step already, and is still alive

    monkeypatch.setattr(Checkpointer, "_commit", commit_then_linger)
    sink = RecordingSink()
    ckpt = make_checkpointer(tmp_path, sink, every_steps=4, keep_best=True)
    state = lambda: big_state(1)  # noqa: E731
    assert ckpt.maybe_save(4, state)
    deadline = time.monotonic() + 30
    while not (tmp_path / "latest").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ckpt.busy and ckpt.note_eval(4, 1.7, state)
    ckpt.finalize()
    assert json.loads((tmp_path / "best").read_text()) == {"step": 4, "metric": "walk_tau", "value": 1.7}
    assert [step for step, _ in sink.of("best_checkpoint")] == [4]


# ---- NFS: another node's rank file, late or hidden from rank 0's listing (issue 34, item 4) -----------
def small_rank_state(step: int) -> dict:
    return {"model": {"w": torch.ones(4)}, "optimizer": {"lr": 0.1}, "trainer": {"step": step}, "rng": {"t": torch.zeros(2)}}


def as_rank_0_of_2(ckpt: Checkpointer) -> Checkpointer:
    """Rank 0 of two, whose rank 1 runs on another node: the file system is the only thing they
    share here (the agreement collective, which says rank 1 wrote its files, is taken as passed)."""
    ckpt.world_size = 2
    return ckpt


def test_meta_lists_a_rank_file_that_shows_late_and_is_hidden_from_the_listing(tmp_path, monkeypatch):
    ckpt = as_rank_0_of_2(make_checkpointer(tmp_path))
    tmp = tmp_path / ".tmp-step_000001"

    def other_node_writes_late():  # rank 1's files appear 0.5 s after rank 0 starts its commit
        deadline = time.monotonic() + 30
        while not (tmp / "rank_00000.json").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)
        ckpt_mod.write_part(tmp, "rank_00001", {"trainer": {"step": 1}}, {"rng/t": torch.ones(2)})

    real_iterdir, real_scandir, real_listdir = Path.iterdir, os.scandir, os.listdir
    hidden = lambda name: str(name).rsplit("/", 1)[-1].startswith("rank_00001")  # noqa: E731 - NFS's cached listing
    monkeypatch.setattr(Path, "iterdir", lambda self: (p for p in real_iterdir(self) if not hidden(p)))
    monkeypatch.setattr(os, "listdir", lambda path=".": [n for n in real_listdir(path) if not hidden(n)])
    monkeypatch.setattr(os, "scandir", lambda path=".": iter([e for e in real_scandir(path) if not hidden(e.name)]))
    writer = threading.Thread(target=other_node_writes_late)
    writer.start()
    ckpt.save(1, lambda: small_rank_state(1), blocking=True)
    writer.join()
    monkeypatch.undo()
    meta = json.loads((tmp_path / "step_000001" / "meta.json").read_text())
    assert sorted(meta["files"]) == [
        "model.safetensors", "rank_00000.json", "rank_00000.safetensors", "rank_00001.json", "rank_00001.safetensors",
        "shared.json", "shared.safetensors",
    ]
    assert ckpt_mod.checkpoint_problem(tmp_path / "step_000001", rank=1) is None
    assert ckpt_mod.load_checkpoint(tmp_path / "step_000001", 1)["trainer"] == {"step": 1}


def test_a_rank_file_that_never_shows_fails_the_save_naming_it(tmp_path, monkeypatch):
    ckpt = make_checkpointer(tmp_path)
    ckpt.save(1, lambda: small_rank_state(1), blocking=True)  # one rank: committed
    monkeypatch.setattr(ckpt_format, "RANK_FILE_WAIT_S", 1.0)
    as_rank_0_of_2(ckpt)
    started = time.monotonic()
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint .*\.tmp-step_000002: rank_00001\.json is not there 1 s after its rank reported it written: "
        r"checkpoint\.dir \(.*\) must be one folder every node sees",
    ):
        ckpt.save(2, lambda: small_rank_state(2), blocking=True)
    assert 1.0 <= time.monotonic() - started < 10
    assert latest_checkpoint(tmp_path).name == "step_000001"  # nothing committed without rank 1's state


# ---- the `best` pointer: one reader, every rank told (review1 item 15) --------------------------------
def best_as_rank_sees_it(rank: int, port: int, dirs: list[Path], out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        ckpt = Checkpointer(CheckpointConfig(keep_best=True), dirs[rank], None, rank, 2)
        out.put((rank, ckpt.best_metric, ckpt.best_value))
    finally:
        dist.destroy_process_group()


def test_every_rank_holds_the_best_pointer_rank_0_read(tmp_path):
    """Rank 1 sees another `best` file than rank 0 (a stale NFS copy, here another folder): it must hold
    rank 0's pointer, or the ranks disagree on whether an eval is a new best and some save while others
    do not. Two gloo ranks forked from this process (no fresh interpreter to import torch)."""
    import multiprocessing
    import socket

    dirs = [tmp_path / "as_rank_0_sees_it", tmp_path / "as_rank_1_sees_it"]
    for folder, pointer in zip(dirs, ({"step": 4, "metric": "accept_len", "value": 1.5}, {"step": 2, "metric": "walk_tau", "value": 1.1})):
        folder.mkdir()
        (folder / "best").write_text(json.dumps(pointer))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    procs = [context.Process(target=best_as_rank_sees_it, args=(rank, port, dirs, out)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        seen = sorted(out.get(timeout=60) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert seen == [(0, "accept_len", 1.5), (1, "accept_len", 1.5)]


def resume_choice_as_rank_sees_it(rank: int, port: int, ckpt_dir: Path, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank == 1:  # another node's cached listing: the newest step_N and `latest` not seen yet
            listed = ckpt_mod.candidates
            ckpt_mod.candidates = lambda folder: listed(folder)[:-1]
        ckpt = Checkpointer(CheckpointConfig(every_steps=1), ckpt_dir, None, rank, 2)
        out.put((rank, ckpt.select().path.name))
    finally:
        dist.destroy_process_group()


def test_every_rank_resumes_from_the_checkpoint_rank_0_chose(tmp_path):
    """Rank 1 lists the checkpoints folder as a stale NFS cache shows it (without the newest step):
    each rank choosing from its own listing resumed rank 0 from step 2 and rank 1 from step 1, each
    verdict agreed, so the run went on with ranks at different steps, weights and data positions."""
    import multiprocessing
    import socket

    ckpt = as_rank_0_of_2(make_checkpointer(tmp_path))
    for step in (1, 2):  # two checkpoints of a 2-rank run, rank 1's files written as its rank would
        (tmp_path / f".tmp-step_00000{step}").mkdir()
        ckpt_mod.write_part(tmp_path / f".tmp-step_00000{step}", "rank_00001", {"trainer": {"step": step}}, {"rng/t": torch.ones(2)})
        ckpt.save(step, lambda step=step: small_rank_state(step), blocking=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    procs = [context.Process(target=resume_choice_as_rank_sees_it, args=(rank, port, tmp_path, out)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        seen = sorted(out.get(timeout=60) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert seen == [(0, "step_000002"), (1, "step_000002")]


def test_a_listing_without_the_newest_step_still_resumes_from_the_step_latest_names(tmp_path, monkeypatch):
    """Relaunched with rank 0 on another node, whose NFS cache still lists the folder as it was before
    the last save: the listing lacks step_000002 while `latest` (read by opening it) names it. The
    resume went back to step_000001 in silence, training its steps again."""
    ckpt = make_checkpointer(tmp_path)
    for step in (1, 2):
        ckpt.save(step, lambda step=step: small_rank_state(step), blocking=True)
    real_iterdir = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda self: (p for p in real_iterdir(self) if p.name != "step_000002"))
    assert ckpt.select().path.name == "step_000002"
    assert latest_checkpoint(tmp_path).name == "step_000002"
    assert [p.name for p in ckpt_mod.candidates(tmp_path)] == ["step_000001", "step_000002"]


@pytest.mark.parametrize("key, before, after", [
    ("model.intermediate_size", None, 128),           # the target's width, now written out
    ("model.layer_types", None, ["full_attention"]),  # every layer full, now listed
    ("target.layer_ids", None, [1, 2, 3]),            # the DFlash rule's ids, now listed
    ("target.num_feature_layers", 3, 5),               # ignored beside explicit target.layer_ids
])
def test_a_setting_spelled_out_as_the_drafter_it_resolved_to_resumes(key, before, after):
    """A resume whose setting now names the value the checkpoint's drafter already had (its
    drafter.json equal field for field) was refused, model.intermediate_size even under
    train.resume_force as 'its weights do not fit this drafter', which they do."""
    section, name = key.split(".")
    saved = {"model": {"block_size": 8, "intermediate_size": None, "layer_types": None},
             "target": {"layer_ids": [1, 2, 3] if name == "num_feature_layers" else None, "num_feature_layers": 3},
             "resolved": {"layer_ids": [1, 2, 3]}}
    current = json.loads(json.dumps(saved))
    current[section][name] = after
    drafter = {"intermediate_size": 128, "layer_types": ["full_attention"], "target_layer_ids": [1, 2, 3], "block_size": 8}
    assert check_compatible(saved, current, force=False, saved_drafter=drafter, drafter=dict(drafter)) == []
    # the same setting changing the drafter is still refused, naming it
    other = {**drafter, "intermediate_size": 64, "layer_types": ["sliding_attention"], "target_layer_ids": [1, 2, 3, 4]}
    with pytest.raises(CheckpointError, match=re.escape(f"{key}: saved {before!r}, now {after!r}")):
        check_compatible(saved, current, force=False, saved_drafter=drafter, drafter=other)
