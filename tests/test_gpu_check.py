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

from bench import gpu_check

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
    assert gpu_check.bf16_peak("NVIDIA H200", None) == (989e12, "H200 SXM dense bf16 989 TFLOP/s (datasheet)")
    assert gpu_check.bf16_peak("NVIDIA A100-SXM4-80GB", None)[0] == 312e12
    assert gpu_check.bf16_peak("NVIDIA H200", 700.0) == (700e12, "700 TFLOP/s (--peak-tflops)")
    assert gpu_check.bf16_peak("Tesla T4", None)[0] is None


@pytest.mark.slow
def test_cpu_smoke_runs_every_phase(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--cpu-smoke", "--json", str(out), "--work-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    phases = result["phases"]
    assert list(phases) == ["env", "gpu_paths", "extract_smollm2", "extract_8b", "train", "generate"]
    assert {n: p["status"] for n, p in phases.items()} == dict.fromkeys(phases, "ok")
    assert phases["env"]["packages"]["zarr"] and phases["env"]["choices"]
    paths = phases["gpu_paths"]
    assert paths["copies_after_event"]["equal"] and paths["loader_buffers"]["allocated"] <= 3
    graphs = paths["flex_20_shapes"]["graphs_after_each"]
    assert len(graphs) == 20 and graphs[-1] <= 6 and graphs[9] == graphs[-1]  # no recompile per pack shape
    assert paths["flex_20_shapes"]["max_abs_diff_vs_rule"] < 1e-5

    for name in ("extract_smollm2", "extract_8b"):
        p = phases[name]
        assert p["tokens"] == p["pure_forward"]["tokens"] > 1000
        # The ratio is the two measured times' ratio (its size is the benchmark's business, not a test's).
        assert p["tok_per_s"] > 0 and p["pure_forward"]["seconds"] > 0
        assert p["extract_over_forward"] == pytest.approx(p["extract"]["seconds"] / p["pure_forward"]["seconds"], abs=1e-3)
        assert p["extract"]["num_samples"] == 12
    assert phases["extract_8b"]["target_params"] > 19e6  # the tiny Qwen3 with Qwen3's 152K vocabulary

    t = phases["train"]
    assert (t["steps_logged"], t["steps_measured"]) == (6, 4)
    assert t["work_matches_log"]  # the replayed plan gives the tokens and blocks the trainer logged
    assert t["drafter"]["num_layers"] == 5 and t["drafter"]["block_size"] == 16
    assert t["tok_per_s"] > 0 and t["block_tok_per_s"] > 0 and t["achieved_tflops"] > 0
    assert t["mfu"] is None  # no peak on CPU
    assert abs(sum(t["flops_share"].values()) - 1) < 1e-3
    assert t["flops_share"]["lm_head"] > 0.5  # 152K vocabulary, 64 wide: the head dominates

    g = phases["generate"]
    assert g["backend"] == "transformers" and g["generated_tokens"] > 0
    assert g["tok_per_s"] > g["tok_per_s_with_start"] > 0

    figures = [r[0] for r in gpu_check.rows(result)]
    assert sum(f.startswith("extraction") for f in figures) == 4
    assert any(f.startswith("drafter training MFU") for f in figures)
    assert any(f.startswith("generation tokens/s") for f in figures)
    assert not list(tmp_path.glob("gpu_check_*"))  # the work folder is removed
