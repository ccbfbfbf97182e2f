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
from tests.test_model import tiny_arch, tiny_drafter

REPO = Path(__file__).resolve().parents[1]


def test_the_formula_counts_the_drafters_parameters_exactly():
    arch = tiny_arch(kv_heads=2)
    model = tiny_drafter(arch, num_layers=3, num_feature_layers=2)
    trainable = sum(p.numel() for p in model.parameters())
    assert formula(model.cfg, arch, 2, world_size=1)["params"] == round(trainable / 1e9, 3)
    qwen = formula(DrafterConfig(num_layers=5), KNOWN_TARGETS["qwen3-8b"], 5, world_size=8)
    assert qwen["params"] == pytest.approx(1.05, abs=0.01) and qwen["frozen_embed_and_head_bf16"] == pytest.approx(2.32, abs=0.01)


@pytest.mark.parametrize("variant, extra", [
    ("dspark", {"markov_rank": 8}), ("dspark", {"markov_rank": 8, "markov_head": "gated"}),
    ("dspark", {"markov_rank": 8, "markov_head": "rnn", "confidence_head": False}),
    ("dflash2", {"conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4, "conv_kernel_size": 3}),
])
def test_the_formula_counts_each_variants_parameters(variant, extra):
    from stage2_train.model.drafter import drafter_class

    arch = tiny_arch(kv_heads=2)
    cfg = DrafterConfig(variant=variant, num_layers=3, block_size=4, **extra)
    model = drafter_class(variant)(cfg, arch, 2, 99)
    trainable = sum(p.numel() for p in model.parameters())
    base = sum(p.numel() for p in tiny_drafter(arch, num_layers=3, num_feature_layers=2).parameters())
    assert trainable > base
    assert formula(cfg, arch, 2, world_size=1)["weights_fp32"] == round(4 * trainable / 2**30, 2)
    assert formula(cfg, arch, 2, world_size=1)["params"] * 1e9 == pytest.approx(trainable, abs=5e5)
    qwen = formula(DrafterConfig(variant=variant, num_layers=5), KNOWN_TARGETS["qwen3-8b"], 5, world_size=8)["params"]
    assert qwen == pytest.approx({"dspark": 1.05 + 0.078, "dflash2": 1.05 + 0.078 + 0.001 + 0.042}[variant], abs=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("variant, extra", [
    ("dspark", {"markov_rank": 64, "markov_head": "rnn"}), ("dflash2", {"conv_group_size": 8, "selector_rank": 64, "selector_top_k": 4}),
])
def test_the_traced_step_of_a_variant_holds_its_heads(variant, extra):
    """The plan traces the variant's own step (its heads in the forward and the loss): its weights are
    the formula's, heads included (a 100K vocabulary, so the [V, r] heads weigh ~0.05 GiB)."""
    arch = tiny_arch(kv_heads=2, vocab=100_000)
    cfg = DrafterConfig(variant=variant, num_layers=2, block_size=4, **extra)
    traced = traced_step(cfg, LossConfig(gamma=4.0), arch, 2, StepShape(256, 64, 8, 4), bf16=False)
    assert traced["Parameter"] == pytest.approx(formula(cfg, arch, 2, world_size=1)["weights_fp32"], abs=0.006)
    plain = traced_step(DrafterConfig(num_layers=2, block_size=4), LossConfig(gamma=4.0), arch, 2, StepShape(256, 64, 8, 4), bf16=False)
    assert traced["Parameter"] > plain["Parameter"] + 0.04


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
