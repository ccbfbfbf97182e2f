"""A real run made to overfit: the live detectors write a `generalisation` warning during training.

    .venv/bin/python -m pytest tests/test_overfit_run.py -q -m slow

The embedded SmolLM2 target (its real LM head, so the drafter learns quickly) extracts 40 chats
whose answers are random sequences of a few words: a 1-layer drafter memorises the training
answers over many epochs while the held-out ones, drawn the same way, cannot be memorised.
"""

from __future__ import annotations

import json

import pytest

from shared.config import load_run_config
from stage1_extract import commands as stage1
from stage2_train import commands as stage2
from stage2_train.observe.metrics import read_log
from testkit.data import chat_rows, write_jsonl


@pytest.mark.slow
def test_an_overfitting_run_raises_a_generalisation_warning_live(tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(48, seed=5))
    common = [f"run_dir={tmp_path / 'run'}", f"data.path={data}", "data.regenerate=false", "data.max_length=256",
              "store.shard_mb=1", "target.dtype=fp32"]
    stage1.cmd_extract(load_run_config("default", common), progress=False)
    cfg = load_run_config("default", [
        *common, "train.max_steps=240", "train.epochs=1000", "eval.every_steps=20", "eval.holdout_fraction=0.5",
        "eval.offline_max_samples=24", "optim.lr=3e-3", "sampler.micro_batch_tokens=1024", "noise.std=0",
        "checkpoint.every_steps=0", "log.wandb=disabled",
    ])
    stage2.cmd_train(cfg, progress=False)
    log = tmp_path / "run" / "train_log.jsonl"
    warnings = [e for e in read_log(log, "event") if e["event"] == "warning" and e["detector"] == "generalisation"]
    assert warnings, json.dumps([r for r in read_log(log, "eval")], indent=0)[:2000]
    first = warnings[0]
    evals = {r["step"]: r for r in read_log(log, "eval")}
    train = read_log(log, "train")
    assert first["step"] in evals and first["details"]["confirmed_step"] > first["step"]
    # training kept improving while the held-out metric turned
    assert first["details"]["train_now"]["loss"] < first["details"]["train_then"]["loss"]
    assert train[-1]["accuracy"] > 2 * min(r["accuracy"] for r in train[5:20])
