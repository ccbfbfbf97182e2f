"""Fast reads of the store's arrays: whole inner chunks, read with one call each, decoded, cached.

Every array of a shard group is one Zarr v3 array stored as ONE shard file (sharding codec, inner
chunks of up to `chunk_tokens` tokens, `bytes` (+ `zstd`) + `crc32c` codecs, the index at the end with
a crc32c):

    shards/shard-000003-<tag>/hidden/zarr.json        the array's metadata
    shards/shard-000003-<tag>/hidden/c/0/0/0          the shard: inner chunks, then the index

zarr-python spends 1.5-7 ms of per-call machinery on every `array[lo:hi]` whatever its size, and a
sample needs five arrays. This module reads what zarr would read (the index once per array, then
the byte range of each inner chunk) with one plain read per chunk, decodes it with the same codec
(numcodecs' zstd), and keeps decoded chunks in a byte-bounded LRU, so the samples that share a
chunk decode it once. Each chunk's crc32c and the index's are checked when read (shards written before
chunks carried one have only the index's): a flipped bit on disk, or bytes altered in place, is an
error naming the shard, array and chunk, never features trained on. Arrays written with any other codec pipeline are not recognised here
(`open_shard_array` returns None) and `shared.reader.StoreReader` reads them through zarr instead.
Remote stores (fsspec URLs) read the same byte ranges with `cat_file`; `LocalChunkCache` keeps
their chunk bytes on local disk within a size bound, keyed by the shard's content checksum too: a
shard rewritten under its own name (`reprocess` of rows whose tokens changed, `verify --repair`) has
chunks at the same offsets and lengths, whose old copies must never be served for it.

Shape legend: T tokens of the array, C tokens per inner chunk.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import StoreError

_EMPTY = 2**64 - 1  # an index entry for a chunk that was never written (all fill value)
ALL_CHUNKS_WRITTEN = "dflash_all_chunks_written"  # array attribute: every chunk has its bytes on disk
_DTYPES = {"uint8", "uint16", "int32", "int64", "float16", "float32", "bool"}


@dataclass
class ShardArray:
    """One array of one shard group, ready for chunk reads."""

    key: str  # the shard file, relative to the store root
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_shape: tuple[int, ...]
    compressed: bool
    fill_value: Any
    index: list[tuple[int, int]]  # per inner chunk: byte offset, byte count
    checked: bool = False  # each chunk ends in a crc32c of its (compressed) bytes
    version: str = ""  # the shard's content checksum: part of its chunks' names in a LocalChunkCache
    # Uncompressed chunks whose crc32c was checked (read whole once), one flag per chunk: it lives
    # and goes with the open shard, so a reader over a whole store holds no per-chunk set of its own.
    verified: bytearray = field(default_factory=bytearray)

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_shape[0]

    @property
    def row_bytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.chunk_shape[1:])


INNER_CODECS = {("bytes",): (False, False), ("bytes", "zstd"): (True, False), ("bytes", "crc32c"): (False, True),
                ("bytes", "zstd", "crc32c"): (True, True)}  # -> (zstd?, crc32c?)


def parse_metadata(meta: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype, tuple[int, ...], tuple[bool, bool], Any] | None:
    """(shape, dtype, inner chunk shape, (zstd?, crc32c?), fill value) of an array this module can
    read, else None."""
    try:
        shape = tuple(meta["shape"])
        grid = meta["chunk_grid"]["configuration"]["chunk_shape"]
        (sharding,) = meta["codecs"]
        if sharding["name"] != "sharding_indexed" or meta["data_type"] not in _DTYPES:
            return None
        conf = sharding["configuration"]
        inner = [c["name"] for c in conf["codecs"]]
        index = [c["name"] for c in conf["index_codecs"]]
        endian = conf["codecs"][0].get("configuration", {}).get("endian", "little")
        if tuple(inner) not in INNER_CODECS or endian != "little":
            return None
        if index != ["bytes", "crc32c"] or conf.get("index_location", "end") != "end":
            return None
        if list(grid[1:]) != list(shape[1:]) or grid[0] < shape[0]:
            return None  # not one shard holding the whole array
        chunk = tuple(conf["chunk_shape"])
        if list(chunk[1:]) != list(shape[1:]) or meta.get("chunk_key_encoding", {}).get("configuration", {}).get("separator", "/") != "/":
            return None
        return shape, np.dtype(meta["data_type"]), chunk, INNER_CODECS[tuple(inner)], meta.get("fill_value", 0)
    except (KeyError, TypeError, ValueError):
        return None


class ChunkSource:
    """Byte reads under the store root: local files with pread, or an fsspec filesystem."""

    def __init__(self, fs: Any, root: str, is_local: bool, cache: LocalChunkCache | None = None):
        self.fs, self.root, self.is_local, self.cache = fs, root.rstrip("/"), is_local, cache

    def read_into(self, key: str, start: int, out: memoryview, version: str = "") -> None:
        """Fill `out` with the bytes at `start` (local files: straight into it, no second copy)."""
        if not self.is_local:
            out[:] = self.read(key, start, len(out), version=version)
            return
        fd = os.open(f"{self.root}/{key}", os.O_RDONLY)
        try:
            got = os.preadv(fd, [out], start)
        finally:
            os.close(fd)
        if got != len(out):
            raise OSError(f"{self.root}/{key}: read {got} bytes at {start}, expected {len(out)} (truncated file)")

    def read(self, key: str, start: int, length: int, fresh: bool = False, version: str = "") -> bytes:
        """`length` bytes at `start`; `fresh`: past the local chunk cache (its copy is dropped);
        `version`: the content checksum of the shard the file belongs to (`ShardArray.version`)."""
        if fresh and self.cache is not None:
            self.cache.drop(key, start, length, version)
        if self.is_local:
            fd = os.open(f"{self.root}/{key}", os.O_RDONLY)
            try:
                data = os.pread(fd, length, start)
            finally:
                os.close(fd)
        elif self.cache is not None:
            data = self.cache.get_or_fetch(
                key, start, length, lambda: self.fs.cat_file(f"{self.root}/{key}", start, start + length), version
            )
        else:
            data = self.fs.cat_file(f"{self.root}/{key}", start, start + length)
        if len(data) != length:
            raise OSError(f"{self.root}/{key}: read {len(data)} bytes at {start}, expected {length} (truncated file)")
        return data

    def size(self, key: str) -> int:
        if self.is_local:
            return os.stat(f"{self.root}/{key}").st_size
        return int(self.fs.size(f"{self.root}/{key}"))

    def text(self, key: str) -> str:
        if self.is_local:
            return Path(f"{self.root}/{key}").read_text()
        return self.fs.cat_file(f"{self.root}/{key}").decode()


def shard_file_key(array_dir: str, ndim: int) -> str:
    """The one shard file of an array written whole (`.../hidden/c/0/0/0` for a 3-d array)."""
    return f"{array_dir}/c/" + "/".join("0" * ndim)


def open_shard_array(source: ChunkSource, array_dir: str, version: str = "") -> ShardArray | None:
    """The array under `array_dir` (relative to the root) with its chunk index read, or None when its
    layout is not the one this module reads. `version`: its shard's content checksum ("" if none)."""
    meta = json.loads(source.text(f"{array_dir}/zarr.json"))
    parsed = parse_metadata(meta)
    if parsed is None:
        return None
    shape, dtype, chunk, (compressed, checked), fill = parsed
    key = shard_file_key(array_dir, len(shape))
    num_chunks = max(1, math.ceil(shape[0] / chunk[0]))
    index_bytes = num_chunks * 16 + 4  # (offset, nbytes) uint64 per chunk, then a crc32c
    try:
        size = source.size(key)
    except FileNotFoundError:
        if (meta.get("attributes") or {}).get(ALL_CHUNKS_WRITTEN):
            raise  # this writer writes every chunk: a missing file is a lost file
        # Zarr writes no file for an array whose every chunk equals the fill value (stores written
        # before ALL_CHUNKS_WRITTEN: a one-sample shard's sample_ids [0]); zarr reads it as fill.
        return ShardArray(key, shape, dtype, chunk, compressed, fill, [(_EMPTY, _EMPTY)] * num_chunks, checked, version)
    raw = checked_read(source, key, size - index_bytes, index_bytes, "its chunk index", version)
    index = [tuple(pair) for pair in np.frombuffer(raw[:-4], dtype="<u8").reshape(num_chunks, 2).tolist()]
    return ShardArray(key, shape, dtype, chunk, compressed, fill, index, checked, version)


def checked_read(source: ChunkSource, key: str, start: int, length: int, what: str, version: str = "") -> bytes:
    """The bytes at `start`, which end in their crc32c, checked. A remote store's local copy may be
    what is damaged (bit rot, a crash mid-write of the right length): it is dropped and the store's
    own bytes decide."""
    data = source.read(key, start, length, version=version)
    try:
        check_crc32c(data, f"{source.root}/{key}", what)
    except StoreError:
        if source.cache is None:
            raise
        data = source.read(key, start, length, fresh=True, version=version)
        check_crc32c(data, f"{source.root}/{key}", what)
    return data


def check_crc32c(data: bytes, key: str, what: str) -> None:
    """`data` ends in the little-endian crc32c of the bytes before it (zarr's crc32c codec), or a
    StoreError names the file and the fix."""
    import google_crc32c

    body = np.frombuffer(data, dtype=np.uint8)[:-4]  # a view: no copy of the chunk
    if len(data) < 4 or google_crc32c.value(body).to_bytes(4, "little") != bytes(data[-4:]):
        raise StoreError(
            f"{key}: {what} does not match its crc32c: the file was damaged on disk or in a copy, or altered in "
            f"place; run `python -m stage1_extract verify --repair` to re-extract the shards it names"
        )


def decode_chunk(source: ChunkSource, array: ShardArray, k: int) -> np.ndarray:
    """Inner chunk k, decoded ([C, ...]); the last chunk may extend past the array's end."""
    offset, nbytes = array.index[k]
    if offset == _EMPTY and nbytes == _EMPTY:
        return np.full(array.chunk_shape, array.fill_value, dtype=array.dtype)
    if array.checked:
        what = f"inner chunk {k} (tokens {k * array.chunk_tokens}-{(k + 1) * array.chunk_tokens - 1})"
        data = memoryview(checked_read(source, array.key, offset, nbytes, what, array.version))[:-4]
    else:
        data = source.read(array.key, offset, nbytes, version=array.version)
    if array.compressed:
        from numcodecs import Zstd

        data = Zstd().decode(data)
    return np.frombuffer(data, dtype=array.dtype).reshape(array.chunk_shape)


class DecodedChunks:
    """A thread-safe LRU of decoded chunks, bounded in bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: tuple) -> np.ndarray | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
            return value

    def put(self, key: tuple, value: np.ndarray) -> None:
        if value.nbytes > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = value
            self._bytes += value.nbytes
            while self._bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.nbytes


def read_range(
    source: ChunkSource, array: ShardArray, lo: int, hi: int, cache: DecodedChunks, tag: tuple, out: np.ndarray | None = None
) -> np.ndarray:
    """Rows [lo, hi) of the array, into `out` when given (C-contiguous, [hi - lo, ...] of the array's
    dtype: the loader's packed micro-batch, so the rows are copied once, not read and then packed).
    Uncompressed, local: exactly those rows' bytes, one read per chunk touched; a chunk that carries
    a crc32c is read whole once per open shard first, to check it (`ShardArray.verified`), so a flipped
    bit is found on the first read of its chunk and later reads stay row reads. Remote: as compressed.
    Compressed: each chunk touched read and decoded once (cached)."""
    C = array.chunk_tokens
    if out is None:
        out = np.empty((max(0, hi - lo), *array.chunk_shape[1:]), dtype=array.dtype)
    elif out.shape != (max(0, hi - lo), *array.chunk_shape[1:]) or out.dtype != array.dtype or not out.flags.c_contiguous:
        raise ValueError(f"{array.key}: rows {lo}..{hi} do not fit an output of shape {list(out.shape)} {out.dtype}")
    if hi <= lo:
        return out
    # A remote store's uncompressed chunks are read whole (one GET each, checked, cached): row reads
    # would each be a local copy of its own that no checksum covers.
    if not array.compressed and (source.is_local or not array.checked):
        if array.checked:
            if not array.verified:
                array.verified = bytearray(len(array.index))
            for k in range(lo // C, (hi - 1) // C + 1):
                if not array.verified[k]:
                    decode_chunk(source, array, k)
                    array.verified[k] = 1
        return _read_rows(source, array, lo, hi, out)
    for k in range(lo // C, (hi - 1) // C + 1):
        chunk = cache.get((*tag, k))
        if chunk is None:
            chunk = decode_chunk(source, array, k)
            cache.put((*tag, k), chunk)
        a, b = max(lo, k * C) - k * C, min(hi, (k + 1) * C) - k * C
        # A copy: the caller owns `out`, the cached chunk stays untouched.
        out[k * C + a - lo : k * C + b - lo] = chunk[a:b]
    return out


def _read_rows(source: ChunkSource, array: ShardArray, lo: int, hi: int, out: np.ndarray) -> np.ndarray:
    C = array.chunk_tokens
    row_bytes = array.row_bytes
    flat = memoryview(out.reshape(-1).view(np.uint8))
    for k in range(lo // C, (hi - 1) // C + 1):
        offset, nbytes = array.index[k]
        a, b = max(lo, k * C) - k * C, min(hi, (k + 1) * C) - k * C
        dest = out[k * C + a - lo : k * C + b - lo]
        if offset == _EMPTY and nbytes == _EMPTY:
            dest[...] = array.fill_value
            continue
        start = (k * C + a - lo) * row_bytes
        source.read_into(array.key, offset + a * row_bytes, flat[start : start + (b - a) * row_bytes], array.version)
    return out


class LocalChunkCache:
    """Chunk bytes of a remote store kept on local disk, least recently used evicted past `max_bytes`
    (per process: give each node's ranks the node's share)."""

    def __init__(self, folder: str | os.PathLike, max_bytes: int):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        found = sorted(self.folder.glob("*.bin"), key=lambda p: p.stat().st_atime)
        self._sizes: OrderedDict[str, int] = OrderedDict((p.name, p.stat().st_size) for p in found)
        self._bytes = sum(self._sizes.values())

    @staticmethod
    def _name(key: str, start: int, length: int, version: str = "") -> str:
        # The shard's content checksum is part of the name: a shard rewritten under its own name holds
        # other bytes at the same offsets and lengths, and a copy of the old ones would pass its crc32c.
        return hashlib.sha1(f"{key}@{start}+{length}#{version}".encode()).hexdigest() + ".bin"

    def drop(self, key: str, start: int, length: int, version: str = "") -> None:
        name = self._name(key, start, length, version)
        with self._lock:
            size = self._sizes.pop(name, None)
            if size is not None:
                self._bytes -= size
        (self.folder / name).unlink(missing_ok=True)

    def get_or_fetch(self, key: str, start: int, length: int, fetch, version: str = "") -> bytes:
        name = self._name(key, start, length, version)
        path = self.folder / name
        with self._lock:
            known = name in self._sizes
            if known:
                self._sizes.move_to_end(name)
        if known:
            try:
                data = path.read_bytes()
                # No fsync on write (a cache, not a record): a crash may leave a short file, so a
                # file of the wrong length is fetched again rather than trusted.
                if len(data) == length:
                    return data
            except OSError:
                pass  # evicted by another process: fetch again
        data = fetch()
        tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError:
            return data  # a full or read-only cache costs a refetch, never the read
        with self._lock:
            self._sizes[name] = len(data)
            self._bytes += len(data)
            while self._bytes > self.max_bytes and len(self._sizes) > 1:
                old, size = self._sizes.popitem(last=False)
                self._bytes -= size
                (self.folder / old).unlink(missing_ok=True)
        return data
