"""Checkpoints that neither stall training nor change it: the asynchronous saver.

    .venv/bin/python -m pytest tests/test_checkpoint.py -q      # behaviour
    .venv/bin/python bench/checkpoint.py --json ckpt.json      # blocked time, async vs sync

Use from the trainer:

    ckpt = Checkpointer(cfg, paths.checkpoints, sink, rank, world_size)
    ckpt.register({"model": model, "optimizer": optimizers, ...})   # components with their own state_dict
    selection = ckpt.select()                          # newest complete checkpoint whose checksums hold
    ckpt.load_state_dict(ckpt.load(selection.path))    # verified once, in select; every component restored
    for step in ...:                                   # step = optimizer steps completed
        train_step()
        ckpt.maybe_save(step)                          # every `every_steps`; returns after a CPU copy
    ckpt.save(step, blocking=True)                     # the final checkpoint (skipped if already saved)
    ckpt.finalize()                                    # in `finally`: waits, re-raises a writer error

The checkpointer owns the registry of what a checkpoint holds: each component's `state_dict()` is
taken at the snapshot, and a resume calls each one's `load_state_dict` (a component renamed since a
checkpoint was written is read under its old name: COMPONENT_RENAMES).

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

Every rank writes its files into `.tmp-step_N/` (`format.py` has the layout), fsyncs them, and the
ranks agree (one all_reduce on a gloo group of their own, so the writer thread never shares a
collective with DDP); then rank 0 hashes every file, writes meta.json, renames the directory to
`step_N`, updates `latest`, and prunes to `keep_latest_k` (`select.py`). A crash at any point leaves
the previous checkpoint intact. Several nodes need `ckpt_dir` on a shared file system.
Rank 0 names the files it hashes (`format.expected_files`) rather than listing the directory: on NFS
a cached listing can miss another node's files, and a resume would skip that checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shared.errors import CheckpointError, UserError
from shared.files import file_sha256, fsync_dir, write_atomic
from stage2_train.train.checkpoint.format import (
    FORMAT_VERSION,
    SHARED_KEYS,
    TMP_PREFIX,
    check_finite_weights,
    checkpoint_problem,
    expected_files,
    load_checkpoint,
    read_meta,
    step_name,
    write_part,
    written_sizes,
)
from stage2_train.train.checkpoint.select import (
    BEST,
    Selection,
    best_pointer,
    best_saved_with,
    candidates,
    latest_checkpoint,
    prunable,
)
from stage2_train.train.checkpoint.snapshot import Job, Snapshots
from stage2_train.train.config import CheckpointConfig


class CheckpointWriteError(UserError):
    """A save failed in the background (a full disk, a lost rank); raised on the caller's thread."""

# Components renamed since checkpoints were written (new name -> old), and those older checkpoints lack.
COMPONENT_RENAMES = {"loader": "sampler"}
OPTIONAL_COMPONENTS = {"drafter"}


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
        self.components: dict[str, Any] = {}
        self._snapshots = Snapshots()
        self._thread: threading.Thread | None = None
        self._job: Job | None = None
        self._last_step: int | None = None
        # A group of our own, so the writer thread's collective never interleaves with DDP's.
        self._group = dist.new_group(backend="gloo") if world_size > 1 else None
        best = self._read_best() if cfg.keep_best else None
        # The pointer names its metric: walk_tau when the evals score every anchor, else accept_len.
        self.best_metric: str = "walk_tau" if best is None else str(best.get("metric", "walk_tau"))
        self.best_value: float | None = None if best is None else best.get("value", best.get("walk_tau"))
        self.best_step: int | None = None if best is None else best["step"]  # the step best_value was scored at
        # The held-out samples and anchors the value was estimated on (`note_eval`'s basis).
        self.best_basis: dict | None = None if best is None else best.get("basis")
        self._best_step: int | None = None  # a save of this step is the new best: point at it once committed
        self._pointed_step: int | None = None  # the step `best` was last pointed at by this process
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for leftover in self.dir.glob(TMP_PREFIX + "*"):
                shutil.rmtree(leftover, ignore_errors=True)
        if self._group is not None:
            dist.barrier(group=self._group)

    def _read_best(self, path: Path | None = None) -> dict | None:
        """The `best` pointer (or the one checkpoint `path` was saved with) as rank 0 reads it, on every
        rank: ranks reading it themselves can see different files (NFS caches), disagree on a new best,
        and pair the agreement collectives up wrongly."""
        pointer = [None if self.rank else best_pointer(self.dir) if path is None else best_saved_with(path)]
        if self._group is not None:
            dist.broadcast_object_list(pointer, src=0, group=self._group)
        return pointer[0]

    # ---- the registry -------------------------------------------------------------------------
    def register(self, components: Mapping[str, Any]) -> None:
        """What a checkpoint holds: name -> a component with `state_dict()` and `load_state_dict()`."""
        self.components = dict(components)

    def state_dict(self) -> dict[str, Any]:
        return {name: component.state_dict() for name, component in self.components.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Every registered component from a checkpoint's state (old component names read too)."""
        state = {new: state[old] for new, old in COMPONENT_RENAMES.items() if old in state and new not in state} | dict(state)
        missing = [n for n in self.components if n not in state and n not in OPTIONAL_COMPONENTS]
        if missing:
            raise CheckpointError(f"checkpoint state lacks {missing}; it was written by another version")
        for name, component in self.components.items():
            if name in state:
                component.load_state_dict(state[name])

    # ---- saving -----------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """True while a background write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def is_due(self, step: int) -> bool:
        return self.cfg.every_steps > 0 and step > 0 and step % self.cfg.every_steps == 0

    def maybe_save(self, step: int, state_fn: Callable[[], dict[str, Any]] | None = None) -> bool:
        """Save if `step` is a multiple of `every_steps`; whether a save started. At the first call that
        is not a save step, the snapshot buffers are allocated (pages touched) in the background, so
        that no save pays for it inside the loop."""
        self._poll()
        state_fn = state_fn or self.state_dict
        if self.is_due(step):
            return self.save(step, state_fn)
        if self.cfg.async_save and self.cfg.every_steps > 0 and not self._snapshots.buffers and not self.busy:
            self._start_thread(self._snapshots.allocate, self._snapshots.take(step, state_fn(), self.rank, copy=False))
        return False

    def save(self, step: int, state_fn: Callable[[], dict[str, Any]] | None = None, blocking: bool = False) -> bool:
        """Save now (async unless `blocking` or `async_save` is off). False if `step` is already saved.
        `state_fn`: the state to save; the registered components' by default."""
        state_fn = state_fn or self.state_dict
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
        job = self._snapshots.take(step, state_fn(), self.rank)
        job.waited_s, job.best = waited_s, None if self.best_step is None else self._best_record(self.best_step)
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

    def note_eval(
        self, step: int, value: float | None, state_fn: Callable[[], dict[str, Any]] | None = None, metric: str = "walk_tau",
        basis: dict[str, Any] | None = None,
    ) -> bool:
        """checkpoint.keep_best: when this eval's `metric` (higher is better) beats every earlier one,
        save this step (unless it is saved already) and point `best` at it once the save commits.
        Every rank calls it with the same row (the eval is reduced over ranks). Returns whether it is
        the new best. A pointer of another metric, or of another `basis` (what the value was estimated
        on: the eval's samples and anchors, changed on resume; compared when both record one), is
        replaced: values on other samples are not comparable, and the old one could stay best for good."""
        if not self.cfg.keep_best or value is None:
            return False
        if metric != self.best_metric or (None not in (basis, self.best_basis) and basis != self.best_basis):
            self.best_metric, self.best_value = metric, None
        if self.best_value is not None and value <= self.best_value:
            return False
        self.best_value, self._best_step, self.best_step, self.best_basis = value, step, step, basis
        if not self.save(step, state_fn) and step == self._last_step and not self.busy:
            self._point_best(step)  # this step was committed before the eval named it the best
        # else: a save of this step is being written (begun now or before the eval); `_poll` points
        # at it on the main thread once it has committed, whatever the writer thread saw.
        return True

    def _point_best(self, step: int) -> None:
        """Rank 0 writes the `best` pointer at `step` (committed) and logs it, once per step."""
        if step == self._pointed_step:
            return
        self._pointed_step = step
        if self.rank == 0:
            write_atomic(self.dir / BEST, json.dumps(self._best_record(step)))
        self._event("best_checkpoint", step, **{self.best_metric: self.best_value}, path=str(self.dir / step_name(step)))

    def _best_record(self, step: int) -> dict[str, Any]:
        basis = {} if self.best_basis is None else {"basis": self.best_basis}
        return {"step": step, "metric": self.best_metric, "value": self.best_value, **basis}

    def mark_saved(self, step: int) -> None:
        """`step` is already on disk (a resumed run that has nothing left to train): no final save."""
        self._last_step = step

    def resumed_at(self, step: int, path: str | os.PathLike | None = None) -> None:
        """A run resumed from `step` (on disk at `path`: no second save of it). Resumed from an older
        checkpoint of this folder, what is newer belongs to the run this resume abandons: `latest` moves
        back to `path` now (lost before its first save, `train.resume=auto` would continue the abandoned
        run), and a `best` newer than `step` is forgotten (kept, its value would keep this run's better
        checkpoints from being named), and the best as of `step` (`path`'s meta.json) named again."""
        self.mark_saved(step)
        ours = path is not None and Path(path).parent.resolve() == self.dir.resolve()
        newest = self.latest() if ours and self.rank == 0 else None
        if newest is not None and (read_meta(newest) or {}).get("step", step) > step:
            write_atomic(self.dir / "latest", Path(path).name + "\n")
        if self.best_step is not None and self.best_step > step:
            self.forget_best(step, f"resuming from step {step}", self._read_best(Path(path)) if ours else None)

    def forget_best(self, step: int, why: str, earlier: dict | None = None) -> None:
        """Forget the `best` of a run this one abandons (`why`), logged at `step`; name `earlier` again."""
        forgotten = self._best_record(self.best_step)
        self.best_value = self.best_step = self.best_basis = None
        if earlier is not None:
            self.best_metric, self.best_value, self.best_basis = earlier["metric"], earlier["value"], earlier.get("basis")
            self.best_step = self._pointed_step = earlier["step"]
        if self.rank == 0:
            if earlier is None:
                (self.dir / BEST).unlink(missing_ok=True)
            else:
                write_atomic(self.dir / BEST, json.dumps(earlier))
            again = "" if earlier is None else f"; `best` is step {earlier['step']} again ({earlier['metric']} {earlier['value']})"
            print(f"warning: {why}: forgetting {self.dir / BEST} (step {forgotten['step']}, "
                  f"{forgotten['metric']} {forgotten['value']}), an eval of the run this one abandons{again}", file=sys.stderr)
        self._event("best_forgotten", step, best_step=forgotten["step"], metric=forgotten["metric"], value=forgotten["value"],
                    best_again=None if earlier is None else earlier["step"])

    def _start_thread(self, target: Callable[[Job], None], job: Job) -> None:
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
            raise CheckpointWriteError(f"checkpoint {path} failed: {job.error!r}{self._fix(job.error)}") from job.error
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
        if job.step == self._best_step:
            self._point_best(job.step)

    def _fix(self, error: BaseException) -> str:
        """What to do about a failed save: for a full disk, how much is free and what to change."""
        if not (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)):
            return ""
        free = shutil.disk_usage(self.dir).free
        return (
            f"; the partial save was removed, the previous checkpoints are intact, {free / 2**30:.2f} GiB are free on "
            f"{self.dir}: free space there, set checkpoint.dir to a larger disk, or lower checkpoint.keep_latest_k"
        )

    def _event(self, kind: str, step: int, **fields: Any) -> None:
        if self.sink is not None:
            self.sink.event(kind, step, **fields)

    # ---- the write (background thread) --------------------------------------------------------
    def _write(self, job: Job) -> None:
        t0 = time.perf_counter()
        try:
            self._write_and_commit(job)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread by _poll
            job.error = exc
        job.write_s = time.perf_counter() - t0

    def _write_and_commit(self, job: Job) -> None:
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
        if not self.agree(error is None):
            if self.rank == 0:  # a partial save holds disk the next one may need: remove it now
                shutil.rmtree(tmp, ignore_errors=True)
            raise error or RuntimeError("another rank failed to write its part")
        if self.rank == 0:
            try:
                self._commit(job, tmp)
            except BaseException as exc:  # noqa: BLE001 - the other ranks must still hear about it
                error = exc
        # A second agreement: when finalize() returns on any rank, the checkpoint is committed.
        if not self.agree(error is None):
            raise error or RuntimeError("rank 0 failed to commit the checkpoint")

    def _commit(self, job: Job, tmp: Path) -> None:
        """Rank 0: meta.json (every file's size and sha256), rename, `latest`, prune."""
        name = tmp.name[len(TMP_PREFIX) :]
        sizes = written_sizes(tmp, expected_files([stem for stem, _, _ in job.parts], self.world_size))
        files = {n: {"bytes": size, "sha256": file_sha256(tmp / n)} for n, size in sizes.items()}
        meta = {
            "format_version": FORMAT_VERSION,
            "step": job.step,
            "world_size": self.world_size,
            "keys": job.keys,
            "shared_keys": list(SHARED_KEYS),
            "files": files,
            **({"best": job.best} if job.best else {}),
        }
        write_atomic(tmp / "meta.json", json.dumps(meta, indent=1))
        job.num_bytes += (tmp / "meta.json").stat().st_size
        fsync_dir(tmp)
        final = self.dir / name
        if final.exists():  # a stale copy of this step, e.g. from a run that crashed before `latest`
            stale = self.dir / (TMP_PREFIX + "replaced-" + name)
            os.replace(final, stale)
            shutil.rmtree(stale)
        os.replace(tmp, final)
        fsync_dir(self.dir)
        write_atomic(self.dir / "latest", name + "\n")  # the commit
        if self._best_step == job.step:
            write_atomic(self.dir / BEST, json.dumps(self._best_record(job.step)))
        for old in prunable(self.dir, job.step, self.cfg.keep_latest_k):
            shutil.rmtree(old)

    def agree(self, ok: bool) -> bool:
        """True when `ok` on every rank (a collective: every rank calls it)."""
        if self._group is None:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    # ---- reading ------------------------------------------------------------------------------
    def latest(self) -> Path | None:  # the newest complete one by the pointer rule (sizes only, no checksums)
        return latest_checkpoint(self.dir)

    def select(self) -> Selection:
        """The newest checkpoint every rank can use (`select_checkpoint`'s rule) in rank 0's listing (a
        node's cached one can lack the newest step: ranks resumed at other steps, or hung). Rank 0 hashes
        the shared files, each rank its own; one all_reduce agrees. Load it with `verified=True`."""
        selection, listed = Selection(None), [candidates(self.dir) if self.rank == 0 else None]
        if self._group is not None:
            dist.broadcast_object_list(listed, src=0, group=self._group)
        for path in reversed(listed[0]):
            self.refuse_other_world_size(path)
            problem = self.verify(path)
            if problem is None:
                selection.path = path
                return selection
            selection.skipped.append((str(path), problem))
        return selection

    def refuse_other_world_size(self, path: Path) -> None:
        """A checkpoint saved by another number of ranks is this run's history, not damage: skipping
        it would start afresh and later overwrite it. Every rank reads the same meta.json, so every
        rank raises alike (no collective)."""
        meta = read_meta(path)
        if meta is not None and meta.get("world_size") not in (None, self.world_size):
            raise CheckpointError(
                f"{path}: saved by {meta['world_size']} rank(s), this run has {self.world_size}: the data position and "
                f"per-rank state do not split across another rank count; relaunch with {meta['world_size']} processes "
                f"(torchrun --nproc_per_node {meta['world_size']}), or start afresh in another run_dir (or train.resume=never)"
            )

    def verify(self, path: str | os.PathLike) -> str | None:
        """Why some rank cannot use the checkpoint at `path`, agreed by every rank, or None. Each
        file is hashed by one rank only (see `select`)."""
        problem = checkpoint_problem(Path(path), self.rank, shared=self.rank == 0)
        if self.agree(problem is None):
            return None
        return problem or "another rank found its part damaged"

    def load(self, path: str | os.PathLike, *, verified: bool = False) -> dict[str, Any]:
        return load_checkpoint(path, self.rank, verified=verified)
