"""The snapshot of a save: the only part the training loop waits for.

    buffers = Snapshots()
    job = buffers.take(step, state, rank)      # every tensor copied into a CPU buffer kept between saves
    buffers.allocate(buffers.take(step, state, rank, copy=False))   # in the background, before the first save

Tensors are copied into buffers allocated once (pinned on CUDA, with non-blocking copies and one
synchronize per device); the plain parts go as they are. A job lists the files its rank writes:
(file stem, plain values, tensors), laid out as `format.py` describes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stage2_train.train.checkpoint.format import (
    DESCRIPTION_KEY,
    SHARED_KEYS,
    _model_tensors,
    rank_stem,
    split_tensors,
)


@dataclass
class Job:
    step: int
    parts: list[tuple[str, dict[str, Any], dict[str, torch.Tensor]]]  # (file stem, plain values, tensors)
    keys: list[str]
    blocked_s: float = 0.0
    waited_s: float = 0.0
    mode: str = "async"
    write_s: float = 0.0
    num_bytes: int = 0
    error: BaseException | None = None
    best: dict[str, Any] | None = None  # the `best` record when the save began (meta.json, for a rollback)


class Snapshots:
    """The CPU buffers saves copy into, reused from one save to the next."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, step: int, state: Mapping[str, Any], rank: int, copy: bool = True) -> Job:
        """Copy `state` into the CPU buffers; with copy=False, a job holding the live tensors."""
        if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
            raise TypeError("checkpoint state must be a dict with string keys")
        used: set[str] = set()
        devices: set[torch.device] = set()

        def copy_out(key: str, tensor: torch.Tensor) -> torch.Tensor:
            tensor = tensor.detach()
            if not copy:
                return tensor
            buf = self.buffers.get(key)
            if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
                self.buffers[key] = buf
            used.add(key)
            if tensor.is_cuda:
                devices.add(tensor.device)
            buf.copy_(tensor, non_blocking=tensor.is_cuda)
            return buf

        parts = []
        if rank == 0 and any(k in state for k in SHARED_KEYS):
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
        if rank == 0 and DESCRIPTION_KEY in state:
            parts.append((DESCRIPTION_KEY, state[DESCRIPTION_KEY], {}))
        rank_tensors: dict[str, torch.Tensor] = {}
        stem = rank_stem(rank)
        plain = {
            k: split_tensors(v, k, rank_tensors, lambda key, t: copy_out(f"{stem}/{key}", t))
            for k, v in state.items()
            if k not in SHARED_KEYS and k != DESCRIPTION_KEY
        }
        parts.append((stem, plain, rank_tensors))
        for device in devices:
            torch.cuda.synchronize(device)
        if copy:
            self.buffers = {k: v for k, v in self.buffers.items() if k in used}
        return Job(step=step, parts=parts, keys=list(state))

    def allocate(self, job: Job) -> None:
        """Background: a buffer for every tensor of `job` (whose tensors are the live ones)."""
        buffers = {}
        for stem, _, tensors in job.parts:  # buffer keys are "<file stem>/<tensor key>", as in take
            for key, tensor in tensors.items():
                buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
                if not tensor.is_cuda:
                    buf.zero_()  # fault the pages in now rather than during the snapshot
                buffers[f"{stem}/{key}"] = buf
        self.buffers = buffers
