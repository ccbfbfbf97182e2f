"""Reading conversation files, numbered the way both stages number samples (a sample's id is its row).

    for conv in read_conversations(path, data_format="auto", on_bad_row="raise", stats=stats, limits=limits): ...
    rows = read_rows(path, wanted={0, 7}, data_format="auto")      # the export doctor: a few rows by number

What `path` may be, and how its rows are numbered:
- a `.jsonl` file (or `.json` whose first character is not `[`): row = line index, blank lines counted;
  each line is decoded on its own, so a line that is not UTF-8 or not JSON is one bad row, named
  (a file that is one JSON object over many lines, `{"train": [rows]}`, is refused naming its rows' key);
- a `.json` file holding one JSON array: row = element index. The array is parsed element by element
  (one element's text in memory at a time), and an element that is not JSON (or not UTF-8) ends the
  read, named: the elements after it cannot be found;
- a `.parquet` or `.arrow` file (Arrow IPC stream, what `datasets` writes, or file);
- a folder saved by `datasets` (`Dataset.save_to_disk`: its `state.json` lists the arrow files in
  order; a `DatasetDict` folder is refused naming its splits), or a folder of `.parquet` or of `.arrow`
  files read in name order. Rows count on across the files. A folder whose files belong to several
  splits (the Hub's `data/train_sft-00000-of-00003.parquet` beside `data/test_sft-...`, or
  `train.parquet` beside `test.parquet`; the `datasets` cache's `<name>-train-00000-of-00002.arrow`
  beside `<name>-test-...`) is refused naming each split and the `data.path` that reads it: merged,
  the test split would become training data;
- a glob in the last part of the path (`data/train_sft-*.parquet`: one split of such a folder), its
  files read in name order.
A UTF-8 byte-order mark starting a file is not part of its first row. The format is found per file
(`shared/conversations.py`): from a table's columns, or from the first row that is an object; every
later row of the file must be in it.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.conversations import (
    FORMAT_KEYS,
    FORMAT_NAMES,
    Conversation,
    ReadStats,
    RowLimits,
    answer_cuts,
    both_formats,
    detect_columns,
    detect_format,
    fits,
    mismatch,
)
from shared.errors import DataError, InputFileError
from shared.json_shapes import refuse_one_object, refuse_utf16
from shared.paths import relative_note
from shared.row_formats import parse_row

log = logging.getLogger(__name__)

BOM = b"\xef\xbb\xbf"
ARRAY_CHUNK = 1 << 20  # characters read at a time from a JSON array
# A split's files as the Hub names them (`train_sft-00000-of-00003.parquet`; older uploads add
# `-<fingerprint>`; a one-file split may be `train.parquet`) and as the `datasets` cache does
# (`ultrachat_200k-train_sft-00000-of-00003.arrow`, `ultrachat_200k-test.arrow`). `datasets` allows
# split names of word characters and dots only, so the split is the last field. A file named after
# no shard and no usual split (`chunk1.parquet`) belongs to none.
USUAL_SPLITS = "train|test|validation|valid|dev"
SPLIT_FILES = {
    ".parquet": re.compile(rf"(?:(?P<split>\w+(?:\.\w+)*)-\d{{5}}-of-\d{{5}}(?:-[0-9a-f]+)?|(?P<plain>{USUAL_SPLITS}))\.parquet"),
    ".arrow": re.compile(rf"(?P<name>.+?)-(?:(?P<split>\w+(?:\.\w+)*)-\d{{5}}-of-\d{{5}}|(?P<plain>{USUAL_SPLITS}))\.arrow"),
}


@dataclass
class _Table:
    """One data file: its columns when it is a table (the format is read from them), and its rows."""

    file: Path
    columns: list[str] | None
    rows: Iterator[tuple[int, Any]]  # (index in the file, record or the ValueError that makes it bad)


def read_conversations(
    path: str | Path,
    *,
    data_format: str = "auto",
    on_bad_row: str = "raise",
    max_samples: int | None = None,
    stats: ReadStats | None = None,
    limits: RowLimits | None = None,
    log_skips: bool = True,
) -> Iterator[Conversation]:
    path = Path(path)
    if not input_exists(path):
        missing = f"data file not found: {path}" if glob_files(path) is None else f"data.path={path} matches no file"
        raise InputFileError(missing + relative_note("data.path", path))
    stats = stats if stats is not None else ReadStats()
    kept = offset = 0
    warned = False
    for table in _tables(path):
        fmt, why = _table_format(table, data_format)
        count = 0
        for index, record in table.rows:
            if max_samples is not None and kept >= max_samples:
                return
            row, count = offset + index, index + 1
            stats.rows += 1
            try:
                if fmt is None and data_format == "auto":
                    fmt, why = detect_format(record), "like the rows before it"
                if fmt is None or not fits(record, fmt):
                    raise record if isinstance(record, Exception) else mismatch(fmt, record, why)
                ambiguous = both_formats(record) if data_format == "auto" else None
                if ambiguous is not None:
                    raise ambiguous
                messages, tools, cut, dropped = parse_row(record, fmt, limits)
                origin = generated_origin(record)
            except ValueError as exc:
                message = f"{path}: row {row}: {exc}"
                if on_bad_row == "raise":
                    raise DataError(message + " (set data.on_bad_row=skip to skip and count bad rows)") from None
                stats.bad_rows += 1
                if len(stats.bad_examples) < 5:
                    stats.bad_examples.append(message)
                if log_skips:
                    log.warning("skipping %s", message)
                continue
            finally:
                del record  # a huge row's text is gone once it is cut, not when the next row comes
            kept += 1
            stats.leading_turns_dropped += dropped
            cut_answers, unknown = answer_cuts(messages)
            stats.answers_cut += cut_answers
            stats.answers_cut_unknown += unknown
            if dropped and not warned:
                warned = True
                log.warning(
                    "%s: row %d opens with %d assistant/tool turn(s) before its first user turn: dropped (they answer "
                    "nothing in the row); every such turn is counted as leading_turns_dropped", path, row, dropped,
                )
            yield Conversation(row=row, messages=messages, source=str(path), tools=tools, cut=cut, **origin)
        offset += count


def generated_origin(record: dict[str, Any]) -> dict[str, Any]:
    """The columns `generate` writes beside each conversation (`source_row`: its row in the user's
    data; `prompt_hash`: that row's prompt), as Conversation fields; {} for rows without them."""
    out: dict[str, Any] = {}
    if isinstance(record.get("source_row"), int) and not isinstance(record.get("source_row"), bool):
        out["source_row"] = record["source_row"]
    # Only generate's own form (32 hex): a column of that name in a user's file must not become a split key.
    if isinstance(record.get("prompt_hash"), str) and re.fullmatch(r"[0-9a-f]{32}", record["prompt_hash"]):
        out["prompt_hash"] = record["prompt_hash"]
    return out


def read_rows(path: str | Path, wanted: set[int], data_format: str = "auto") -> dict[int, Conversation]:
    """The rows numbered in `wanted` that read as conversations (bad rows left out), reading no further
    than the last one needed."""
    out: dict[int, Conversation] = {}
    last = max(wanted, default=-1)
    for conv in read_conversations(path, data_format=data_format, on_bad_row="skip", log_skips=False):
        if conv.row in wanted:
            out[conv.row] = conv
        if conv.row >= last:
            break
    return out


def _table_format(table: _Table, data_format: str) -> tuple[str | None, str]:
    """(format, why a row must be in it) for one file: data.format, or the table's columns, or None
    until the first object row says it."""
    if table.columns is None:
        return (None, "") if data_format == "auto" else (data_format, f"(data.format={data_format})")
    if data_format != "auto":
        if FORMAT_KEYS[data_format] not in table.columns:
            raise DataError(
                f"{table.file}: data.format={data_format} reads {FORMAT_NAMES[data_format]}, but the file's columns "
                f"are {table.columns}"
            )
        return data_format, f"(data.format={data_format})"
    fmt = detect_columns(table.columns)
    if fmt is None:
        raise DataError(
            f"{table.file}: needs a `messages` column (OpenAI chat), `conversations` (ShareGPT) or `prompt` "
            f"(+ `completion`); it has {table.columns}"
        )
    return fmt, "as the file's columns say"


# ---------------------------------------------------------------------------------------------
# Files


def data_files(path: Path) -> list[Path]:
    """The files of `path` in row order (module docstring)."""
    matched = glob_files(path)
    if matched is not None:
        return matched
    if not path.is_dir():
        return [path]
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise InputFileError(
            f"{path} is a DatasetDict saved by `datasets` with splits {', '.join(map(str, splits))}: set data.path to "
            f"one split's folder ({path / str(splits[0]) if splits else path / 'train'})"
        )
    if (path / "state.json").is_file():
        try:
            names = [f["filename"] for f in json.loads((path / "state.json").read_text())["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputFileError(f"{path / 'state.json'} (a dataset saved by `datasets`) cannot be read: {exc}") from None
        return [path / name for name in names]
    parquet, arrow = sorted(path.glob("*.parquet")), sorted(path.glob("*.arrow"))
    if parquet and arrow:
        raise InputFileError(f"{path} holds both .parquet and .arrow files: point data.path at a folder of one kind")
    if not parquet and not arrow:
        hub = path / "data"
        files = (sorted(hub.glob("*.parquet")) or sorted(hub.glob("*.arrow"))) if hub.is_dir() else []
        hint, rows = "", sorted(path.glob("*.jsonl")) or sorted(path.glob("*.json"))
        if files:
            choices = _choices(hub, files)
            hint = f" (a Hub dataset keeps them under data/: {choices or shlex.quote(f'data.path={hub}')})"
        elif rows:  # JSON files are read one by one or by a glob, never as a folder: say how
            hint = (f" (it holds {len(rows)} {rows[0].suffix} file(s): {', '.join(p.name for p in rows[:3])}{', ...' * (len(rows) > 3)}; set "
                    f"data.path to one, or to a glob of one split's: {shlex.quote(f'data.path={path}/*{rows[0].suffix}')} reads all)")
        raise InputFileError(f"{path}: folder holds no .parquet or .arrow files{hint}")
    choices = _choices(path, parquet or arrow)
    if choices:
        raise InputFileError(
            f"{path} holds the files of several splits, which would be read as one data set (a test split trained on): "
            f"{choices}"
        )
    return parquet or arrow


def glob_files(path: Path) -> list[Path] | None:
    """The files a glob in the last part of `path` matches, in name order (`data/train_sft-*.parquet`:
    one split of a Hub dataset); None when `path` is no glob (or a file of that very name exists)."""
    if path.exists() or not any(c in path.name for c in "*?["):
        return None
    return sorted(p for p in path.parent.glob(path.name) if p.is_file())


def input_exists(path: Path) -> bool:
    """`path` exists, or is a glob that matches a file."""
    return path.exists() or bool(glob_files(path))


def _choices(folder: Path, files: list[Path]) -> str | None:
    """How to read one split (its data.path) when the folder's files belong to several (or some to
    none); None when they are one split's, or carry no split in their names."""
    splits: dict[str, tuple[str, int]] = {}  # split -> (the glob of its files, how many)
    other = []
    for file in files:
        match = SPLIT_FILES[file.suffix].fullmatch(file.name)
        if match is None:
            other.append(file.name)
            continue
        split, name = match["split"] or match["plain"], match.groupdict().get("name")
        pattern = file.name if match["plain"] else f"{name + '-' if name else ''}{split}-*{file.suffix}"
        splits[split] = (pattern, splits.get(split, ("", 0))[1] + 1)
    if not splits or (len(splits) == 1 and not other):
        return None
    text = "set data.path to one split's files: " + "; ".join(
        f"{split} ({n} file{'s' * (n > 1)}): {shlex.quote(f'data.path={folder / pattern}')}" for split, (pattern, n) in splits.items()
    )
    if other:
        text += f"; {len(other)} other file{'s' * (len(other) > 1)}, of no split ({', '.join(other[:3])}{', ...' * (len(other) > 3)})"
    return text


def _tables(path: Path) -> Iterator[_Table]:
    for file in data_files(path):
        if not file.is_file():
            raise InputFileError(f"data file not found: {file} (listed by {path})")
        if file.suffix in (".jsonl", ".json"):
            yield _Table(file, None, _json_rows(file))
        elif file.suffix in (".parquet", ".arrow"):
            yield _parquet(file) if file.suffix == ".parquet" else _arrow(file)
        else:
            raise DataError(f"{file}: unsupported data file type {file.suffix!r} (use .jsonl, .json, .parquet or .arrow)")


def _json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open("rb") as fh:
        head = fh.read(4096)
    start = head[len(BOM) :] if head.startswith(BOM) else head
    refuse_utf16(path, head)
    if start.lstrip()[:1] == b"[":
        yield from _json_array_rows(path)
    else:
        yield from _jsonl_rows(path)


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line index, record or the ValueError that makes the row bad) for every non-blank line. Bytes
    are decoded per line, so a line that is not UTF-8 is one bad row, named, not the end of the file."""
    with path.open("rb") as fh:
        i, seen = -1, False
        for raw in fh:  # not enumerate(): its cached result tuple would keep a huge row's bytes alive
            i += 1
            if i == 0 and raw.startswith(BOM):
                raw = raw[len(BOM) :]  # Windows tools write one: not part of the row
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
                if not seen and text.lstrip().startswith("{"):  # one JSON object written over many lines?
                    refuse_one_object(path)
                record = ValueError(f"not valid JSON ({json_problem(exc)} at column {exc.colno})")
            seen = True
            del text
            yield i, record
            del record


def json_problem(exc: json.JSONDecodeError) -> str:
    """The decoder's message without the " at" it ends some with ("Invalid control character at",
    "Unterminated string starting at"): its position follows in its str(), our column in ours."""
    return exc.msg.removesuffix(" at")


class _ArrayText:
    """A JSON array's text, read in chunks and decoded incrementally; `consumed` bytes so far."""

    def __init__(self, fh: Any, path: Path):
        self.fh, self.path = fh, path
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.pos, self.eof, self.consumed = "", 0, False, 0

    def more(self, row: int, at_least: int = ARRAY_CHUNK) -> bool:
        if self.eof:
            return False
        chunk = self.fh.read(max(ARRAY_CHUNK, at_least))
        if self.consumed == 0 and chunk.startswith(BOM):
            chunk, self.consumed = chunk[len(BOM) :], len(BOM)
        try:
            text = self.decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{self.path}: row {row}: not UTF-8 (byte {exc.object[exc.start]:#04x} at byte {self.consumed + exc.start} of "
                f"the file); a JSON array cannot be read past it: fix the file or write it as JSONL, one row a line"
            ) from None
        self.consumed += len(chunk)
        self.eof = not chunk
        self.buf = self.buf[self.pos :] + text
        self.pos = 0
        return True

    def skip_space(self, row: int) -> str:
        """The next character after white space ('' at the end of the file)."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf) or not self.more(row):
                return self.buf[self.pos : self.pos + 1]


def _json_array_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(element index, record) of a file holding one JSON array, parsed one element at a time."""
    decoder = json.JSONDecoder()
    with path.open("rb") as fh:
        text = _ArrayText(fh, path)
        text.skip_space(0)
        text.pos += 1  # the "[" _json_rows saw
        row = 0
        while True:
            char = text.skip_space(row)
            if char == "]" and row == 0:
                return
            while True:
                try:
                    record, end = decoder.raw_decode(text.buf, text.pos)
                    break
                except json.JSONDecodeError as exc:
                    if not text.more(row, at_least=len(text.buf) - text.pos):  # an element longer than the text read
                        raise DataError(
                            f"{path}: row {row}: not valid JSON ({json_problem(exc)}); a JSON array cannot be read past a broken "
                            f"element: fix the file or write it as JSONL, one row a line"
                        ) from None
            text.pos = end
            yield row, record
            del record
            row += 1
            char = text.skip_space(row)
            if char == "]":
                return
            if char != ",":
                raise DataError(f"{path}: row {row}: expected ',' or ']' after row {row - 1} of the JSON array, found {char!r}")
            text.pos += 1


def _parquet(file: Path) -> _Table:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{file}: not a readable Parquet file ({exc})") from None
    return _Table(file, parquet.schema_arrow.names, _batch_rows(parquet.iter_batches(batch_size=1024)))


def _arrow(file: Path) -> _Table:
    """An Arrow IPC file: the stream format `datasets` writes, or the random-access file format."""
    import pyarrow as pa

    try:
        reader: Any = pa.ipc.open_stream(pa.memory_map(str(file)))
        batches: Iterator[Any] = iter(reader)
    except pa.ArrowInvalid:
        try:
            reader = pa.ipc.open_file(pa.memory_map(str(file)))
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"{file}: not a readable Arrow file ({exc})") from None
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    return _Table(file, reader.schema.names, _batch_rows(batches))


def _batch_rows(batches: Iterator[Any]) -> Iterator[tuple[int, Any]]:
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            yield row, record
            row += 1
