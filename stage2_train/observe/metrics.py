"""The training log: one sink that writes `run_dir/train_log.jsonl` and forwards to wandb.

    sink = MetricsSink(LogConfig(), run_dir="runs/default", rank=0, run_config=cfg.to_dict())
    sink.event("run_start", step=0, config={...})      # {"kind": "event", "event": "run_start", ...}
    sink.log(12, {"loss": 1.93, "acc_per_pos": [...]})  # {"kind": "train", "step": 12, ...}
    sink.log(12, {"loss": 2.10}, kind="eval")
    sink.close()

The JSONL file is the record of truth: one JSON object per line, flushed at every write, appended
to on resume, every line carrying `kind` ("train", "eval", "event"), `step` and wall-clock `time`.
Only rank 0 writes (other ranks get a sink whose `active` is False). wandb is imported lazily and
only when the resolved mode is not "disabled": "auto" follows $WANDB_MODE, else "online" when
$WANDB_API_KEY is set, else "offline" (a local run under run_dir/wandb, no network). The wandb run
id is kept in run_dir/wandb_id.txt so a resumed run continues the same wandb run.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from pathlib import Path
from typing import Any

from shared.paths import RunPaths
from stage2_train.observe.config import LogConfig

WANDB_MODES = ("online", "offline", "disabled")


def resolve_wandb_mode(requested: str) -> str:
    """The configured mode, or for "auto": $WANDB_MODE, else online with an API key, else offline."""
    if requested != "auto":
        return requested
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env in ("dryrun",):
        return "offline"
    if env in WANDB_MODES:
        return env
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def plain(value: Any) -> Any:
    """JSON-able copy: tensors and numpy values become Python numbers or lists; NaN/inf stay readable."""
    if hasattr(value, "detach"):  # torch tensor
        value = value.detach().cpu()
        return plain(value.item() if value.dim() == 0 else value.tolist())
    if hasattr(value, "tolist"):  # numpy array or scalar
        return plain(value.tolist())
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan" / "inf": strict JSON has no NaN
    if isinstance(value, Path):
        return str(value)
    return value


def flatten_for_wandb(prefix: str, row: dict[str, Any]) -> dict[str, Any]:
    """Numbers only: lists become prefix/name_k, nested dicts prefix/name/key, strings are dropped."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        name = f"{prefix}/{key}"
        if isinstance(value, bool) or isinstance(value, (int, float)):
            out[name] = value
        elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
            out.update({f"{name}_{i + 1}": v for i, v in enumerate(value)})
        elif isinstance(value, dict):
            out.update(flatten_for_wandb(name, value))
    return out


class MetricsSink:
    def __init__(
        self,
        cfg: LogConfig,
        run_dir: str | os.PathLike,
        *,
        rank: int = 0,
        run_config: dict[str, Any] | None = None,
    ):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.active = rank == 0
        self.path = RunPaths(self.run_dir).log
        self.wandb_mode = resolve_wandb_mode(cfg.wandb)
        self._file = None
        self._wandb_run = None
        self._wandb_step = 0  # wandb drops a row whose step is below one it has seen
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        if self.wandb_mode != "disabled":
            self._wandb_run = self._start_wandb(run_config or {})

    def _start_wandb(self, run_config: dict[str, Any]) -> Any:
        import wandb

        id_file = self.run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        (self.run_dir / "wandb").mkdir(exist_ok=True)
        return wandb.init(
            project=self.cfg.project,
            entity=self.cfg.entity,
            name=self.cfg.run_name or self.run_dir.resolve().name,
            id=run_id,
            resume="allow",
            dir=str(self.run_dir),
            mode=self.wandb_mode,
            config=run_config,
        )

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(plain(record), allow_nan=False) + "\n")
        self._file.flush()

    def log(self, step: int, row: dict[str, Any], *, kind: str = "train") -> None:
        """One metrics row at optimizer step `step` (kind "train" or "eval")."""
        if not self.active:
            return
        record = {"kind": kind, "step": int(step), **plain(row), "time": time.time()}
        self._write(record)
        self._to_wandb(kind, plain(row), int(step))

    def event(self, kind: str, step: int, **fields: Any) -> None:
        """Something that happened in the run (run_start, epoch_end, checkpoint_saved, resume...)."""
        if not self.active:
            return
        record = {"kind": "event", "event": kind, "step": int(step), **plain(fields), "time": time.time()}
        self._write(record)
        self._to_wandb(f"event/{kind}", {k: v for k, v in fields.items() if k != "config"}, int(step))

    def _to_wandb(self, prefix: str, fields: dict[str, Any], step: int) -> None:
        """wandb ignores a row logged at a step below one it has seen, and some rows come late: an
        async checkpoint's checkpoint_end (the save's blocked and written seconds, what showed the
        failed run's stalls) arrives after the next step's row. Such a row goes to wandb at the
        latest step, carrying its own step as prefix/step; the JSONL keeps the true step."""
        if self._wandb_run is None:
            return
        numbers = flatten_for_wandb(prefix, fields)
        if step < self._wandb_step:
            numbers = {**numbers, f"{prefix}/step": step}
        self._wandb_step = max(self._wandb_step, step)
        self._wandb_run.log(numbers, step=self._wandb_step)

    def close(self) -> None:
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self._file is not None:
            self._file.close()
            self._file = None


def read_records(path: str | os.PathLike) -> tuple[list[dict[str, Any]], int]:
    """(records, number of unreadable lines) of a JSONL log. A crash mid-write leaves a torn (or,
    cut inside a multi-byte character, non-UTF-8) last line: such lines are counted, not fatal."""
    records, bad = [], 0
    for raw in Path(path).read_bytes().splitlines():
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            bad += 1
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            bad += 1
    return records, bad


def read_log(path: str | os.PathLike, kind: str | None = None) -> list[dict[str, Any]]:
    """The readable rows of a train_log.jsonl, optionally only those of one kind."""
    return [r for r in read_records(path)[0] if kind is None or r.get("kind") == kind]
