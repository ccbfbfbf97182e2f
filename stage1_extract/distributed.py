"""Stage 1 under torchrun / accelerate launch: the rank's place, barriers, and agreement.

    join_ranks(world)        # the network check, then the process groups (before any collective)
    ...
    wait_for_ranks(world)    # a barrier that waits for the slowest rank's tokenizing, target or shards
    leave_ranks(world)

Only barriers and small agreements travel (gloo works on CPU and GPU nodes). Every rank reaches
every collective, also on bad input or a busy store: a rank that failed raises after the others
have heard of it. Two timeouts: joining and the quick agreements (the store lock's vote) give up
after JOIN_TIMEOUT, so a node that never joins (it refused the network check, or its launch failed)
stops the others in minutes; only the barriers that wait for other ranks' work run on a group of
their own with WORK_TIMEOUT, since the default 30 minutes would kill healthy runs there.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from shared.errors import StoreError
from shared.lock import exclusive_on_rank0
from shared.target_model import resolve_device


def distributed_context() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun / accelerate launch variables."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


JOIN_TIMEOUT = timedelta(minutes=10)  # the rendezvous and the store lock's vote
WORK_TIMEOUT = timedelta(hours=6)  # a barrier behind the slowest rank's tokenizing, target load, shards, merge
_work_group: Any = None  # the gloo group of those barriers, WORK_TIMEOUT (made by join_ranks)


def join_ranks(world: int, backend: str = "gloo") -> None:
    """Under torchrun (world > 1, no process group yet): refuse a network gloo cannot serve, then join
    the default group (JOIN_TIMEOUT) and make the group the long barriers wait in (WORK_TIMEOUT).
    `backend`: "cpu:gloo,cuda:nccl" where a tensor-parallel target's activations travel over NCCL;
    barriers and agreements always go over the gloo work group (CPU tensors)."""
    global _work_group
    import torch.distributed as dist

    from shared.network import check_gloo_network

    if world == 1 or dist.is_initialized():
        return
    check_gloo_network()  # a hostname on loopback would hang the first collective
    dist.init_process_group(backend, timeout=JOIN_TIMEOUT)
    _work_group = dist.new_group(backend="gloo", timeout=WORK_TIMEOUT)


def leave_ranks(world: int) -> None:
    global _work_group
    if world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        _work_group = None


def wait_for_ranks(world: int) -> None:
    """A barrier behind other ranks' work (tokenizing, loading the target, extracting, merging): up to
    WORK_TIMEOUT, on join_ranks's group (the default group, JOIN_TIMEOUT, when another caller made it)."""
    if world > 1:
        import torch.distributed as dist

        dist.barrier(group=_work_group)


def agreed_done(done: set[int], num_shards: int, world: int) -> set[int]:
    """Rank 0's reading of which shards are done, on every rank (a CPU tensor over the gloo work
    group): the ranks of a tensor-parallel group must run the same batches, so none decides from its
    own reading (and a rank that sees the file system later than rank 0 does not redo a shard)."""
    if world == 1:
        return done
    import torch
    import torch.distributed as dist

    flags = torch.zeros(num_shards, dtype=torch.uint8)
    flags[sorted(done)] = 1
    dist.broadcast(flags, src=0, group=_work_group)
    return {int(i) for i in flags.nonzero().flatten()}


def from_rank_0(value: Any, world: int) -> Any:
    """Rank 0's `value` on every rank (the others pass None): what rank 0 read from the store's files,
    which a rank on another node may not see yet (NFS attribute caching) or see as another copy."""
    if world == 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0, group=_work_group)
    return box[0]


@contextmanager
def store_lock(url: str, rank: int, world: int, command: str) -> Iterator[str | None]:
    """Rank 0 holds the store's lock for the whole job; every rank learns at once if it could not.
    Yields the lock's kind on rank 0 ("flock", or "lease" where the file system has no flock)."""
    with exclusive_on_rank0(url, f"stage1_extract {command}", rank, lambda ok: all_ok(world, ok)) as kind:
        yield kind


def all_ok(world: int, ok: bool, behind_work: bool = False) -> bool:
    """Whether every rank is `ok`, on every rank. `behind_work`: some rank may first do long work (rank
    0 fitting fp4's outlier channels), so the agreement waits up to WORK_TIMEOUT on the work group."""
    if world == 1:
        return ok
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=_work_group if behind_work else None)
    return bool(flag.item())


def on_rank_0(rank: int, world: int, work: Callable[[], Any], refused: str, behind_work: bool = True) -> Any:
    """`work` on rank 0 alone, its outcome agreed by every rank: rank 0 returns its result (the others
    None), or every rank raises together (rank 0 its own error, the others `refused`), so no rank
    is left waiting in the next collective for one that raised."""
    result, error = None, None
    if rank == 0:
        try:
            result = work()
        except BaseException as exc:  # noqa: BLE001 - raised after the agreement, which every rank reaches
            error = exc
    if not all_ok(world, error is None, behind_work=behind_work):
        if error is not None:
            raise error
        raise StoreError(refused)
    return result


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

