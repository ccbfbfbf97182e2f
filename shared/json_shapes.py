"""JSON data files that hold no rows as the readers take them (`shared/conversation_files.py`): one
object over many lines (`{"train": [rows]}`), objects written over several lines each (`jq` without
-c), UTF-16 text. Read as JSON lines, every line would be a bad row and `data.on_bad_row=skip` would
skip them all; each is refused whatever on_bad_row says, naming the command that writes the rows.
"""

from __future__ import annotations

import codecs
import json
import shlex
from pathlib import Path
from typing import Any

from shared.conversations import detect_format
from shared.errors import DataError

ONE_OBJECT_MAX = 1 << 30  # bytes read to say what a file of JSON written over many lines holds


def refuse_utf16(path: Path, head: bytes) -> None:
    """Refuse a file that opens with a UTF-16 byte-order mark (PowerShell's `>` writes one)."""
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        out = shlex.quote(str(path.with_name(f"{path.stem}.utf8{path.suffix}")))
        raise DataError(f"{path}: is UTF-16 (it starts with its byte-order mark), not UTF-8: convert it with `iconv -f UTF-16 "
                        f"-t UTF-8 {shlex.quote(str(path))} > {out}` and set data.path={out}")


def refuse_one_object(path: Path) -> None:
    """Refuse JSON written over many lines (`{"train": [rows]}`, `jq` without -c): as JSON lines, each line is a bad row."""
    with path.open("rb") as fh:
        text = fh.read(ONE_OBJECT_MAX).decode("utf-8", "replace").removeprefix("\ufeff").lstrip()
    try:
        first, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return
    if isinstance(first, dict) and not text[end:].strip():
        raise DataError(f"{path}: holds one JSON object (keys {sorted(first)[:8]}), not rows (a JSON array, or JSONL: one row "
                        f"a line); {rows_fix(first, path)}")
    if isinstance(first, dict):
        out = shlex.quote(str(path.with_suffix(".lines.jsonl")))
        raise DataError(f"{path}: holds JSON objects written over several lines each (`jq` without -c?), not one per line: "
                        f"write them one per line with `jq -c . {shlex.quote(str(path))} > {out}` and set data.path={out}")


def rows_fix(whole: dict[str, Any], path: Any) -> str:
    """How to read a JSON object that holds the rows (`{"train": [rows]}`) or is one row, as data:
    the command that writes its rows one per line; "" when it holds no list of rows."""
    if detect_format(whole) is not None:
        return "it is one conversation: put it in a JSON array ([...]) or on one line (JSONL)"
    key = next((k for k, v in whole.items() if isinstance(v, list) and v and all(detect_format(r) for r in v[:8])), None)
    if key is None:
        return "" if path is None else "write its rows as a JSON array, or one per line (JSONL)"
    file, out = (shlex.quote(str(path)), shlex.quote(str(path.with_suffix(f".{key}.jsonl")))) if path else ("FILE", "ROWS.jsonl")
    return (f"its rows are the list under {key!r}: write them one per line with `python -c \"import json, sys; "
            f"[print(json.dumps(r)) for r in json.load(open(sys.argv[1]))[{key!r}]]\" {file} > {out}` and set data.path={out}")
