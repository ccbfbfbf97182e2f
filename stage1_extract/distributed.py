"""Stage 1 under torchrun / accelerate launch: the rank's place, barriers, and agreement.

Only barriers and small agreements travel (gloo works on CPU and GPU nodes). Every rank reaches
every collective, also on bad input or a busy store: a rank that failed raises after the others
have heard of it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from shared.lock import exclusive_on_rank0
from shared.target_model import resolve_device


def distributed_context() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun / accelerate launch variables."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def _barrier(world: int) -> None:
    """Every rank here before any goes on: an all-reduce of a CPU tensor, so it travels over gloo
    also where the process group holds NCCL for a tensor-parallel target's activations."""
    if world > 1:
        import torch
        import torch.distributed as dist

        dist.all_reduce(torch.zeros(1, dtype=torch.int32))


def agreed_done(done: set[int], num_shards: int, world: int) -> set[int]:
    """Rank 0's reading of which shards are done, on every rank (a CPU tensor over gloo): the ranks
    of a tensor-parallel group must run the same batches, so none decides from its own reading."""
    if world == 1:
        return done
    import torch
    import torch.distributed as dist

    flags = torch.zeros(num_shards, dtype=torch.uint8)
    flags[sorted(done)] = 1
    dist.broadcast(flags, src=0)
    return {int(i) for i in flags.nonzero().flatten()}


@contextmanager
def store_lock(url: str, rank: int, world: int, command: str) -> Iterator[str | None]:
    """Rank 0 holds the store's lock for the whole job; every rank learns at once if it could not.
    Yields the lock's kind on rank 0 ("flock", or "lease" where the file system has no flock)."""
    with exclusive_on_rank0(url, f"stage1_extract {command}", rank, lambda ok: _all_ok(world, ok)) as kind:
        yield kind


def _all_ok(world: int, ok: bool) -> bool:
    if world == 1:
        return ok
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def rank_device(setting: str, local_rank: int) -> str:
    """This rank's device, made current before anything touches CUDA: under torchrun every rank
    would otherwise share cuda:0's default stream and context, and a sync of "the current stream"
    would not wait for copies issued on cuda:k (stores written from half-copied buffers)."""
    device = resolve_device(setting)
    if not device.startswith("cuda"):
        return device
    import torch

    index = local_rank if device == "cuda" else torch.device(device).index
    torch.cuda.set_device(index)
    return f"cuda:{index}"

