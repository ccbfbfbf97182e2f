"""One writer at a time: an exclusive lock on a store or a run directory, held for one command.

    with exclusive(store_url, "extract"):         # a second writer fails at once, naming the holder
        ...

Local folders: `flock` on `<folder>/.dflash.lock`, which the kernel drops when the process dies, so
a crashed command never leaves a stale lock; the file also says who holds it (command, pid, host,
since). Object stores (any fsspec URL with a protocol) have no flock: a lease object
`<folder>/.dflash.lease.json` with owner, host and expiry, renewed in the background every third of
its lifetime; a lease whose holder died expires after `LEASE_S` seconds. Two commands racing for a
free lease both write it, then both read it back: the one whose token is there wins.

A long reader of a local store (`stage2_train train`, for its whole run) holds a shared claim:

    claim = ReaderClaim(store_url); claim.acquire("stage2_train train")   # refused while a writer holds it
    ...; claim.release()

one file per reading process under `<folder>/.dflash.readers/`, flocked (shared) by its reader for
as long as it reads, saying who reads. A writer takes its exclusive lock first, then looks for live
claims (a claim whose flock it can take belongs to a process that died: it is removed); a reader
makes its claim first, then checks for a writer. So one of them always sees the other, and a
writer is refused naming the reader (rewriting shards under a training run breaks it). Short
readers (`status`, `verify` without `--repair`, `doctor`, `eval`, `export`) make no claim.

Local folders whose file system has no `flock` (Lustre mounted without `-o flock`, NFS without a
lock daemon: ENOSYS, ENOLCK, EOPNOTSUPP) get the lease instead, written by rename; a warning says
so, and `exclusive` yields the lock it took ("flock" or "lease") for the command's summary. Reader
claims need `flock` and are not made there: a reader refuses to start while a writer's lease is
live, and a rewrite that still happens under it is named by the manifest check
(`StoreReader._rewritten`), not refused. Lustre's `-o localflock` makes flock node-local: not handled.
"""

from __future__ import annotations

import _thread
import errno
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from shared.errors import BusyError
from shared.files import write_atomic

LOCK_NAME = ".dflash.lock"
READERS_NAME = ".dflash.readers"
LEASE_NAME = ".dflash.lease.json"
LEASE_S = 300.0
# What `flock` fails with where the file system does not support it (Lustre: ENOSYS; NFS: ENOLCK).
NO_FLOCK_ERRNOS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})

log = logging.getLogger(__name__)


class FlockUnsupported(OSError):
    """The folder's file system does not support `flock`."""


def _flock(fd: int, operation: int, folder: Path) -> None:
    import fcntl

    try:
        fcntl.flock(fd, operation)
    except OSError as exc:  # BlockingIOError (held by another) goes to the caller as it is
        if exc.errno not in NO_FLOCK_ERRNOS:
            raise
        raise FlockUnsupported(
            exc.errno, f"{folder}: the file system does not support flock ({os.strerror(exc.errno)}; Lustre "
            f"mounted without -o flock, or NFS without a lock daemon)"
        ) from exc


def _holder(command: str) -> dict[str, Any]:
    return {
        "command": command,
        "argv": " ".join(sys.argv[:6]),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _describe(holder: dict[str, Any]) -> str:
    return (
        f"`{holder.get('command', '?')}` (pid {holder.get('pid', '?')} on {holder.get('host', '?')}, "
        f"since {holder.get('since', '?')})"
    )


def acquire_lock(url: str, command: str) -> FileLock | LeaseLock:
    """The lock of the folder `url` (created if missing), held: an flock locally, a lease on an
    object store or where the file system has no flock."""
    if "://" in url and not url.startswith("file://"):
        lease = LeaseLock(url)
        lease.acquire(command)
        return lease
    lock = FileLock(Path(url))
    try:
        lock.acquire(command)
        return lock
    except FlockUnsupported as exc:
        log.warning(
            "%s; locking with a lease instead (%s, renewed while held: a holder that dies blocks the next "
            "writer for up to %d s)", exc.strerror, lock.folder / LEASE_NAME, LEASE_S,
        )
    lease = LeaseLock(str(lock.folder))
    lease.acquire(command)
    return lease


@contextmanager
def exclusive(url: str, command: str) -> Iterator[str]:
    """Hold the lock of the folder `url` (created if missing) while the block runs; yields its kind
    ("flock" or "lease")."""
    lock = acquire_lock(url, command)
    try:
        yield lock.kind
    except KeyboardInterrupt:
        if getattr(lock, "lost", None) is None:  # the lease's renewer stopped this command (`LeaseLock._renew`)
            raise
        raise _lost_lease(url, lock.lost) from None
    finally:
        lock.release()
    if getattr(lock, "lost", None) is not None:  # taken as the block ended, before the renewer could stop it
        raise _lost_lease(url, lock.lost)


def _lost_lease(url: str, lost: dict[str, Any]) -> BusyError:
    return BusyError(
        f"{url}: this command's lease was taken by {_describe(lost)} while it ran (not renewed for over "
        f"{LEASE_S:.0f} s: a stalled or suspended process); it stopped so that two writers never share the "
        f"folder. What it finished is kept: rerun it when the other is done"
    )


@contextmanager
def exclusive_on_rank0(url: str, command: str, rank: int, all_ok: Callable[[bool], bool]) -> Iterator[str | None]:
    """Under torchrun: rank 0 holds the lock of `url` while the block runs, and every rank learns at
    once when it could not (a second writer is refused before any rank touches a file). `all_ok` is
    the agreement collective (True on every rank iff True on all); every rank calls it once. Yields
    the lock's kind on rank 0, None on the others."""
    with ExitStack() as stack:
        error: BaseException | None = None
        kind = None
        if rank == 0:
            try:
                kind = stack.enter_context(exclusive(url, command))
            except Exception as exc:  # noqa: BLE001 - any failure (busy, read-only, NFS) must reach the vote
                error = exc
        if not all_ok(error is None):
            if error is not None:
                raise error
            raise BusyError(f"{url}: rank 0 could not lock it (its error is in rank 0's output)")
        yield kind


class FileLock:
    kind = "flock"

    def __init__(self, folder: Path):
        self.folder = Path(str(folder).removeprefix("file://"))
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None

    def acquire(self, command: str) -> None:
        import fcntl

        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, self.folder)
            except BlockingIOError:
                time.sleep(0.05)  # a reader's claim checks for a writer with a shared flock held for microseconds
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except FlockUnsupported:
            os.close(fd)
            raise
        except BlockingIOError:
            holder = _read_json(os.read(fd, 4096))
            os.close(fd)
            raise BusyError(
                f"{self.folder} is in use by {_describe(holder)}; wait for it to finish or stop it "
                f"(two writers would corrupt it)"
            ) from None
        readers = live_readers(self.folder)
        if readers:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            more = f" (and {len(readers) - 1} more reader(s))" if len(readers) > 1 else ""
            raise BusyError(
                f"{self.folder} is being read by {_describe(readers[0])}{more}; wait for it to finish or stop it "
                f"(`{command}` would replace shards under it)"
            )
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(_holder(command)).encode())
        self._fd = fd

    def release(self) -> None:
        import fcntl

        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def live_readers(folder: Path) -> list[dict[str, Any]]:
    """Who holds a reader claim on `folder` now (claims of processes that died are removed)."""
    import fcntl

    live = []
    claims = folder / READERS_NAME
    for path in sorted(claims.glob("*.json")) if claims.is_dir() else []:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # released meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            live.append(_read_json(os.read(fd, 4096)))
        else:
            path.unlink(missing_ok=True)  # its reader died: the kernel dropped its flock
        finally:
            os.close(fd)
    return live


class ReaderClaim:
    """A reading process's shared claim on a local store folder (see the module docstring)."""

    def __init__(self, url: str):
        self.folder = Path(url.removeprefix("file://"))
        self.path: Path | None = None
        self._fd: int | None = None

    def acquire(self, command: str) -> None:
        """Claim the folder; BusyError naming the writer that holds it; OSError where no claim can be
        made (a read-only store; FlockUnsupported: a file system without flock, after checking that
        no writer's lease is live): the caller reads without one."""
        import fcntl

        claims = self.folder / READERS_NAME
        claims.mkdir(exist_ok=True)
        holder = _holder(command)
        name = f"{holder['host']}-{holder['pid']}-{secrets.token_hex(4)}.json"
        tmp = claims / f".{name}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _flock(fd, fcntl.LOCK_SH, self.folder)  # before it has its name: a writer never sees it unclaimed
        except OSError as exc:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            lease = LeaseLock(str(self.folder)).live() if isinstance(exc, FlockUnsupported) else None
            if lease is not None:  # there, writers hold a lease (`acquire_lock`)
                raise BusyError(
                    f"{self.folder} is being written by {_describe(lease)}; wait for it to finish before `{command}` "
                    f"reads it"
                ) from None
            raise
        os.write(fd, json.dumps(holder).encode())
        os.replace(tmp, claims / name)
        self.path, self._fd = claims / name, fd
        # A reader dropped without close() (a refused training start) lets its claim go when collected.
        self._finalizer = weakref.finalize(self, _drop_claim, self.path, fd)
        writer = os.open(self.folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(writer, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(writer, fcntl.LOCK_UN)
        except BlockingIOError:
            self.release()
            raise BusyError(
                f"{self.folder} is being written by {_describe(_read_json(os.read(writer, 4096)))}; wait for it "
                f"to finish before `{command}` reads it"
            ) from None
        finally:
            os.close(writer)

    def release(self) -> None:
        if self._fd is not None:
            self._finalizer()
            self._fd = None


def _drop_claim(path: Path, fd: int) -> None:
    path.unlink(missing_ok=True)
    os.close(fd)  # drops the flock


class LeaseLock:
    kind = "lease"

    def __init__(self, url: str, lease_s: float = LEASE_S, clock: Callable[[], float] = time.time):
        import fsspec

        self.url = url.rstrip("/")
        self.fs, root = fsspec.core.url_to_fs(self.url)
        self.path = f"{root}/{LEASE_NAME}"
        # A local folder without flock: written by rename, so a reader never sees a half-written lease.
        self.local = "file" in ((self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol)
        self.lease_s = lease_s
        self.clock = clock  # wall clock (leases are compared across hosts); tests pass their own
        self.token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._stopping = threading.Lock()  # the renewer interrupts the command only while release() has not begun
        self._renewer: threading.Thread | None = None
        self.lost: dict[str, Any] | None = None  # the lease that replaced this one (`_renew`)

    def _read(self) -> dict[str, Any] | None:
        try:
            return _read_json(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None

    def _write(self, command: str) -> None:
        lease = {**_holder(command), "token": self.token, "expires": self.clock() + self.lease_s}
        if self.local:
            write_atomic(self.path, json.dumps(lease))
        else:
            self.fs.pipe_file(self.path, json.dumps(lease).encode())

    def live(self) -> dict[str, Any] | None:
        """Another holder's unexpired lease, or None."""
        current = self._read()
        if current and current.get("token") != self.token and current.get("expires", 0) > self.clock():
            return current
        return None

    def acquire(self, command: str) -> None:
        current = self.live()
        if current is not None:
            raise BusyError(
                f"{self.url} is in use by {_describe(current)} (lease until "
                f"{time.strftime('%H:%M:%S', time.localtime(current['expires']))}); wait for it or stop it"
            )
        self._write(command)
        time.sleep(0.05)  # let a racing writer's PUT land, then see who won
        won = self._read()
        if not won or won.get("token") != self.token:
            raise BusyError(f"{self.url} was just taken by {_describe(won or {})}; wait for it or stop it")
        self._renewer = threading.Thread(target=self._renew, args=(command,), name="dflash-lease", daemon=True)
        self._renewer.start()

    def _renew(self, command: str) -> None:
        """Renew every third of the lease's life; a lease another holder took (this process stalled past
        the lease's end, and a second writer acquired it) is never written over: the command is stopped
        (`exclusive` names the holder), rather than both writing."""
        wait = self.lease_s / 3
        while not self._stop.wait(wait):
            try:
                current = self._read()
                if current and current.get("token") not in (None, self.token):
                    self.lost = current
                    log.error("%s: the lease was taken by %s; stopping this command", self.path, _describe(current))
                    with self._stopping:  # an interrupt landing after the block ended would escape `exclusive`
                        if not self._stop.is_set():
                            _stop_main()
                    return
                self._write(command)
                wait = self.lease_s / 3
            except Exception as exc:  # noqa: BLE001 - an ended renewer lets the lease expire under a live writer
                log.warning("%s: renewing the lease failed (%s); trying again in %.0f s", self.path, exc, self.lease_s / 30)
                wait = self.lease_s / 30

    def release(self) -> None:
        with self._stopping:
            self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        current = self._read()
        if current and current.get("token") == self.token:
            self.fs.rm_file(self.path)


def _stop_main() -> None:
    """A KeyboardInterrupt in the main thread (`exclusive` names the lease's new holder). Where SIGINT is
    ignored (a background job of a shell script: `extract ... &`), interrupt_main does nothing and the
    command would go on writing beside the new holder: the process is ended with SIGTERM instead."""
    if callable(signal.getsignal(signal.SIGINT)):
        _thread.interrupt_main()
    else:
        os.kill(os.getpid(), signal.SIGTERM)


def _read_json(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data.decode("utf-8", "replace") or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@contextmanager
def waiting_flock(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` held while the block runs, waiting for it (the others here refuse a
    second holder); none where the folder or flock refuses: for work that is only wasted, never
    wrong, when two do it at once."""
    import fcntl

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("a")
    except OSError:
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
