"""Reading conversations: JSONL or Parquet of chat `messages`, or prompt/completion pairs.

Every row becomes a `Conversation` (row index in its file, list of {role, content}). A malformed
row, an unknown role or an empty conversation raises a ValueError naming the file and row, or is
skipped and counted with `data.on_bad_row=skip`. Rows are never silently dropped.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from shared.config import Section
from shared.errors import DataError, InputFileError
from shared.files import atomic_path

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")


class DataConfig(Section):
    section: ClassVar[str] = "data"
    path: str | None = None
    """Conversations to regenerate and extract. None = the embedded default prompt set, built under run_dir. A .jsonl/.parquet file or a folder of .parquet parts."""
    regenerate: bool = True
    """True: extract the target's regenerated answers (run `generate` first), as the recipe does. False: extract data.path as it is (its answers must already come from the target)."""
    max_samples: int | None = None
    """Use only the first N usable rows (a quick run); null = all."""
    on_bad_row: Literal["raise", "skip"] = "raise"
    """A malformed row (bad JSON or UTF-8, unknown role, nothing to supervise): stop naming it, or skip and count it."""
    max_length: int = 3072
    """Tokens per sample, after the chat template; longer samples are truncated or skipped (counted)."""
    on_long: Literal["truncate", "skip"] = "truncate"
    """A row longer than max_length: cut it, or leave it out (both counted in the manifest)."""
    num_default_prompts: int = 384
    """Size of the embedded default prompt set."""
    default_question_share: float = 0.25
    """Share of the default prompts that are short questions (the rest ask about a documentation
    excerpt, whose prefill costs generation time but is not supervised)."""
    tokenize_workers: int = 0
    """Processes that template and tokenize the rows on the first command (0 = min(16, CPUs)); the result is cached under run_dir/cache/ for every later command and rank."""
    token_cache: bool = True
    """Cache the tokenized rows (memory-mapped by later commands and ranks); false = tokenize every time."""
    cache_dir: str | None = None
    """Where the token cache lives; null = <run_dir>/cache. $VARS are expanded, so a node-local folder
    (`/local/$HOSTNAME/cache`) works: each node's local rank 0 then builds it once for its node."""

    def validate(self) -> None:
        self.require(self.max_samples is None or self.max_samples > 0, "max_samples", "must be > 0")
        self.require(self.max_length >= 16, "max_length", "must be >= 16")
        self.require(self.num_default_prompts > 0, "num_default_prompts", "must be > 0")
        self.require(0.0 <= self.default_question_share <= 1.0, "default_question_share", "must be in [0, 1]")
        self.require(self.tokenize_workers >= 0, "tokenize_workers", "must be >= 0 (0 = one per CPU, at most 16)")


@dataclass
class Conversation:
    row: int  # index of the row in its file (stable id of the sample)
    messages: list[dict[str, Any]]  # role, content (and, for regenerated answers, the target's token_ids)
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    cut: bool = False  # a message's text or ids were cut to RowLimits when read

    def row_hash(self) -> str:
        """Identity of the input row: re-extraction is needed exactly when this changes."""
        text = json.dumps(self.messages, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class RowLimits:
    """What one row may bring to tokenizing (`stage1_extract.prepare.row_limits`): each message's text
    is cut to `max_chars` characters and a token_ids list to `max_ids` ids, bounds that still give
    more tokens than data.max_length keeps (so truncation and data.on_long decide as on the whole
    row), while one 200 MB row costs its parse, not gigabytes of tokenizer offsets."""

    max_chars: int
    max_ids: int


@dataclass
class ReadStats:
    rows: int = 0
    bad_rows: int = 0
    bad_examples: list[str] = field(default_factory=list)


def _raw_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(row, record or the ValueError that makes the row bad) for every non-blank row. Bytes are
    decoded per line, so a line that is not UTF-8 is one bad row, named, not the end of the file."""
    if path.suffix == ".jsonl" or path.suffix == ".json":
        with path.open("rb") as fh:
            i = -1
            for raw in fh:  # not enumerate(): its cached result tuple would keep a huge row's bytes alive
                i += 1
                if i == 0 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]  # a UTF-8 byte-order mark (Windows tools write one): not part of the row
                if raw.isspace() or not raw:
                    continue
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    yield i, ValueError(f"not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1})")
                    continue
                # One copy of a huge row at a time: its bytes go before it is parsed, its text after.
                del raw
                try:
                    record: Any = json.loads(text)
                except json.JSONDecodeError as exc:
                    record = ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})")
                del text
                yield i, record
                del record
        return
    if path.suffix == ".parquet" or path.is_dir():
        files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
        if not files:
            raise InputFileError(f"{path}: folder holds no .parquet files")
        yield from _parquet_rows(files)
        return
    raise DataError(f"{path}: unsupported data file type {path.suffix!r} (use .jsonl or .parquet)")


def _parquet_rows(files: list[Path]) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 0
    for file in files:
        try:
            parquet = pq.ParquetFile(file)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"{file}: not a readable Parquet file ({exc})") from None
        columns = parquet.schema_arrow.names
        if "messages" not in columns and "prompt" not in columns:
            raise DataError(
                f"{file}: needs a `messages` column or `prompt` (+ `completion`) columns; it has {columns}"
            )
        for batch in parquet.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                yield row, record
                row += 1


def parse_row(record: Any) -> list[dict[str, str]]:
    """One raw row -> validated messages. Raises ValueError saying what is wrong."""
    return parse_bounded_row(record, None)[0]


def parse_bounded_row(record: Any, limits: RowLimits | None) -> tuple[list[dict[str, Any]], bool]:
    """One raw row -> (validated messages, whether `limits` cut any of them). Text and ids are cut
    before anything else reads them. Raises ValueError saying what is wrong."""
    cut = False
    if isinstance(record, Exception):
        raise record
    if not isinstance(record, dict):
        raise ValueError(f"row must be an object, got {type(record).__name__}")
    if record.get("messages") is not None:
        messages = record["messages"]
        if not isinstance(messages, list):
            raise ValueError("'messages' must be a list")
        out = []
        for j, msg in enumerate(messages):
            if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
                raise ValueError(f"messages[{j}] must have 'role' and 'content'")
            role, content = msg["role"], msg["content"]
            if role not in ROLES:
                raise ValueError(f"messages[{j}] has unknown role {role!r} (known: {', '.join(ROLES)})")
            if not isinstance(content, str):
                raise ValueError(f"messages[{j}].content must be a string")
            if limits is not None and len(content) > limits.max_chars:
                content, cut = content[: limits.max_chars], True
            message = {"role": role, "content": content}
            ids = msg.get("token_ids")
            if ids is not None:  # the target's own tokens of a regenerated answer (`generate` writes them)
                if limits is not None and isinstance(ids, list) and len(ids) > limits.max_ids:
                    ids, cut = ids[: limits.max_ids], True
                if role != "assistant" or not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
                    raise ValueError(f"messages[{j}].token_ids must be a list of token ids on an assistant turn")
                message["token_ids"] = ids
            out.append(message)
    elif "prompt" in record:
        prompt, completion = record["prompt"], record.get("completion")
        if not isinstance(prompt, str) or (completion is not None and not isinstance(completion, str)):
            raise ValueError("'prompt' and 'completion' must be strings")
        texts = [prompt] + ([completion] if completion is not None else [])
        if limits is not None and any(len(t) > limits.max_chars for t in texts):
            texts, cut = [t[: limits.max_chars] for t in texts], True
        out = [{"role": role, "content": t} for role, t in zip(("user", "assistant"), texts)]
    else:
        raise ValueError("row has neither 'messages' nor 'prompt'")
    if not any(m["role"] == "user" and m["content"].strip() for m in out):
        raise ValueError("empty conversation (no non-empty user turn)")
    return out, cut


def read_conversations(
    path: str | Path,
    *,
    on_bad_row: str = "raise",
    max_samples: int | None = None,
    stats: ReadStats | None = None,
    limits: RowLimits | None = None,
) -> Iterator[Conversation]:
    path = Path(path)
    if not path.exists():
        raise InputFileError(f"data file not found: {path}")
    stats = stats if stats is not None else ReadStats()
    kept = 0
    for row, record in _raw_rows(path):
        if max_samples is not None and kept >= max_samples:
            return
        stats.rows += 1
        try:
            messages, cut = parse_bounded_row(record, limits)
        except ValueError as exc:
            message = f"{path}: row {row}: {exc}"
            if on_bad_row == "raise":
                raise DataError(message + " (set data.on_bad_row=skip to skip and count bad rows)") from None
            stats.bad_rows += 1
            if len(stats.bad_examples) < 5:
                stats.bad_examples.append(message)
            log.warning("skipping %s", message)
            continue
        finally:
            del record  # a huge row's text is gone once it is cut, not when the next row comes
        kept += 1
        yield Conversation(row=row, messages=messages, source=str(path), cut=cut)


def write_conversations_parquet(conversations: list[Conversation], path: Path) -> None:
    """Atomic Parquet write of `messages` rows (plus `source_row` so edits can be traced)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("token_ids", pa.list_(pa.int32()))])
    rows = [
        {"messages": [{**m, "token_ids": m.get("token_ids")} for m in c.messages], "source_row": c.row}
        for c in conversations
    ]
    table = pa.Table.from_pylist(rows, schema=pa.schema([("messages", pa.list_(message)), ("source_row", pa.int64())]))
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
