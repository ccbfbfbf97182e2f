"""Reading a store: samples by index over the shards its manifest lists (`StoreReader`), for
stage 2's loader and evaluation, and for verify.

    reader = StoreReader(url, cache_mb=1024)        # refuses a missing or damaged manifest, another schema
    sample = reader[412]                             # input_ids_T, loss_mask_T, hidden_TLH (bf16), topk_*
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from shared.codecs import FP4_ARRAYS, decode_hidden, hidden_array_names
from shared.errors import StoreError
from shared.shard_records import duplicate_hashes, split_hashes
from shared.store import ARRAY_NAMES, StoreFiles, _zarr_store, read_manifest

log = logging.getLogger(__name__)


# An opening shared by more than GENERIC_OPENING_MIN rows is generic (one fixed instruction before every
# row): kept together it would put the whole group on one side of the split (no held-out sample, or no
# training one), so its rows are keyed on their prompt or tokens. The count is the group's own, so rows
# added to a store never move another group's rows. A store made before identity version 7
# (`shared/identity.py` FIXED_GENERIC_VERSION) keeps the rule it was trained with: generic past
# GENERIC_OPENING_SHARE of the store too, a threshold that grows with the store.
GENERIC_OPENING_MIN = 16
GENERIC_OPENING_SHARE = 0.05
FIXED_GENERIC_VERSION = 7


def generic_threshold(num_samples: int, identity_version: int | None) -> float:
    """How many rows may share an opening before it is generic, under the rule of a store made at
    `identity_version` (None: a store older than versions)."""
    if (identity_version or 0) >= FIXED_GENERIC_VERSION:
        return GENERIC_OPENING_MIN
    return max(GENERIC_OPENING_MIN, GENERIC_OPENING_SHARE * num_samples)


def content_keys(shards: list[dict[str, Any]], sample_ids: np.ndarray, identity_version: int | None) -> np.ndarray:
    """int64 per sample: the hash `split_hashes` chooses (a row's opening; in older stores a regenerated
    row's prompt, else the sample's tokens and loss mask), so rows that open alike share a key and the
    held-out split keeps them on one side; else the sample ids (stores written before any hash). Rows
    of a generic opening (`generic_threshold` of the store's `identity_version`, its manifest's) are
    keyed on their prompt or tokens instead."""
    chosen = split_hashes(shards)
    if chosen is None:
        return sample_ids
    keys = np.asarray([int(h[:15], 16) for h in chosen[1]], dtype=np.int64)
    finer = duplicate_hashes(shards)
    if chosen[0] == "opening_hashes" and finer is not None and len(keys):
        _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
        generic = counts[inverse] > generic_threshold(len(keys), identity_version)
        if generic.any():
            keys[generic] = np.asarray([int(h[:15], 16) for h in finer[1]], dtype=np.int64)[generic]
    return keys


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
        self.split_keys = content_keys(shards, self.sample_ids, self.manifest.get("identity_version"))
        self._supervised_pairs: np.ndarray | None = None
        files = StoreFiles(url)
        self._check_listing(files)
        local_cache = None
        if not files.is_local and local_cache_dir is not None and local_cache_gb > 0:
            local_cache = LocalChunkCache(local_cache_dir, int(local_cache_gb * 2**30))
        self._source = ChunkSource(files.fs, files.root, files.is_local, local_cache)
        self._chunks = DecodedChunks(cache_mb * 2**20)
        self._open: OrderedDict[int, tuple[dict[str, Any], np.ndarray, np.ndarray | None]] = OrderedDict()
        self._cache_shards = cache_shards
        self._lock = threading.Lock()
        self._zarr_store = None
        self._feature_shape: tuple[int, int] | None = None
        self._claim: Any = None
        self.claim = "none"  # what `hold` could claim: "flock", or "none (why)"

    def __len__(self) -> int:
        return int(self._shard_start[-1])

    def hold(self, command: str) -> StoreReader:
        """Claim a local store for as long as this reader reads it (until `close`): stage-1 writers
        are refused naming this process, and this is refused while one writes. Where no claim can
        be made (an object store, a read-only folder) a failed read still says whether the store
        was rewritten meanwhile (`_damaged`)."""
        from shared.lock import FlockUnsupported, ReaderClaim

        if "://" in self.url and not self.url.startswith("file://"):
            self.claim = "none (object store)"
            return self
        claim = ReaderClaim(self.url)
        try:
            claim.acquire(command)
        except FlockUnsupported as exc:
            self.claim = "none (no flock here)"
            log.warning(
                "%s; no reader claim: writers are not refused while `%s` reads (keep them off this store), and a "
                "rewrite under it is named if a read fails", exc.strerror, command,
            )
            return self
        except OSError as exc:
            self.claim = f"none ({exc.strerror or exc})"
            log.info("%s: no reader claim (%s); a concurrent rewrite is still named if a read fails", self.url, exc)
            return self
        self._claim, self.claim = claim, "flock"
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
            f"rewritten (stage 1's reprocess, extract or verify --repair) while being read. The store is "
            f"not damaged; rerun once the writer has finished (keep writers off a store while training reads it)"
        )

    def _check_listing(self, files: StoreFiles) -> None:
        """Cheap open-time check (one listing): every shard the manifest lists is there."""
        present = files.present("shards", [s["name"] for s in self._shards if s["name"]])
        missing = [s["name"] for s in self._shards if s["name"] and s["name"] not in present]
        if missing:
            raise self._damaged(
                missing[0], f"is missing ({len(missing)} shard(s) listed in manifest.json are)",
                "run `python -m stage1_extract verify --repair` or `python -m stage1_extract reprocess`",
            )

    def _shard(self, shard: int) -> tuple[dict[str, Any], np.ndarray, np.ndarray | None]:
        """The shard's arrays (metadata and chunk indexes read once), its offsets and (fp4) its
        outlier channels."""
        with self._lock:
            if shard in self._open:
                self._open.move_to_end(shard)
                return self._open[shard]
        name = self._shards[shard]["name"]
        try:
            arrays = self._open_arrays(name, self._shards[shard].get("checksum") or "")
            offsets = self._read(arrays["offsets"], 0, self._shards[shard]["num_samples"] + 1, (shard, "offsets"))
            channels = None
            if self.hidden_dtype == "fp4":
                num_layers = arrays["hidden"].shape[1]
                channels = self._read(arrays["hidden_outlier_channels"], 0, num_layers, (shard, "hidden_outlier_channels"))
        except (StoreError, ImportError):  # a missing package is not a damaged shard: never send to --repair
            raise
        except Exception as exc:  # noqa: BLE001 - any failure here means a damaged (or replaced) shard
            raise self._damaged(
                name, f"cannot be opened ({type(exc).__name__}: {exc})", "run `python -m stage1_extract verify --repair`"
            ) from exc
        info = self._shards[shard]
        own = self._own_checksum(name)
        if own is not None and info.get("checksum") is not None and own != info["checksum"]:
            raise self._damaged(
                name, f"is another shard than the manifest lists (its content checksum {own[:12]}, the manifest's "
                f"{info['checksum'][:12]}: copied in from another store?)", "run `python -m stage1_extract verify --repair`",
            )
        if len(offsets) != info["num_samples"] + 1 or int(offsets[-1]) != info["num_tokens"]:
            raise self._damaged(
                name, f"holds {len(offsets) - 1} samples / {int(offsets[-1])} tokens, the manifest says "
                f"{info['num_samples']} / {info['num_tokens']}", "run `python -m stage1_extract reprocess`",
            )
        with self._lock:
            self._open[shard] = (arrays, offsets, channels)
            while len(self._open) > self._cache_shards:
                self._open.popitem(last=False)
        return arrays, offsets, channels

    def _own_checksum(self, name: str) -> str | None:
        """The checksum a shard group records of itself (None for shards written before it did)."""
        try:
            return json.loads(self._source.text(f"shards/{name}/zarr.json")).get("attributes", {}).get("checksum")
        except (OSError, ValueError):
            return None  # its arrays' own checks name what is wrong

    def _open_arrays(self, name: str, version: str) -> dict[str, Any]:
        """The shard's arrays; `version`, its content checksum, keys their chunks in the local cache."""
        from shared.chunks import open_shard_array

        present = set(StoreFiles(self.url).list(f"shards/{name}")) if not self._source.is_local else {
            p.name for p in Path(self._source.root, "shards", name).iterdir()
        }
        wanted = [a for a in ARRAY_NAMES if a in present]
        missing = [a for a in (*self.REQUIRED, *hidden_array_names(self.hidden_dtype)) if a not in present]
        if missing:
            raise self._damaged(
                name, f"lacks the array(s) {missing}", "run `python -m stage1_extract verify --repair` to extract it again"
            )
        arrays: dict[str, Any] = {}
        for array in wanted:
            fast = open_shard_array(self._source, f"shards/{name}/{array}", version)
            arrays[array] = fast if fast is not None else self._zarr_array(name, array)
        # A shard of another codec (an fp4 shard listed as fp8) has another width: refuse it by name.
        hidden_size = self.manifest["target"].get("hidden_size")
        width = arrays["hidden"].shape[2] * (2 if self.hidden_dtype == "fp4" else 1)
        if hidden_size is not None and width != hidden_size:
            raise StoreError(
                f"{self.url}: shard {name} holds hidden states {width} wide as {self.hidden_dtype}, the manifest says "
                f"{hidden_size}: it was written with another store.dtype; run `python -m stage1_extract verify --repair`"
            )
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

    def supervised_pairs(self) -> np.ndarray:
        """Every sample's `supervised_pairs` (int64), in reader order: from the manifest, or, for a
        store extracted before the part records carried them, counted from each shard's loss mask
        (one byte per token read once; no features)."""
        if self._supervised_pairs is None:
            if all("supervised_pairs" in s for s in self._shards):
                counts = [np.asarray(s["supervised_pairs"], dtype=np.int64) for s in self._shards]
            else:
                counts = [self._count_pairs(shard) for shard in range(len(self._shards))]
            self._supervised_pairs = np.concatenate(counts) if counts else np.zeros(0, np.int64)
        return self._supervised_pairs

    def _count_pairs(self, shard: int) -> np.ndarray:
        info = self._shards[shard]
        if not info["num_samples"]:
            return np.zeros(0, np.int64)
        arrays, offsets, _ = self._shard(shard)
        try:
            mask = np.asarray(self._read(arrays["loss_mask"], 0, info["num_tokens"], (shard, "loss_mask")), dtype=bool)
        except ImportError:
            raise
        except Exception as exc:  # noqa: BLE001 - name the shard and the fix
            raise self._damaged(
                info["name"], f"cannot be read: loss_mask ({type(exc).__name__}: {exc})",
                "run `python -m stage1_extract verify --repair`",
            ) from exc
        pairs = mask[:-1] & mask[1:]
        cum = np.concatenate([[0], np.cumsum(pairs, dtype=np.int64)])
        # Pairs inside each sample: those that start before its last token (none cross a boundary).
        starts, ends = offsets[:-1].astype(np.int64), offsets[1:].astype(np.int64)
        return cum[np.maximum(ends - 1, starts)] - cum[starts]

    @property
    def feature_shape(self) -> tuple[int, int] | None:
        """(layers, hidden) of the stored features; None for an empty store."""
        if self._feature_shape is None and len(self):
            arrays, _, _ = self._shard(0)
            layers, width = (int(d) for d in arrays["hidden"].shape[1:])
            self._feature_shape = (layers, width * 2 if self.hidden_dtype == "fp4" else width)
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
        arrays, offsets, channels = self._shard(shard)
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
            except (StoreError, ImportError):  # a checksum's own message names the file and the fix
                raise
            except Exception as exc:  # noqa: BLE001 - name the shard and the fix
                raise self._damaged(
                    self._shards[shard]["name"],
                    f"cannot be read: {name} of {self.describe(index)} ({type(exc).__name__}: {exc})",
                    "run `python -m stage1_extract verify --repair`",
                ) from exc

        scale = get("hidden_scale") if self.hidden_dtype != "bf16" else None
        parts = {key: get(key) for key in FP4_ARRAYS} if self.hidden_dtype == "fp4" else {}
        if channels is not None:
            parts["hidden_outlier_channels"] = channels
        if hidden_out is None:
            hidden_TLH = decode_hidden(get("hidden"), scale, self.hidden_dtype, **parts)
        elif self.hidden_dtype == "bf16":
            get("hidden", hidden_out.view(torch.int16).numpy().view(np.uint16))
            hidden_TLH = hidden_out
        else:
            hidden_TLH = hidden_out.copy_(decode_hidden(get("hidden"), scale, self.hidden_dtype, **parts))
        return {
            "sample_id": int(self.sample_ids[index]),
            "input_ids_T": torch.from_numpy(get("input_ids").astype(np.int64)),
            "loss_mask_T": torch.from_numpy(get("loss_mask")),
            "hidden_TLH": hidden_TLH,
            "topk_logprobs_TK": torch.from_numpy(get("topk_logprobs").astype(np.float32)),
            "topk_ids_TK": torch.from_numpy(get("topk_ids").astype(np.int64)),
        }
