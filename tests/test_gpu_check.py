"""bench/gpu_check.py: its report rows, and every phase run tiny on CPU (the FLOP count it reports
is tests/test_flops.py's).

    .venv/bin/python -m pytest tests/test_gpu_check.py -q             # the report rows (fast)
    .venv/bin/python -m pytest tests/test_gpu_check.py -q -m slow     # the CPU smoke (~1.5 min)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check, gpu_check_train

REPO = Path(__file__).resolve().parents[1]


def test_report_rows_flag_failed_phases():
    result = {"phases": {"env": {"status": "fallback", "gpu": "NVIDIA H200", "torch": "2.11", "cuda": "13.0",
                                 "fallbacks": ["vllm: not installed -> transformers"]},
                         "train": {"status": "failed", "error": "RuntimeError: boom | x"}}}
    rows = gpu_check.rows(result)
    assert rows[0] == ("GPU check: machine", "NVIDIA H200, torch 2.11, CUDA 13.0", "", "", "")
    assert rows[1] == ("FALLBACKS taken", "vllm: not installed -> transformers", "", "", "")
    assert rows[2] == ("phase train", "failed: RuntimeError: boom / x", "ok", "", "**no**")


def test_mfu_divides_by_the_datasheet_peak_stage_1_plans_with():
    assert gpu_check_train.bf16_peak("NVIDIA H200", None) == (989e12, "H200 SXM dense bf16 989 TFLOP/s (datasheet)")
    assert gpu_check_train.bf16_peak("NVIDIA A100-SXM4-80GB", None)[0] == 312e12
    assert gpu_check_train.bf16_peak("NVIDIA H200", 700.0) == (700e12, "700 TFLOP/s (--peak-tflops)")
    assert gpu_check_train.bf16_peak("Tesla T4", None)[0] is None


@pytest.mark.slow
def test_cpu_smoke_runs_every_phase(tmp_path):
    """Every phase of the GPU check, tiny, on CPU: the plumbing a GPU run depends on (the DDP worker
    under torchrun with gloo, the resume, 2 gloo ranks splitting the target, the plan traced meanwhile)."""
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--cpu-smoke", "--json", str(out), "--work-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=1500, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    phases = result["phases"]
    assert list(phases) == ["env", "gpu_paths", "packed_vs_padded", "extract_8b", "train", "resume", "tp_extract", "generate",
                            "extract_smollm2"]
    assert {n: p["status"] for n, p in phases.items()} == dict.fromkeys(phases, "ok")
    assert phases["env"]["packages"]["zarr"] and phases["env"]["choices"]
    paths = phases["gpu_paths"]
    assert paths["copies_after_event"]["equal"] and paths["loader_buffers"]["allocated"] <= 3
    assert paths["copies_after_event"]["value_sum"]["close"]  # the batch's finiteness sum, read after its event
    graphs = paths["flex_20_shapes"]["graphs_after_each"]
    assert len(graphs) == 20 and graphs[-1] <= 6 and graphs[9] == graphs[-1]  # no recompile per pack shape
    assert paths["flex_20_shapes"]["max_abs_diff_vs_rule"] < 1e-5
    packed = phases["packed_vs_padded"]
    assert packed["attn_implementation"] == "sdpa" and packed["hidden_max_rel_diff"] < 1e-4 and packed["top1_agreement"] == 1.0

    for name, samples in (("extract_smollm2", 12), ("extract_8b", 48)):
        p = phases[name]
        assert p["tokens"] == p["pure_forward"]["tokens"] > 1000
        # The ratio is the two measured times' ratio (its size is the benchmark's business, not a test's).
        assert p["tok_per_s"] > 0 and p["pure_forward"]["seconds"] > 0
        assert p["extract_over_forward"] == pytest.approx(p["extract"]["seconds"] / p["pure_forward"]["seconds"], abs=1e-3)
        assert p["extract"]["num_samples"] == samples
    assert phases["extract_8b"]["target_params"] > 19e6  # the tiny Qwen3 with Qwen3's 152K vocabulary

    t = phases["train"]
    assert t["ddp"]["wrapped"] == "DistributedDataParallel" and t["ddp"]["backend"] == "gloo" and t["ddp"]["world_size"] == 1
    assert t["ddp"]["reducer"] and t["ddp"]["no_sync"] == 2 * (3 - 1)  # grad_accum 3: two micro-batches a step without sync
    assert t["grad_accum"] == 3 and t["steps_logged"] == 2 and t["evals"] >= 1 and t["best"]["step"] in (1, 2)
    assert t["allocator"] == "torch's defaults (no expandable_segments)"
    assert t["plan"]["peak_gib"] > 0 and t["plan"]["micro_batch"]["blocks"] <= 32  # `stage2_train plan --json`, same budgets
    assert t["work_matches_log"]  # the replayed plan gives the tokens and blocks the trainer logged
    assert t["drafter"]["num_layers"] == 5 and t["drafter"]["block_size"] == 16
    r = phases["resume"]
    assert r["resumed_from"].endswith("step_000002") and r["steps_logged"] == [1, 2, 3] and r["ddp"]["no_sync"] == 2
    tp = phases["tp_extract"]
    assert tp["samples"] == 12 and tp["hidden_max_rel_diff"] < 1e-2 and tp["topk_ids_equal"] > 0.9

    g = phases["generate"]
    assert g["backend"] == "transformers" and g["generated_tokens"] > 0
    assert g["tok_per_s"] > g["tok_per_s_with_start"] > 0

    figures = [r[0] for r in gpu_check.rows(result)]
    assert sum(f.startswith("extraction") for f in figures) == 4
    assert any(f.startswith("packed vs padded extraction") for f in figures)
    assert any(f.startswith("world-size-1 DDP wrap") for f in figures) and any(f.startswith("resume of that run") for f in figures)
    assert any(f.startswith("tensor-parallel extraction (2 ranks)") for f in figures)
    assert any(f.startswith("generation tokens/s") for f in figures)
    assert not list(tmp_path.glob("gpu_check_*"))  # the work folder is removed


def test_a_phase_the_machine_cannot_run_is_reported_not_failed(tmp_path, monkeypatch):
    """One GPU: tp_extract is skipped with its reason and the exit status stays 0; a phase left out
    of time still fails the check."""
    monkeypatch.setitem(gpu_check.PHASES, "tp_extract", lambda entry, ctx: ctx.skipped(entry, "needs 2 GPUs; this machine has 1"))
    out = tmp_path / "result.json"
    assert gpu_check.main(["--cpu-smoke", "--phases", "tp_extract", "--json", str(out), "--work-dir", str(tmp_path)]) == 0
    assert json.loads(out.read_text())["phases"]["tp_extract"] == {"status": "skipped", "why": "needs 2 GPUs; this machine has 1",
                                                                     "seconds": pytest.approx(0, abs=1)}
    assert gpu_check.main(["--cpu-smoke", "--phases", "env", "--deadline-s", "1", "--json", str(out), "--work-dir", str(tmp_path)]) == 1
    assert json.loads(out.read_text())["phases"]["env"] == {"status": "skipped", "why": "out of time"}
