"""The feature store: sharded Zarr v3 groups plus a manifest, the stage-1 -> stage-2 contract.

This is the only module that imports zarr. Layout under the store root (a local path or an
fsspec URL such as s3://bucket/store or memory://x):

    manifest.json              written last; readers trust only the shards it lists
    plan.json                  the shard plan, pinned at the first run (resume and reprocess reuse it)
    parts/shard-000003.json    one record per finished shard, written right after the shard's data
    shards/shard-000003-<tag>/ one Zarr group per shard, written whole, once, by one writer:
        hidden        [T, L, H]  bf16 (as uint16 bits) or fp8 e4m3 (as uint8 bits)
        hidden_scale  [T, L]     float32, fp8 only: per-token, per-layer scale (amax / 448)
        topk_logprobs [T, K]     float16, log-softmax of the target's logits after final norm + LM head
        topk_ids      [T, K]     int32
        input_ids     [T]        int32
        loss_mask     [T]        bool
        offsets       [S + 1]    int64, sample s is tokens offsets[s]:offsets[s+1]
        sample_ids    [S]        int64, the sample's index in the input data

The shard tag hashes the shard's inputs and the extraction settings, so a rewritten shard gets
a new name and the manifest switches to it in one write: replacing a shard needs no rename,
which object stores lack. Every array is one Zarr shard of `chunk_tokens`-token chunks, so any
zarr client (xarray, dask) can open a group, and a random window read touches few chunks.

Shape legend: T tokens, L feature layers, H hidden size, K top-k, S samples.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from shared.chunks import ALL_CHUNKS_WRITTEN, shard_file_key
from shared.errors import StoreError
from shared.files import fsync_tree, write_atomic
from shared.section import Section
from shared.shard_records import record_problem

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
FP8_MAX = 448.0  # largest finite float8_e4m3fn
ARRAY_NAMES = ("hidden", "hidden_scale", "topk_logprobs", "topk_ids", "input_ids", "loss_mask", "offsets", "sample_ids")


class StoreConfig(Section):
    section: ClassVar[str] = "store"
    path: str | None = None
    """Local folder or fsspec URL (s3://bucket/store); null = <run_dir>/store."""
    dtype: Literal["bf16", "fp8"] = "bf16"
    """Hidden states as bf16, or fp8 e4m3 with a per-token, per-layer scale (half the bytes)."""
    compression: Literal["none", "zstd"] = "zstd"
    """Codec of every array (zstd saves ~1.3x on hidden states, ~2x on top-k)."""
    zstd_level: int = 3
    """zstd level, 1..22."""
    shard_mb: int = 256
    """Target size of one shard group; the first run turns it into a pinned samples-per-shard."""
    chunk_tokens: int = 1024
    """Zarr chunk inside a shard: the unit of a random read."""
    read_cache_mb: int = 1024
    """Readers keep this many MB of decoded chunks (per process), so samples sharing a chunk decode it once."""
    local_cache_dir: str | None = None
    """Remote stores (s3://...): keep the chunks read on local disk here ($VARS expanded), within local_cache_gb."""
    local_cache_gb: float = 0.0
    """Size bound of local_cache_dir per process (least recently used chunks go first); 0 = no local cache."""

    def validate(self) -> None:
        self.require(1 <= self.zstd_level <= 22, "zstd_level", "must be in 1..22")
        self.require(self.shard_mb >= 1, "shard_mb", "must be >= 1")
        self.require(self.chunk_tokens >= 16, "chunk_tokens", "must be >= 16")
        self.require(self.read_cache_mb >= 0, "read_cache_mb", "must be >= 0")
        self.require(self.local_cache_gb >= 0, "local_cache_gb", "must be >= 0")

    def reader_options(self) -> dict[str, Any]:
        """StoreReader's keyword arguments from this section."""
        folder = os.path.expandvars(self.local_cache_dir) if self.local_cache_dir else None
        return {"cache_mb": self.read_cache_mb, "local_cache_dir": folder, "local_cache_gb": self.local_cache_gb}

    def url(self, run_dir: str | os.PathLike) -> str:
        """store.path, or <run_dir>/store."""
        return self.path or str(Path(run_dir) / "store")


def bytes_per_token(dtype: str, num_layers: int, hidden_size: int, top_k: int) -> int:
    """Uncompressed bytes one token costs in the store."""
    hidden = num_layers * hidden_size * (2 if dtype == "bf16" else 1) + (4 * num_layers if dtype == "fp8" else 0)
    return hidden + top_k * (2 + 4) + 4 + 1


# ---------------------------------------------------------------------------------------------
# Files beside the Zarr groups (manifest, plan, part records) through fsspec, so URLs work too.


class StoreFiles:
    def __init__(self, url: str):
        import fsspec

        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.is_local = self.fs.protocol in ("file", "local") or (
            isinstance(self.fs.protocol, tuple) and "file" in self.fs.protocol
        )

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def read_json(self, rel: str) -> Any:
        with self.fs.open(self.path(rel), "r") as fh:
            return json.load(fh)

    def write_json(self, rel: str, data: Any) -> None:
        """Atomic: local files go through temp + fsync + rename; an object-store PUT replaces the
        whole object at once, so readers see the old or the new manifest, never a mix."""
        text = json.dumps(data, indent=1, sort_keys=True)
        if self.is_local:
            write_atomic(self.path(rel), text)
        else:
            self.fs.pipe_file(self.path(rel), text.encode())

    def list(self, rel: str) -> list[str]:
        if not self.fs.exists(self.path(rel)):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path(rel), detail=False))

    def remove(self, rel: str) -> None:
        if self.fs.exists(self.path(rel)):
            self.fs.rm(self.path(rel), recursive=True)

    def size(self, rel: str) -> int:
        return int(self.fs.du(self.path(rel), total=True))

    def free_bytes(self) -> int | None:
        if not self.is_local:
            return None
        probe = Path(self.root)
        while not probe.exists():
            probe = probe.parent
        return os.statvfs(probe).f_bavail * os.statvfs(probe).f_frsize


def _zarr_store(url: str, read_only: bool) -> Any:
    from zarr.storage import FsspecStore, LocalStore

    if "://" not in url or url.startswith("file://"):
        path = url[len("file://") :] if url.startswith("file://") else url
        return LocalStore(path, read_only=read_only)
    return FsspecStore.from_url(url, read_only=read_only)


# ---------------------------------------------------------------------------------------------
# Encoding


@dataclass
class SampleFeatures:
    """One extracted sample, host memory, ready to store."""

    sample_id: int
    input_ids_T: np.ndarray  # int32
    loss_mask_T: np.ndarray  # bool
    hidden_TLH: Any  # torch tensor, bf16 or fp32
    topk_logprobs_TK: Any  # torch tensor, float32
    topk_ids_TK: Any  # torch tensor, int


def encode_hidden(hidden_TLH: Any, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """torch [T, L, H] -> stored bits (uint16 for bf16, uint8 for fp8) and the fp8 scale [T, L]."""
    import torch

    if dtype == "bf16":
        return hidden_TLH.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16), None
    x_TLH = hidden_TLH.float()
    amax_TL = x_TLH.abs().amax(dim=-1)
    scale_TL = torch.where(amax_TL > 0, amax_TL / FP8_MAX, torch.ones_like(amax_TL))
    q_TLH = (x_TLH / scale_TL[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q_TLH.view(torch.uint8).numpy(), scale_TL.numpy().astype(np.float32)


@dataclass
class EncodedSample:
    """One sample in its stored form, in arrays of its own (no view into a producer's buffer)."""

    sample_id: int
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # bool [T]
    hidden_bits: np.ndarray  # uint16 (bf16) or uint8 (fp8) [T, L, H]
    hidden_scale: np.ndarray | None  # float32 [T, L], fp8 only
    topk_logprobs: np.ndarray  # float16 [T, K]
    topk_ids: np.ndarray  # int32 [T, K]

    @property
    def nbytes(self) -> int:
        arrays = (self.input_ids, self.loss_mask, self.hidden_bits, self.hidden_scale, self.topk_logprobs, self.topk_ids)
        return sum(a.nbytes for a in arrays if a is not None)


def encode_sample(sample: SampleFeatures, dtype: str) -> EncodedSample:
    """A host sample in stored form. Every array is a copy: the caller may reuse (pinned) buffers
    the moment this returns."""
    bits, scale = encode_hidden(sample.hidden_TLH, dtype)
    return EncodedSample(
        sample_id=sample.sample_id,
        input_ids=np.array(sample.input_ids_T, dtype=np.int32),
        loss_mask=np.array(sample.loss_mask_T, dtype=bool),
        hidden_bits=np.array(bits, copy=True),
        hidden_scale=scale,
        topk_logprobs=sample.topk_logprobs_TK.float().numpy().astype(np.float16),
        topk_ids=sample.topk_ids_TK.numpy().astype(np.int32),
    )


def decode_hidden(bits_TLH: np.ndarray, scale_TL: np.ndarray | None, dtype: str) -> Any:
    import torch

    if dtype == "bf16":
        return torch.from_numpy(np.ascontiguousarray(bits_TLH).view(np.int16)).view(torch.bfloat16)
    q_TLH = torch.from_numpy(np.ascontiguousarray(bits_TLH)).view(torch.float8_e4m3fn)
    return (q_TLH.float() * torch.from_numpy(np.ascontiguousarray(scale_TL))[..., None]).to(torch.bfloat16)


def content_checksum(arrays: dict[str, np.ndarray]) -> str:
    """sha256 over the decoded arrays (name, dtype, shape, bytes): independent of the codecs used."""
    digest = hashlib.sha256()
    for name in ARRAY_NAMES:
        if name not in arrays:
            continue
        arr = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}|{arr.dtype.str}|{arr.shape}".encode())
        digest.update(arr.tobytes())
    return digest.hexdigest()


def shard_name(index: int, tag: str) -> str:
    return f"shard-{index:06d}-{tag}"


def write_shard(
    url: str, name: str, samples: list[SampleFeatures] | list[EncodedSample], cfg: StoreConfig
) -> dict[str, Any]:
    """Write one whole shard group and return its record (tokens, bytes, checksum)."""
    import zarr
    from zarr.codecs import ZstdCodec

    if not samples:
        raise ValueError(f"shard {name}: no samples to write")
    encoded = [s if isinstance(s, EncodedSample) else encode_sample(s, cfg.dtype) for s in samples]
    arrays: dict[str, np.ndarray] = {
        "hidden": np.concatenate([s.hidden_bits for s in encoded]),
        "topk_logprobs": np.concatenate([s.topk_logprobs for s in encoded]),
        "topk_ids": np.concatenate([s.topk_ids for s in encoded]),
        "input_ids": np.concatenate([s.input_ids for s in encoded]),
        "loss_mask": np.concatenate([s.loss_mask for s in encoded]),
        "offsets": np.concatenate([[0], np.cumsum([len(s.input_ids) for s in encoded])]).astype(np.int64),
        "sample_ids": np.asarray([s.sample_id for s in encoded], dtype=np.int64),
    }
    if cfg.dtype == "fp8":
        arrays["hidden_scale"] = np.concatenate([s.hidden_scale for s in encoded])
    num_tokens = int(arrays["offsets"][-1])
    compressors = ZstdCodec(level=cfg.zstd_level) if cfg.compression == "zstd" else None
    group = zarr.open_group(store=_zarr_store(url, read_only=False), path=f"shards/{name}", mode="w", zarr_format=3)
    group.attrs.update({"schema_version": SCHEMA_VERSION, "hidden_dtype": cfg.dtype, "num_tokens": num_tokens})
    for key, data in arrays.items():
        token_major = key not in ("offsets", "sample_ids")
        # Equal chunks of at most chunk_tokens: an uncompressed partial tail chunk would be stored
        # padded to full size, which costs up to a chunk of padding per shard.
        num_chunks = -(-len(data) // cfg.chunk_tokens) if token_major else 1
        chunks = (max(1, -(-len(data) // num_chunks)),) + data.shape[1:]
        # One Zarr shard per array, written in one call: partial shard writes rewrite the file.
        shards = (-(-len(data) // chunks[0]) * chunks[0],) + data.shape[1:]
        # Every chunk written, even one equal to the fill value (a one-sample shard's sample_ids is
        # [0]): zarr would otherwise write no file at all, and a missing file would look like a loss.
        array = group.create_array(
            name=key, shape=data.shape, dtype=data.dtype, chunks=chunks, shards=shards, compressors=compressors,
            config={"write_empty_chunks": True}, attributes={ALL_CHUNKS_WRITTEN: True},
        )
        array[...] = data
    files = StoreFiles(url)
    if files.is_local:
        # The part record that marks the shard done is fsynced; its data must be on disk before it,
        # or a node crash leaves a "done" shard whose chunk files never reached the disk.
        fsync_tree(Path(files.path(f"shards/{name}")))
    return {
        "name": name,
        "num_samples": len(samples),
        "num_tokens": num_tokens,
        "bytes": files.size(f"shards/{name}"),
        "checksum": content_checksum(arrays),
    }


def read_shard_arrays(url: str, name: str) -> dict[str, np.ndarray]:
    """Every array of a shard, decoded (for verify and tests)."""
    import zarr

    group = zarr.open_group(store=_zarr_store(url, read_only=True), path=f"shards/{name}", mode="r")
    files = StoreFiles(url)
    out = {}
    for key in ARRAY_NAMES:
        if key not in group:
            continue
        array = group[key]
        # zarr reads a missing chunk as its fill value; where every chunk was written, it is a loss.
        shard_file = shard_file_key(f"shards/{name}/{key}", array.ndim)
        if array.attrs.get(ALL_CHUNKS_WRITTEN) and not files.exists(shard_file):
            raise FileNotFoundError(f"{shard_file}: missing (this writer writes every chunk)")
        out[key] = array[...]
    return out


# ---------------------------------------------------------------------------------------------
# The manifest


def read_manifest(url: str) -> dict[str, Any]:
    files = StoreFiles(url)
    if not files.exists("manifest.json"):
        hint = " (extraction has not finished: run `python -m stage1_extract status`)" if files.exists("plan.json") else ""
        raise StoreError(f"{url}: no manifest.json{hint}")
    manifest = load_manifest(files)
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise StoreError(
            f"{url}/manifest.json has schema_version {version}; this code reads version {SCHEMA_VERSION} "
            f"(re-extract, or use the matching dflash-pipeline version)"
        )
    return manifest


MANIFEST_KEYS = {"schema_version": int, "storage": dict, "shards": list, "layer_ids": list, "target": dict}


def load_manifest(files: StoreFiles) -> dict[str, Any]:
    """manifest.json parsed and checked for shape; a damaged one is a StoreError naming the file
    and the command that rebuilds it from the part records (which survive a torn manifest)."""
    fix = "run `python -m stage1_extract reprocess` to rebuild it from the part records"
    try:
        manifest = files.read_json("manifest.json")
    except (ValueError, UnicodeDecodeError) as exc:
        raise StoreError(f"{files.url}/manifest.json is damaged (not valid JSON: {exc}); {fix}") from None
    if not isinstance(manifest, dict):
        raise StoreError(f"{files.url}/manifest.json is damaged (a JSON {type(manifest).__name__}, not an object); {fix}")
    for key, kind in MANIFEST_KEYS.items():
        if not isinstance(manifest.get(key), kind):
            raise StoreError(f"{files.url}/manifest.json is damaged ({key!r} missing or not a {kind.__name__}); {fix}")
    for position, record in enumerate(manifest["shards"]):
        problem = record_problem(record, position)
        if problem is not None:
            raise StoreError(f"{files.url}/manifest.json is damaged ({problem}); {fix}")
    return manifest


def check_manifest_matches(manifest: dict[str, Any], expected: dict[str, Any], url: str) -> None:
    """Refuse a store whose manifest disagrees with the config, naming the first differing field."""
    for key, want in expected.items():
        have = manifest
        for part in key.split("."):
            have = have.get(part) if isinstance(have, dict) else None
        if have != want:
            raise StoreError(
                f"{url}/manifest.json: {key} is {have!r} but the config expects {want!r}; "
                f"re-extract or run `python -m stage1_extract reprocess` with this config"
            )


# ---------------------------------------------------------------------------------------------
# Reading


def content_keys(shards: list[dict[str, Any]], sample_ids: np.ndarray) -> np.ndarray:
    """int64 per sample: a hash of its tokens and loss mask when every shard record lists them
    (`content_hashes`), so identical samples share a key and the held-out split keeps them on one
    side; else the sample ids (stores written before content hashes were recorded)."""
    if shards and all("content_hashes" in s for s in shards):
        return np.asarray([int(h[:15], 16) for s in shards for h in s["content_hashes"]], dtype=np.int64)
    return sample_ids


class StoreReader:
    """Samples by index over the shards the manifest lists. Thread-safe for concurrent reads.

    A read decodes whole inner chunks (one plain read each, `shared/chunks.py`) and keeps them in a
    byte-bounded LRU (`cache_mb`), so samples sharing a chunk decode it once; shard metadata and chunk
    indexes are read once per shard and kept for the `cache_shards` shards used last. Arrays written
    with another codec pipeline are read through zarr. A remote store's chunk bytes can be kept on
    local disk (`local_cache_dir`, at most `local_cache_gb`)."""

    REQUIRED = ("input_ids", "loss_mask", "hidden", "topk_logprobs", "topk_ids", "offsets")

    def __init__(
        self,
        url: str,
        *,
        cache_mb: int = 1024,
        cache_shards: int = 256,
        local_cache_dir: str | os.PathLike | None = None,
        local_cache_gb: float = 0.0,
    ):
        from shared.chunks import ChunkSource, DecodedChunks, LocalChunkCache

        self.url = url
        self.manifest = read_manifest(url)
        self.hidden_dtype = self.manifest["storage"]["dtype"]
        shards = self.manifest["shards"]
        counts = np.asarray([s["num_samples"] for s in shards], dtype=np.int64)
        self._shard_start = np.concatenate([[0], np.cumsum(counts)])
        self._shards = shards
        self.lengths = np.concatenate([np.asarray(s["lengths"], dtype=np.int64) for s in shards]) if shards else np.zeros(0, np.int64)
        self.sample_ids = np.concatenate([np.asarray(s["sample_ids"], dtype=np.int64) for s in shards]) if shards else np.zeros(0, np.int64)
        self.split_keys = content_keys(shards, self.sample_ids)
        files = StoreFiles(url)
        self._check_listing(files)
        local_cache = None
        if not files.is_local and local_cache_dir is not None and local_cache_gb > 0:
            local_cache = LocalChunkCache(local_cache_dir, int(local_cache_gb * 2**30))
        self._source = ChunkSource(files.fs, files.root, files.is_local, local_cache)
        self._chunks = DecodedChunks(cache_mb * 2**20)
        self._open: OrderedDict[int, tuple[dict[str, Any], np.ndarray]] = OrderedDict()
        self._cache_shards = cache_shards
        self._lock = threading.Lock()
        self._zarr_store = None
        self._feature_shape: tuple[int, int] | None = None
        self._claim: Any = None

    def __len__(self) -> int:
        return int(self._shard_start[-1])

    def hold(self, command: str) -> StoreReader:
        """Claim a local store for as long as this reader reads it (until `close`): stage-1 writers
        are refused naming this process, and this is refused while one writes. Where no claim can
        be made (an object store, a read-only folder) a failed read still says whether the store
        was rewritten meanwhile (`_damaged`)."""
        from shared.lock import ReaderClaim

        if "://" in self.url and not self.url.startswith("file://"):
            return self
        claim = ReaderClaim(self.url)
        try:
            claim.acquire(command)
        except OSError as exc:
            log.info("%s: no reader claim (%s); a concurrent rewrite is still named if a read fails", self.url, exc)
            return self
        self._claim = claim
        return self

    def close(self) -> None:
        if self._claim is not None:
            self._claim.release()
            self._claim = None

    def _damaged(self, shard: str, what: str, fix: str) -> StoreError:
        """The error for shard `shard`, which cannot be read as the manifest says: `fix` names the
        repair, unless the store was rewritten under this reader (`_rewritten`)."""
        return self._rewritten(shard, what) or StoreError(f"{self.url}: shard {shard} {what}; {fix}")

    def _rewritten(self, shard: str, what: str) -> StoreError | None:
        """When manifest.json changed since this reader opened the store, a writer (`reprocess`)
        replaced shards under it: no repair of the store would help, and the error says so."""
        try:
            changed = read_manifest(self.url) != self.manifest
        except StoreError:
            changed = True  # gone or torn now: not what this reader opened
        if not changed:
            return None
        return StoreError(
            f"{self.url}: shard {shard} {what}, and manifest.json changed since this run opened the store: it was "
            f"rewritten (`stage1_extract reprocess`, `extract` or `verify --repair`) while being read. The store is "
            f"not damaged; rerun once the writer has finished (keep writers off a store while training reads it)"
        )

    def _check_listing(self, files: StoreFiles) -> None:
        """Cheap open-time check (one listing): every shard the manifest lists is there."""
        present = set(files.list("shards"))
        missing = [s["name"] for s in self._shards if s["name"] and s["name"] not in present]
        if missing:
            raise self._damaged(
                missing[0], f"is missing ({len(missing)} shard(s) listed in manifest.json are)",
                "run `python -m stage1_extract verify --repair` or `reprocess`",
            )

    def _shard(self, shard: int) -> tuple[dict[str, Any], np.ndarray]:
        """The shard's arrays (metadata and chunk indexes read once) and its offsets."""
        with self._lock:
            if shard in self._open:
                self._open.move_to_end(shard)
                return self._open[shard]
        name = self._shards[shard]["name"]
        try:
            arrays = self._open_arrays(name)
            offsets = self._read(arrays["offsets"], 0, self._shards[shard]["num_samples"] + 1, (shard, "offsets"))
        except StoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure here means a damaged (or replaced) shard
            raise self._damaged(
                name, f"cannot be opened ({type(exc).__name__}: {exc})", "run `python -m stage1_extract verify --repair`"
            ) from exc
        info = self._shards[shard]
        if len(offsets) != info["num_samples"] + 1 or int(offsets[-1]) != info["num_tokens"]:
            raise self._damaged(
                name, f"holds {len(offsets) - 1} samples / {int(offsets[-1])} tokens, the manifest says "
                f"{info['num_samples']} / {info['num_tokens']}", "run `python -m stage1_extract reprocess`",
            )
        with self._lock:
            self._open[shard] = (arrays, offsets)
            while len(self._open) > self._cache_shards:
                self._open.popitem(last=False)
        return arrays, offsets

    def _open_arrays(self, name: str) -> dict[str, Any]:
        from shared.chunks import open_shard_array

        present = set(StoreFiles(self.url).list(f"shards/{name}")) if not self._source.is_local else {
            p.name for p in Path(self._source.root, "shards", name).iterdir()
        }
        wanted = [a for a in ARRAY_NAMES if a in present]
        missing = [a for a in self.REQUIRED if a not in present] + (
            ["hidden_scale"] if self.hidden_dtype == "fp8" and "hidden_scale" not in present else []
        )
        if missing:
            raise self._damaged(
                name, f"lacks the array(s) {missing}", "run `python -m stage1_extract verify --repair` to extract it again"
            )
        arrays: dict[str, Any] = {}
        for array in wanted:
            fast = open_shard_array(self._source, f"shards/{name}/{array}")
            arrays[array] = fast if fast is not None else self._zarr_array(name, array)
        return arrays

    def _zarr_array(self, name: str, array: str) -> Any:
        import zarr

        if self._zarr_store is None:
            self._zarr_store = _zarr_store(self.url, read_only=True)
        return zarr.open_array(store=self._zarr_store, path=f"shards/{name}/{array}", mode="r")

    def _read(self, array: Any, lo: int, hi: int, tag: tuple, out: np.ndarray | None = None) -> np.ndarray:
        from shared.chunks import ShardArray, read_range

        if isinstance(array, ShardArray):
            return read_range(self._source, array, lo, hi, self._chunks, tag, out)
        if out is None:
            return array[lo:hi]
        out[...] = array[lo:hi]
        return out

    @property
    def feature_shape(self) -> tuple[int, int] | None:
        """(layers, hidden) of the stored features; None for an empty store."""
        if self._feature_shape is None and len(self):
            arrays, _ = self._shard(0)
            self._feature_shape = tuple(int(d) for d in arrays["hidden"].shape[1:])
        return self._feature_shape

    def describe(self, index: int) -> str:
        """'sample 412 (input row 412) in shard shard-000004-... of <store>': for error messages."""
        shard, _ = self.locate(index)
        return f"sample {index} (input row {int(self.sample_ids[index])}) in shard {self._shards[shard]['name']} of {self.url}"

    def locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range [0, {len(self)})")
        shard = int(np.searchsorted(self._shard_start, index, side="right") - 1)
        return shard, index - int(self._shard_start[shard])

    def order_key(self, index: int) -> tuple[int, int]:
        """Where a sample sits in the store: reading a batch in this order reuses decoded chunks."""
        return self.locate(index)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.read(index)

    def read(self, index: int, start: int = 0, stop: int | None = None, *, hidden_out: Any = None) -> dict[str, Any]:
        """Sample `index`, optionally only tokens [start, stop) of it (a window read).

        `hidden_out`, a contiguous bf16 CPU tensor [tokens, layers, hidden] (the loader's slice of a
        packed micro-batch), receives the features: bf16 bits are read straight into it, so the
        8B-sized features (~80 MB a sample) are copied once instead of read and then packed."""
        import torch

        shard, local = self.locate(index)
        arrays, offsets = self._shard(shard)
        begin, end = int(offsets[local]), int(offsets[local + 1])
        stop = end - begin if stop is None else min(stop, end - begin)
        lo, hi = begin + start, begin + stop
        if hidden_out is not None and hidden_out.shape[0] != hi - lo:
            # The caller sized it from the manifest's lengths: the shard's offsets disagree.
            rewritten = self._rewritten(self._shards[shard]["name"], f"has {hi - lo} tokens for {self.describe(index)}")
            if rewritten is not None:
                raise rewritten
            raise ValueError(f"has {hi - lo} tokens but the store's lengths say {hidden_out.shape[0]}")

        def get(name: str, out: np.ndarray | None = None) -> np.ndarray:
            try:
                return self._read(arrays[name], lo, hi, (shard, name), out)
            except Exception as exc:  # noqa: BLE001 - name the shard and the fix
                raise self._damaged(
                    self._shards[shard]["name"],
                    f"cannot be read: {name} of {self.describe(index)} ({type(exc).__name__}: {exc})",
                    "run `python -m stage1_extract verify --repair`",
                ) from exc

        scale = get("hidden_scale") if self.hidden_dtype == "fp8" else None
        if hidden_out is None:
            hidden_TLH = decode_hidden(get("hidden"), scale, self.hidden_dtype)
        elif self.hidden_dtype == "bf16":
            get("hidden", hidden_out.view(torch.int16).numpy().view(np.uint16))
            hidden_TLH = hidden_out
        else:
            hidden_TLH = hidden_out.copy_(decode_hidden(get("hidden"), scale, self.hidden_dtype))
        return {
            "sample_id": int(self.sample_ids[index]),
            "input_ids_T": torch.from_numpy(get("input_ids").astype(np.int64)),
            "loss_mask_T": torch.from_numpy(get("loss_mask")),
            "hidden_TLH": hidden_TLH,
            "topk_logprobs_TK": torch.from_numpy(get("topk_logprobs").astype(np.float32)),
            "topk_ids_TK": torch.from_numpy(get("topk_ids").astype(np.int64)),
        }
