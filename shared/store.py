"""The feature store: sharded Zarr v3 groups plus a manifest, the stage-1 -> stage-2 contract.

This module and its reader (`shared/reader.py`) are the only code that imports zarr; how hidden
states are encoded is `shared/codecs.py`. Layout under the store root (a local path or an
fsspec URL such as s3://bucket/store or memory://x):

    manifest.json              written last; readers trust only the shards it lists
    plan.json                  the shard plan, pinned at the first run (resume and reprocess reuse it)
    parts/shard-000003.json    one record per finished shard, written right after the shard's data
    shards/shard-000003-<tag>/ one Zarr group per shard, written whole, once, by one writer:
        hidden        [T, L, H]  bf16 (as uint16 bits) or fp8 e4m3 (as uint8 bits); fp4: [T, L, H/2]
                                 uint8, two e2m1 codes a byte (shared/fp4.py)
        hidden_scale  [T, L]     float32, fp8 and fp4: per-token, per-layer scale (amax / 448; fp4 amax / 2688)
        topk_logprobs [T, K]     float16, log-softmax of the target's logits after final norm + LM head
        topk_ids      [T, K]     int32
        input_ids     [T]        int32
        loss_mask     [T]        bool
        offsets       [S + 1]    int64, sample s is tokens offsets[s]:offsets[s+1]
        sample_ids    [S]        int64, the sample's index in the input data
      fp4 only (shared/fp4.py):
        hidden_group_scale      [T, L, H/16]  uint8, e4m3 bits: one scale per 16 channels
        hidden_outliers         [T, L, N]     uint16, bf16 bits of the outlier channels, exact
        hidden_outlier_channels [L, N]        int32, those channels (one set for the whole store)

The shard tag hashes the shard's inputs and the extraction settings, so a rewritten shard gets
a new name and the manifest switches to it in one write: replacing a shard needs no rename,
which object stores lack. Every array is one Zarr shard of `chunk_tokens`-token chunks, so any
zarr client (xarray, dask) can open a group, and a random window read touches few chunks.

Shape legend: T tokens, L feature layers, H hidden size, K top-k, S samples, N outlier channels.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from shared import fp4
from shared.chunks import ALL_CHUNKS_WRITTEN, shard_file_key
from shared.codecs import FP4_ARRAYS, EncodedSample, SampleFeatures, encode_sample
from shared.errors import StoreError
from shared.files import fsync_tree, write_atomic
from shared.section import Section
from shared.shard_records import record_problem

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
ARRAY_NAMES = (
    "hidden", "hidden_scale", "topk_logprobs", "topk_ids", "input_ids", "loss_mask", "offsets", "sample_ids",
    "hidden_group_scale", "hidden_outliers", "hidden_outlier_channels",
)
NOT_TOKEN_MAJOR = ("offsets", "sample_ids", "hidden_outlier_channels")


class StoreConfig(Section):
    section: ClassVar[str] = "store"
    path: str | None = None
    """Local folder or fsspec URL (s3://bucket/store); null = <run_dir>/store."""
    dtype: Literal["bf16", "fp8", "fp4"] = "bf16"
    """Hidden states as bf16, or fp8 e4m3 with a per-token, per-layer scale (half the bytes), or fp4: e2m1
    in groups of 16 with e4m3 group scales plus fp4_outlier_channels exact channels (0.29x at 8B)."""
    fp4_outlier_channels: int = 8
    """fp4 only: per layer, this many channels (largest mean |x| on the first shard, fixed per store) stored exact."""
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
        self.require(1 <= self.fp4_outlier_channels <= 256, "fp4_outlier_channels", "must be in 1..256 (the fp4 codec keeps at least one exact channel per layer)")

    def alternatives(self) -> list[str]:
        if self.dtype == "fp4":
            return []
        return [
            "store.dtype=fp4: 0.29x of bf16's bytes per token at the Qwen3-8B shape (fp8 0.505x; docs/capacity.md); "
            "a drafter trained on it accepted as many tokens as one trained on fp8, fp4 - fp8 -0.001 [-0.018, +0.015] "
            "on the CPU default and +0.002 [-0.020, +0.024] on cpu-long (BENCHMARKS.md \"fp4_compare\", "
            "\"fp4_compare_long\"; one small target: measure yours)"
        ]

    def identity(self) -> dict[str, Any]:
        """The settings that change a shard's bytes (the header's `storage`); the outlier count only
        for fp4, so the identity of bf16 and fp8 stores is what it was before fp4 existed."""
        out: dict[str, Any] = {"dtype": self.dtype, "compression": self.compression, "zstd_level": self.zstd_level,
                               "chunk_tokens": self.chunk_tokens}
        if self.dtype == "fp4":
            out["fp4_outlier_channels"] = self.fp4_outlier_channels
        return out

    def bytes_per_token(self, num_layers: int, hidden_size: int, top_k: int) -> int:
        """Uncompressed bytes one token costs in a store of these settings."""
        return bytes_per_token(self.dtype, num_layers, hidden_size, top_k, self.fp4_outlier_channels)

    def describe(self) -> str:
        """'fp8+zstd', 'fp4 (e2m1/16 + e4m3 scales + 8 exact channels)+zstd'."""
        codec = f"fp4 (e2m1/16 + e4m3 scales + {self.fp4_outlier_channels} exact channels)" if self.dtype == "fp4" else self.dtype
        return f"{codec}+{self.compression}"

    def reader_options(self) -> dict[str, Any]:
        """StoreReader's keyword arguments from this section."""
        folder = os.path.expandvars(self.local_cache_dir) if self.local_cache_dir else None
        return {"cache_mb": self.read_cache_mb, "local_cache_dir": folder, "local_cache_gb": self.local_cache_gb}

    def url(self, run_dir: str | os.PathLike) -> str:
        """store.path, or <run_dir>/store."""
        return self.path or str(Path(run_dir) / "store")


def bytes_per_token(dtype: str, num_layers: int, hidden_size: int, top_k: int, outlier_channels: int = 8) -> int:
    """Uncompressed bytes one token costs in the store (`outlier_channels`: fp4's, per layer)."""
    if dtype == "fp4":
        hidden = fp4.bytes_per_token(num_layers, hidden_size, outlier_channels)
    else:
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

    def present(self, rel: str, names: list[str]) -> set[str]:
        """Which of `names` are in folder `rel`: one listing, then each one it lacks looked up by name
        (NFS serves a node a cached listing of a folder other nodes wrote into for up to a minute)."""
        listed = set(self.list(rel))
        return listed | {n for n in names if n not in listed and self.exists(f"{rel}/{n}")}

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


def supervised_pairs(loss_mask_T: np.ndarray) -> int:
    """Positions t with loss_mask[t] and loss_mask[t + 1]: where stage 2 may anchor a block (its
    anchor and first drafted token supervised). Recorded per sample in the part records, so the
    trainer counts a sample's blocks without reading its features."""
    mask = np.asarray(loss_mask_T, dtype=bool)
    return int(np.count_nonzero(mask[:-1] & mask[1:]))


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
    url: str, name: str, samples: list[SampleFeatures] | list[EncodedSample], cfg: StoreConfig,
    outlier_channels: np.ndarray | None = None,
) -> dict[str, Any]:
    """Write one whole shard group and return its record (tokens, bytes, checksum). fp4 samples not
    yet encoded need the store's `outlier_channels`."""
    import zarr
    from zarr.codecs import Crc32cCodec, ZstdCodec

    if not samples:
        raise ValueError(f"shard {name}: no samples to write")
    encoded = [s if isinstance(s, EncodedSample) else encode_sample(s, cfg.dtype, outlier_channels) for s in samples]
    arrays: dict[str, np.ndarray] = {
        "hidden": np.concatenate([s.hidden_bits for s in encoded]),
        "topk_logprobs": np.concatenate([s.topk_logprobs for s in encoded]),
        "topk_ids": np.concatenate([s.topk_ids for s in encoded]),
        "input_ids": np.concatenate([s.input_ids for s in encoded]),
        "loss_mask": np.concatenate([s.loss_mask for s in encoded]),
        "offsets": np.concatenate([[0], np.cumsum([len(s.input_ids) for s in encoded])]).astype(np.int64),
        "sample_ids": np.asarray([s.sample_id for s in encoded], dtype=np.int64),
    }
    if cfg.dtype in ("fp8", "fp4"):
        arrays["hidden_scale"] = np.concatenate([s.hidden_scale for s in encoded])
    if cfg.dtype == "fp4":
        for key in FP4_ARRAYS:
            arrays[key] = np.concatenate([s.fp4_parts[key] for s in encoded])
        channels = encoded[0].fp4_parts["hidden_outlier_channels"]
        if any(not np.array_equal(s.fp4_parts["hidden_outlier_channels"], channels) for s in encoded):
            raise ValueError(f"shard {name}: samples encoded with different outlier channels")
        arrays["hidden_outlier_channels"] = channels
    num_tokens = int(arrays["offsets"][-1])
    # crc32c last: every chunk's stored bytes checked when read (shared/chunks.py), so a flipped bit
    # is an error, not features trained on; 4 bytes a chunk.
    compressors = [*([ZstdCodec(level=cfg.zstd_level)] if cfg.compression == "zstd" else []), Crc32cCodec()]
    group = zarr.open_group(store=_zarr_store(url, read_only=False), path=f"shards/{name}", mode="w", zarr_format=3)
    checksum = content_checksum(arrays)
    # The shard's own checksum travels with it: a shard group copied in from another store (same
    # samples and lengths, another target's features) is told apart from the manifest's at open.
    group.attrs.update({"schema_version": SCHEMA_VERSION, "hidden_dtype": cfg.dtype, "num_tokens": num_tokens, "checksum": checksum})
    for key, data in arrays.items():
        token_major = key not in NOT_TOKEN_MAJOR
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
        "checksum": checksum,
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
        if files.exists("plan.json"):
            hint = (
                "extraction has not finished: `python -m stage1_extract status` says what is left, "
                "`python -m stage1_extract extract` resumes it"
            )
        else:
            hint = (
                "no store was extracted here: build it with `python -m stage1_extract generate`, then "
                "`python -m stage1_extract extract` (`make extract` runs both; with data.regenerate=false, extract alone)"
            )
        raise StoreError(f"{url}: no manifest.json; {hint}")
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


