"""Durable local files: one atomic write and one file hash for every writer of the project.

    write_atomic(path, data)          # bytes or str: temp file, fsync it, rename, fsync the folder
    with atomic_path(path) as tmp:    # for writers that need a path (safetensors, parquet, np.save)
        save_file(tensors, tmp)
    file_sha256(path)                 # streamed, any size
    full_disk(exc, folder, "writing X; ...")  # a DiskFullError naming the folder's free space, or None

A reader (or a crash) sees the old file or the new one, never a torn mix: the data is on disk
before the rename (fsync of the file), and the rename is on disk before the call returns (fsync of
the folder). Object stores have no rename and replace an object whole on PUT: `shared/store.py`
handles them through fsspec.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shared.errors import DiskFullError

HASH_CHUNK = 1 << 24  # 16 MB reads: hashing runs at disk or page-cache speed, not per-call overhead


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and folder under `root`, then `root` and its parent (its entry)."""
    root = Path(root)
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_file(Path(folder) / name)
        fsync_dir(folder)
    fsync_dir(root.parent)


def temp_name(path: Path) -> Path:
    """A hidden name beside `path`, unique per process (two writers never share a temp file)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block ends without error, the file (or
    folder) written there is fsynced and renamed onto `path`; on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        yield tmp
        if tmp.is_dir():
            for child in tmp.rglob("*"):
                if child.is_file():
                    fsync_file(child)
            fsync_dir(tmp)
        else:
            fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | os.PathLike, data: bytes | str) -> Path:
    """Replace `path` with `data` atomically and durably; returns the path."""
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
    return path


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(HASH_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def human_bytes(n: float) -> str:
    """3 significant figures in the largest unit that keeps the number >= 1 (0.00 GiB hides 500 MB)."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            break
    return f"{n:.3g} {unit}"


def full_disk(exc: BaseException, folder: str | os.PathLike, what: str) -> DiskFullError | None:
    """`exc` as one line naming `folder` and its free space when it is a full disk or quota (else
    None); `what` says what was being written and how to go on."""
    if not (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)):
        return None
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = human_bytes(shutil.disk_usage(probe).free)
    where = "no space left on the device" if exc.errno == errno.ENOSPC else "over the disk quota"
    return DiskFullError(f"{folder}: {where} ({free} free) {what}")
