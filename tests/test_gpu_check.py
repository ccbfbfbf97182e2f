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
import time
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
    """Every phase of the GPU check, tiny, on CPU: the plumbing a GPU run depends on (the device tests
    under pytest, the DDP worker under torchrun with gloo, the resume, the plan traced meanwhile)."""
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--cpu-smoke", "--json", str(out), "--work-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=1500, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    phases = result["phases"]
    assert list(phases) == ["env", "device_tests", "extract_8b", "train", "resume", "generate", "extract_smollm2"]
    assert {n: p["status"] for n, p in phases.items()} == dict.fromkeys(phases, "ok")
    assert phases["env"]["packages"]["zarr"] and phases["env"]["choices"]
    tests = phases["device_tests"]["tests"]  # tests/conftest.py's --device, the slow ones left to `make test-all`
    assert tests["test_extract::test_packed_extraction_equals_padded_extraction[sdpa]"] == "passed"
    assert tests["test_extract_writer::test_host_copies_read_after_their_event_equal_the_device_tensors"] == "passed"
    assert tests["test_extract::test_packed_extraction_equals_padded_extraction[flash_attention_2]"].startswith("skipped")
    assert not any(t.startswith(("failure", "error")) for t in tests.values()) and len(tests) >= 6

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

    g = phases["generate"]
    assert g["backend"] == "transformers" and g["generated_tokens"] > 0
    assert g["tok_per_s"] > g["tok_per_s_with_start"] > 0

    figures = [r[0] for r in gpu_check.rows(result)]
    assert sum(f.startswith("extraction") for f in figures) == 4
    assert any(f.startswith("the tests a GPU changes") for f in figures)
    assert any(f.startswith("world-size-1 DDP wrap") for f in figures) and any(f.startswith("resume of that run") for f in figures)
    assert any(f.startswith("generation tokens/s") for f in figures)
    assert not list(tmp_path.glob("gpu_check_*"))  # the work folder is removed


def test_a_phase_left_out_of_time_fails_the_check(tmp_path):
    out = tmp_path / "result.json"
    assert gpu_check.main(["--cpu-smoke", "--phases", "env", "--deadline-s", "1", "--json", str(out), "--work-dir", str(tmp_path)]) == 1
    assert json.loads(out.read_text())["phases"]["env"] == {"status": "skipped", "why": "out of time"}


def test_device_tests_report_each_test_and_fail_on_a_failed_one(tmp_path, monkeypatch):
    """The phase reads pytest's own report: a skipped flash-attn test on a GPU is a fallback, a
    failed test fails the phase by name; the rows count each outcome."""
    from bench import gpu_check_kit
    from bench.common import CommandFailed

    def pytest_run(args, name, timeout, env=None):
        assert args[:2] == ["-m", "pytest"] and "--device" in args and env["DFLASH_TEST_TOKENIZER"]
        report = next(a.split("=", 1)[1] for a in args if a.startswith("--junitxml="))
        Path(report).write_text(
            '<testsuites><testsuite><testcase classname="tests.test_extract" name="test_packed[sdpa]"/>'
            '<testcase classname="tests.test_extract" name="test_packed[flash_attention_2]"><skipped message="flash-attn: needs CUDA"/>'
            '</testcase><testcase classname="tests.test_loader" name="test_pinned"><failure message="assert 4 &lt;= 3"/>'
            "</testcase></testsuite></testsuites>")
        raise CommandFailed("pytest exited 1", 1)

    monkeypatch.setattr(gpu_check_kit.Context, "run_cli", lambda self, *a, **k: pytest_run(*a, **k))
    ctx = gpu_check_kit.Context(sizes=gpu_check_kit.GPU_SIZES, work=tmp_path, rec=None, peak_tflops=None,
                                small_target="x", tokenizer_dir=tmp_path)
    ctx.rec = type("Rec", (), {"left": lambda self: 100.0})()
    entry: dict = {}
    with pytest.raises(RuntimeError, match=r"device tests failed: \['test_loader::test_pinned'\] \(logs/device_tests.log.out\)"):
        gpu_check.phase_device_tests(entry, ctx)
    assert entry["tests"] == {"test_extract::test_packed[sdpa]": "passed",
                              "test_extract::test_packed[flash_attention_2]": "skipped: flash-attn: needs CUDA",
                              "test_loader::test_pinned": "failure: assert 4 <= 3"}
    assert entry["fallbacks"] == ["flash-attn: not installed -> packed extraction was checked under sdpa and eager, not flash-attn's varlen kernel"]
    (row,) = [r for r in gpu_check.rows({"phases": {"device_tests": {**entry, "status": "failed"}}}) if r[0].startswith("the tests")]
    assert row[1:3] == ("1 / 1 / 1", "none failed") and row[4] == "**no**"


def test_a_phase_that_fell_back_ends_fallback_never_ok(tmp_path, monkeypatch):
    """flash-attn or vllm missing: the phase still runs, and its status says it fell back."""
    from bench.gpu_check_kit import fallback

    monkeypatch.setitem(gpu_check.PHASES, "generate", lambda entry, ctx: fallback(entry, "vllm: not installed -> transformers"))
    out = tmp_path / "result.json"
    assert gpu_check.main(["--cpu-smoke", "--phases", "generate", "--json", str(out), "--work-dir", str(tmp_path)]) == 0
    phase = json.loads(out.read_text())["phases"]["generate"]
    assert (phase["status"], phase["fallbacks"]) == ("fallback", ["vllm: not installed -> transformers"])


@pytest.mark.slow  # a whole collection of the suite in a subprocess (12 s): test-all
def test_the_device_tests_are_the_ones_the_gpu_check_promises():
    """docs/gpu.md lists what `device_tests` runs on a GPU: a test that lost its `device` mark (or was
    renamed) would drop out of the GPU check unseen."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "device", "tests"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    collected = {line.split("[")[0] for line in done.stdout.splitlines() if "::" in line}
    assert collected == {
        "tests/test_attention.py::test_compiled_flex_compiles_a_fixed_number_of_times_over_twenty_pack_shapes",
        "tests/test_extract.py::test_packed_extraction_equals_padded_extraction",
        "tests/test_extract_writer.py::test_host_copies_read_after_their_event_equal_the_device_tensors",
        "tests/test_loader.py::test_host_buffers_are_pinned_once_and_reused_across_copies_to_the_device",
        "tests/test_model.py::test_flex_matches_naive_forward_and_backward",
        "tests/test_tensor_parallel.py::test_two_ranks_split_a_qwen3_target_and_store_what_one_process_stores",
    }, done.stdout[-2000:]


def test_a_command_past_its_limit_is_killed_with_every_process_it_started(tmp_path):
    """torchrun's ranks are the command's children: a GPU check phase that runs out of time must not
    leave them holding the GPU for the phases after it."""
    from bench.common import run_cli

    script = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              "print(child.pid, flush=True); time.sleep(60)")
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli(["-c", script], tmp_path / "sleep.log", timeout=2)
    grandchild = int((tmp_path / "sleep.log.out").read_text())
    for _ in range(50):  # killed, then reaped by whoever inherited it
        status = Path(f"/proc/{grandchild}/status")
        if not status.exists() or "State:\tZ" in status.read_text():
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"process {grandchild} outlived the command that started it")
