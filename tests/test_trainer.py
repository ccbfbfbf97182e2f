"""The stage-2 trainer on a tiny real store: the log, the schedules, learning, the store checks,
the held-out split, exact resume, the dry run, and 1 vs 2 processes.

    .venv/bin/python -m pytest tests/test_trainer.py -q            # ~30 s
    .venv/bin/python -m pytest tests/test_trainer.py -q -m slow    # + torchrun with 2 processes
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from shared.config import load_run_config
from shared.store import StoreError
from shared.target import resolve_target
from stage2_train import commands
from stage2_train.__main__ import main
from stage2_train.data.run_data import open_run_data
from stage2_train.data.view import open_store
from stage2_train.observe.metrics import read_log
from stage2_train.train.config import OptimConfig
from stage2_train.train.schedules import lr_factor
from testkit.data import chat_rows, stage1_overrides, train_overrides_for, write_jsonl

REPO = Path(__file__).resolve().parents[1]
MAX_STEPS = 10
NOISE_WARMUP = 4


@pytest.fixture(scope="module")
def store(tiny_target_dir, tmp_path_factory) -> Path:
    """A 40-sample feature store of the tiny target (stage 1, run in-process)."""
    from stage1_extract import commands as stage1

    root = tmp_path_factory.mktemp("stage1")
    data = write_jsonl(root / "chat.jsonl", chat_rows(40))
    cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, root / "run"))
    stage1.cmd_extract(cfg, progress=False)
    return root / "run" / "store"


def overrides(target_dir: Path, store: Path, run_dir: Path, **extra) -> list[str]:
    """A small, fast stage-2 run: ~7 optimizer steps per epoch, lr high enough to move in 10 steps."""
    base = {
        "sampler.micro_batch_tokens": 512,
        "train.grad_accum": 1,
        "sampler.max_anchors_per_seq": 4,
        "model.num_layers": 1,
        "model.block_size": 8,
        "loss.gamma": 4.0,
        "loss.kl_weight": 0.0,  # the recipe's loss (the CPU default's has its own test below)
        "loss.full_vocab_slots": None,
        "optim.lr": 3e-3,
        "optim.warmup_ratio": 0.25,
        "noise.std": 0.05,
        "noise.warmup_steps": NOISE_WARMUP,
        "train.max_steps": MAX_STEPS,
        "train.num_data_threads": 1,
        "train.resume": "never",
        "checkpoint.every_steps": 0,
        "eval.holdout_fraction": 0.1,
        "eval.offline_max_samples": 2,  # the final eval scores every anchor over the 49K vocabulary: most of a run's time
        "log.wandb": "disabled",
    }
    base.update(extra)
    return train_overrides_for(target_dir, store, run_dir, base)


def config(target_dir, store, run_dir, **extra):
    return load_run_config("configs/default.yaml", overrides(target_dir, store, run_dir, **extra))


def open_cfg_store(cfg):
    return open_store(cfg.store.url(cfg.run_dir), resolve_target(cfg.target), need_topk=cfg.loss.needs_topk)


def open_cfg_data(cfg, rank=0, world_size=1):
    return open_run_data(cfg, rank=rank, world_size=world_size, num_threads=1)


@pytest.fixture(scope="module")
def run(tiny_target_dir, store, tmp_path_factory) -> tuple[Path, dict]:
    """One 10-step training run (into the second epoch), shared by the log tests."""
    run_dir = tmp_path_factory.mktemp("train")
    summary = commands.cmd_train(config(tiny_target_dir, store, run_dir), progress=False)
    return run_dir, summary


# ---- the log ---------------------------------------------------------------------------------------
TRAIN_FIELDS = {
    "step": int, "epoch": int, "step_in_epoch": int, "steps_in_epoch": int, "loss": float, "ce": float,
    "kl": float, "accuracy": float, "acc_per_pos": list, "accept_len": float, "lr": float,
    "noise_std": float, "grad_norm": float, "tokens": int, "samples": int, "blocks": int, "tok_per_s": float,
    "data_wait_frac": float, "data_s": float, "forward_s": float, "backward_s": float, "optim_s": float,
    "step_s": float, "elapsed_s": float, "cpu_s": float, "time": float,
}


def test_every_train_row_has_every_field_with_its_type(run):
    run_dir, summary = run
    rows = read_log(run_dir / "train_log.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
    for row in rows:
        for key, kind in TRAIN_FIELDS.items():
            value = row[key]
            assert isinstance(value, kind) and not isinstance(value, bool), (key, value)
            if kind is float:
                assert math.isfinite(value), (key, value)
        assert len(row["acc_per_pos"]) == 7 and all(0.0 <= a <= 1.0 for a in row["acc_per_pos"])
        assert row["kind"] == "train" and row["ce"] == row["loss"] and row["kl"] == 0.0
        assert 0.0 <= row["data_wait_frac"] <= 1.0 and row["tokens"] > 0 and row["blocks"] > 0
        assert row["step_s"] == pytest.approx(row["data_s"] + row["forward_s"] + row["backward_s"] + row["optim_s"], abs=1e-5)
    assert summary["steps"] == MAX_STEPS and summary["tokens_seen"] == sum(r["tokens"] for r in rows)


def test_epochs_and_data_position_are_logged_with_events(run):
    run_dir, _ = run
    log = read_log(run_dir / "train_log.jsonl")
    train = [r for r in log if r["kind"] == "train"]
    per_epoch = train[0]["steps_in_epoch"]
    assert 3 <= per_epoch < MAX_STEPS  # the run crosses epoch boundaries
    for row in train:  # the position moves one step at a time, rolling over at the epoch end
        assert 0 <= row["step_in_epoch"] < row["steps_in_epoch"]
    positions = [(r["epoch"], r["step_in_epoch"]) for r in train]
    assert positions[:per_epoch + 1] == [(0, i) for i in range(per_epoch)] + [(1, 0)]
    events = [(r["event"], r["step"], r.get("epoch")) for r in log if r["kind"] == "event" and "epoch" in r["event"]]
    assert events[:3] == [("epoch_start", 0, 0), ("epoch_end", per_epoch, 0), ("epoch_start", per_epoch, 1)]
    kinds = [r["kind"] if r["kind"] != "event" else r["event"] for r in log]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end" and kinds.count("eval") == 1


def test_run_start_holds_the_resolved_config_and_hyperparameters(run, tiny_target_dir, store):
    run_dir, _ = run
    start = read_log(run_dir / "train_log.jsonl", "event")[0]
    assert start["event"] == "run_start" and start["step"] == 0
    saved = yaml.safe_load((run_dir / "train_config.yaml").read_text())
    expected = config(tiny_target_dir, store, run_dir).to_dict()
    assert saved == expected
    assert {k: v for k, v in start["config"].items() if k != "resolved"} == expected
    assert start["config"]["resolved"]["layer_ids"] == [1, 2, 3]
    hp = start["hyperparameters"]
    assert hp["optim.betas"] == [0.9, 0.999] and hp["optim.lr"] == 3e-3 and hp["total_steps"] == MAX_STEPS
    assert hp["warmup_steps"] == 3 and hp["grad_accum"] == 1 and hp["loss.gamma"] == 4.0
    assert any("optim.lr" in w for w in hp["recipe_warnings"])
    resolved = start["config"]["resolved"]
    assert resolved["world_size"] == 1 and start["num_params"] > 0 and resolved["num_heldout_samples"] >= 1


def test_lr_warms_up_then_decays_by_cosine_and_noise_warms_up(run):
    run_dir, _ = run
    rows = read_log(run_dir / "train_log.jsonl", "train")
    lrs = [r["lr"] for r in rows]
    cfg = OptimConfig(lr=3e-3, warmup_ratio=0.25)
    assert lrs == pytest.approx([3e-3 * lr_factor(s, MAX_STEPS, cfg) for s in range(MAX_STEPS)], rel=1e-9)
    assert lrs[:3] == pytest.approx([1e-3, 2e-3, 3e-3])  # warmup: ceil(0.25 * 10) = 3 steps
    assert lrs[3] == 3e-3 and all(a > b for a, b in zip(lrs[3:], lrs[4:]))  # then strictly down
    assert lrs[-1] < 0.05 * 3e-3
    mid = 3 + (MAX_STEPS - 3) // 2
    assert lrs[mid] == pytest.approx(3e-3 * 0.5 * (1 + math.cos(math.pi * (mid - 3) / (MAX_STEPS - 3))))
    noise = [r["noise_std"] for r in rows]
    assert noise == pytest.approx([0.05 * min(s, NOISE_WARMUP) / NOISE_WARMUP for s in range(MAX_STEPS)])
    assert noise[0] == 0.0 and noise[NOISE_WARMUP] == 0.05


def test_a_tiny_run_learns(run):
    run_dir, summary = run
    losses = [r["loss"] for r in read_log(run_dir / "train_log.jsonl", "train")]
    assert sum(losses[-3:]) / 3 < sum(losses[:2]) / 2 - 0.15, losses
    assert summary["final_eval"]["ce"] < losses[0]


def test_the_cpu_default_loss_trains_end_to_end(tiny_target_dir, store, tmp_path):
    """KL against the stored top-k plus the candidate softmax past slot 1, as configs/default.yaml."""
    cfg = config(tiny_target_dir, store, tmp_path, **{"loss.kl_weight": 1.0, "loss.full_vocab_slots": 1})
    summary = commands.cmd_train(cfg, progress=False)
    rows = read_log(tmp_path / "train_log.jsonl", "train")
    assert summary["steps"] == MAX_STEPS and all(r["kl"] > 0 and r["loss"] == pytest.approx(r["ce"] + r["kl"], rel=1e-5) for r in rows)
    losses = [r["loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < sum(losses[:2]) / 2 - 0.15, losses


def test_a_projected_run_fits_its_basis_on_the_token_budget_it_is_given(tiny_target_dir, store, tmp_path):
    """model.projection_fit_tokens below the split's tokens: the basis the drafter trains with is the
    fit over the seeded budget's samples, not over the whole split (days at 8B)."""
    from safetensors.torch import load_file

    from shared.paths import RunPaths
    from stage2_train.data.projection import fit_distributed

    budget = {"model.feature_projection": "pca", "model.projection_dim": 24, "model.projection_fit_tokens": 300}
    cfg = config(tiny_target_dir, store, tmp_path, **budget)
    assert commands.cmd_train(cfg, progress=False)["steps"] == MAX_STEPS
    data = open_cfg_data(cfg)
    try:
        assert int(data.train_reader.lengths.sum()) > 2 * 300
        expected = fit_distributed(data.train_reader, 0, 1, 24, "rms", budget_tokens=300, seed=cfg.seed)
    finally:
        data.close()
    saved = load_file(RunPaths.of(cfg).step(MAX_STEPS) / "model.safetensors")["projection_RF"]
    assert torch.equal(saved, expected)


def test_lr_factor_shapes():
    cfg = OptimConfig(warmup_ratio=0.1, schedule="linear", min_lr_ratio=0.1)
    factors = [lr_factor(s, 100, cfg) for s in range(100)]
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert factors[10] == 1.0 and factors[-1] == pytest.approx(0.1 + 0.9 / 90)
    assert [lr_factor(s, 10, OptimConfig(warmup_ratio=0.0, schedule="constant")) for s in range(10)] == [1.0] * 10


# ---- the store contract -----------------------------------------------------------------------------
def edited_store(store: Path, tmp_path: Path, edit) -> Path:
    copy = shutil.copytree(store, tmp_path / "store")
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.mark.parametrize(
    "field, edit, extra",
    [
        ("target.hidden_size", lambda m: m["target"].update(hidden_size=128), {}),
        ("target.weights_sha256", lambda m: m["target"].update(weights_sha256="0" * 64), {}),
        ("layer_ids", lambda m: None, {"target.layer_ids": [1, 2, 4]}),
        ("layer_ids", lambda m: None, {"target.num_feature_layers": 2}),
        ("tokenizer_sha256", lambda m: m.update(tokenizer_sha256="f" * 64), {}),
        ("top_k", lambda m: m.update(top_k=0), {"loss.kl_weight": 0.1}),
        ("schema_version", lambda m: m.update(schema_version=99), {}),
    ],
)
def test_a_mismatched_store_is_refused_by_name(tiny_target_dir, store, tmp_path, field, edit, extra):
    copy = edited_store(store, tmp_path, edit)
    cfg = config(tiny_target_dir, copy, tmp_path / "run", **extra)
    with pytest.raises(StoreError, match=field):
        open_cfg_store(cfg)


def test_kl_with_matching_top_k_is_accepted(tiny_target_dir, store, tmp_path):
    """A store with top-k trains the KL term: every step's kl is finite and positive, and it is in the loss."""
    cfg = config(tiny_target_dir, store, tmp_path, **{"loss.kl_weight": 0.1, "train.max_steps": 2})
    assert len(open_cfg_store(cfg)) == 40
    commands.cmd_train(cfg, progress=False)
    for row in read_log(tmp_path / "train_log.jsonl", "train"):
        assert math.isfinite(row["kl"]) and row["kl"] > 0
        assert row["loss"] == pytest.approx(row["ce"] + 0.1 * row["kl"], rel=1e-5)


def test_heldout_samples_are_never_trained_on(tiny_target_dir, store, tmp_path):
    cfg = config(tiny_target_dir, store, tmp_path, **{"eval.holdout_fraction": 0.2})
    data = open_cfg_data(cfg)
    heldout_ids = set(data.reader.sample_ids[data.heldout_indices].tolist())
    assert 2 <= len(heldout_ids) <= 20
    assert sorted(heldout_ids | set(data.train_reader.sample_ids.tolist())) == sorted(data.reader.sample_ids.tolist())
    trained = []
    for loaded in data.loader:  # a whole epoch through the real loader
        trained += [int(data.train_reader[i]["sample_id"]) for i in loaded.sample_indices]
    data.close()
    assert not heldout_ids & set(trained)
    assert sorted(trained) == sorted(data.train_reader.sample_ids.tolist())
    other = open_cfg_data(cfg, rank=2, world_size=3)  # the split ignores the rank count
    assert set(other.reader.sample_ids[other.heldout_indices].tolist()) == heldout_ids


def test_evals_during_training_sample_anchors_and_the_last_scores_every_one(tiny_target_dir, store, tmp_path):
    """eval.offline_max_anchors_per_seq keeps the curve cheap (no walk_tau, a few blocks per sample);
    the final eval scores every anchor and adds walk_tau; keep_best then compares accept_len."""
    cfg = config(tiny_target_dir, store, tmp_path, **{"eval.every_steps": 3, "eval.offline_max_anchors_per_seq": 2,
                                                       "checkpoint.keep_best": True, "train.max_steps": 7})
    commands.cmd_train(cfg, progress=False)
    evals = read_log(tmp_path / "train_log.jsonl", "eval")
    assert [r["step"] for r in evals] == [3, 6, 7]
    for row in evals[:-1]:
        assert row["walk_tau"] is None and row["num_blocks"] <= 2 * row["num_samples"]
    assert evals[-1]["walk_tau"] is not None and evals[-1]["num_blocks"] > 2 * evals[-1]["num_samples"]
    best = json.loads((tmp_path / "checkpoints" / "best").read_text())
    assert best["metric"] == "accept_len" and best["step"] in (3, 6, 7)
    if best["step"] != 7:  # the final step is judged by the sampled estimator, not the dense row
        assert best["value"] == {r["step"]: r["accept_len"] for r in evals}[best["step"]]


def no_anchor_for_even_samples(monkeypatch):
    """Samples whose id is even yield no block (as an answer of one token would), and the store's
    supervised_pairs, which the block budget plans with, say so too (the loader holds them to it)."""
    from shared.reader import StoreReader
    from stage2_train.data import anchors

    real = anchors.AnchorSampler.anchors
    real_pairs = StoreReader.supervised_pairs

    def anchors_of(self, loss_mask_T, *, sample_id, epoch):
        found = real(self, loss_mask_T, sample_id=sample_id, epoch=epoch)
        return found[:0] if sample_id % 2 == 0 else found

    monkeypatch.setattr(anchors.AnchorSampler, "anchors", anchors_of)
    monkeypatch.setattr(StoreReader, "supervised_pairs", lambda self: real_pairs(self) * (self.sample_ids % 2 == 1))


def test_micro_batches_without_a_block_still_train(tiny_target_dir, store, tmp_path, monkeypatch):
    """Half the samples yield no block, so some micro-batches of one or two samples have none. A step
    that scored no block logged loss 0.0 and accuracy 0.0: a perfect loss on the plots and an
    accuracy cliff to the doctor. Its ratios are null, and the doctor and the report read them so."""
    from stage2_train.observe.doctor import diagnose
    no_anchor_for_even_samples(monkeypatch)
    extra = {"sampler.micro_batch_tokens": 128, "train.max_steps": 6}
    commands.cmd_train(config(tiny_target_dir, store, tmp_path, **extra), progress=False)
    rows = read_log(tmp_path / "train_log.jsonl", "train")
    assert len(rows) == 6 and any(r["blocks"] == 0 for r in rows) and any(r["blocks"] > 0 for r in rows)
    for row in rows:
        assert math.isfinite(row["grad_norm"])
        if row["blocks"] == 0:  # nothing scored: no loss or accuracy (null), and a zero gradient
            assert row["loss"] is None and row["grad_norm"] == 0.0 and row["accuracy"] is None
        else:
            assert math.isfinite(row["loss"])
    events = read_log(tmp_path / "train_log.jsonl")
    assert not [e for e in events if e.get("event") == "warning"]
    assert not [e for e in diagnose(events)["events"] if e.get("step") in {r["step"] for r in rows if not r["blocks"]}]
    assert len(commands.cmd_report(tmp_path / "train_log.jsonl", tmp_path / "report")["plots"]) >= 5


@pytest.mark.slow
def test_micro_batches_without_a_block_still_train_on_two_ranks(tiny_target_dir, store, tmp_path):
    """with_a_block exists for DDP: a rank whose micro-batch has no block must still run forward and
    backward, or the other rank hangs in the gradient all_reduce. Two gloo ranks, half the samples
    without a block: every step completes, the zero-block steps are exactly zero."""
    extra = {"sampler.micro_batch_tokens": 160, "train.max_steps": 6}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "stage2_train", "train", "--json", "--no-progress", *overrides(tiny_target_dir, store, tmp_path, **extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO / 'tests' / 'hooks'}:{REPO}",
           "DFLASH_NO_ANCHORS_FOR_EVEN_SAMPLES": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_log(tmp_path / "train_log.jsonl", "train")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and any(r["blocks"] > 0 for r in rows)
    for row in rows:
        assert math.isfinite(row["grad_norm"]) and (row["loss"] is None if row["blocks"] == 0 else math.isfinite(row["loss"]))


# ---- mixed precision ---------------------------------------------------------------------------------
@pytest.fixture
def fresh_accelerator_state():
    """Accelerate keeps one process-wide state whose mixed precision cannot change once set: a bf16
    trainer in this process starts from a fresh state and leaves one for the next test."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def bf16_trainer(cfg, init_from=None):
    from stage2_train.serve.load import init_weights_for
    from stage2_train.train.launch import make_accelerator
    from stage2_train.train.trainer import Trainer

    weights = None if init_from is None else init_weights_for(init_from, cfg.model, resolve_target(cfg.target))
    return Trainer(cfg, make_accelerator(cfg.train), init_weights=weights, progress=False)


def signalled_during_step(trainer, step: int):
    """The trainer, with SIGTERM's flag raised while its step `step` (1-based) runs, as the handler would."""
    train_step = trainer.train_step

    def signalled():
        if trainer.progress.step == step - 1:
            trainer.preemption.requested = "SIGTERM"
        return train_step()

    trainer.train_step = signalled
    return trainer


def test_a_stop_signal_at_the_last_step_ends_as_a_finished_run(tiny_target_dir, store, tmp_path, fresh_accelerator_state):
    """Preempted at the run's last step, the run saved and exited 75 before its final eval; the rerun
    found the run finished and never evaluated it. It now ends as a finished run does."""
    extra = {"train.max_steps": 3, "checkpoint.every_steps": 0, "eval.every_steps": 0}
    trainer = signalled_during_step(bf16_trainer(config(tiny_target_dir, store, tmp_path, **extra)), 3)
    summary = trainer.fit()
    log = read_log(tmp_path / "train_log.jsonl")
    assert summary["steps"] == 3 and not any(r.get("event") == "preempted" for r in log)
    assert [r["step"] for r in log if r["kind"] == "eval"] == [3] and (tmp_path / "checkpoints" / "step_000003").is_dir()


def test_the_eval_a_preemption_left_runs_first_and_points_best_at_the_checkpoint(tiny_target_dir, store, tmp_path,
                                                                                  fresh_accelerator_state):
    """Stopped at step 2 with its eval due: the resumed run evaluates step 2 before training on, and a
    new best there points `best` at the checkpoint it resumed from (no second save of step 2)."""
    from stage2_train.train.preemption import Preempted

    extra = {"train.max_steps": 4, "checkpoint.every_steps": 0, "eval.every_steps": 2, "checkpoint.keep_best": True,
             "train.resume": "auto"}
    with pytest.raises(Preempted):
        signalled_during_step(bf16_trainer(config(tiny_target_dir, store, tmp_path, **extra)), 2).fit()
    first = len(read_log(tmp_path / "train_log.jsonl"))
    assert bf16_trainer(config(tiny_target_dir, store, tmp_path, **extra)).fit()["steps"] == 4
    log = read_log(tmp_path / "train_log.jsonl")
    again = log[first:]
    assert [r["step"] for r in log if r["kind"] == "eval"] == [2, 4]
    assert [(r["event"], r["step"]) for r in again if r.get("event") in ("checkpoint_start", "best_checkpoint")][:1] == [
        ("best_checkpoint", 2)]


def on_training_forward(module, record, pre: bool = False) -> None:
    """Call `record(args or output)` on the forwards of training (the held-out eval runs in eval mode)."""

    def hook(m, args, out=None):
        if m.training:
            record(args if pre else out)

    (module.register_forward_pre_hook if pre else module.register_forward_hook)(hook)


def assert_fp32_master_state(trainer) -> None:
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    assert params and {p.dtype for p in params} == {torch.float32}
    adamw = trainer.optimizers.named["adamw"]
    moments = [t for p in params for k, t in adamw.state[p].items() if k != "step"]
    assert len(moments) == 2 * len(params) and {t.dtype for t in moments} == {torch.float32}
    assert {b.dtype for n, b in trainer.model.named_buffers() if n in ("embed_VH", "lm_head_VH")} == {torch.bfloat16}


def test_a_resume_under_more_steps_follows_the_new_schedule_from_its_first_step(tiny_target_dir, store, tmp_path):
    """A finished run resumed with a larger train.max_steps and a lower optim.lr: its first resumed step
    took the lr the old schedule gave that step (restored with the optimizer: 0 at the end of a cosine)
    and every later one the old peak (the scheduler's restored base), not this run's (found by the
    doctor's schedule check, which now reads the run as healthy). The log shows the optimizer's lr."""
    run_dir = tmp_path / "run"
    every = {"checkpoint.every_steps": 2, "noise.warmup_steps": 0, "eval.every_steps": 0}
    commands.cmd_train(config(tiny_target_dir, store, run_dir, **{**every, "train.max_steps": 2}), progress=False)
    more = config(tiny_target_dir, store, run_dir, **{**every, "train.max_steps": 5, "train.resume": "auto", "optim.lr": 1e-3})
    assert commands.cmd_train(more, progress=False)["steps"] == 5
    lrs = {r["step"]: r["lr"] for r in read_log(run_dir / "train_log.jsonl", "train")}
    cfg = OptimConfig(lr=1e-3, warmup_ratio=0.25)
    assert [lrs[s] for s in (3, 4, 5)] == pytest.approx([1e-3 * lr_factor(s - 1, 5, cfg) for s in (3, 4, 5)], rel=1e-9)
    assert lrs[3] > 0  # the old schedule (2 steps) had ended at 0
    text, code = commands.cmd_doctor(run_dir, as_json=False)
    assert "off its schedule" not in text and code == 0


def test_a_resume_under_another_schedule_length_says_so_on_the_console(tiny_target_dir, store, tmp_path, capfd):
    """A larger train.max_steps stretches the LR schedule: the lr jumps at the resume (by design, the new
    schedule from the first resumed step). The console says so at the resume, not only the event."""
    every = {"checkpoint.every_steps": 2, "noise.warmup_steps": 0, "eval.every_steps": 0, "train.resume": "auto"}
    commands.cmd_train(config(tiny_target_dir, store, tmp_path, **{**every, "train.max_steps": 2}), progress=False)
    capfd.readouterr()
    commands.cmd_train(config(tiny_target_dir, store, tmp_path, **{**every, "train.max_steps": 4}), progress=False)
    err = capfd.readouterr().err
    assert "schedule" in err and "4 steps" in err and "2" in err and "train.max_steps" in err


def test_optimizers_restored_under_another_schedule_apply_its_lr_to_adamw_and_muon():
    """What the optimizers apply after a load under other settings: this run's peak lr (and Muon's)
    and its schedule at the restored step, in the optimizers' param groups (what updates read)."""
    from stage2_train.train.schedules import Optimizers

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    old = Optimizers(model, OptimConfig(name="muon", lr=1e-3, muon_lr=2e-2, warmup_ratio=0.25), total_steps=4)
    for _ in range(4):
        model(torch.randn(2, 4)).sum().backward()
        old.step(), old.schedule_step(), old.zero_grad()
    cfg = OptimConfig(name="muon", lr=5e-4, muon_lr=1e-2, warmup_ratio=0.25)
    new = Optimizers(model, cfg, total_steps=8)
    new.load_state_dict(old.state_dict())  # the checkpointer's order: the optimizer, then its schedule
    new.schedule.load_state_dict(old.schedule.state_dict())
    factor = lr_factor(4, 8, cfg)
    assert new.named["adamw"].param_groups[0]["lr"] == pytest.approx(5e-4 * factor)
    assert new.named["muon"].param_groups[0]["lr"] == pytest.approx(1e-2 * factor)
    assert new.last_lr() == pytest.approx(5e-4 * factor)
    # The other settings a resume may change on the record are the ones applied, the moments kept.
    old_cfg_state = old.state_dict()
    cfg = OptimConfig(lr=5e-4, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    adamw_only = Optimizers(model, OptimConfig(lr=1e-3), total_steps=4)
    model(torch.randn(2, 4)).sum().backward()
    adamw_only.step()  # moments to carry
    changed = Optimizers(model, cfg, total_steps=4)
    changed.load_state_dict(adamw_only.state_dict())
    group = changed.named["adamw"].param_groups[0]
    assert (tuple(group["betas"]), group["eps"], group["weight_decay"]) == ((0.8, 0.95), 1e-6, 0.1)
    carried, kept = changed.named["adamw"].state_dict()["state"], adamw_only.named["adamw"].state_dict()["state"]
    assert kept and all(torch.equal(carried[i]["exp_avg"], kept[i]["exp_avg"]) for i in kept)
    muon = Optimizers(model, OptimConfig(name="muon", lr=5e-4, muon_momentum=0.9, muon_weight_decay=0.0), total_steps=8)
    muon.load_state_dict(old_cfg_state)
    assert (muon.named["muon"].param_groups[0]["momentum"], muon.named["muon"].param_groups[0]["weight_decay"]) == (0.9, 0.0)


def test_bf16_trains_fp32_master_weights_from_a_bf16_drafter_and_after_resume(
    tiny_target_dir, store, run, tmp_path, fresh_accelerator_state
):
    """What this trainer keeps under train.mixed_precision=bf16: the forward in bf16 autocast, every
    trainable parameter (the master weights) and every AdamW moment in fp32, the frozen embedding and
    LM head in bf16. A bf16 drafter as model.init_from (exports are bf16) and a resume keep it so: no
    configuration trains bf16 parameters, whose updates would round away as the learning rate decays."""
    exported = tmp_path / "export"  # the shared run's drafter: an export is bf16 however it trained
    commands.cmd_export(config(tiny_target_dir, store, run[0]), None, str(exported), "zlab")
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(exported / "model.safetensors").values()} == {torch.bfloat16}

    extra = {"train.mixed_precision": "bf16", "model.init_from": str(exported), "train.max_steps": 3, "train.resume": "auto"}
    trainer = bf16_trainer(config(tiny_target_dir, store, tmp_path / "b", **extra), init_from=exported)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}  # before any step, too
    seen = {"layer": set(), "output": set()}
    on_training_forward(trainer.model.layers[0].mlp.down_proj, lambda out: seen["layer"].add(out.dtype))
    on_training_forward(trainer.model, lambda out: seen["output"].add(out.dtype))
    evaluated = set()  # the held-out eval computes as the step does (and needs no graphs of its own)
    trainer.model.register_forward_hook(lambda m, args, out: None if m.training else evaluated.add(out.dtype))
    trainer.fit()
    assert seen == {"layer": {torch.bfloat16}, "output": {torch.bfloat16}}  # no fp32 copy of the output
    assert evaluated == {torch.bfloat16}
    assert_fp32_master_state(trainer)
    assert trainer.detectors.not_learning.init_from == str(exported)  # the doctor's warm start, live

    extra["train.max_steps"] = 5
    resumed = bf16_trainer(config(tiny_target_dir, store, tmp_path / "b", **extra), init_from=exported)
    summary = resumed.fit()
    assert summary["steps"] == 5 and resumed.progress.step == 5
    assert [r["step"] for r in read_log(tmp_path / "b" / "train_log.jsonl") if r.get("event") == "resume"] == [3]
    assert_fp32_master_state(resumed)
    assert resumed.detectors.not_learning.init_from == str(exported)


def test_the_step_runs_as_the_memory_plan_traces_it(tiny_target_dir, store, tmp_path, fresh_accelerator_state, monkeypatch):
    """`train/memory_plan.py` traces a step whose micro-batches reach the device one at a time, whose
    noise goes into the moved context in place, and whose forward output stays bf16: the trainer runs
    exactly that (here with train.grad_accum=3, noise on, bf16)."""
    from stage2_train.data.batch import DrafterBatch

    events = []
    real_to = DrafterBatch.to

    def to(batch, device, dtype=None):
        moved = real_to(batch, device, dtype)
        if trainer.model.training:  # not the held-out eval's batches
            events.append(("to", moved.context_TF.data_ptr(), moved.context_TF.clone()))
        return moved

    monkeypatch.setattr(DrafterBatch, "to", to)
    extra = {"train.mixed_precision": "bf16", "train.grad_accum": 3, "train.max_steps": 2, "noise.warmup_steps": 0,
             "eval.every_steps": 0}
    trainer = bf16_trainer(config(tiny_target_dir, store, tmp_path, **extra))
    on_training_forward(trainer.model, lambda args: events.append(("forward", args[0].context_TF.data_ptr(), args[0].context_TF.clone())), pre=True)
    on_training_forward(trainer.model, lambda out: events.append(("output", out.dtype, None)))
    trainer.fit()
    steps = [e[0] for e in events if e[0] in ("to", "forward")]
    assert steps == ["to", "forward"] * 6
    for moved, forward in zip(events[0::3], events[1::3]):
        assert forward[1] == moved[1] and not torch.equal(forward[2], moved[2])  # noised in place, no copy
    assert {e[1] for e in events if e[0] == "output"} == {torch.bfloat16}


# ---- resume ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_continues_exactly(tiny_target_dir, store, tmp_path, optimizer):
    """Crash after step 7 of 8 (checkpoint at 3): the resumed run logs steps 4-8 exactly as before,
    with AdamW and with Muon (its momentum buffers and the AdamW group's moments in the checkpoint),
    and the epoch ending at step 7 (7 steps an epoch) counts its blocks from its start."""
    extra = {"train.max_steps": 8, "checkpoint.every_steps": 3, "checkpoint.keep_latest_k": 3, "train.resume": "auto",
             "sampler.max_anchors_per_seq": 2, "optim.name": optimizer}
    cfg = config(tiny_target_dir, store, tmp_path, **extra)
    commands.cmd_train(cfg, progress=False)
    first = {r["step"]: r for r in read_log(tmp_path / "train_log.jsonl", "train")}
    epoch_ends = [(e["step"], e["blocks"]) for e in read_log(tmp_path / "train_log.jsonl", "event") if e["event"] == "epoch_end"]
    ckpt = tmp_path / "checkpoints"
    shutil.rmtree(ckpt / "step_000006")
    shutil.rmtree(ckpt / "step_000008")
    (ckpt / "latest").write_text("step_000003")
    summary = commands.cmd_train(cfg, progress=False)
    log = read_log(tmp_path / "train_log.jsonl")
    resume = [r for r in log if r.get("event") == "resume"]
    assert len(resume) == 1 and resume[0]["step"] == 3 and resume[0]["path"].endswith("step_000003")
    assert resume[0]["config_changes"] == {}
    again = [r for r in log if r["kind"] == "train"][8:]
    assert [r["step"] for r in again] == [4, 5, 6, 7, 8] and summary["steps"] == 8
    for row in again:
        before = first[row["step"]]
        for key in ("loss", "accuracy", "grad_norm", "lr", "noise_std", "epoch", "step_in_epoch", "tokens"):
            assert row[key] == before[key], (row["step"], key)
    # An epoch ending after the resume counts its blocks from the epoch's start, not the resume's.
    resumed_ends = [(e["step"], e["blocks"]) for e in log[log.index(resume[0]):] if e.get("event") == "epoch_end"]
    assert resumed_ends and resumed_ends == [(s, b) for s, b in epoch_ends if s > 3]
    if optimizer == "muon":
        from stage2_train.train.checkpoint.format import load_checkpoint

        state = load_checkpoint(ckpt / "step_000008")["optimizer"]
        assert set(state) == {"muon", "adamw"} and any("momentum_buffer" in v for v in state["muon"]["state"].values())


def test_a_resume_from_an_older_step_forgets_the_best_of_the_run_it_abandons(tiny_target_dir, store, tmp_path):
    """Rolled back to step 2 (train.resume=<its folder>, a lower lr) of a run whose `best` named its step
    4: that best is an eval of the abandoned run, and this run's save of step 4 replaces its folder.
    `best` must end naming the best of this history (up to step 2, or this run's evals) with its own
    value, not the old value on this run's weights (nor keep this run's better checkpoints from it)."""
    extra = {"train.max_steps": 4, "checkpoint.every_steps": 1, "checkpoint.keep_latest_k": 10, "eval.every_steps": 1,
             "checkpoint.keep_best": True, "eval.offline_max_anchors_per_seq": None}
    commands.cmd_train(config(tiny_target_dir, store, tmp_path, **extra), progress=False)
    ckpt = tmp_path / "checkpoints"
    # The abandoned run's best at its step 4, a value no eval of the rolled-back run reaches.
    (ckpt / "best").write_text(json.dumps({"step": 4, "metric": "walk_tau", "value": 1e9}))
    first = len(read_log(tmp_path / "train_log.jsonl"))
    earlier = json.loads((ckpt / "step_000002" / "meta.json").read_text())["best"]  # the best as of step 2
    back = {**extra, "train.resume": str(ckpt / "step_000002"), "optim.lr": 1e-4}
    assert commands.cmd_train(config(tiny_target_dir, store, tmp_path, **back), progress=False)["steps"] == 4
    again = read_log(tmp_path / "train_log.jsonl")[first:]
    evals = {r["step"]: r["walk_tau"] for r in again if r["kind"] == "eval"}
    best = json.loads((ckpt / "best").read_text())
    named = {earlier["step"]: earlier["value"], **evals}  # what this history evaluated, step 4 by this run
    assert sorted(evals) == [3, 4] and earlier["step"] <= 2 and named[best["step"]] == best["value"] == max(named.values())


def test_a_rollback_names_again_the_best_the_checkpoint_it_resumes_was_saved_with(tiny_target_dir, store, tmp_path):
    """Rolled back to step 2 of a run whose `best` moved on to step 4: the best as of step 2 (recorded
    in step 2's meta.json; here an eval no later one reaches) is still a checkpoint of this history and
    must stay named, not be forgotten with the abandoned run's."""
    extra = {"train.max_steps": 4, "checkpoint.every_steps": 1, "checkpoint.keep_latest_k": 10, "eval.every_steps": 1,
             "checkpoint.keep_best": True, "eval.offline_max_anchors_per_seq": None}
    commands.cmd_train(config(tiny_target_dir, store, tmp_path, **extra), progress=False)
    ckpt = tmp_path / "checkpoints"
    (ckpt / "best").write_text(json.dumps({"step": 4, "metric": "walk_tau", "value": 1e9}))
    meta = json.loads((ckpt / "step_000002" / "meta.json").read_text())
    assert meta["best"]["step"] in (1, 2) and meta["best"]["metric"] == "walk_tau"
    meta["best"]["value"] = 1e8
    (ckpt / "step_000002" / "meta.json").write_text(json.dumps(meta))
    back = {**extra, "train.resume": str(ckpt / "step_000002"), "optim.lr": 1e-4}
    commands.cmd_train(config(tiny_target_dir, store, tmp_path, **back), progress=False)
    forgotten = [e for e in read_log(tmp_path / "train_log.jsonl", "event") if e["event"] == "best_forgotten"]
    assert [(e["best_step"], e["best_again"]) for e in forgotten] == [(4, meta["best"]["step"])]
    assert json.loads((ckpt / "best").read_text())["step"] == meta["best"]["step"]
    assert json.loads((ckpt / "best").read_text())["value"] == 1e8


def test_starting_over_in_a_run_dir_forgets_the_abandoned_runs_best_and_latest(
    tiny_target_dir, store, tmp_path, fresh_accelerator_state
):
    """train.resume=never (what a refused resume after `reprocess` names: "starts over in this run_dir")
    left the abandoned run's `best` pointer in place: `export --checkpoint best` exported that run's
    drafter, trained on the old store, and its value kept this run's evals from being named. Its
    `latest` stayed too: a crash before the new run's first save, and eval, export and
    train.resume=auto took the abandoned run's newest checkpoint."""
    from shared.errors import CheckpointError
    from stage2_train.train.checkpoint.select import latest_checkpoint, resolve_checkpoint

    extra = {"train.max_steps": 4, "checkpoint.every_steps": 1, "checkpoint.keep_latest_k": 10}
    commands.cmd_train(config(tiny_target_dir, store, tmp_path, **extra), progress=False)
    ckpt = tmp_path / "checkpoints"
    (ckpt / "best").write_text(json.dumps({"step": 4, "metric": "walk_tau", "value": 1e9}))  # the abandoned run's best
    trainer = bf16_trainer(config(tiny_target_dir, store, tmp_path, **{**extra, "checkpoint.every_steps": 2}))

    def node_lost():
        raise RuntimeError("node lost")

    trainer.train_step = node_lost
    with pytest.raises(RuntimeError, match="node lost"):
        trainer.fit()
    assert not (ckpt / "best").exists() and latest_checkpoint(ckpt) is None
    with pytest.raises(CheckpointError, match="no best checkpoint recorded"):
        resolve_checkpoint("best", ckpt)
    again = {**extra, "train.max_steps": 2, "eval.every_steps": 1, "checkpoint.keep_best": True,
             "eval.offline_max_anchors_per_seq": None}
    first = len(read_log(tmp_path / "train_log.jsonl"))
    commands.cmd_train(config(tiny_target_dir, store, tmp_path, **again), progress=False)
    evals = {r["step"]: r["walk_tau"] for r in read_log(tmp_path / "train_log.jsonl")[first:] if r["kind"] == "eval"}
    best = json.loads((ckpt / "best").read_text())
    assert best["step"] in evals and best["value"] == max(evals.values()) and latest_checkpoint(ckpt).name == "step_000002"


def test_a_rolled_back_run_lost_before_its_first_save_resumes_from_where_it_rolled_back_to(
    tiny_target_dir, store, tmp_path, fresh_accelerator_state
):
    """Rolled back to step 2 (train.resume=<its folder>, a lower lr) of a run saved up to step 4, and
    lost at step 3, before its first save: the job's train.resume=auto must continue the rolled-back
    run from step 2, not take the abandoned run's step 4 (here its last step: the rolled-back training
    would be reported complete, on the weights it was rolled back from)."""
    extra = {"train.max_steps": 4, "checkpoint.every_steps": 1, "checkpoint.keep_latest_k": 10, "train.resume": "auto"}
    commands.cmd_train(config(tiny_target_dir, store, tmp_path, **extra), progress=False)
    ckpt = tmp_path / "checkpoints"
    back = {**extra, "checkpoint.every_steps": 2, "optim.lr": 1e-4}
    trainer = bf16_trainer(config(tiny_target_dir, store, tmp_path, **{**back, "train.resume": str(ckpt / "step_000002")}))

    def node_lost():
        raise RuntimeError("node lost")

    trainer.train_step = node_lost
    with pytest.raises(RuntimeError, match="node lost"):
        trainer.fit()
    first = len(read_log(tmp_path / "train_log.jsonl"))
    summary = commands.cmd_train(config(tiny_target_dir, store, tmp_path, **back), progress=False)
    resumed = [r for r in read_log(tmp_path / "train_log.jsonl")[first:] if r.get("event") == "resume"]
    assert [r["path"] for r in resumed] == [str(ckpt / "step_000002")]
    assert summary["steps"] == 4 and not summary.get("already_complete")


def test_a_resume_that_finds_no_checkpoint_in_a_moved_checkpoint_dir_is_refused_not_started_over(
    tiny_target_dir, store, tmp_path, capfd
):
    """A full disk's error says to set checkpoint.dir to a larger disk: the same command with it then
    finds no checkpoint there, and train.resume=auto would train this run_dir again from step 0. It
    is refused, naming the folder the last training saved in and the ways on."""
    from shared.errors import CheckpointError

    run_dir = tmp_path / "run"
    extra = {"train.max_steps": 2, "checkpoint.every_steps": 1, "train.resume": "auto"}
    commands.cmd_train(config(tiny_target_dir, store, run_dir, **extra), progress=False)
    rows = len(read_log(run_dir / "train_log.jsonl"))
    moved = {**extra, "train.max_steps": 4, "checkpoint.dir": str(tmp_path / "bigger")}
    with pytest.raises(CheckpointError) as refused:
        commands.cmd_train(config(tiny_target_dir, store, run_dir, **moved), progress=False)
    message = str(refused.value)
    assert str(run_dir / "checkpoints") in message and "checkpoint.dir" in message and "train.resume=never" in message
    assert len(read_log(run_dir / "train_log.jsonl")) == rows  # nothing trained, nothing logged
    # Moved there, the checkpoints resume; a fresh start stays one setting away.
    shutil.move(run_dir / "checkpoints", tmp_path / "bigger")
    assert commands.cmd_train(config(tiny_target_dir, store, run_dir, **moved), progress=False)["steps"] == 4
    fresh = {**moved, "checkpoint.dir": str(tmp_path / "empty"), "train.resume": "never"}
    assert commands.cmd_train(config(tiny_target_dir, store, run_dir, **fresh), progress=False)["steps"] == 4


def test_a_resume_that_can_verify_no_checkpoint_is_refused_not_started_over(tiny_target_dir, store, tmp_path):
    """Every checkpoint fails its checks (damaged, or unreadable as this node's file system shows
    them): train.resume=auto would train the run again from step 0, and its saves would later
    replace them. It is refused, naming each and the ways on; train.resume=never starts over."""
    from shared.errors import CheckpointError

    extra = {"train.max_steps": 2, "checkpoint.every_steps": 1, "train.resume": "auto"}
    commands.cmd_train(config(tiny_target_dir, store, tmp_path, **extra), progress=False)
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    for step_dir in saved:
        weights = step_dir / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-100:-36] = bytes(64)  # same size, other bytes
        weights.write_bytes(bytes(data))
    rows = len(read_log(tmp_path / "train_log.jsonl"))
    more = {**extra, "train.max_steps": 4}
    with pytest.raises(CheckpointError) as refused:
        commands.cmd_train(config(tiny_target_dir, store, tmp_path, **more), progress=False)
    message = str(refused.value)
    assert len(saved) == 2 and all(str(p) in message for p in saved) and "train.resume=never" in message
    assert len(read_log(tmp_path / "train_log.jsonl")) == rows
    fresh = {**more, "train.resume": "never"}
    assert commands.cmd_train(config(tiny_target_dir, store, tmp_path, **fresh), progress=False)["steps"] == 4


def test_a_resume_under_other_eval_samples_chooses_the_best_among_its_own_evals(tiny_target_dir, store, tmp_path):
    """The best's value is an estimate on eval.offline_max_samples held-out samples: resumed with
    another number, its evals score another set, and comparing them with the saved best (here a set
    the first run scored higher than any eval of the second can) would keep `best` on the old
    checkpoint for good. The resumed run's evals choose anew, as under another metric."""
    extra = {"train.max_steps": 2, "checkpoint.every_steps": 1, "checkpoint.keep_latest_k": 10, "eval.every_steps": 1,
             "checkpoint.keep_best": True, "eval.offline_max_anchors_per_seq": None, "train.resume": "auto",
             "eval.offline_max_samples": 4}
    commands.cmd_train(config(tiny_target_dir, store, tmp_path, **extra), progress=False)
    pointer = tmp_path / "checkpoints" / "best"
    pointer.write_text(json.dumps({**json.loads(pointer.read_text()), "value": 1e9}))
    first = len(read_log(tmp_path / "train_log.jsonl"))
    more = {**extra, "train.max_steps": 4, "eval.offline_max_samples": 2}
    assert commands.cmd_train(config(tiny_target_dir, store, tmp_path, **more), progress=False)["steps"] == 4
    evals = {r["step"]: r["walk_tau"] for r in read_log(tmp_path / "train_log.jsonl")[first:] if r["kind"] == "eval"}
    best = json.loads(pointer.read_text())
    assert sorted(evals) == [3, 4] and best["step"] in evals and best["value"] == max(evals.values())


def test_a_best_saved_at_an_epochs_last_step_resumes_with_the_next_epochs_count_from_zero(tiny_target_dir, store, tmp_path):
    """checkpoint.keep_best saves a new best when its eval runs, before the epoch_end that closes the
    epoch: resumed from that save (8 steps an epoch, evals every 8), the next epoch's epoch_end counts
    its own blocks, not the finished epoch's added to them."""
    extra = {"train.max_steps": 17, "checkpoint.every_steps": 0, "eval.every_steps": 8, "checkpoint.keep_best": True,
             "checkpoint.keep_latest_k": 5, "train.resume": "auto", "sampler.max_anchors_per_seq": 2}
    cfg = config(tiny_target_dir, store, tmp_path, **extra)
    commands.cmd_train(cfg, progress=False)
    ends = [(e["epoch"], e["step"], e["blocks"]) for e in read_log(tmp_path / "train_log.jsonl", "event") if e["event"] == "epoch_end"]
    assert ends[0][:2] == (0, 8) and len(ends) == 2
    ckpt = tmp_path / "checkpoints"
    for later in (p for p in ckpt.glob("step_*") if p.name != "step_000008"):
        shutil.rmtree(later)
    (ckpt / "latest").write_text("step_000008")
    (ckpt / "best").write_text(json.dumps({"step": 8, "metric": "accept_len", "value": 0.0}))
    first = len(read_log(tmp_path / "train_log.jsonl"))
    assert commands.cmd_train(cfg, progress=False)["steps"] == 17
    again = [(e["epoch"], e["step"], e["blocks"]) for e in read_log(tmp_path / "train_log.jsonl")[first:] if e.get("event") == "epoch_end"]
    assert again == ends[1:]


def test_a_run_lost_during_its_final_eval_evaluates_its_last_step_when_run_again(
    tiny_target_dir, store, tmp_path, fresh_accelerator_state
):
    """The last step's periodic save came before the final eval: lost during that eval (a preemption's
    grace period, a node), the run was complete on disk, so the same command reported it done with no
    final eval, its summary held an earlier eval and keep_best never judged the final weights. The last
    step is saved once, after its final eval: run again, the run trains its last steps again (exactly)
    and evaluates them."""
    extra = {"train.max_steps": 4, "checkpoint.every_steps": 2, "eval.every_steps": 2, "checkpoint.keep_best": True,
             "train.resume": "auto"}
    trainer = bf16_trainer(config(tiny_target_dir, store, tmp_path, **extra))
    evaluate = trainer.evaluate

    def lost_in_the_final_eval(final=False):
        if final:
            raise RuntimeError("node lost")
        return evaluate(final)

    trainer.evaluate = lost_in_the_final_eval
    with pytest.raises(RuntimeError, match="node lost"):
        trainer.fit()
    first = {r["step"]: r for r in read_log(tmp_path / "train_log.jsonl", "train")}
    rows = len(read_log(tmp_path / "train_log.jsonl"))
    summary = commands.cmd_train(config(tiny_target_dir, store, tmp_path, **extra), progress=False)
    again = read_log(tmp_path / "train_log.jsonl")[rows:]
    assert not summary.get("already_complete") and summary["steps"] == 4
    final = [r for r in again if r["kind"] == "eval" and r["step"] == 4]
    assert len(final) == 1 and final[0]["walk_tau"] is not None
    assert summary["final_eval"]["walk_tau"] == final[0]["walk_tau"]
    assert [(r["step"], r["loss"]) for r in again if r["kind"] == "train"] == [(s, first[s]["loss"]) for s in (3, 4)]


def test_a_run_stopped_early_at_resume_at_a_saved_step_still_gets_its_final_eval(tiny_target_dir, store, tmp_path):
    """train.max_steps lowered at resume to a step a periodic save holds: the run ends there, but that
    checkpoint's run never ran its final (dense) eval; it was reported complete without one."""
    from stage2_train import commands
    from stage2_train.observe.metrics import read_log

    extra = {"checkpoint.every_steps": 2, "eval.every_steps": 0, "train.resume": "auto"}
    commands.cmd_train(config(tiny_target_dir, store, tmp_path, **{**extra, "train.max_steps": 4}), progress=False)
    shutil.rmtree(tmp_path / "checkpoints" / "step_000004")  # as if lost before its last save
    (tmp_path / "checkpoints" / "latest").write_text("step_000002\n")
    rows = len(read_log(tmp_path / "train_log.jsonl"))
    summary = commands.cmd_train(config(tiny_target_dir, store, tmp_path, **{**extra, "train.max_steps": 2}), progress=False)
    again = read_log(tmp_path / "train_log.jsonl")[rows:]
    assert not summary.get("already_complete") and summary["steps"] == 2
    assert [r["step"] for r in again if r["kind"] == "eval"] == [2] and summary["final_eval"]["walk_tau"] is not None


def test_muon_takes_the_weight_matrices_and_adamw_the_rest():
    from stage2_train.train.config import OptimConfig
    from stage2_train.train.schedules import Optimizers, muon_params
    from testkit.drafter import tiny_arch, tiny_drafter

    model = tiny_drafter(tiny_arch(kv_heads=2), num_layers=2)
    muon, adamw, tables = muon_params(model)
    assert not tables and {n for n, _ in muon} == {n for n, p in model.named_parameters() if p.ndim == 2}
    assert all(p.ndim == 1 for _, p in adamw) and "fc.weight" in {n for n, _ in muon}
    opts = Optimizers(model, OptimConfig(name="muon", lr=1e-3), total_steps=10)
    muon_group = opts.named["muon"].param_groups[0]
    assert (muon_group["momentum"], muon_group["weight_decay"], muon_group["adjust_lr_fn"]) == (0.95, 0.1, "match_rms_adamw")
    assert opts.named["adamw"].param_groups[0]["weight_decay"] == 0.0


# ---- commands --------------------------------------------------------------------------------------
def test_batches_json_lines_describe_the_steps(tiny_target_dir, store, tmp_path, capsys):
    args = ["batches", "--json", "--steps", "7", "--world-size", "2"] + overrides(tiny_target_dir, store, tmp_path)
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 7
    rows = [json.loads(line) for line in lines]
    for row in rows:
        assert set(row) >= {"epoch", "step_in_epoch", "tokens", "num_samples", "length_p50", "length_max",
                            "padding_fraction", "rank_tokens"}
        assert len(row["rank_tokens"]) == 2 and sum(row["rank_tokens"]) == row["tokens"]
        assert row["tokens"] <= 2 * 512
    assert rows[0]["epoch"] == 0 and rows[-1]["epoch"] >= 1  # crosses into the next epoch
    assert not (tmp_path / "train_log.jsonl").exists()  # a dry run trains and writes nothing


def test_check_reports_gamma_and_betas(tiny_target_dir, store, tmp_path, capsys):
    extra = {"loss.gamma": 7.0, "optim.betas": [0.9, 0.98]}
    assert main(["check"] + overrides(tiny_target_dir, store, tmp_path, **extra)) == 0
    out = capsys.readouterr()
    assert yaml.safe_load(out.out)["optim"]["betas"] == [0.9, 0.98]
    assert "loss.gamma=7 departs from the recipe: 4 for model.block_size=8" in out.err
    assert "issue #115" in out.err


def test_bad_values_and_missing_logs_exit_2(tmp_path, capsys):
    assert main(["check", "optim.betas=[0.9, 1.5]"]) == 2
    assert "optim.betas must both be in [0, 1)" in capsys.readouterr().err
    assert main(["check", "train.epochs=0"]) == 2
    assert main(["doctor", f"run_dir={tmp_path}"]) == 2
    assert str(tmp_path) in capsys.readouterr().err


def test_doctor_reads_the_run_log(run, capsys):
    run_dir, _ = run
    code = main(["doctor", "--json", f"run_dir={run_dir}"])
    diagnosis = json.loads(capsys.readouterr().out)
    assert diagnosis["summary"]["log"] == str(run_dir / "train_log.jsonl")
    # 10 rows are fewer than the detectors' min_history_rows: nothing can be judged, so nothing fires.
    assert code == 0 and diagnosis["events"] == [] and diagnosis["summary"]["healthy"]


# ---- 1 process vs 2 ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_processes_give_the_losses_of_one(tiny_target_dir, store, tmp_path):
    """Same global batch: 1 rank x 2 micro-batches vs 2 ranks (torchrun, gloo) x 1 micro-batch; the
    held-out eval mid-training (every 2 steps) is spread over the 2 ranks and gives the same row."""
    extra = {"train.max_steps": 4, "sampler.micro_batch_tokens": 256, "sampler.max_anchors_per_seq": 2,
             "eval.every_steps": 2, "eval.offline_max_samples": 5, "eval.holdout_fraction": 0.25}
    one = tmp_path / "one"
    commands.cmd_train(config(tiny_target_dir, store, one, **{**extra, "train.grad_accum": 2}), progress=False)
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "stage2_train", "train", "--json", "--no-progress"]
    cmd += overrides(tiny_target_dir, store, two, **{**extra, "train.grad_accum": 1})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows_one = read_log(one / "train_log.jsonl", "train")
    rows_two = read_log(two / "train_log.jsonl", "train")
    assert [r["step"] for r in rows_two] == [1, 2, 3, 4]
    for a, b in zip(rows_one, rows_two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["tokens"] == a["tokens"] and b["blocks"] == a["blocks"]
    start = read_log(two / "train_log.jsonl", "event")[0]
    assert start["config"]["resolved"]["world_size"] == 2
    eval_one, eval_two = read_log(one / "train_log.jsonl", "eval"), read_log(two / "train_log.jsonl", "eval")
    assert [r["step"] for r in eval_two] == [r["step"] for r in eval_one] == [2, 4]
    for a, b in zip(eval_one, eval_two):
        assert b["num_samples"] == a["num_samples"] == 5 and b["accept_hist"] == a["accept_hist"]
        for key in ("ce", "accuracy", "accept_len", "walk_tau", "ce_se", "accuracy_se", "walk_tau_se"):
            if a.get(key) is None:  # walk_tau: evals during training sample anchors; only the final one is dense
                assert b.get(key) is None, key
                continue
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert eval_one[-1]["walk_tau"] is not None and eval_two[-1]["walk_tau"] is not None


@pytest.mark.slow
def test_two_process_resume_continues_exactly(tiny_target_dir, store, tmp_path):
    """2 ranks, saved at step 3 and resumed: steps 4-6 and the final weights equal the uninterrupted run,
    and the resume hashes each file of the checkpoint once (rank 0 the shared ones, each rank its own)."""
    from safetensors.torch import load_file

    extra = {"train.max_steps": 6, "checkpoint.every_steps": 3, "train.resume": "auto",
             "sampler.micro_batch_tokens": 256, "sampler.max_anchors_per_seq": 2}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "stage2_train", "train", "--json", "--no-progress", *overrides(tiny_target_dir, store, tmp_path, **extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = tmp_path / "checkpoints"
    first = {r["step"]: r for r in read_log(tmp_path / "train_log.jsonl", "train")}
    weights = load_file(ckpt / "step_000006" / "model.safetensors")
    shutil.rmtree(ckpt / "step_000006")
    (ckpt / "latest").write_text("step_000003")
    hashes = tmp_path / "hashes.log"
    counted = {**env, "PYTHONPATH": f"{REPO / 'tests' / 'hooks'}:{REPO}", "DFLASH_HASH_LOG": str(hashes)}
    done = subprocess.run(cmd, cwd=REPO, env=counted, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed_from = str(ckpt / "step_000003")
    reads = [line.split(" ", 1) for line in hashes.read_text().splitlines() if resumed_from + "/" in line]
    by_file: dict[str, list[str]] = {}
    for rank, path in reads:
        by_file.setdefault(Path(path).name, []).append(rank)
    assert by_file == {
        "model.safetensors": ["0"], "shared.safetensors": ["0"], "shared.json": ["0"], "drafter.json": ["0"],
        "rank_00000.safetensors": ["0"], "rank_00000.json": ["0"], "rank_00001.safetensors": ["1"], "rank_00001.json": ["1"],
    }
    again = [r for r in read_log(tmp_path / "train_log.jsonl", "train")][6:]
    assert [r["step"] for r in again] == [4, 5, 6]
    for row in again:
        for key in ("loss", "grad_norm", "lr", "noise_std", "tokens", "blocks"):
            assert row[key] == first[row["step"]][key], (row["step"], key)
    resumed = load_file(ckpt / "step_000006" / "model.safetensors")
    assert resumed.keys() == weights.keys()
    assert all(torch.equal(resumed[k], weights[k]) for k in weights)


def test_each_training_rank_makes_its_own_gpu_current_before_accelerate_starts(monkeypatch):
    """Rank k's GPU is current before the Accelerator exists (else its NCCL communicator, default
    stream and first allocations are cuda:0's, and eight ranks crowd one GPU); DDP does not re-send
    the buffers every rank already holds."""
    import accelerate

    from stage2_train.train import launch

    events = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: events.append(("set_device", index)))

    class FakeAccelerator:
        def __init__(self, cpu, mixed_precision, kwargs_handlers, gradient_accumulation_plugin):
            events.append(("accelerator", cpu, mixed_precision))
            assert [h.broadcast_buffers for h in kwargs_handlers] == [False]  # the frozen buffers are equal everywhere
            assert gradient_accumulation_plugin.num_steps == 1  # the trainer accumulates; accelerate divides nothing
            self.distributed_type = accelerate.utils.DistributedType.MULTI_GPU

    monkeypatch.setattr(accelerate, "Accelerator", FakeAccelerator)
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    launch.make_accelerator(load_run_config("configs/default.yaml", ["train.device=cuda"]).train)
    assert events == [("set_device", 5), ("accelerator", False, "bf16")]
    events.clear()
    launch.make_accelerator(load_run_config("configs/default.yaml", ["train.device=cpu"]).train)
    assert events == [("accelerator", True, "no")]


def test_an_accumulation_count_from_accelerate_launch_is_refused_naming_the_setting(monkeypatch):
    """Accelerate divides each backward's loss by the count it reads from its launcher's environment:
    with the trainer's own accumulation that shrank every update N times, silently."""
    from shared.errors import ConfigError
    from stage2_train.train import launch

    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=4 .*set train\.grad_accum=4 and gradient_accumulation_steps to 1"):
        launch.make_accelerator(load_run_config("configs/default.yaml", ["train.device=cpu"]).train)
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    assert launch.make_accelerator(load_run_config("configs/default.yaml", ["train.device=cpu"]).train).gradient_accumulation_steps == 1


class FrozenBuffers(torch.nn.Module):
    """A trained layer and a frozen, non-persistent buffer, as the drafter holds the target's LM head."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("head_VH", torch.zeros(8, 4), persistent=False)

    def forward(self, x):
        return self.lin(x) @ self.head_VH.T


def ddp_buffers_on_rank(rank: int, port: int, out: str) -> None:
    from stage2_train.train.launch import make_accelerator

    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    accelerator = make_accelerator(load_run_config("configs/default.yaml", ["train.device=cpu", "train.cpu_threads=1"]).train)
    model = accelerator.prepare(FrozenBuffers())
    seen = []
    for _ in range(2):
        model.module.head_VH.fill_(float(rank + 1))  # the ranks disagree, which the drafter's never do
        model(torch.ones(2, 4)).sum().backward()
        seen.append(model.module.head_VH[0, 0].item())
    Path(out, f"rank{rank}.json").write_text(json.dumps({"wrapped": type(model).__name__, "seen": seen}))
    torch.distributed.destroy_process_group()


@pytest.mark.slow  # two gloo ranks: ~10 s
def test_ddp_leaves_the_frozen_buffers_where_each_rank_holds_them(tmp_path):
    """DDP's default broadcasts every module buffer from rank 0 before each forward: 2.5 GB of target
    embedding and LM head per step at 8B, equal on every rank by construction. 2 gloo ranks."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(ddp_buffers_on_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["wrapped"] for r in ranks] == ["DistributedDataParallel"] * 2
    assert ranks[1]["seen"] == [2.0, 2.0]  # not rank 0's 1.0


def test_tokens_per_second_counts_training_time_not_the_evals_between_rows(tiny_target_dir, store, tmp_path, fresh_accelerator_state):
    """A held-out eval between two train rows is not training time: the row after it read as a
    slowdown every eval.every_steps (here each eval takes 1 s longer than the steps it follows)."""
    extra = {"train.max_steps": 4, "eval.every_steps": 2, "log.every_steps": 1, "checkpoint.every_steps": 0}
    trainer = bf16_trainer(config(tiny_target_dir, store, tmp_path / "run", **extra))
    row = trainer.heldout.row

    def slow_row(*args, **kwargs):
        time.sleep(1.0)
        return row(*args, **kwargs)

    trainer.heldout.row = slow_row
    trainer.fit()
    rows = read_log(tmp_path / "run" / "train_log.jsonl", "train")
    evals = [r["eval_s"] for r in read_log(tmp_path / "run" / "train_log.jsonl", "eval")]
    assert len(evals) == 2 and min(evals) >= 1.0
    for r in rows[1:]:  # each row's rate over its own step: the previous row's eval is not in it
        assert r["tok_per_s"] > 0.5 * r["tokens"] / r["step_s"], (r["step"], r["tok_per_s"], r["tokens"] / r["step_s"])

