"""The token cache: every input row templated and tokenized once, kept for every later command and
rank (`stage1_extract/tokens.py` builds it), and read by stage 2 to check a store against its data
without tokenizing anything (`shared/freshness.py`).

    <cache>/tokens-<key>/
        ids.npy    int32 [total tokens]   every row's input ids, concatenated
        mask.npy   bool  [total tokens]   the loss mask
        rows.npz   offsets [R+1], sample_ids [R], row_hashes [R] (S32), truncated [R], skipped [R],
                   content_hashes [R] (S16), empty_turns [R], prompt_hashes [R] (S32), source_rows [R],
                   opening_hashes [R] (S32)
        meta.json  the key's inputs, the read statistics, and every file's size and sha256

The key hashes the input's bytes, the tokenizer (vocabulary and chat template), the data settings
that decide a row's tokens (`ROW_SETTINGS`) and this format's version, so any change tokenizes
again. Later commands and the other ranks memory-map the arrays: one copy in the page cache serves
all of them. The cache is written to a temporary folder and renamed, so a killed run leaves none.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from shared.conversation_files import glob_files
from shared.files import file_sha256, fsync_dir, fsync_file

TOKENS_VERSION = 13  # 3: per-file sha256 in meta.json, empty_turns; 4: ShareGPT, tool calls, data.format;
# 5: turns before the first user turn dropped; 6: a cut answer's end-of-turn marker unsupervised, answers_cut counted;
# 7: a row's `system` in every format, reasoning_content, weight 0; 8: a regenerated row's prompt_hash and source_row;
# 9: a turn's `name` kept on every role and passed to the template, a ShareGPT turn with differing value/content refused;
# 10: a regenerated answer's ids right after its prompt (no template text before them), turns a template renders
# otherwise once a user turn follows kept as context (context_turns, ids_fallbacks counted); 11: each row's opening
# hash (its turns through the first user turn), the held-out split key; 12: a text row tokenized apart at a turn's edge
# a token crossed (an answer opening with whitespace the template's own merged into); 13: a turn without reasoning whose
# render as the last turn only adds an opening (Qwen3's empty think block before a tool call) supervised where the
# whole render has it (was refused, or context before a later user turn), a regenerated answer's own stop token (`stop_id`)
# in place of the template's end marker, answers_cut counted over the rows stored
# The first version whose rows tokenize as this one's do: later ones changed only what the cache holds
# beside the tokens (11: opening hashes), so a store's manifest at it still holds today's tokens.
SAME_TOKENS_SINCE = 13


# The data.* settings a row's tokens depend on: stage 1 keys its cache with them, and stage 2
# (shared/freshness.py) finds that cache with the same values.
ROW_SETTINGS = ("max_length", "on_long", "on_bad_row", "max_samples", "format", "chat_template_kwargs")
# Those the store's header key does not already hold: the manifest records them beside the data's
# sha256, so a store checked without a token cache is still checked against every row setting.
SELECTION_SETTINGS = ("on_bad_row", "max_samples", "format")


def source_fingerprint(path: Path) -> str:
    """sha256 of the input's bytes (a file, every file of a folder in name order, or a glob's files)."""
    digest = hashlib.sha256()
    matched = glob_files(path)
    files = matched or (sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path])
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        with file.open("rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def token_cache_key(source: Path, tokenizer_hashes: dict[str, str], settings: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    inputs = {
        "version": TOKENS_VERSION,
        "source": str(source),
        "source_sha256": source_fingerprint(source),
        "tokenizer": tokenizer_hashes,
        **settings,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24], inputs


class DamagedCache(Exception):
    """A token cache file that does not match the checksum written with it (or cannot be read)."""


CACHE_FILES = ("ids.npy", "mask.npy", "rows.npz")


class TokenCache:
    """The cached rows of one input under one tokenizer and settings; see the module docstring.

    Every file's size and sha256 are written into meta.json with it and checked whenever a command
    opens the cache: a flipped byte or a truncated file on a node's disk must never become a token
    the data never held. A cache that fails is a cache: the command warns naming the file, tokenizes
    again and rewrites it (`stage1_extract.prepare.tokenized_rows`). Hashing reads the files once at
    ~1-2 GB/s (`bench/tokens.py`): at 800K chats of 1.5K tokens (~6 GB) a few seconds, against
    ~80 core-minutes of tokenizing."""

    def __init__(self, root: Path, key: str, inputs: dict[str, Any]):
        self.root, self.key, self.inputs = root, key, inputs
        self.path = root / f"tokens-{key}"

    def exists(self) -> bool:
        return (self.path / "meta.json").is_file()

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def verify(self) -> dict[str, Any]:
        """meta.json, after every file was checked against the size and sha256 it records."""
        try:
            meta = json.loads((self.path / "meta.json").read_text())
            files = meta["files"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DamagedCache(f"token cache {self.path / 'meta.json'} is unreadable ({exc})") from None
        for name in CACHE_FILES:
            path = self.path / name
            try:
                size = path.stat().st_size
            except OSError:
                raise DamagedCache(f"token cache file {path} is missing") from None
            if name not in files or size != files[name]["bytes"]:
                raise DamagedCache(f"token cache file {path} has {size} bytes, its checksum record {files.get(name, {}).get('bytes')}")
            if file_sha256(path) != files[name]["sha256"]:
                raise DamagedCache(f"token cache file {path} does not match its sha256 (damaged on disk)")
        return meta

    def load(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Per row: sample_id, row_hash, input_ids / loss_mask (read-only memory-mapped views), flags.
        DamagedCache when a file fails its checksum or does not hold what meta.json says."""
        meta = self.verify()
        try:
            ids = np.load(self.path / "ids.npy", mmap_mode="r")
            mask = np.load(self.path / "mask.npy", mmap_mode="r")
            with np.load(self.path / "rows.npz") as rows:
                columns = {name: rows[name] for name in rows.files}
        except (OSError, ValueError) as exc:
            raise DamagedCache(f"token cache {self.path} cannot be read ({exc})") from None
        offsets, sample_ids = columns["offsets"], columns["sample_ids"]
        if len(offsets) != len(sample_ids) + 1 or offsets[-1] != len(ids) or len(mask) != len(ids):
            raise DamagedCache(f"token cache {self.path}: its files disagree on the number of tokens")
        empty = columns.get("empty_turns", np.zeros(len(sample_ids), dtype=np.int32))
        out = [
            {
                "sample_id": int(sample_ids[i]),
                "row_hash": columns["row_hashes"][i].decode(),
                "input_ids": ids[offsets[i] : offsets[i + 1]],
                "loss_mask": mask[offsets[i] : offsets[i + 1]],
                "truncated": bool(columns["truncated"][i]),
                "skipped": bool(columns["skipped"][i]),
                "content_hash": columns["content_hashes"][i].decode(),
                "empty_turns": int(empty[i]),
                "prompt_hash": columns["prompt_hashes"][i].decode(),
                "source_row": int(columns["source_rows"][i]),
                "opening_hash": columns["opening_hashes"][i].decode(),
            }
            for i in range(len(sample_ids))
        ]
        return out, dict(meta["stats"])

    def row_hashes(self) -> list[str]:
        """Every cached row's hash, in order, after the files were checked (DamagedCache otherwise)."""
        return [h for h, _ in self.row_identity()]

    def row_identity(self) -> list[tuple[str, str | None]]:
        """Every cached row's (hash, hash of its tokens and loss mask; None for a row skipped as too
        long), in order, after the files were checked (DamagedCache otherwise)."""
        self.verify()
        try:
            with np.load(self.path / "rows.npz") as rows:
                return [(h.decode(), None if skipped else c.decode())
                        for h, c, skipped in zip(rows["row_hashes"], rows["content_hashes"], rows["skipped"])]
        except (OSError, ValueError, KeyError) as exc:
            raise DamagedCache(f"token cache {self.path} cannot be read ({exc})") from None

    def save(self, rows: list[Any], stats: Any) -> None:
        """Write atomically (a folder renamed into place, each file's sha256 in meta.json); other
        keys' folders are removed."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tokens-{self.key}-", dir=self.root))
        try:
            lengths = np.array([len(r.input_ids) for r in rows], dtype=np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            np.save(tmp / "ids.npy", np.concatenate([r.input_ids for r in rows]).astype(np.int32))
            np.save(tmp / "mask.npy", np.concatenate([r.loss_mask for r in rows]).astype(bool))
            np.savez(
                tmp / "rows.npz",
                offsets=offsets,
                sample_ids=np.array([r.sample_id for r in rows], dtype=np.int64),
                row_hashes=np.array([r.row_hash.encode() for r in rows], dtype="S32"),
                truncated=np.array([r.truncated for r in rows], dtype=bool),
                skipped=np.array([r.skipped for r in rows], dtype=bool),
                content_hashes=np.array([r.content_hash.encode() for r in rows], dtype="S16"),
                empty_turns=np.array([r.empty_turns for r in rows], dtype=np.int32),
                prompt_hashes=np.array([r.prompt_hash.encode() for r in rows], dtype="S32"),
                source_rows=np.array([r.source_row for r in rows], dtype=np.int64),
                opening_hashes=np.array([r.opening_hash.encode() for r in rows], dtype="S32"),
            )
            files = {n: {"bytes": (tmp / n).stat().st_size, "sha256": file_sha256(tmp / n)} for n in CACHE_FILES}
            meta = {"inputs": self.inputs, "stats": vars(stats), "files": files}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            for name in (*CACHE_FILES, "meta.json"):
                fsync_file(tmp / name)
            if self.path.exists():  # another process (or rank) finished first: same key, same content
                shutil.rmtree(tmp)
            else:
                os.replace(tmp, self.path)
                fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for other in self.root.glob("tokens-*"):
            if other != self.path:
                shutil.rmtree(other, ignore_errors=True)
