"""Planning the extraction: tokenized rows, shards of consecutive rows, windows dealt to ranks, and
forward batches by token budget.

Samples are planned into shards of `samples_per_shard` consecutive rows (pinned in plan.json).
Forward batches are built by token budget over length-sorted samples inside a window of shards,
so padding is small and nothing padded is stored. The batches of a window depend only on the data
and the config, never on the number of processes or on what an earlier run finished.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from shared.store import shard_name


@dataclass
class TokenizedRow:
    sample_id: int
    row_hash: str  # of the input row as read: an edited row changes its shard's identity
    input_ids: np.ndarray
    loss_mask: np.ndarray
    truncated: bool = False
    skipped: bool = False
    content_hash: str = ""  # of the tokens and loss mask: identical samples share it (duplicates)
    empty_turns: int = 0  # assistant turns whose text is empty (only their end-of-turn tokens are supervised)
    prompt_hash: str = ""  # a regenerated row's prompt (generated.parquet's `prompt_hash`): its split key; "" = none
    source_row: int = -1  # a regenerated row's 0-based row in the user's data (`source_row`); -1 = none
    opening_hash: str = ""  # the row's turns through its first user turn (`Conversation.opening_hash`): its split key


def content_hash(input_ids: np.ndarray, loss_mask: np.ndarray) -> str:
    digest = hashlib.blake2b(np.asarray(input_ids, dtype=np.int32).tobytes(), digest_size=8)
    digest.update(np.asarray(loss_mask, dtype=bool).tobytes())
    return digest.hexdigest()


@dataclass
class ShardPlan:
    index: int
    rows: list[TokenizedRow]
    tag: str
    key: str  # header key of the settings that produce it

    @property
    def name(self) -> str:
        return shard_name(self.index, self.tag)

    @property
    def rows_sha256(self) -> str:
        return hashlib.sha256("".join(r.row_hash for r in self.rows).encode()).hexdigest()

    @property
    def kept(self) -> list[TokenizedRow]:
        return [r for r in self.rows if not r.skipped]


def choose_samples_per_shard(rows: list[TokenizedRow], shard_mb: int, token_bytes: int) -> int:
    mean_tokens = max(1.0, float(np.mean([len(r.input_ids) for r in rows]))) if rows else 1.0
    return max(1, int(shard_mb * 2**20 / token_bytes / mean_tokens))


def plan_shards(rows: list[TokenizedRow], samples_per_shard: int, key: str) -> list[ShardPlan]:
    shards = []
    for index, start in enumerate(range(0, len(rows), samples_per_shard)):
        chunk = rows[start : start + samples_per_shard]
        tag = hashlib.sha256((key + "".join(r.row_hash for r in chunk)).encode()).hexdigest()[:10]
        shards.append(ShardPlan(index=index, rows=chunk, tag=tag, key=key))
    return shards


def windows_for_rank(shards: list[ShardPlan], window_shards: int, rank: int, world: int) -> list[list[ShardPlan]]:
    """Consecutive shards, `window_shards` at a time, dealt to ranks whole.

    The batches of a window depend only on the data and the config, never on the number of
    processes or on what an earlier run finished, so every sample goes through the target in the
    same batch (same padding, same kernels) and a resumed or multi-process store is bit-identical
    to a single uninterrupted run.
    """
    windows = [shards[i : i + window_shards] for i in range(0, len(shards), window_shards)]
    return [w for number, w in enumerate(windows) if number % world == rank]


def token_budget_batches(rows: list[TokenizedRow], budget: int, max_samples: int) -> Iterator[list[TokenizedRow]]:
    """Length-sorted rows cut into batches whose padded size (rows x longest) fits the budget."""
    batch: list[TokenizedRow] = []
    for row in sorted(rows, key=lambda r: len(r.input_ids)):
        longest = max([len(row.input_ids)] + [len(r.input_ids) for r in batch])
        if batch and (longest * (len(batch) + 1) > budget or len(batch) >= max_samples):
            yield batch
            batch = []
        batch.append(row)
    if batch:
        yield batch
