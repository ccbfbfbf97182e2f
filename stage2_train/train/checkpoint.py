"""Checkpoints that neither stall training nor change it, verified on every read, and an exact resume.

    .venv/bin/python -m pytest tests/test_checkpoint.py -q      # behaviour
    .venv/bin/python bench/checkpoint.py --json ckpt.json      # blocked time, async vs sync

Use from the trainer:

    ckpt = Checkpointer(cfg, cfg.resolve_dir(run_dir), sink, rank, world_size)
    path, skipped = ckpt.select()                      # newest complete checkpoint whose checksums hold
    state = ckpt.load(path)                            # every file verified against meta.json
    for step in ...:                                   # step = optimizer steps completed
        train_step()
        ckpt.maybe_save(step, state_fn)                # every `every_steps`; returns after a CPU copy
    ckpt.save(step, state_fn, blocking=True)           # the final checkpoint (skipped if already saved)
    ckpt.finalize()                                    # in `finally`: waits, re-raises a writer error

The state has a schema. It maps component names to that component's `state_dict()`: nested dicts
with string keys (no "/"), whose leaves are tensors or plain JSON values (None, bool, int, float,
str, and lists of those). Tensors go to safetensors under their path ("optimizer/state/0/exp_avg"),
the rest to JSON; nothing is pickled, and anything else is a TypeError naming its path. Components
whose native state is not of that shape (an optimizer keys its state by int, RNG states are tuples
and numpy arrays) are wrapped: `optimizer_state`, `rng_state`.

A save has two halves. The snapshot is the only time the loop waits: `state_fn()` is called and every
tensor is copied into a CPU buffer kept between saves (pinned memory and non_blocking copies on CUDA,
then one synchronize per device). The buffers (host memory the size of the state) are allocated in
the background at the first `maybe_save` call, so the first save does not pay for them either. A
background thread then checks that every model weight is finite (a checkpoint with NaN weights is
never written), writes the files, and commits. One save is in flight at most: a save that comes due
while one is writing waits for it, and `waited_s` in its events says so. Events, sent from the
caller's thread only: `checkpoint_start` (step, waited_s) and `checkpoint_end` (step, blocked_s,
write_s, bytes, path, mode); an async save's end event goes out at the first call after the writer
finished. A writer error is re-raised by the next call (or `finalize`), naming the path.

On-disk layout (FORMAT_VERSION 2):

    ckpt_dir/
      latest                     "step_000500": replaced atomically, after the directory is complete
      step_000500/
        model.safetensors        state["model"] under the model's own names (rank 0; export reads it)
        shared.safetensors       the other tensors of SHARED_KEYS, e.g. the optimizer state (rank 0)
        shared.json              the plain values of SHARED_KEYS (rank 0)
        rank_00000.safetensors   tensors of every other component (RNG states, ...), one pair per rank
        rank_00000.json          plain values of every other component (sampler, noise, trainer, config)
        meta.json                version, step, world size, components, every file's size and sha256
      .tmp-step_001000/          a save being written; removed at start-up if a crash left it

Every rank writes its files into `.tmp-step_N/`, fsyncs them, and the ranks agree (one all_reduce on a
gloo group of their own, so the writer thread never shares a collective with DDP); then rank 0 hashes
every file, writes meta.json, renames the directory to `step_N`, updates `latest`, and prunes to
`keep_latest_k`. A crash at any point leaves the previous checkpoint intact. DDP keeps model and
optimizer identical on every rank, so rank 0 alone writes SHARED_KEYS; sharded optimizer state
(ZeRO, FSDP) is outside this format. Several nodes need `ckpt_dir` on a shared file system.

Choosing a checkpoint (resume, export, eval: one rule, `select_checkpoint`): the newest complete
directory not newer than `latest` whose files all match the sizes and sha256 sums in its meta.json;
every one passed over is reported with the reason. Pruning keeps the `keep_latest_k` newest complete
checkpoints up to the one just written and never touches newer ones (an abandoned future).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from shared.config import Section
from shared.errors import CheckpointError, DivergedError, UserError

FORMAT_VERSION = 2
SHARED_KEYS = ("model", "optimizer")  # identical on every DDP rank: written once, by rank 0
STEP_DIR = re.compile(r"step_(\d+)")
TMP_PREFIX = ".tmp-"
SAFETENSORS_META = {"format": "pt"}  # what transformers' loaders expect in the header
MODEL_FILE = "model.safetensors"

# Fields that change what training computes: resuming with a different value is refused (unless
# forced). Dotted paths into the config dict the trainer stores under state["config"]: its resolved
# run config plus a "resolved" mapping of values known only at run time.
COMPATIBILITY_FIELDS: dict[str, str] = {
    "model.block_size": "the drafter's block, hence anchors, attention and loss weights",
    "loss.gamma": "the position weights of the loss",
    "target.num_feature_layers": "how many target features the drafter fuses",
    "target.layer_ids": "which target layers feed the drafter, as configured",
    "resolved.layer_ids": "which target layers feed the drafter, as resolved against the target",
    "resolved.target_fingerprint": "the target weights the features came from",
    "sampler.token_budget": "tokens per micro-batch: with grad_accum and world size, the global batch",
    "sampler.grad_accum": "micro-batches per optimizer step",
    "resolved.world_size": "ranks: the global batch and the per-rank RNG and sampler states",
}
OPTIONAL_FIELDS = {"resolved.target_fingerprint"}  # compared only when both configs carry it


class CheckpointConfig(Section):
    section: ClassVar[str] = "checkpoint"
    every_steps: int = 0
    """Save every N optimizer steps; 0 = no periodic saves, only the trainer's final save at the end."""
    keep_latest_k: int = 2
    """Complete checkpoints kept; older ones are deleted after each successful save (>= 2: a fallback)."""
    async_save: bool = True
    """Write in a background thread after a CPU snapshot; false = the loop waits for the whole write."""
    dir: str | None = None
    """Where checkpoints go; null = <run_dir>/checkpoints. Several nodes need a shared file system."""

    def validate(self) -> None:
        self.require(self.every_steps >= 0, "every_steps", "must be >= 0 (0 = only the final save)")
        self.require(
            self.keep_latest_k >= 2, "keep_latest_k", "must be >= 2 (a crash mid-save needs a fallback)"
        )

    def resolve_dir(self, run_dir: str | os.PathLike) -> Path:
        return Path(self.dir) if self.dir is not None else Path(run_dir) / "checkpoints"


class CheckpointWriteError(UserError):
    """A save failed in the background (a full disk, a lost rank); raised on the caller's thread."""


@dataclass
class _Job:
    step: int
    parts: list[tuple[str, dict[str, Any], dict[str, torch.Tensor]]]  # (file stem, plain values, tensors)
    keys: list[str]
    blocked_s: float = 0.0
    waited_s: float = 0.0
    mode: str = "async"
    write_s: float = 0.0
    num_bytes: int = 0
    error: BaseException | None = None


@dataclass
class Selection:
    """The checkpoint to use and the ones passed over on the way, each with its reason."""

    path: Path | None
    skipped: list[tuple[str, str]] = field(default_factory=list)


class Checkpointer:
    def __init__(
        self,
        cfg: CheckpointConfig,
        ckpt_dir: str | os.PathLike,
        sink: Any = None,
        rank: int = 0,
        world_size: int = 1,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"checkpoint: rank {rank} is outside world size {world_size}")
        if world_size > 1 and not dist.is_initialized():
            raise ValueError(f"checkpoint: world_size {world_size} needs torch.distributed initialised")
        self.cfg, self.dir, self.sink = cfg, Path(ckpt_dir), sink
        self.rank, self.world_size = rank, world_size
        self._buffers: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._job: _Job | None = None
        self._last_step: int | None = None
        # A group of our own, so the writer thread's collective never interleaves with DDP's.
        self._group = dist.new_group(backend="gloo") if world_size > 1 else None
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for leftover in self.dir.glob(TMP_PREFIX + "*"):
                shutil.rmtree(leftover, ignore_errors=True)
        if self._group is not None:
            dist.barrier(group=self._group)

    # ---- saving -----------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """True while a background write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def is_due(self, step: int) -> bool:
        return self.cfg.every_steps > 0 and step > 0 and step % self.cfg.every_steps == 0

    def maybe_save(self, step: int, state_fn: Callable[[], dict[str, Any]]) -> bool:
        """Save if `step` is a multiple of `every_steps`. Returns whether a save started.

        At the first call that is not a save step, the snapshot buffers are allocated (and their
        pages touched) in the background, so that no save pays for it inside the loop.
        """
        self._poll()
        if self.is_due(step):
            return self.save(step, state_fn)
        if self.cfg.async_save and self.cfg.every_steps > 0 and not self._buffers and not self.busy:
            self._start_thread(self._allocate, self._snapshot(step, state_fn(), copy=False))
        return False

    def save(self, step: int, state_fn: Callable[[], dict[str, Any]], blocking: bool = False) -> bool:
        """Save now (async unless `blocking` or `async_save` is off). False if `step` is already saved."""
        t0 = time.perf_counter()
        self._poll()
        if step == self._last_step:
            return False
        waited_s = 0.0
        if self.busy:
            self._wait()
            waited_s = time.perf_counter() - t0
            self._poll()
        self._event("checkpoint_start", step, waited_s=round(waited_s, 4))
        job = self._snapshot(step, state_fn())
        job.waited_s = waited_s
        self._last_step = step
        if blocking or not self.cfg.async_save:
            job.mode = "sync"
            self._write(job)
            job.blocked_s = time.perf_counter() - t0
            self._job = job
            self._poll()
        else:
            job.blocked_s = time.perf_counter() - t0
            self._job = job
            self._start_thread(self._write, job)
        return True

    def mark_saved(self, step: int) -> None:
        """`step` is already on disk (a resumed run that has nothing left to train): no final save."""
        self._last_step = step

    def _start_thread(self, target: Callable[[_Job], None], job: _Job) -> None:
        # Not niced: under load a low-priority writer overran the save interval and the next save
        # had to wait, which is the stall this class exists to prevent.
        self._thread = threading.Thread(target=target, args=(job,), name="checkpoint-writer", daemon=True)
        self._thread.start()

    def finalize(self) -> None:
        """Wait for the save in flight; re-raise its error."""
        self._wait()
        self._poll()

    def _wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _poll(self) -> None:
        """Report a finished save: its end event, or its error."""
        if self.busy:
            return
        job, self._job, self._thread = self._job, None, None
        if job is None:  # nothing ran, or the thread allocated buffers
            return
        path = self.dir / step_name(job.step)
        if job.error is not None:
            self._last_step = None
            if isinstance(job.error, UserError):
                raise job.error
            raise CheckpointWriteError(f"checkpoint {path} failed: {job.error!r}") from job.error
        self._event(
            "checkpoint_end",
            job.step,
            blocked_s=round(job.blocked_s, 4),
            write_s=round(job.write_s, 4),
            waited_s=round(job.waited_s, 4),
            bytes=job.num_bytes,
            path=str(path),
            mode=job.mode,
        )

    def _event(self, kind: str, step: int, **fields: Any) -> None:
        if self.sink is not None:
            self.sink.event(kind, step, **fields)

    # ---- the snapshot (the loop waits for this) ----------------------------------------------
    def _snapshot(self, step: int, state: Mapping[str, Any], copy: bool = True) -> _Job:
        """Copy `state` into the CPU buffers; with copy=False, a job holding the live tensors."""
        if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
            raise TypeError("checkpoint state must be a dict with string keys")
        used: set[str] = set()
        devices: set[torch.device] = set()

        def copy_out(key: str, tensor: torch.Tensor) -> torch.Tensor:
            tensor = tensor.detach()
            if not copy:
                return tensor
            buf = self._buffers.get(key)
            if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
                self._buffers[key] = buf
            used.add(key)
            if tensor.is_cuda:
                devices.add(tensor.device)
            buf.copy_(tensor, non_blocking=tensor.is_cuda)
            return buf

        parts = []
        if self.rank == 0 and any(k in state for k in SHARED_KEYS):
            model_tensors: dict[str, torch.Tensor] = {}
            if "model" in state:
                for name, tensor in _model_tensors(state["model"]).items():
                    model_tensors[name] = copy_out("model/" + name, tensor)
                parts.append(("model", {}, model_tensors))
            shared_tensors: dict[str, torch.Tensor] = {}
            plain = {
                k: split_tensors(state[k], k, shared_tensors, lambda key, t: copy_out("shared/" + key, t))
                for k in SHARED_KEYS
                if k in state and k != "model"
            }
            parts.append(("shared", plain, shared_tensors))
        rank_tensors: dict[str, torch.Tensor] = {}
        stem = rank_stem(self.rank)
        plain = {
            k: split_tensors(v, k, rank_tensors, lambda key, t: copy_out(f"{stem}/{key}", t))
            for k, v in state.items()
            if k not in SHARED_KEYS
        }
        parts.append((stem, plain, rank_tensors))
        for device in devices:
            torch.cuda.synchronize(device)
        if copy:
            self._buffers = {k: v for k, v in self._buffers.items() if k in used}
        return _Job(step=step, parts=parts, keys=list(state))

    def _allocate(self, job: _Job) -> None:
        """Background: a buffer for every tensor of `job` (whose tensors are the live ones)."""
        buffers = {}
        for stem, _, tensors in job.parts:  # buffer keys are "<file stem>/<tensor key>", as in _snapshot
            for key, tensor in tensors.items():
                buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
                if not tensor.is_cuda:
                    buf.zero_()  # fault the pages in now rather than during the snapshot
                buffers[f"{stem}/{key}"] = buf
        self._buffers = buffers

    # ---- the write (background thread) --------------------------------------------------------
    def _write(self, job: _Job) -> None:
        t0 = time.perf_counter()
        try:
            self._write_and_commit(job)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread by _poll
            job.error = exc
        job.write_s = time.perf_counter() - t0

    def _write_and_commit(self, job: _Job) -> None:
        name = step_name(job.step)
        tmp = self.dir / (TMP_PREFIX + name)
        error: BaseException | None = None
        try:
            for stem, _, tensors in job.parts:
                if stem == "model":
                    check_finite_weights(tensors, job.step)
            tmp.mkdir(parents=True, exist_ok=True)
            for stem, plain, tensors in job.parts:
                job.num_bytes += write_part(tmp, stem, plain, tensors)
        except BaseException as exc:  # noqa: BLE001 - the other ranks must still hear about it
            error = exc
        if not self._all_ranks_ok(error is None):
            raise error or RuntimeError("another rank failed to write its part")
        if self.rank == 0:
            try:
                self._commit(job, tmp)
            except BaseException as exc:  # noqa: BLE001 - the other ranks must still hear about it
                error = exc
        # A second agreement: when finalize() returns on any rank, the checkpoint is committed.
        if not self._all_ranks_ok(error is None):
            raise error or RuntimeError("rank 0 failed to commit the checkpoint")

    def _commit(self, job: _Job, tmp: Path) -> None:
        """Rank 0: meta.json (every file's size and sha256), rename, `latest`, prune."""
        name = tmp.name[len(TMP_PREFIX) :]
        files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in sorted(tmp.iterdir())}
        meta = {
            "format_version": FORMAT_VERSION,
            "step": job.step,
            "world_size": self.world_size,
            "keys": job.keys,
            "shared_keys": list(SHARED_KEYS),
            "files": files,
        }
        _write_synced(tmp / "meta.json", json.dumps(meta, indent=1).encode())
        job.num_bytes += (tmp / "meta.json").stat().st_size
        _fsync_dir(tmp)
        final = self.dir / name
        if final.exists():  # a stale copy of this step, e.g. from a run that crashed before `latest`
            stale = self.dir / (TMP_PREFIX + "replaced-" + name)
            os.replace(final, stale)
            shutil.rmtree(stale)
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        _write_synced(self.dir / "latest.tmp", (name + "\n").encode())
        os.replace(self.dir / "latest.tmp", self.dir / "latest")
        _fsync_dir(self.dir)
        for old in prunable(self.dir, job.step, self.cfg.keep_latest_k):
            shutil.rmtree(old)

    def _all_ranks_ok(self, ok: bool) -> bool:
        if self._group is None:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    # ---- reading ------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        """The newest complete checkpoint by the pointer rule (sizes only, no checksums)."""
        return latest_checkpoint(self.dir)

    def select(self) -> Selection:
        """The newest checkpoint every rank can verify (`select_checkpoint`, agreed across ranks)."""
        selection = Selection(None)
        for path in reversed(candidates(self.dir)):
            problem = checkpoint_problem(path, self.rank)
            if self._all_ranks_ok(problem is None):
                selection.path = path
                return selection
            selection.skipped.append((str(path), problem or "another rank found its part damaged"))
        return selection

    def load(self, path: str | os.PathLike) -> dict[str, Any]:
        return load_checkpoint(path, self.rank)


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def rank_stem(rank: int) -> str:
    return f"rank_{rank:05d}"


# ---- the schema -------------------------------------------------------------------------------
PLAIN_TYPES = (type(None), bool, int, float, str)


def split_tensors(
    obj: Any,
    path: str,
    tensors: dict[str, torch.Tensor],
    copy: Callable[[str, torch.Tensor], torch.Tensor],
    in_list: bool = False,
) -> Any:
    """The plain part of a component's state; its tensors go to `tensors` under their "/" path."""
    if isinstance(obj, torch.Tensor):
        if in_list:
            raise TypeError(f"checkpoint state {path}: a tensor inside a list (tensors go under string keys)")
        tensors[path] = copy(path, obj)
        return None
    if isinstance(obj, Mapping):
        out = {}
        for key, value in obj.items():
            if not isinstance(key, str) or "/" in key:
                raise TypeError(f"checkpoint state {path}: key {key!r} must be a string without '/'")
            if isinstance(value, torch.Tensor) and not in_list:
                tensors[f"{path}/{key}"] = copy(f"{path}/{key}", value)
            else:
                out[key] = split_tensors(value, f"{path}/{key}", tensors, copy, in_list)
        return out
    if isinstance(obj, (list, tuple)):
        return [split_tensors(v, f"{path}/{i}", tensors, copy, True) for i, v in enumerate(obj)]
    if isinstance(obj, PLAIN_TYPES):
        return obj
    raise TypeError(
        f"checkpoint state {path}: cannot store a {type(obj).__name__} (tensors and plain JSON values only)"
    )


def join_tensors(plain: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Put every "a/b/c" tensor back at plain["a"]["b"]["c"]."""
    for key, tensor in tensors.items():
        node = plain
        *parents, leaf = key.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = tensor
    return plain


def _model_tensors(model_state: Any) -> dict[str, torch.Tensor]:
    if not isinstance(model_state, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model_state.items()
    ):
        raise TypeError("checkpoint state 'model' must map parameter names to tensors")
    return dict(model_state)


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's state_dict in the schema: its int parameter keys as strings."""
    native = optimizer.state_dict()
    return {"state": {str(k): dict(v) for k, v in native["state"].items()}, "param_groups": native["param_groups"]}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    native_state = {}
    for key, value in state["state"].items():
        entry = dict(value)
        if "step" in entry and not isinstance(entry["step"], torch.Tensor):
            entry["step"] = torch.tensor(float(entry["step"]))
        native_state[int(key)] = entry
    optimizer.load_state_dict({"state": native_state, "param_groups": state["param_groups"]})


def rng_state() -> dict[str, Any]:
    """This process's Python, numpy, torch (and CUDA) RNG states, in the schema."""
    version, internal, gauss = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {"name": name, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["name"], np.asarray(n["key"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([state["cuda"][str(i)] for i in range(len(state["cuda"]))])


def check_finite_weights(tensors: dict[str, torch.Tensor], step: int) -> None:
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise DivergedError(
                f"refusing to save step {step}: model weight {name} holds {bad} non-finite values; "
                f"the previous checkpoints are kept"
            )


# ---- files ---------------------------------------------------------------------------------------
def write_part(directory: Path, stem: str, plain: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
    """Write `<stem>.safetensors` (and `<stem>.json` unless it is the model), fsynced. Returns bytes."""
    tensor_path = directory / f"{stem}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, tensor_path, metadata=SAFETENSORS_META)
    _fsync_file(tensor_path)
    num_bytes = tensor_path.stat().st_size
    if stem != "model":
        data = json.dumps(plain).encode()
        _write_synced(directory / f"{stem}.json", data)
        num_bytes += len(data)
    return num_bytes


def read_meta(path: Path) -> dict[str, Any] | None:
    """meta.json of a complete checkpoint (every listed file present with its size), else None."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        files = meta["files"]
        for name, info in files.items():
            if (path / name).stat().st_size != info["bytes"]:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta


def _step_of(path: Path) -> int:
    return int(STEP_DIR.fullmatch(path.name).group(1))


def complete_checkpoints(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Complete `step_N` directories (sizes as meta.json says), oldest first."""
    return [p for p in step_dirs(ckpt_dir) if read_meta(p) is not None]


def step_dirs(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Every `step_N` directory, complete or not, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted((p for p in ckpt_dir.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir()), key=_step_of)


def candidates(ckpt_dir: str | os.PathLike) -> list[Path]:
    """`step_N` directories not newer than `latest`, oldest first, complete or not (a resume says
    why it passes over an incomplete one).

    Updating `latest` is the commit. Directories newer than it are not trusted: a crash between the
    rename and the pointer update, or checkpoints of a run abandoned by resuming from an older step.
    Without a pointer, every directory."""
    found = step_dirs(ckpt_dir)
    try:
        pointer = STEP_DIR.fullmatch((Path(ckpt_dir) / "latest").read_text().strip())
    except OSError:
        pointer = None
    if pointer is not None:
        found = [p for p in found if _step_of(p) <= int(pointer.group(1))]
    return found


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest complete candidate (sizes as meta.json says; checksums are `select_checkpoint`'s)."""
    complete = [p for p in candidates(ckpt_dir) if read_meta(p) is not None]
    return complete[-1] if complete else None


def prunable(ckpt_dir: Path, step: int, keep: int) -> list[Path]:
    """Complete checkpoints older than the `keep` newest up to `step`; newer ones are never touched."""
    upto = [p for p in complete_checkpoints(ckpt_dir) if _step_of(p) <= step]
    return upto[: max(0, len(upto) - keep)]


def _files_for_rank(meta: dict[str, Any], rank: int) -> list[str]:
    mine = [n for n in meta["files"] if not n.startswith("rank_") or n.startswith(rank_stem(rank) + ".")]
    return [n for n in mine if n != "meta.json"]


def checkpoint_problem(path: Path, rank: int = 0) -> str | None:
    """Why `rank` cannot use the checkpoint at `path`, or None: every file it reads is checked
    against its recorded size and sha256."""
    meta = read_meta(path)
    if meta is None:
        return "incomplete: meta.json missing or damaged, or a file missing or truncated"
    if meta.get("format_version") != FORMAT_VERSION:
        return f"format_version {meta.get('format_version')!r}, this code reads {FORMAT_VERSION}"
    if f"{rank_stem(rank)}.json" not in meta["files"]:
        return f"saved by {meta['world_size']} rank(s); it holds no state for rank {rank}"
    for name in _files_for_rank(meta, rank):
        if file_sha256(path / name) != meta["files"][name]["sha256"]:
            return f"{name} does not match its checksum (damaged)"
    return None


def select_checkpoint(ckpt_dir: str | os.PathLike, rank: int = 0) -> Selection:
    """The newest checkpoint (not newer than `latest`) whose files all verify, and those skipped."""
    selection = Selection(None)
    for path in reversed(candidates(ckpt_dir)):
        problem = checkpoint_problem(path, rank)
        if problem is None:
            selection.path = path
            return selection
        selection.skipped.append((str(path), problem))
    return selection


def load_checkpoint(path: str | os.PathLike, rank: int = 0) -> dict[str, Any]:
    """The state saved at `path` as seen by `rank`: shared parts plus this rank's own, CPU tensors,
    after checking every file it reads against meta.json."""
    path = Path(path)
    problem = checkpoint_problem(path, rank)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path}: {problem}")
    meta = read_meta(path)
    state: dict[str, Any] = {}
    if MODEL_FILE in meta["files"]:
        state["model"] = load_file(path / MODEL_FILE)
    if "shared.json" in meta["files"]:
        shared = json.loads((path / "shared.json").read_text())
        state.update(join_tensors(shared, load_file(path / "shared.safetensors")))
    stem = rank_stem(rank)
    own = json.loads((path / f"{stem}.json").read_text())
    state.update(join_tensors(own, load_file(path / f"{stem}.safetensors")))
    return {key: state[key] for key in meta["keys"]}


def read_model_weights(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], Path]:
    """(drafter weights, the file read) from a `model.safetensors`, a folder holding one (a
    checkpoint step or an export), or a checkpoints folder (`select_checkpoint`'s choice). A
    training checkpoint is verified against its checksums first."""
    path = Path(path)
    if path.is_dir() and not (path / MODEL_FILE).is_file():
        selection = select_checkpoint(path)
        if selection.path is None:
            reasons = "; ".join(f"{p}: {why}" for p, why in selection.skipped) or "none saved yet"
            raise CheckpointError(f"no usable checkpoint in {path} ({reasons}); train first (`make train`)")
        path = selection.path
    folder, file = (path.parent, path) if path.is_file() else (path, path / MODEL_FILE)
    if not file.is_file():
        raise CheckpointError(f"no drafter weights at {path}: expected {MODEL_FILE}")
    if (folder / "meta.json").is_file():
        problem = checkpoint_problem(folder)
        if problem is not None:
            raise CheckpointError(f"checkpoint {folder}: {problem}")
    try:
        return load_file(file), file
    except Exception as exc:  # noqa: BLE001 - a damaged export: name it
        raise CheckpointError(f"{file} cannot be read ({exc})") from exc


def check_compatible(
    saved_config: dict[str, Any], current_config: dict[str, Any], force: bool = False
) -> list[str]:
    """Differences in COMPATIBILITY_FIELDS, as 'field: saved X, now Y'. Raises unless `force`."""
    differences = []
    for key in COMPATIBILITY_FIELDS:
        saved, current = _lookup(saved_config, key), _lookup(current_config, key)
        if saved is _ABSENT and current is _ABSENT:
            continue
        if key in OPTIONAL_FIELDS and (saved is _ABSENT or current is _ABSENT):
            continue
        if _plain(saved) != _plain(current):
            differences.append(f"{key}: saved {saved!r}, now {current!r}")
    if differences and not force:
        raise CheckpointError(
            "cannot resume: "
            + "; ".join(differences)
            + " (these change what training computes; set train.resume_force=true to accept it)"
        )
    return differences


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


def _lookup(config: Mapping[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ---- durable files ------------------------------------------------------------------------------
def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
