"""`python -m stage2_train plan`: the memory of a training step, traced with fake tensors.

    .venv/bin/python -m pytest tests/test_memory_plan.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import load_run_config
from stage2_train.model.config import DrafterConfig, LossConfig
from stage2_train.train.memory_plan import KNOWN_TARGETS, StepShape, formula, traced_step
from testkit.drafter import tiny_arch, tiny_drafter

REPO = Path(__file__).resolve().parents[1]


def test_the_formula_counts_the_drafters_parameters_exactly():
    arch = tiny_arch(kv_heads=2)
    model = tiny_drafter(arch, num_layers=3, num_feature_layers=2)
    trainable = sum(p.numel() for p in model.parameters())
    assert formula(model.cfg, arch, 2, world_size=1)["params"] == round(trainable / 1e9, 3)
    qwen = formula(DrafterConfig(num_layers=5), KNOWN_TARGETS["qwen3-8b"], 5, world_size=8)
    assert qwen["params"] == pytest.approx(1.05, abs=0.01) and qwen["frozen_embed_and_head_bf16"] == pytest.approx(2.32, abs=0.01)


def test_the_traced_peak_follows_the_micro_batch_and_checkpointing():
    """The trace runs the real step (forward, chunked loss, backward, AdamW) on fake tensors: its
    weights and optimizer state equal the formula, and activations grow with the micro-batch and
    shrink with checkpointing."""
    arch = tiny_arch(hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=4096, inter=512)
    loss = LossConfig(gamma=7.0)
    small = traced_step(DrafterConfig(num_layers=2, block_size=16), loss, arch, 3, StepShape(2048, 256, 64, 16))
    large = traced_step(DrafterConfig(num_layers=2, block_size=16), loss, arch, 3, StepShape(4096, 256, 64, 16))
    saved = traced_step(DrafterConfig(num_layers=2, block_size=16, activation_checkpointing=True), loss, arch, 3, StepShape(4096, 256, 64, 16))
    fixed = formula(DrafterConfig(num_layers=2, block_size=16), arch, 3, world_size=1)
    assert small["Parameter"] == pytest.approx(fixed["weights_fp32"], abs=0.01)
    assert small["Optstate"] == pytest.approx(fixed["adamw_state_fp32"], abs=0.01)
    assert large["Activation"] > 1.8 * small["Activation"] and saved["Activation"] < 0.6 * large["Activation"]
    assert large["Total"] > small["Total"]


def test_plan_prints_for_the_default_preset():
    done = subprocess.run(
        [sys.executable, "-m", "stage2_train", "plan", "--json", "--config", "default", "--sample-tokens", "256"],
        cwd=REPO, capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["shape_from"] == "config.json" and out["fits"] == {"H100/A100 80 GB": True, "H200 141 GB": True}
    assert out["micro_batch"] == {"tokens": 2048, "samples": 8, "anchors_per_sample": 8, "block_rows": 1024}


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["qwen3-8b", "llama-3.1-8b"])
def test_plan_prints_for_the_8b_presets(preset):
    cfg = load_run_config(preset)
    assert cfg.model.activation_checkpointing
    done = subprocess.run([sys.executable, "-m", "stage2_train", "plan", "--json", "--config", preset], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["shape_from"].startswith("the published") and out["fits"]["H200 141 GB"]
    with_ckpt, without = out["traced_peak_gib"]["with_checkpointing"], out["traced_peak_gib"]["without_checkpointing"]
    assert with_ckpt["Total"] < without["Total"]
