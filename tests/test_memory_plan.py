"""`python -m stage2_train plan`: the memory of the worst training step, traced with fake tensors.

    .venv/bin/python -m pytest tests/test_memory_plan.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from shared.config import load_run_config
from stage2_train.data.config import SamplerConfig
from stage2_train.data.sampler import LengthMixedSampler
from stage2_train.model.config import DrafterConfig, LossConfig
from stage2_train.train.memory_plan import (
    KNOWN_TARGETS,
    LEGACY_COSTS,
    PlanInputs,
    StepShape,
    densest_micro_batch,
    formula,
    largest_fitting,
    traced_step,
)
from testkit.drafter import tiny_arch, tiny_drafter

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


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
    traced = traced_step(cfg, LossConfig(gamma=4.0), arch, 2, StepShape(256, 32, 4, 4), bf16=False)
    assert traced["Parameter"] == pytest.approx(formula(cfg, arch, 2, world_size=1)["weights_fp32"], abs=0.006)
    plain = traced_step(DrafterConfig(num_layers=2, block_size=4), LossConfig(gamma=4.0), arch, 2, StepShape(256, 32, 4, 4), bf16=False)
    assert traced["Parameter"] > plain["Parameter"] + 0.04


def test_the_densest_micro_batch_is_the_most_blocks_both_budgets_allow():
    # The 8B preset: 16 samples of 1,024 tokens with 512 anchors each fill both budgets.
    assert densest_micro_batch(16384, 8192, 512, 16) == StepShape(16384, 8192, 16, 16)
    # A block budget above what the tokens can yield: samples of 513 tokens give 512 blocks each.
    assert densest_micro_batch(16384, 10**6, 512, 16) == StepShape(16384, 31 * 512 + 480, 32, 16)
    # The CPU default: 2,048 tokens, 8 anchors per sample.
    assert densest_micro_batch(2048, 1024, 8, 16) == StepShape(2048, 1024, 128, 16)
    for tokens, budget, anchors in ((100, 60, 4), (4096, 300, 512), (7, 7, 8)):
        shape = densest_micro_batch(tokens, budget, anchors, 4)
        assert sum(shape.sample_tokens()) == tokens and sum(shape.sample_blocks()) == shape.blocks <= budget
        assert all(b <= min(t - 1, anchors) for t, b in zip(shape.sample_tokens(), shape.sample_blocks()))


def test_no_micro_batch_the_sampler_forms_is_denser_than_the_plans():
    """Whatever the data (here short, fully supervised samples, which make the most blocks per token),
    the sampler's micro-batches stay within the plan's traced micro-batch in tokens and blocks."""
    rng = np.random.default_rng(0)
    for max_anchors, tokens in ((512, 16384), (8, 2048), (64, 4096)):
        cfg = SamplerConfig(micro_batch_tokens=tokens, max_anchors_per_seq=max_anchors)
        lengths = rng.integers(2, 3 * max_anchors, 3000)
        blocks = np.minimum(lengths - 1, max_anchors)
        shape = densest_micro_batch(tokens, cfg.blocks_budget(), max_anchors, 16)
        plan = LengthMixedSampler(cfg, lengths, seed=0, world_size=2, blocks=blocks).plan_epoch(0)
        bins = [b for step in plan for b in step]
        assert max(int(lengths[b].sum()) for b in bins) <= shape.tokens
        assert max(int(blocks[b].sum()) for b in bins) <= shape.blocks


def small_inputs(grad_accum: int = 1, **sampler) -> PlanInputs:
    arch = tiny_arch(hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=4096, inter=512)
    from stage2_train.train.config import NoiseConfig, OptimConfig

    return PlanInputs(
        DrafterConfig(num_layers=2, block_size=16), LossConfig(gamma=7.0), SamplerConfig(**sampler), NoiseConfig(std=0.05),
        OptimConfig(), grad_accum, arch, 3,
    )


def test_the_traced_peak_follows_the_micro_batch_and_checkpointing():
    """The trace runs the trainer's step (a micro-batch copied in, noise, forward, chunked loss,
    backward, AdamW) on fake tensors: its weights and optimizer state equal the formula, and
    activations grow with the blocks and shrink with checkpointing."""
    inputs = small_inputs()
    small = inputs.trace(StepShape(2048, 512, 8, 16))
    large = inputs.trace(StepShape(4096, 1024, 16, 16))
    saved = inputs.trace(StepShape(4096, 1024, 16, 16), model=inputs.model.model_copy(update={"activation_checkpointing": True}))
    fixed = formula(inputs.model, inputs.arch, 3, world_size=1)
    assert small["Parameter"] == pytest.approx(fixed["weights_fp32"], abs=0.01)
    assert small["Optstate"] == pytest.approx(fixed["adamw_state_fp32"], abs=0.01)
    assert large["Activation"] > 1.8 * small["Activation"] and saved["Activation"] < 0.6 * large["Activation"]
    assert large["Total"] > small["Total"]


@pytest.mark.slow  # 10-15 s: `make test-all`
def test_each_removed_cost_is_what_the_trace_measures_when_it_is_put_back():
    """The three costs the trainer no longer pays, each traced by putting it back, come back at least
    at their sizes: (grad_accum - 1) more micro-batches on the device, a noisy bf16 copy of the
    context, an fp32 copy of the [N, B, H] output (less the bf16 one it replaces; at this small shape
    the fp32 loss around it adds as much again, at the 8B shape it is the copy: the slow test)."""
    inputs = small_inputs(grad_accum=3)
    shape = StepShape(4096, 1024, 16, 16)
    base = inputs.trace(shape)["Total"]
    context = shape.tokens * 3 * 256 * 2 / GIB  # [T, 3 layers x 256] bf16
    output = shape.block_rows * 256 * 2 / GIB  # [N, B, H]: fp32 minus bf16
    added = {name: inputs.trace(shape, legacy=frozenset({name}))["Total"] - base for name in LEGACY_COSTS}
    assert 2 * context <= added["all_micro_batches_on_device"] <= 2 * context + 0.002
    assert context - 0.001 <= added["noisy_copy"] <= context + 0.002
    assert output <= added["fp32_output_cast"] <= 4 * output
    with pytest.raises(ValueError, match="unknown legacy costs"):
        traced_step(inputs.model, inputs.loss, inputs.arch, 3, shape, legacy=frozenset({"fp16"}))


@pytest.mark.slow
def test_search_finds_the_largest_budgets_under_a_memory_bound():
    """Doubling then bisection in steps of 256 blocks, tokens in the config's ratio: the answer fits
    and 256 more blocks would not."""
    inputs = small_inputs(micro_batch_tokens=4096, max_anchors_per_seq=64)
    bound = inputs.trace(inputs.shape(2 * 4480, 4480))["Total"]  # halfway between two steps of the search
    best = largest_fitting(inputs, bound)
    assert best["micro_batch_blocks"] == 4352 and best["micro_batch_tokens"] == 2 * 4352
    assert best["traced_peak_gib"] <= bound < inputs.trace(inputs.shape(2 * 4608, 4608))["Total"]
    assert largest_fitting(inputs, 0.001)["micro_batch_blocks"] is None


@pytest.mark.slow  # 10-15 s: `make test-all`
def test_plan_prints_for_the_default_preset():
    done = subprocess.run(
        [sys.executable, "-m", "stage2_train", "plan", "--json", "--config", "default"], cwd=REPO, capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["shape_from"] == "config.json" and out["fits"] == {"H100/A100 80 GB": True, "H200 141 GB": True}
    assert out["micro_batch"] == {"tokens": 2048, "blocks": 1024, "samples": 128, "block_rows": 16384}
    assert out["budgets"]["micro_batch_blocks_from"] == "null: micro_batch_tokens // 2"
    assert set(out["removed_costs_gib"]) == set(LEGACY_COSTS) and out["peak_gib"] > 4.0


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["qwen3-8b", "llama-3.1-8b"])
def test_the_8b_presets_worst_step_fits_an_80_gb_gpu_with_its_reserve(preset, tmp_path):
    """The densest micro-batch the preset's budgets allow, traced as the trainer runs it, plus DDP's
    buckets and a 4 GiB reserve, stays within 76 GiB; each removed cost is measured and positive."""
    cfg = load_run_config(preset)
    assert cfg.model.activation_checkpointing
    # An empty Hub cache: a node that holds the target would plan from its cached config.json instead.
    done = subprocess.run([sys.executable, "-m", "stage2_train", "plan", "--json", "--config", preset], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "HF_HUB_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["shape_from"].startswith("the published") and out["fits"] == {"H100/A100 80 GB": True, "H200 141 GB": True}
    assert out["peak_gib"] <= 76.0
    mb = out["micro_batch"]
    assert mb["block_rows"] == cfg.sampler.blocks_budget() * cfg.model.block_size and mb["tokens"] == cfg.sampler.micro_batch_tokens
    # What each removed cost adds back: 2 more micro-batches of [T, 5 x 4096] bf16 context, a noisy
    # copy of it, and the fp32 output [N, B, 4096] less its bf16 original (the 1.3, 0.6, 1.0 GiB).
    context, output = mb["tokens"] * 5 * 4096 * 2 / 2**30, mb["block_rows"] * 4096 * 2 / 2**30
    removed = {name: cost["would_add"] for name, cost in out["removed_costs_gib"].items()}
    assert removed["all_micro_batches_on_device"] == pytest.approx(2 * context, abs=0.03)
    assert removed["noisy_copy"] == pytest.approx(context, abs=0.03)
    assert removed["fp32_output_cast"] == pytest.approx(output, abs=0.03)
    with_ckpt, without = out["traced_peak_gib"]["with_checkpointing"], out["traced_peak_gib"]["without_checkpointing"]
    assert with_ckpt["step_total"] < without["step_total"] and with_ckpt["Total"] >= with_ckpt["step_total"]
    assert out["eval_pack"]["tokens"] == max(cfg.eval.offline_batch_tokens, 3072)


def test_the_plan_traces_the_compute_dtype_the_trainer_takes(monkeypatch):
    """train.mixed_precision=fp32 (or auto under an `accelerate launch` configured with no mixed
    precision) trains in fp32 on a GPU: the plan traced bf16 regardless and called fitting a step
    that needs about twice its activations."""
    from stage2_train.commands import plan_inputs

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert plan_inputs(load_run_config("qwen3-8b"))[0].bf16
    assert not plan_inputs(load_run_config("qwen3-8b", ["train.mixed_precision=fp32"]))[0].bf16
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert not plan_inputs(load_run_config("qwen3-8b"))[0].bf16
    shape = StepShape(2048, 512, 8, 16)
    bf16, fp32 = small_inputs().trace(shape), replace(small_inputs(), bf16=False).trace(shape)
    assert fp32["Activation"] > 1.3 * bf16["Activation"] and fp32["Total"] > bf16["Total"]


def test_the_plan_traces_the_final_evals_densest_pack():
    """The final held-out eval scores every anchor of a pack of `eval.offline_batch_tokens` tokens: on
    the default preset 131K block rows against a training micro-batch's 16K, without gradients but
    beside the optimizer state. The plan traced the steps alone and so missed a peak that was the
    eval's (1.8 against 1.0 GiB there)."""
    inputs = small_inputs()
    shape = StepShape(2048, 512, 8, 16)
    alone, with_eval = inputs.trace(shape), replace(inputs, eval_tokens=8192).trace(shape)
    assert alone["Total"] == alone["step_total"] == with_eval["step_total"]
    assert with_eval["Total"] > alone["Total"] + 8191 * 16 * 256 * 2 / GIB  # at least its [N, B, H] bf16 output
    assert replace(inputs, eval_tokens=8192).eval_shape() == StepShape(8192, 8191, 1, 16)


def test_the_plan_reads_the_eval_pack_and_refuses_an_attention_it_does_not_trace():
    from shared.errors import ConfigError
    from stage2_train.commands import plan_inputs

    assert plan_inputs(load_run_config("qwen3-8b"))[0].eval_tokens == 8192
    assert plan_inputs(load_run_config("qwen3-8b", ["eval.offline_batch_tokens=1024"]))[0].eval_tokens == 3072  # data.max_length
    assert plan_inputs(load_run_config("qwen3-8b", ["eval.holdout_fraction=0"]))[0].eval_tokens is None
    # sdpa keeps each chunk group's mask and scores for backward: a plan of flex would call it fitting.
    with pytest.raises(ConfigError, match="model.attention='sdpa'.*model.attention=auto"):
        plan_inputs(load_run_config("qwen3-8b", ["model.attention=sdpa"]))
    # A torch without flex: `auto` resolves to sdpa on the GPU, so the same plan would be wrong.
    from stage2_train.model import attention

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "flex_importable", lambda: False)
        with pytest.raises(ConfigError, match=r"no flex_attention: model.attention=auto would run sdpa.*torch >= 2.5"):
            plan_inputs(load_run_config("qwen3-8b"))
