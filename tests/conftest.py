"""Shared fixtures: a tiny random target with the real SmolLM2 tokenizer, and small data files.

Tests never touch the network. The tokenizer comes from the embedded default target (converted
once by `make setup`; converted here on first use otherwise).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

# Tests drive both stages with one config: both register their sections (each entry point alone
# validates only its own; tests/test_layout.py checks that at run time).
import stage1_extract  # noqa: F401
import stage2_train  # noqa: F401

# stage1_overrides and train_overrides_for stay importable from here for tests written on branches
# before testkit/ existed; new tests import testkit.data.
from testkit.data import chat_rows, stage1_overrides, train_overrides_for, write_jsonl  # noqa: F401
from testkit.target import build_tiny_target

# Two cores: one torch thread per test process keeps tiny models fast and runs reproducible.
torch.set_num_threads(1)
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="where tests marked `device` run (cpu, cuda): `pytest -m device --device cuda` on a GPU node "
                          "(bench/gpu_check.sh's device_tests phase)")


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """The device of the tests marked `device`: CPU in every default run, the GPU under
    `--device cuda` (refused by name when torch sees none: a GPU run must not pass on CPU)."""
    device = torch.device(request.config.getoption("--device"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: torch sees no CUDA device")
    return device


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """A 6-layer, 64-wide random Llama with SmolLM2's tokenizer and chat template."""
    return build_tiny_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture
def chat_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "chat.jsonl", chat_rows(24))


@pytest.fixture
def hub_8b(tmp_path, monkeypatch) -> Path:
    """A Hugging Face cache (the hub's own layout) holding only the config.json of the 8B presets'
    targets (Qwen/Qwen3-8B, meta-llama/Llama-3.1-8B-Instruct): what `check` and `plan` read.
    HF_HUB_CACHE points at it, for this process and the subprocesses a test starts."""
    from dataclasses import asdict

    from stage2_train.train.memory_plan import KNOWN_TARGETS

    cache = tmp_path / "hf-hub"
    for repo, name in (("Qwen/Qwen3-8B", "qwen3-8b"), ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b")):
        folder = tmp_path / "hub-src" / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(asdict(KNOWN_TARGETS[name])))
        add_to_hub_cache(cache, repo, folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def add_to_hub_cache(cache: Path, repo_id: str, folder: Path, commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """Put `folder`'s files into `cache` as huggingface_hub lays out a downloaded snapshot
    (models--org--name/{blobs/<sha256>, refs/main, snapshots/<commit>/<file> -> ../../blobs/<sha256>})."""
    import hashlib

    storage = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in folder.iterdir() if p.is_file()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, storage / "blobs" / digest)
        os.symlink(Path("..", "..", "blobs", digest), snapshot / file.name)
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def copy_tree():
    def copy(src: Path, dst: Path) -> Path:
        shutil.copytree(src, dst)
        return dst

    return copy


@pytest.fixture(scope="module")
def one_thread():
    """Two OpenMP threads on a shared 2-core box spin-wait: a tiny step takes 1.2 s instead of 13 ms."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
