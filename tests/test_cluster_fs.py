"""Real cluster file systems and networks: no flock (Lustre, NFS), a hostname on loopback.

    .venv/bin/python -m pytest tests/test_cluster_fs.py -q

A file system without flock is this machine's with `fcntl.flock` failing as Lustre (ENOSYS) and
NFS (ENOLCK) fail it; a node whose hostname resolves to loopback is a patched resolver. (The
checkpoint's delayed rank file is in tests/test_checkpoint.py.)
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest

from shared.config import load_run_config
from shared.errors import BusyError
from shared.lock import LEASE_NAME, READERS_NAME, FlockUnsupported, LeaseLock, ReaderClaim, exclusive
from shared.store import StoreReader


@pytest.fixture(params=[errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS], ids=["ENOLCK", "EOPNOTSUPP", "ENOSYS"])
def no_flock(request, monkeypatch) -> int:
    def refuse(fd, operation):
        raise OSError(request.param, "flock refused by this file system")

    monkeypatch.setattr(fcntl, "flock", refuse)
    return request.param


def test_without_flock_a_writer_takes_the_lease_says_so_and_a_second_writer_is_refused(no_flock, tmp_path, caplog):
    store = tmp_path / "store"
    with caplog.at_level(logging.WARNING, logger="shared.lock"):
        with exclusive(str(store), "stage1_extract extract") as kind:
            assert kind == "lease"
            lease = json.loads((store / LEASE_NAME).read_text())
            assert lease["command"] == "stage1_extract extract" and lease["expires"] > 0
            with pytest.raises(BusyError, match=r"is in use by `stage1_extract extract` \(pid \d+ on .*lease until"):
                with exclusive(str(store), "stage1_extract reprocess"):
                    pass
    said = (
        f"{store}: the file system does not support flock ({os.strerror(no_flock)}; "
        f"Lustre mounted without -o flock, or NFS without a lock daemon); locking with a lease instead "
        f"({store / LEASE_NAME}, renewed while held: a holder that dies blocks the next writer for up to 300 s)"
    )
    assert [r.getMessage() for r in caplog.records] == [said, said]  # the holder's and the refused writer's
    assert not (store / LEASE_NAME).exists()  # released
    with exclusive(str(store), "stage1_extract reprocess") as kind:  # free again
        assert kind == "lease"


def test_an_extract_and_a_training_say_which_lock_they_hold(no_flock, tmp_path):
    from stage1_extract.distributed import store_lock
    from stage2_train.commands import run_dir_lock

    with store_lock(str(tmp_path / "store"), 0, 1, "extract") as kind:
        assert kind == "lease"
    with ExitStack() as stack:
        accelerator = SimpleNamespace(process_index=0, num_processes=1)
        assert run_dir_lock(stack, accelerator, str(tmp_path / "run")) == "lease"
        assert (tmp_path / "run" / LEASE_NAME).exists()


def test_flock_where_it_works_is_still_the_lock(tmp_path):
    with exclusive(str(tmp_path / "store"), "stage1_extract extract") as kind:
        assert kind == "flock"
        assert not (tmp_path / "store" / LEASE_NAME).exists()


def test_extract_is_refused_while_another_nodes_lease_is_live(no_flock, tmp_path):
    from stage1_extract import commands as stage1

    cfg = load_run_config("configs/default.yaml", [f"run_dir={tmp_path / 'run'}"])
    store = Path(cfg.store.url(cfg.run_dir))
    store.mkdir(parents=True)
    other = LeaseLock(str(store))  # another node's extract, on a mount without flock
    other.acquire("stage1_extract extract")
    try:
        with pytest.raises(BusyError, match=rf"{store} is in use by `stage1_extract extract`"):
            stage1.cmd_extract(cfg, progress=False)
        assert {p.name for p in store.iterdir()} == {".dflash.lock", LEASE_NAME}  # touched nothing
    finally:
        other.release()


def test_without_flock_a_reader_makes_no_claim_and_says_so_but_refuses_a_live_writer(no_flock, tmp_path, caplog):
    store = tmp_path / "store"
    store.mkdir()
    with pytest.raises(FlockUnsupported, match="does not support flock"):
        ReaderClaim(str(store)).acquire("stage2_train train")
    assert list((store / READERS_NAME).iterdir()) == []  # no half-made claim left behind
    reader = StoreReader.__new__(StoreReader)  # hold() needs only the url: no store to build
    reader.url, reader._claim, reader.claim = str(store), None, "none"
    with caplog.at_level(logging.WARNING, logger="shared.store"):
        assert reader.hold("stage2_train train") is reader
    assert reader.claim == "none (no flock here)"
    assert "no reader claim: writers are not refused while `stage2_train train` reads" in caplog.text
    writer = LeaseLock(str(store))
    writer.acquire("stage1_extract reprocess")
    try:
        with pytest.raises(BusyError, match=r"is being written by `stage1_extract reprocess`.*before `stage2_train train`"):
            reader.hold("stage2_train train")
    finally:
        writer.release()
