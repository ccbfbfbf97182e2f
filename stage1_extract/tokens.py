"""Tokenize every input row once, in parallel, for the token cache (`shared/token_cache.py`).

Templating and tokenizing run at ~250K tokens/s on one core: 800K chats of 1.5K tokens take
~80 minutes, and `extract`, `status` and `reprocess` each need every row's tokens (shard plan,
lengths, staleness), on every rank. So the first command tokenizes with a pool of processes
(`data.tokenize_workers`) and caches the rows under `<run_dir>/cache/tokens-<key>/`; later commands
and the other ranks memory-map them.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Iterable
from typing import Any

from shared.conversations import Conversation
from stage1_extract.template import tokenize_conversation

log = logging.getLogger(__name__)

_PARALLEL_MIN_ROWS = 512  # below this a process pool costs more than it saves
_WORKER: dict[str, Any] = {}  # the forked workers' tokenizer and settings


def _tokenize_one(item: tuple[int, list[dict[str, Any]], str | None]) -> tuple[int, Any]:
    row, messages, tools = item
    try:
        return row, tokenize_conversation(_WORKER["tokenizer"], messages, _WORKER["max_length"], tools, _WORKER["template_kwargs"])
    except ValueError as exc:
        return row, str(exc)


def _worker_init() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def tokenize_all(
    tokenizer: Any, conversations: list[Conversation], max_length: int, workers: int,
    template_kwargs: dict[str, Any] | None = None,
) -> Iterable[tuple[int, Any]]:
    """(row, TokenizedSample or an error message) per conversation, in order; `template_kwargs`: the
    chat template's variables (`data.chat_template_kwargs`)."""
    items = [(c.row, c.messages, c.tools) for c in conversations]
    _WORKER.update(tokenizer=tokenizer, max_length=max_length, template_kwargs=template_kwargs)
    if workers <= 1 or len(items) < _PARALLEL_MIN_ROWS or "fork" not in multiprocessing.get_all_start_methods():
        yield from map(_tokenize_one, items)
        return
    # fork: the workers inherit the tokenizer instead of each loading it. Their Rust thread pools
    # stay off (the processes are the parallelism), which also silences the fork warning; set in
    # the workers, so this process's environment is left as it was.
    # Results come back a block at a time (`map`, not `imap`) and the pool ends with close + join, never
    # terminate: when the caller stops early (a bad row raises there) no task is in flight, while
    # Pool.terminate with tasks still queued hung in joining its task handler (seen in the test suite:
    # the command never ended, instead of naming the row).
    chunk = max(1, min(256, len(items) // (workers * 8)))
    block = chunk * workers * 16
    pool = multiprocessing.get_context("fork").Pool(workers, initializer=_worker_init)
    try:
        for start in range(0, len(items), block):
            yield from pool.map(_tokenize_one, items[start : start + block], chunksize=chunk)
    finally:
        pool.close()
        pool.join()


def resolve_workers(requested: int) -> int:
    return requested if requested > 0 else max(1, min(16, os.cpu_count() or 1))
