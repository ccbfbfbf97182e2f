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
import socket
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest

from shared import network
from shared.config import load_run_config
from shared.errors import BusyError, ConfigError
from shared.lock import LEASE_NAME, READERS_NAME, FlockUnsupported, LeaseLock, ReaderClaim, exclusive
from shared.reader import StoreReader


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


# ---- a hostname on loopback ---------------------------------------------------------------------
@pytest.fixture
def loopback_host(monkeypatch):
    """This node is `node-a`, whose /etc/hosts line says 127.0.1.1; it reaches 10.0.0.1 through ib0."""
    names = {"node-a": "127.0.1.1", "node-b": "10.0.0.8", "10.0.0.1": "10.0.0.1", "127.0.0.1": "127.0.0.1"}

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in names:
            raise socket.gaierror(socket.EAI_NONAME, "unknown")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (names[host], 0))]

    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(network, "_interfaces", lambda: {"eth0": "192.168.1.7", "ib0": "10.0.0.7"})
    monkeypatch.setattr(network, "_route_to", lambda address: "10.0.0.7")
    monkeypatch.setattr(network, "_is_local", lambda address: False)
    for name in ("GLOO_SOCKET_IFNAME", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


TWO_NODES = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1"}


def test_a_multi_node_job_on_a_loopback_hostname_is_refused_naming_gloo_socket_ifname(loopback_host):
    with pytest.raises(ConfigError) as refused:
        network.check_gloo_network(TWO_NODES)
    assert str(refused.value) == (
        "this node's hostname 'node-a' resolves to 127.0.1.1 (loopback) and WORLD_SIZE=16 > LOCAL_WORLD_SIZE=8: this "
        "job spans nodes: gloo (stage 1's barriers, the checkpoint agreement) would bind every rank here to loopback, "
        "where ranks on other nodes cannot reach it (the first collective hangs). Set GLOO_SOCKET_IFNAME on every node "
        "to the interface the nodes reach each other through, here `export GLOO_SOCKET_IFNAME=ib0` (the interface "
        "this node reaches MASTER_ADDR through, 10.0.0.7), or make the hostname resolve to that interface's address "
        "(/etc/hosts)"
    )
    # another launcher (no LOCAL_WORLD_SIZE): MASTER_ADDR is another machine
    with pytest.raises(ConfigError, match=r"MASTER_ADDR=10\.0\.0\.1 is another machine.*GLOO_SOCKET_IFNAME=ib0"):
        network.check_gloo_network({"WORLD_SIZE": "16", "MASTER_ADDR": "10.0.0.1"})


@pytest.mark.parametrize(
    "env",
    [
        {**TWO_NODES, "GLOO_SOCKET_IFNAME": "ib0"},  # the fix
        {**TWO_NODES, "LOCAL_WORLD_SIZE": "16"},  # one node
        {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"},  # two "nodes" on one machine
        {"WORLD_SIZE": "1", "MASTER_ADDR": "10.0.0.1"},  # one process
    ],
    ids=["ifname-set", "one-node", "rendezvous-on-loopback", "one-process"],
)
def test_jobs_gloo_can_serve_pass(loopback_host, env):
    assert network.gloo_network_problem(env) is None


def test_a_hostname_that_resolves_to_the_network_passes(loopback_host):
    loopback_host.setattr(socket, "gethostname", lambda: "node-b")
    assert network.gloo_network_problem(TWO_NODES) is None


def test_master_on_this_machine_without_local_world_size_is_a_warning(loopback_host, caplog):
    loopback_host.setattr(network, "_is_local", lambda address: True)
    with caplog.at_level(logging.WARNING, logger="shared.network"):
        network.check_gloo_network({"WORLD_SIZE": "16", "MASTER_ADDR": "10.0.0.1"})
    assert "MASTER_ADDR=10.0.0.1 is this machine, and other ranks may be on other nodes" in caplog.text
    assert "GLOO_SOCKET_IFNAME=ib0" in caplog.text


def test_both_stages_check_before_their_first_collective(loopback_host, tmp_path):
    """Refused at start-up, before a process group or Accelerator exists (either would wait for hours)."""
    import torch.distributed as dist

    from stage1_extract import commands as stage1
    from stage2_train import commands as stage2
    from stage2_train.train import launch

    def would_hang(*args, **kwargs):
        raise AssertionError("reached the first collective")

    loopback_host.setattr(dist, "init_process_group", would_hang)
    loopback_host.setattr(launch, "make_accelerator", would_hang)
    for name, value in {**TWO_NODES, "RANK": "9", "LOCAL_RANK": "1"}.items():
        loopback_host.setenv(name, value)
    cfg = load_run_config("configs/default.yaml", [f"run_dir={tmp_path / 'run'}", "log.wandb=disabled"])
    with pytest.raises(ConfigError, match="GLOO_SOCKET_IFNAME=ib0"):
        stage1.cmd_extract(cfg, progress=False)
    with pytest.raises(ConfigError, match="GLOO_SOCKET_IFNAME=ib0"):
        stage2.cmd_train(cfg, progress=False)
    assert not (tmp_path / "run").exists()


RANKS_SCRIPT = """
import os, sys, time
from datetime import timedelta
from pathlib import Path
import torch.distributed as dist
from stage1_extract import distributed as d

d.JOIN_TIMEOUT, d.WORK_TIMEOUT = timedelta(seconds=4), timedelta(seconds=120)  # 10 min and 6 h, scaled down
late, folder, ranks_here = float(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
(folder / os.environ["RANK"]).touch()
while len(list(folder.iterdir())) < ranks_here:  # start together: imports on shared cores take seconds
    time.sleep(0.05)
start = time.monotonic()
try:
    d.join_ranks(2)
except Exception as exc:
    print(f"not joined after {time.monotonic() - start:.0f} s: {type(exc).__name__}", flush=True)
    sys.exit(0)
time.sleep(late)  # this rank's tokenizing or shards take longer than JOIN_TIMEOUT
d.wait_for_ranks(2)
print("waited", flush=True)
time.sleep(late)
try:
    dist.barrier()  # the default group (the store lock's vote) keeps JOIN_TIMEOUT
    print("voted", flush=True)
except RuntimeError:
    print("vote timed out", flush=True)
d.leave_ranks(2)
"""


@pytest.mark.slow  # three interpreters importing torch, ranks 7 s late twice: ~30 s
def test_a_node_that_never_joins_stops_the_others_soon_and_only_work_barriers_wait_long(tmp_path):
    """One node refusing the network check used to leave the others in init_process_group for 6 hours."""
    import subprocess
    import sys

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def launch(rank: int, port: int, late: float, folder: Path, ranks_here: int) -> subprocess.Popen:
        folder.mkdir(exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        return subprocess.Popen([sys.executable, "-c", RANKS_SCRIPT, str(late), str(folder), str(ranks_here)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    port = free_port()
    pair = [launch(rank, port, 7.0 * rank, tmp_path / "pair", 2) for rank in (0, 1)]
    alone = launch(0, free_port(), 0.0, tmp_path / "alone", 1)  # its rank 1's node refused to start
    outs = [p.communicate(timeout=90) for p in (*pair, alone)]
    assert [p.returncode for p in (*pair, alone)] == [0, 0, 0], [err[-2000:] for _, err in outs]
    # rank 1 came 7 s late to both: the work barrier waited for it, the vote gave up after 4 s (and so
    # did rank 1's, its partner gone)
    assert [out for out, _ in outs[:2]] == ["waited\nvote timed out\n"] * 2
    assert outs[2][0] in ("not joined after 4 s: DistStoreError\n", "not joined after 5 s: DistStoreError\n")


def test_a_lease_whose_renewal_fails_once_is_still_renewed(tmp_path):
    """One failed renewal (an object store's PUT timing out) ended the renewing thread: the lease
    expired LEASE_S later while its command went on writing, and a second writer could take the store."""
    store = tmp_path / "store"
    store.mkdir()
    lease = LeaseLock(str(store), lease_s=0.3)
    write = lease._write
    failures = []

    def flaky(command):
        if not failures:
            failures.append(command)
            raise OSError(errno.ETIMEDOUT, "PUT timed out")
        write(command)

    lease.acquire("stage1_extract extract")
    lease._write = flaky
    try:
        time.sleep(1.2)  # four renewal periods: the first fails, the later ones must renew
        assert failures
        with pytest.raises(BusyError, match="is in use by `stage1_extract extract`"):
            LeaseLock(str(store), lease_s=0.3).acquire("stage1_extract reprocess")
    finally:
        lease.release()


def test_a_lease_another_writer_took_is_never_written_over_and_its_command_stops(tmp_path, monkeypatch):
    """A holder stalled past its lease's end (SIGSTOP, a suspended VM) found, on waking, another writer
    holding the store, and its renewer wrote its own lease back over it: both wrote. It now stops its
    command instead (`exclusive` says who took it), and the other's lease stays."""
    from shared import lock as lock_mod

    store = tmp_path / "store"
    store.mkdir()
    monkeypatch.setattr(lock_mod, "acquire_lock", lambda url, command: _acquired(LeaseLock(url, lease_s=0.3), command))
    taken = {"token": "0123456789abcdef", "expires": time.time() + 100, "host": "node-7", "pid": 42, "command": "stage1_extract extract"}
    with pytest.raises(BusyError, match=r"store: this command's lease was taken by .*node-7.* while it ran .*rerun it when the other is done"):
        with lock_mod.exclusive(str(store), "stage1_extract reprocess"):
            (store / lock_mod.LEASE_NAME).write_text(json.dumps(taken))  # the other writer's lease
            time.sleep(2)  # the renewer sees it within a third of the lease
    assert json.loads((store / lock_mod.LEASE_NAME).read_text())["token"] == taken["token"]


def _acquired(lease, command):
    lease.acquire(command)
    return lease


def test_a_lease_found_taken_as_its_command_ends_is_said_and_never_interrupts_what_follows(tmp_path, monkeypatch):
    """The renewer found the lease taken just as the block ended (its check delayed on a loaded
    machine): its interrupt landed after `exclusive` had left, a KeyboardInterrupt in whatever ran
    next (it crashed a pytest worker), and the lost lease was never said. Once release has begun the
    renewer interrupts nothing, and `exclusive` names the new holder after the block."""
    from shared import lock as lock_mod

    store = tmp_path / "store"
    store.mkdir()
    interrupts = []
    monkeypatch.setattr(lock_mod, "_stop_main", lambda: interrupts.append("KeyboardInterrupt"))
    lease = LeaseLock(str(store), lease_s=0.3)
    monkeypatch.setattr(lock_mod, "acquire_lock", lambda url, command: _acquired(lease, command))
    taken = {"token": "0123456789abcdef", "expires": time.time() + 100, "host": "node-7", "pid": 42, "command": "x"}
    read = lease._read

    def read_as_release_begins():
        current = read()
        if current and current.get("token") == taken["token"]:
            lease._stop.set()  # the block ended and release() began while the renewer read this
        return current

    lease._read = read_as_release_begins
    with pytest.raises(BusyError, match=r"store: this command's lease was taken by .*node-7"):
        with lock_mod.exclusive(str(store), "stage1_extract reprocess"):
            (store / lock_mod.LEASE_NAME).write_text(json.dumps(taken))
            time.sleep(0.5)  # the renewer reads it within a third of the lease
    assert interrupts == [] and json.loads((store / lock_mod.LEASE_NAME).read_text())["token"] == taken["token"]


LOST_LEASE_IN_BACKGROUND = """
import json, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell script's background job (`extract ... &`) starts
from shared import lock
store = sys.argv[1]
lock.acquire_lock = lambda url, command: _hold(lock.LeaseLock(url, lease_s=0.3), command)
def _hold(lease, command):
    lease.acquire(command)
    return lease
taken = {"token": "0123456789abcdef", "expires": time.time() + 100, "host": "node-7", "pid": 42, "command": "x"}
with lock.exclusive(store, "stage1_extract extract"):
    open(store + "/" + lock.LEASE_NAME, "w").write(json.dumps(taken))
    for _ in range(30):
        time.sleep(0.1)
    print("still writing after the lease was taken")
"""


def test_a_command_that_ignores_sigint_still_stops_when_its_lease_is_taken(tmp_path):
    """The renewer stopped its command with _thread.interrupt_main, which does nothing where SIGINT is
    ignored (a background job of a shell script): the command went on writing beside the lease's new
    holder, no longer even renewing. It is ended (SIGTERM) instead."""
    import signal
    import subprocess
    import sys

    store = tmp_path / "store"
    store.mkdir()
    done = subprocess.run([sys.executable, "-c", LOST_LEASE_IN_BACKGROUND, str(store)], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[1],
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert "still writing" not in done.stdout
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert json.loads((store / LEASE_NAME).read_text())["token"] == "0123456789abcdef"


def converted_as_a_rank(out) -> None:
    from shared import embedded

    try:
        folder = embedded.default_target_dir()
        out.put(sorted(p.name for p in folder.iterdir()))
    except BaseException as exc:  # noqa: BLE001 - the parent names it
        out.put(repr(exc))


@pytest.mark.parametrize("flock", ["flock", "no flock"])
def test_ranks_that_start_together_convert_the_embedded_target_once_and_each_finds_it_whole(tmp_path, monkeypatch, flock):
    """`torchrun ... generate` on a fresh cache: every rank resolves the embedded target at once. They
    shared one temp folder, which a second rank emptied under the first: one failed (its files gone,
    or the folder there already) or the folder was renamed while the other still wrote into it."""
    import multiprocessing

    from shared import embedded

    def slow_conversion(tmp: Path, gguf: Path) -> None:  # the real one: ~15 s of CPU
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            time.sleep(0.2)
            (tmp / name).write_text(name)

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"gguf")
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(embedded, "embedded_gguf_path", lambda: gguf)
    monkeypatch.setattr(embedded, "_convert_into", slow_conversion)
    if flock == "no flock":
        monkeypatch.setattr(fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.ENOLCK, "refused")))
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    procs = [context.Process(target=converted_as_a_rank, args=(out,)) for _ in range(2)]
    for proc in procs:
        proc.start()
    try:
        seen = [out.get(timeout=60) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
    whole = [".complete", "config.json", "model.safetensors", "tokenizer.json"]
    assert seen == [whole, whole]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")) == ["smollm2-135m-instruct"]


def test_the_merge_finds_part_records_another_node_just_wrote_and_its_listing_does_not_show(tiny_target_dir, tmp_path, monkeypatch):
    """Rank 0 merged the manifest from its listing of parts/ seconds after the other nodes wrote their
    records: NFS serves a node a cached listing for up to a minute, so a multi-node extraction ended
    'missing or belongs to other rows; rerun extract' after every shard was written. The merge reads
    each planned record by its name (an open asks the server)."""
    from shared.store import StoreFiles
    from stage1_extract import commands
    from testkit.data import chat_rows, stage1_overrides, write_jsonl

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(30))
    cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "run"))
    listed, merge = StoreFiles.list, commands._merge

    def merge_with_a_stale_listing(*args, **kwargs):  # shard 1's record: another node's, written just now
        with monkeypatch.context() as m:
            m.setattr(StoreFiles, "list", lambda self, rel: [n for n in listed(self, rel) if n != "shard-000001.json"])
            return merge(*args, **kwargs)

    monkeypatch.setattr(commands, "_merge", merge_with_a_stale_listing)
    summary = commands.cmd_extract(cfg, progress=False)
    manifest = json.loads((tmp_path / "run" / "store" / "manifest.json").read_text())
    assert len(manifest["shards"]) == summary["shards_total"] >= 2
    assert [r["index"] for r in manifest["shards"]] == list(range(summary["shards_total"]))
    assert (tmp_path / "run" / "store" / "parts" / "shard-000001.json").is_file()


def test_a_shard_another_node_just_wrote_is_no_missing_shard_to_training_or_verify(tiny_target_dir, tmp_path, monkeypatch):
    """Training opened right after a multi-node extraction (or rank 0's check after verify --repair)
    listed shards/ on a node whose NFS cache did not show another node's newest shard group yet: the
    store was refused as damaged ('is missing; run verify --repair'). A shard the listing lacks is
    looked up by name; one deleted by hand is still missing."""
    import shutil

    from shared.store import StoreFiles
    from stage1_extract import commands
    from stage1_extract.verify import verify_store
    from testkit.data import chat_rows, stage1_overrides, write_jsonl

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(30))
    cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "run"))
    commands.cmd_extract(cfg, progress=False)
    url = cfg.store.url(cfg.run_dir)
    newest = json.loads(Path(url, "manifest.json").read_text())["shards"][-1]["name"]
    listed = StoreFiles.list
    monkeypatch.setattr(StoreFiles, "list", lambda self, rel: [n for n in listed(self, rel) if n != newest])
    assert len(StoreReader(url)) > 0
    assert verify_store(url)["ok"]
    shutil.rmtree(Path(url, "shards", newest))
    with pytest.raises(Exception, match=f"shard {newest} is missing"):
        StoreReader(url)
