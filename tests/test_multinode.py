"""Two "nodes" on this machine (torchrun --nnodes 2 --nproc_per_node 1, rendezvous on localhost):
extraction and training give what one process gives, and a node-local token cache is built once
per node, by that node's local rank 0.

    .venv/bin/python -m pytest tests/test_multinode.py -q -m slow
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import load_run_config
from stage1_extract import commands as stage1
from stage2_train.commands import cmd_train
from stage2_train.observe.metrics import read_log
from testkit.data import chat_rows, stage1_overrides, write_jsonl
from tests.test_extract import store_contents

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(module_args: list[str], timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """The same command as node 0 and node 1 of a 2-node job, one process each, at once."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
             "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port), *module_args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for node in (0, 1)
    ]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        outs.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return outs


@pytest.mark.slow
def test_two_node_extraction_equals_one_process_with_a_cache_per_node(tiny_target_dir, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(24))
    one = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "one"))
    stage1.cmd_extract(one, progress=False)
    # Each node its own cache folder: torchrun tells each worker its node as GROUP_RANK.
    node_local = str(tmp_path / "node$GROUP_RANK" / "cache")
    args = ["-m", "stage1_extract", "extract", "--json", "--no-progress",
            *stage1_overrides(tiny_target_dir, data, tmp_path / "two", **{"data.cache_dir": node_local})]
    outs = two_nodes(args)
    assert [o.returncode for o in outs] == [0, 0], [o.stderr[-2000:] for o in outs]
    assert store_contents(str(tmp_path / "two" / "store")) == store_contents(one.store.url(one.run_dir))
    for node in (0, 1):  # built by that node's local rank 0
        assert len(list((tmp_path / f"node{node}" / "cache").glob("tokens-*"))) == 1


@pytest.mark.slow
def test_two_node_training_gives_the_losses_of_one_process(tiny_target_dir, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(40))
    stage1_cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "s1"))
    stage1.cmd_extract(stage1_cfg, progress=False)
    store = stage1_cfg.store.url(stage1_cfg.run_dir)
    base = {
        "store.path": store, "sampler.micro_batch_tokens": 256, "sampler.max_anchors_per_seq": 2,
        "model.block_size": 8, "loss.gamma": 4.0, "train.max_steps": 4, "train.resume": "never",
        "checkpoint.every_steps": 0, "eval.holdout_fraction": 0.1, "log.wandb": "disabled",
    }

    def overrides(run_dir, grad_accum):  # one config for both stages: the store is current against it
        return stage1_overrides(tiny_target_dir, data, run_dir, **{**base, "train.grad_accum": grad_accum})

    cmd_train(load_run_config("configs/default.yaml", overrides(tmp_path / "one", 2)), progress=False)
    outs = two_nodes(["-m", "stage2_train", "train", "--json", "--no-progress", *overrides(tmp_path / "two", 1)])
    assert [o.returncode for o in outs] == [0, 0], [o.stderr[-2000:] for o in outs]
    one, two = read_log(tmp_path / "one" / "train_log.jsonl", "train"), read_log(tmp_path / "two" / "train_log.jsonl", "train")
    assert [r["step"] for r in two] == [1, 2, 3, 4]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
        assert b["tokens"] == a["tokens"] and b["blocks"] == a["blocks"]
