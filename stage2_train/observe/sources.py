"""Finding and reading a training log, whoever wrote it: this project's train_log.jsonl, a wandb run
folder (offline or synced), a TensorBoard log directory, or a CSV / JSONL history export.

    log = load_log("runs/default")              # a run dir, a file, a wandb or TensorBoard folder
    log.records, log.kind, log.names            # records in this project's form (peers.py), ...

What a path means:
- a file: `*.wandb` (a wandb run's transaction log), `events.out.tfevents.*` (its TensorBoard
  folder is read), `*.csv` (wandb's "Export CSV" of a chart, or `run.history().to_csv()`), else
  JSON lines (train_log.jsonl, or `run.history()` / `scan_history()` dumped one row per line, or
  as one JSON array);
- a folder: its train_log.jsonl when there is one (the record of truth: a run dir of this project
  also holds a wandb folder); else a wandb run folder (`run-*.wandb` inside), or a folder of wandb
  runs (`offline-run-*`, `run-*`, directly or under `wandb/`: several runs must be one run resumed,
  same id, read in order); else the TensorBoard event files under it (one folder of them).

wandb runs are read by wandb's own reader (`wandb leet inspect --json`, the wandb-core binary that
comes with the wandb package); an incomplete file (a run still writing, or killed) is read up to its
last whole record. TensorBoard logs are read by tensorboard's EventAccumulator: the `tensorboard`
extra (`pip install -e '.[tensorboard]'`), imported only when such a log is read.
"""

from __future__ import annotations

import csv
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import InputFileError
from shared.paths import RunPaths
from stage2_train.observe.metrics import read_records
from stage2_train.observe.peers import translate
from stage2_train.observe.records import number

WANDB_RUN_GLOBS = ("offline-run-*", "run-*")


@dataclass
class Log:
    records: list[dict[str, Any]]
    path: Path  # the file or folder read
    kind: str  # "jsonl", "csv", "wandb", "tensorboard"
    unreadable: int = 0  # lines or records that could not be read
    names: dict[str, list[str]] = field(default_factory=dict)  # canonical field -> the log's own names
    notes: list[str] = field(default_factory=list)  # what the reader said (an incomplete file)

    @property
    def home(self) -> Path:
        """The folder the log lives in (the report's default output goes under it)."""
        return self.path if self.path.is_dir() else self.path.parent


def load_log(path: str | Path) -> Log:
    kind, where = locate(Path(path))
    if kind == "wandb":
        rows, notes = read_wandb(where)
        log = Log([], where[0].parent if len(where) == 1 else where[0].parent.parent, kind, notes=notes)
    elif kind == "tensorboard":
        rows = read_tensorboard(where[0])
        log = Log([], where[0], kind)
    elif kind == "csv":
        rows = read_csv(where[0])
        log = Log([], where[0], kind)
    else:
        rows, unreadable = read_json_rows(where[0])
        log = Log([], where[0], kind, unreadable=unreadable)
    log.records, log.names = translate(rows)
    return log


def locate(path: Path) -> tuple[str, list[Path]]:
    """(kind, the files or folder to read) for a path given by the user."""
    if path.is_file():
        if path.suffix == ".wandb":
            return "wandb", [path]
        if "tfevents" in path.name:
            return "tensorboard", [path.parent]
        return ("csv" if path.suffix == ".csv" else "jsonl"), [path]
    if not path.is_dir():
        raise InputFileError(f"no training log at {path}")
    if RunPaths(path).log.is_file():
        return "jsonl", [RunPaths(path).log]
    runs = wandb_runs(path)
    if runs:
        return "wandb", runs
    folders = sorted({f.parent for f in path.rglob("events.out.tfevents.*")})
    if len(folders) > 1:
        listed = ", ".join(str(f.relative_to(path)) for f in folders[:8])
        raise InputFileError(f"{path}: TensorBoard logs of {len(folders)} runs ({listed}); give one of them")
    if folders:
        return "tensorboard", folders
    raise InputFileError(
        f"no training log at {path}: looked for train_log.jsonl, a wandb run (run-*.wandb, or a wandb/ "
        "folder of runs) and TensorBoard event files (events.out.tfevents.*)"
    )


def wandb_runs(path: Path) -> list[Path]:
    """The .wandb files of the run in `path` (a run folder, or a folder of runs of one run id, in
    time order: a resumed run); refused when the folder holds several different runs."""
    here = sorted(path.glob("run-*.wandb"))
    if here:
        return here[-1:]
    for folder in (path, path / "wandb"):
        runs = sorted(
            {d.resolve() for pattern in WANDB_RUN_GLOBS for d in folder.glob(pattern) if d.is_dir()},
            key=lambda d: d.name.split("-", 2)[-1],  # offline-run-DATE_TIME-ID, run-DATE_TIME-ID
        )
        files = [f for d in runs for f in sorted(d.glob("run-*.wandb"))[-1:]]
        ids = {f.stem.removeprefix("run-") for f in files}
        if len(ids) > 1:
            listed = ", ".join(f.parent.name for f in files[:8])
            raise InputFileError(
                f"{folder}: {len(ids)} different wandb runs ({listed}); give one run's folder"
            )
        if files:
            return files
    return []


# ---- the readers -----------------------------------------------------------------------------------
def read_json_rows(path: Path) -> tuple[list[dict[str, Any]], int]:
    """JSON lines (torn lines counted, as `metrics.read_records`), or one JSON array of rows."""
    with path.open("rb") as f:
        head = f.read(64).lstrip()
    if head.startswith(b"["):
        try:
            rows = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputFileError(f"{path}: not a JSON array of rows ({exc})") from None
        return [r for r in rows if isinstance(r, dict)], sum(1 for r in rows if not isinstance(r, dict))
    return read_records(path)


def read_csv(path: Path) -> list[dict[str, Any]]:
    """Rows of a CSV history: wandb's chart export ("Step", "<run> - <metric>", with __MIN/__MAX
    columns, dropped) or a DataFrame's `to_csv` (its index column dropped). Empty cells are absent."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        columns = [c for c in reader.fieldnames or [] if c and not c.startswith("Unnamed:")]
        runs = {c.rsplit(" - ", 1)[0] for c in columns if " - " in c}
        if len(runs) > 1:
            raise InputFileError(
                f"{path}: columns of {len(runs)} runs ({', '.join(sorted(runs)[:8])}); export one run"
            )
        keep = {c: c.rsplit(" - ", 1)[-1] for c in columns if not c.endswith(("__MIN", "__MAX"))}
        return [
            {name: value for c, name in keep.items() if (value := row.get(c)) not in (None, "")}
            for row in reader
        ]


def read_wandb(files: list[Path]) -> tuple[list[dict[str, Any]], list[str]]:
    """The history rows of a wandb run's .wandb files, read by wandb's own reader."""
    try:
        from wandb.util import get_core_path
    except ImportError:
        raise InputFileError(
            f"{files[0]}: reading a wandb run needs the wandb package (pip install wandb)"
        ) from None
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for path in files:
        command = [
            get_core_path(),
            "leet",
            "inspect",
            "--json",
            "--no-observability",
            "--run-file",
            str(path),
        ]
        with subprocess.Popen(
            [*command, str(path.parent.parent)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        ) as reader:  # streamed: a long run has a history row per logged step
            for line in reader.stdout:
                record = json.loads(line)
                if record.get("type") == "history":
                    history = record["history"]
                    row = flat(history.get("item", {}))
                    row.setdefault("_step", history.get("step", {}).get("num"))
                    rows.append(row)
            said = reader.stderr.read().strip().splitlines()
        if reader.returncode != 0:
            raise InputFileError(
                f"{path}: wandb's reader (wandb leet inspect) failed: {said[-1] if said else 'no message'}; "
                "it needs a wandb with `wandb leet inspect` (pip install -U wandb)"
            )
        notes += [
            f"{path.name}: {line.removeprefix('wandb leet inspect: ')}" for line in said if line.strip()
        ]
    return rows, notes


def read_tensorboard(folder: Path) -> list[dict[str, Any]]:
    """One row per step of a TensorBoard log folder: every scalar tag (and scalar tensor) logged at
    that step, and the latest wall time of the step as `wall_time`."""
    try:
        from tensorboard.backend.event_processing import event_accumulator
        from tensorboard.util import tensor_util
    except ImportError:
        raise InputFileError(
            f"{folder}: reading a TensorBoard log needs the tensorboard package: pip install -e '.[tensorboard]'"
        ) from None
    reader = event_accumulator.EventAccumulator(
        str(folder), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
    )
    reader.Reload()
    rows: dict[int, dict[str, Any]] = {}

    def add(tag: str, step: int, wall_time: float, value: float) -> None:
        row = rows.setdefault(step, {"_step": step, "wall_time": wall_time})
        row[tag], row["wall_time"] = value, max(row["wall_time"], wall_time)

    tags = reader.Tags()
    for tag in tags.get("scalars", []):
        for event in reader.Scalars(tag):
            add(tag, event.step, event.wall_time, event.value)
    for tag in tags.get("tensors", []):  # TF2-style summaries store scalars as 0-d tensors
        for event in reader.Tensors(tag):
            value = tensor_util.make_ndarray(event.tensor_proto)
            if value.size == 1 and number(value.item()) is not None:
                add(tag, event.step, event.wall_time, float(value.item()))
    return [rows[step] for step in sorted(rows)]


def flat(item: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A wandb history item with nested mappings flattened to "a/b" names."""
    out: dict[str, Any] = {}
    for key, value in item.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}/"))
        else:
            out[prefix + key] = value
    return out
