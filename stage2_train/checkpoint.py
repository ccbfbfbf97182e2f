"""Checkpoints that neither stall training nor change it, and an exact resume.

    .venv/bin/python -m pytest tests/test_checkpoint.py -q      # behaviour
    .venv/bin/python bench/checkpoint.py --json ckpt.json      # blocked time, async vs sync

Use from the trainer:

    ckpt = Checkpointer(cfg, cfg.resolve_dir(run_dir), sink, rank, world_size)
    if (path := ckpt.latest()) is not None:
        state = ckpt.load(path)
        check_compatible(state["config"], current_config, force)
        ...                                            # load_state_dict() of every component
    for step in ...:                                   # step = optimizer steps completed
        train_step()
        ckpt.maybe_save(step, state_fn)                # every `every_steps`; returns after a CPU copy
    ckpt.save(step, state_fn, blocking=True)           # the final checkpoint (skipped if already saved)
    ckpt.finalize()                                    # in `finally`: waits, re-raises a writer error

A save has two halves. The snapshot is the only time the loop waits: `state_fn()` is called and every
tensor is copied into a CPU buffer kept between saves (pinned memory and non_blocking copies on CUDA,
then one synchronize per device); containers are rebuilt and numpy arrays copied, so the loop may change
anything once `maybe_save` returns. The buffers (host memory the size of the state) are allocated in
the background at the first `maybe_save` call, so the first save does not pay for them either. A background thread then writes the files. One save is in flight
at most: a save that comes due while one is writing waits for it, and `waited_s` in its events says so.
Events, sent from the caller's thread only: `checkpoint_start` (step, waited_s) and `checkpoint_end`
(step, blocked_s, write_s, bytes, path, mode); an async save's end event goes out at the first call
after the writer finished. A writer error is re-raised by the next call (or `finalize`), naming the path.

On-disk layout (FORMAT_VERSION 1). No pickles: tensors go to safetensors, the rest to JSON.

    ckpt_dir/
      latest                     "step_000500": replaced atomically, after the directory is complete
      step_000500/
        model.safetensors        state["model"] under the model's own key names (rank 0; export reads it)
        shared.safetensors       the other tensors of SHARED_KEYS, e.g. the optimizer state (rank 0)
        shared.json              the structure of SHARED_KEYS, tensors replaced by tags (rank 0)
        rank_00000.safetensors   tensors of every other key (torch RNG states, ...), one pair per rank
        rank_00000.json          structure of every other key (rng, sampler, noise, trainer, config)
        meta.json                version, step, world size, top-level keys, every file with its size
      .tmp-step_001000/          a save being written; removed at start-up if a crash left it

Every rank writes its files into `.tmp-step_N/`, fsyncs them, and the ranks agree (one all_reduce on a
gloo group of their own, so the writer thread never shares a collective with DDP); then rank 0 writes
meta.json, renames the directory to `step_N`, updates `latest`, and prunes to `keep_latest_k`. A crash
at any point leaves the previous checkpoint intact. DDP keeps model and optimizer identical on every
rank, so rank 0 alone writes SHARED_KEYS; sharded optimizer state (ZeRO, FSDP) is outside this format.
Several nodes need `ckpt_dir` on a shared file system.

JSON tags: {"__tensor__": key} a tensor of the part's safetensors file; {"__ndarray__": key, "dtype",
"shape"} a numpy array stored as raw bytes; {"__np__": dtype, "value"} a numpy scalar; {"__tuple__":
[...]}; {"__dict__": [[k, v], ...]} a dict with non-string keys (optimizer state ids) or a key that
is a tag; {"__model__": [keys]} the model state dict, in order. Ints, floats (repr), bools, None and
strings round-trip exactly. Subclasses come back as their base type (OrderedDict -> dict, a NamedTuple
-> tuple); any other object is a TypeError naming its path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from shared.config import Section

FORMAT_VERSION = 1
SHARED_KEYS = ("model", "optimizer")  # identical on every DDP rank: written once, by rank 0
STEP_DIR = re.compile(r"step_(\d+)")
TMP_PREFIX = ".tmp-"
SAFETENSORS_META = {"format": "pt"}  # what transformers' loaders expect in the header

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

TENSOR, NDARRAY, NPSCALAR, TUPLE, DICT, MODEL = (
    "__tensor__",
    "__ndarray__",
    "__np__",
    "__tuple__",
    "__dict__",
    "__model__",
)
TAGS = {TENSOR, NDARRAY, NPSCALAR, TUPLE, DICT, MODEL}


@dataclass(kw_only=True)
class CheckpointConfig(Section):
    section: ClassVar[str] = "checkpoint"
    # Save every N optimizer steps; 0 = no periodic saves, only the trainer's final save at the end.
    every_steps: int = 0
    # Complete checkpoints kept; older ones are deleted after each successful save.
    keep_latest_k: int = 2
    # Write in a background thread after a CPU snapshot; false = the loop waits for the whole write.
    async_save: bool = True
    # None = <run_dir>/checkpoints
    dir: str | None = None

    def validate(self) -> None:
        self.require(self.every_steps >= 0, "every_steps", "must be >= 0 (0 = only the final save)")
        self.require(
            self.keep_latest_k >= 2, "keep_latest_k", "must be >= 2 (a crash mid-save needs a fallback)"
        )

    def resolve_dir(self, run_dir: str | os.PathLike) -> Path:
        return Path(self.dir) if self.dir is not None else Path(run_dir) / "checkpoints"


class CheckpointError(RuntimeError):
    """A save failed in the background; raised on the caller's thread."""


@dataclass
class _Job:
    step: int
    parts: list[tuple[str, dict[str, Any], dict[str, torch.Tensor]]]  # (file stem, skeleton, tensors)
    keys: list[str]
    blocked_s: float = 0.0
    waited_s: float = 0.0
    mode: str = "async"
    write_s: float = 0.0
    num_bytes: int = 0
    error: BaseException | None = None


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
        state = state_fn()
        job = self._snapshot(step, state)
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
            raise CheckpointError(f"checkpoint {path} failed: {job.error!r}") from job.error
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
            shared_tensors: dict[str, torch.Tensor] = {}
            skeleton: dict[str, Any] = {}
            for key in SHARED_KEYS:
                if key == "model" and key in state:
                    skeleton[key] = _encode_model(state[key], model_tensors, copy_out)
                elif key in state:
                    skeleton[key] = _encode(
                        state[key], key, shared_tensors, lambda k, t: copy_out("shared/" + k, t)
                    )
            if model_tensors:
                parts.append(("model", {}, model_tensors))
            parts.append(("shared", skeleton, shared_tensors))
        rank_tensors: dict[str, torch.Tensor] = {}
        rank_skeleton = {
            k: _encode(v, k, rank_tensors, lambda k, t: copy_out(f"{rank_stem(self.rank)}/{k}", t))
            for k, v in state.items()
            if k not in SHARED_KEYS
        }
        parts.append((rank_stem(self.rank), rank_skeleton, rank_tensors))
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
            tmp.mkdir(parents=True, exist_ok=True)
            for stem, skeleton, tensors in job.parts:
                job.num_bytes += write_part(tmp, stem, skeleton, tensors)
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
        """Rank 0: meta.json, rename, `latest`, prune."""
        name = tmp.name[len(TMP_PREFIX) :]
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
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
        # Newer directories than this one belong to an abandoned run (resumed from an older step): kept.
        older = [p for p in complete_checkpoints(self.dir) if _step_of(p) < job.step]
        for old in older[: len(older) - (self.cfg.keep_latest_k - 1)]:
            shutil.rmtree(old)

    def _all_ranks_ok(self, ok: bool) -> bool:
        if self._group is None:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    # ---- reading ------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        return latest_checkpoint(self.dir)

    def load(self, path: str | os.PathLike) -> dict[str, Any]:
        return load_checkpoint(path, self.rank)

    @staticmethod
    def check_compatible(
        saved_config: dict[str, Any], current_config: dict[str, Any], force: bool = False
    ) -> list[str]:
        return check_compatible(saved_config, current_config, force)


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def rank_stem(rank: int) -> str:
    return f"rank_{rank:05d}"


def write_part(directory: Path, stem: str, skeleton: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
    """Write `<stem>.safetensors` (and `<stem>.json` unless it is the model), fsynced. Returns bytes."""
    tensor_path = directory / f"{stem}.safetensors"
    save_file(tensors, tensor_path, metadata=SAFETENSORS_META)
    _fsync_file(tensor_path)
    num_bytes = tensor_path.stat().st_size
    if stem != "model":
        data = json.dumps(skeleton).encode()
        _write_synced(directory / f"{stem}.json", data)
        num_bytes += len(data)
    return num_bytes


def read_meta(path: Path) -> dict[str, Any] | None:
    """meta.json of a complete checkpoint (every listed file present with its size), else None."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        files = meta["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for name, size in files.items():
        try:
            if (path / name).stat().st_size != size:
                return None
        except OSError:
            return None
    return meta


def _step_of(path: Path) -> int:
    return int(STEP_DIR.fullmatch(path.name).group(1))


def complete_checkpoints(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Complete `step_N` directories, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir()]
    return [p for p in sorted(found, key=_step_of) if read_meta(p) is not None]


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` names if it is complete, else the newest complete one before it.

    Updating `latest` is the commit. Directories newer than it are not trusted: a crash between the
    rename and the pointer update, or checkpoints of a run abandoned by resuming from an older step.
    Without a pointer, the newest complete directory.
    """
    found = complete_checkpoints(ckpt_dir)
    try:
        pointer = STEP_DIR.fullmatch((Path(ckpt_dir) / "latest").read_text().strip())
    except OSError:
        pointer = None
    if pointer is not None:
        found = [p for p in found if _step_of(p) <= int(pointer.group(1))]
    return found[-1] if found else None


def load_checkpoint(path: str | os.PathLike, rank: int = 0) -> dict[str, Any]:
    """The state saved at `path` as seen by `rank`: shared parts plus this rank's own, CPU tensors."""
    path = Path(path)
    meta = read_meta(path)
    if meta is None:
        raise ValueError(
            f"{path} is not a complete checkpoint (meta.json missing, or a file missing or truncated)"
        )
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version {meta.get('format_version')!r}, this reader knows {FORMAT_VERSION}"
        )
    if f"{rank_stem(rank)}.json" not in meta["files"]:
        raise ValueError(
            f"{path} was saved by {meta['world_size']} rank(s) and holds no state for rank {rank}"
        )
    state: dict[str, Any] = {}
    if "shared.json" in meta["files"]:
        model = load_file(path / "model.safetensors") if "model.safetensors" in meta["files"] else {}
        tensors = load_file(path / "shared.safetensors")
        state.update(_decode(json.loads((path / "shared.json").read_text()), tensors, model))
    tensors = load_file(path / f"{rank_stem(rank)}.safetensors")
    state.update(_decode(json.loads((path / f"{rank_stem(rank)}.json").read_text()), tensors, {}))
    return {key: state[key] for key in meta["keys"]}


def check_compatible(
    saved_config: dict[str, Any], current_config: dict[str, Any], force: bool = False
) -> list[str]:
    """Differences in COMPATIBILITY_FIELDS, as 'field: saved X, now Y'. Raises unless `force`."""
    differences = []
    for field in COMPATIBILITY_FIELDS:
        saved, current = _lookup(saved_config, field), _lookup(current_config, field)
        if saved is _ABSENT and current is _ABSENT:
            continue
        if field in OPTIONAL_FIELDS and (saved is _ABSENT or current is _ABSENT):
            continue
        if _plain(saved) != _plain(current):
            differences.append(f"{field}: saved {saved!r}, now {current!r}")
    if differences and not force:
        raise ValueError(
            "cannot resume: "
            + "; ".join(differences)
            + " (these change what training computes; force the resume to accept it)"
        )
    return differences


# ---- encoding ---------------------------------------------------------------------------------
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


CopyFn = Callable[[str, torch.Tensor], torch.Tensor]


def _encode_model(model_state: Any, tensors: dict[str, torch.Tensor], copy: CopyFn) -> dict[str, Any]:
    if not isinstance(model_state, Mapping):
        raise TypeError(f"checkpoint state 'model' must be a state dict, got {type(model_state).__name__}")
    for key, value in model_state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise TypeError(
                f"checkpoint state 'model' must map names to tensors; {key!r} holds {type(value).__name__}"
            )
        tensors[key] = copy("model/" + key, value)
    return {MODEL: list(model_state)}


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor], copy: CopyFn) -> Any:
    if isinstance(obj, torch.Tensor):
        key = _unique(path, tensors)
        tensors[key] = copy(key, obj)
        return {TENSOR: key}
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError(f"checkpoint state {path}: numpy arrays of objects cannot be stored")
        key = _unique(path, tensors)
        raw = torch.from_numpy(np.ascontiguousarray(obj).reshape(-1).view(np.uint8))
        tensors[key] = copy(key, raw)
        return {NDARRAY: key, "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {NPSCALAR: obj.dtype.str, "value": obj.item()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {TUPLE: [_encode(v, f"{path}/{i}", tensors, copy) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}/{i}", tensors, copy) for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) for k in obj) and not TAGS.intersection(obj):
            return {k: _encode(v, f"{path}/{k}", tensors, copy) for k, v in obj.items()}
        return {
            DICT: [
                [_encode(k, f"{path}/key", tensors, copy), _encode(v, f"{path}/{k}", tensors, copy)]
                for k, v in obj.items()
            ]
        }
    raise TypeError(
        f"checkpoint state {path}: cannot store a {type(obj).__name__} (plain data and tensors only)"
    )


def _unique(path: str, tensors: dict[str, torch.Tensor]) -> str:
    key, n = path, 1
    while key in tensors:  # {"a/b": x} and {"a": {"b": y}} flatten to the same name
        key, n = f"{path}#{n}", n + 1
    return key


def _decode(obj: Any, tensors: dict[str, torch.Tensor], model: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, model) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if TENSOR in obj:
        return tensors[obj[TENSOR]]
    if NDARRAY in obj:
        raw = tensors[obj[NDARRAY]].numpy()
        return raw.view(np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    if NPSCALAR in obj:
        return np.dtype(obj[NPSCALAR]).type(obj["value"])
    if TUPLE in obj:
        return tuple(_decode(v, tensors, model) for v in obj[TUPLE])
    if DICT in obj:
        return {_decode(k, tensors, model): _decode(v, tensors, model) for k, v in obj[DICT]}
    if MODEL in obj:
        return {key: model[key] for key in obj[MODEL]}
    return {k: _decode(v, tensors, model) for k, v in obj.items()}


# ---- durable files ------------------------------------------------------------------------------
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
