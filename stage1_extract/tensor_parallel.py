"""Targets larger than one GPU: tensor parallelism through transformers' own TP plans.

    python -m stage1_extract plan --config my-70b.yaml --gpu h100 --gpus 8 extract.tensor_parallel_size=8
    torchrun --nproc_per_node 8 -m stage1_extract extract --config my-70b.yaml extract.tensor_parallel_size=8

On transformers 5.x (this project's) the size must be 1 or the job's number of processes: it builds
its TP mesh over every rank itself (`launch_problem`, refused before any rank tokenizes). On 4.x,
where from_pretrained takes a group's device mesh, 8 GPUs also run 2 copies x 4
(`extract.tensor_parallel_size=4`), a path no test here has run.

Ranks form TP groups of `extract.tensor_parallel_size` consecutive ranks (so a group shares a node:
the size must divide the GPUs per node). Each group loads the target split by the model's own plan
(`from_pretrained(tp_plan="auto", device_mesh=...)`: attention heads and MLP columns/rows across the
group, the embedding and the norms replicated), extracts its windows of shards (the data-parallel
dimension is world / tp: group g takes windows g, g + world/tp, ...) in lockstep, and only the
group's first rank writes. A decoder layer's output is replicated after its row-parallel
all-reduce, so the capture hooks see full features on every rank; the LM head is column-parallel
with its output gathered, so the top-k is taken on the full logits.

A TP group's ranks meet in every layer's collective: a rank that fails (a NaN sample, a full disk,
both raised on the writing rank) leaves the others waiting there until torchrun, which stops every
rank when one exits, ends them; they never write.

Identity: a TP forward sums each row-parallel matmul's partial products across the group, in another
order than one GPU does, so the stored bf16 values differ in their last bits (2 gloo ranks on CPU:
within 1e-7 of one process in fp32). Like the batch shape, the size is not the store's identity:
the values agree within rounding, so a store made split and one made on one GPU per rank are the
same store; each part record names the size it was made with (`batching`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.target import TargetArch

RESERVE_GIB = 4.0  # CUDA context, NCCL buffers, allocator fragmentation: a margin, not a measurement


@dataclass(frozen=True)
class Layout:
    """Where a rank sits: its TP group (consecutive ranks) and that group's data-parallel place."""

    rank: int
    world: int
    tp: int

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def dp_size(self) -> int:
        return self.world // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def writes(self) -> bool:
        """The group's first rank writes the shards; the others only compute their share."""
        return self.tp_rank == 0


def layout(rank: int, world: int, tp: int, local_world: int | None = None) -> Layout:
    """The rank's layout, or ConfigError naming what does not divide."""
    if world % tp:
        raise ConfigError(
            f"extract.tensor_parallel_size={tp} does not divide the {world} ranks of this job: launch a multiple "
            f"of {tp} processes (torchrun --nproc_per_node)"
        )
    if tp > 1 and local_world is not None and local_world % tp:
        raise ConfigError(
            f"extract.tensor_parallel_size={tp} does not divide the {local_world} processes per node: a TP group "
            f"would span nodes (every layer's all-reduce over the network); use a size that divides --nproc_per_node"
        )
    return Layout(rank, world, tp)


def tensor_parallel_problem(arch: TargetArch, tp: int) -> str | None:
    """Why the target's shape cannot be split `tp` ways by its TP plan, or None."""
    if tp == 1:
        return None
    uneven = [
        f"{name} {value}"
        for name, value in (
            ("attention heads", arch.num_attention_heads),
            ("key/value heads", arch.num_key_value_heads),
            ("MLP width", arch.intermediate_size),
        )
        if value % tp
    ]
    if uneven:
        return f"the target's {', '.join(uneven)} do not divide by extract.tensor_parallel_size={tp}"
    return None


def process_group_backend(device: str, tp: int) -> str:
    """Stage 1's barriers and agreements travel over gloo (CPU tensors); a TP group's activations
    over NCCL on GPUs: one process group with both, chosen per tensor's device."""
    return "cpu:gloo,cuda:nccl" if tp > 1 and device.startswith("cuda") else "gloo"


def _spans_the_world() -> bool:
    """True where transformers builds its TP mesh over every rank of the job itself (its
    `DistributedConfig(tp_size=...)`; a device mesh given to from_pretrained is not used there), so a
    TP group must be the whole job; False where from_pretrained takes the group's mesh."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return False
    fields = {f.name for f in dataclasses.fields(DistributedConfig)} if dataclasses.is_dataclass(DistributedConfig) else set()
    return "tp_size" in fields or "tp_size" in inspect.signature(DistributedConfig).parameters


def launch_problem(tp: int, world: int, job: str) -> str | None:
    """Why `world` processes (`job` names them: "the 8 processes of this job", "plan --gpus 8") cannot
    run TP groups of `tp` with this transformers, or None: where it builds its mesh over every rank of
    the job itself, the one group must be the whole job. `extract` asks before any rank joins,
    tokenizes or pins the store's plan (the size is pinned with it), `plan` before it reads a row."""
    if tp in (1, world) or not _spans_the_world():
        return None
    import transformers

    return (
        f"extract.tensor_parallel_size={tp} with {job}: transformers {transformers.__version__} builds its "
        f"tensor-parallel mesh over every rank of the job, so the size must be 1 or the number of processes; set "
        f"extract.tensor_parallel_size={world} (one copy of the target over all {world} GPUs), launch {tp} processes "
        f"(torchrun --nproc_per_node {tp}), or use transformers <5 (from_pretrained takes a group's device mesh there)"
    )


def tensor_parallel_mesh(device: str, lay: Layout) -> Any:
    """The job's (dp, tp) device mesh, built by every rank (its groups are collective), or None
    where transformers builds its own (then the TP group is the whole job: `launch_problem`)."""
    if lay.tp == 1:
        return None
    if _spans_the_world():
        problem = launch_problem(lay.tp, lay.world, f"the {lay.world} processes of this job")
        if problem is not None:
            raise ConfigError(problem)
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (lay.dp_size, lay.tp), mesh_dim_names=("dp", "tp"))


def split_arguments(lay: Layout, mesh: Any) -> dict[str, Any]:
    """from_pretrained's arguments that split the target across this rank's TP group by the model's
    own plan: the group's mesh, or (where transformers builds the mesh itself) its TP size."""
    if mesh is not None:
        return {"tp_plan": "auto", "device_mesh": mesh["tp"]}
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=lay.tp)}


def check_split(model: Any, lay: Layout) -> None:
    """The target's sharded weights live on a mesh of the group's size (a plan that matched nothing
    would leave every rank a whole copy, and the group would compute everything tp times)."""
    sizes = {p.device_mesh.size() for p in model.parameters() if hasattr(p, "device_mesh")}
    if sizes != {lay.tp}:
        raise RuntimeError(f"the target did not load split {lay.tp} ways (its weights' mesh sizes: {sorted(sizes) or 'none'})")


# ---------------------------------------------------------------------------------------------
# Memory per GPU, for `plan`


def _safetensors_headers(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the folder's safetensors files (their JSON headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def replicated(name: str) -> bool:
    """Weights every rank of a TP group holds whole: the input embedding and the norms."""
    return "embed_tokens" in name or name.endswith("norm.weight") or "layernorm" in name


def weight_gib_per_gpu(model_dir: Path | None, arch: TargetArch, dtype_bytes: int, tp: int) -> tuple[float, str]:
    """GiB of the target's weights on each GPU of a TP group of `tp`, and where the count comes from:
    the safetensors headers (every tensor, MoE experts included) or, without them, the dense shape."""
    shapes = _safetensors_headers(model_dir) if model_dir is not None else {}
    if shapes:
        whole = sum(_numel(s) for n, s in shapes.items() if replicated(n))
        split = sum(_numel(s) for n, s in shapes.items() if not replicated(n))
        source = f"{len(shapes)} tensors in the safetensors headers"
    else:
        attention = arch.hidden_size * arch.head_dim * (2 * arch.num_attention_heads + 2 * arch.num_key_value_heads)
        split = arch.num_hidden_layers * (attention + 3 * arch.hidden_size * arch.intermediate_size)
        split += 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
        whole = arch.vocab_size * arch.hidden_size
        source = "the dense shape in config.json (no safetensors headers)"
    return (whole + split / tp) * dtype_bytes / 2**30, source


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def working_set_gib(
    arch: TargetArch, num_layers: int, batch_tokens: int, lm_head_chunk_tokens: int, dtype_bytes: int, tp: int,
    packed_mask: str | None = None,
) -> float:
    """GiB the forward of one batch needs beside the weights, an upper bound: the residual stream,
    its norm and the attention output (4 x hidden), this rank's q/k/v and MLP columns, the captured
    layers, and one LM-head chunk's gathered logits with their fp32 copy. `packed_mask`: the attention
    ("sdpa", "eager") a packed batch runs with, which keeps its samples apart with a [tokens, tokens]
    mask: the boolean mask and, for sdpa, its additive copy in the compute dtype; eager also holds
    this rank's heads' scores and their fp32 softmax (flash-attn's varlen path makes none of these)."""
    n, h = batch_tokens, arch.hidden_size
    qkv = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim // tp
    layer = n * (4 * h + qkv + 3 * arch.intermediate_size // tp) * dtype_bytes
    captured = n * num_layers * h * dtype_bytes
    head = lm_head_chunk_tokens * arch.vocab_size * (dtype_bytes + 4)
    per_pair = {None: 0, "sdpa": 1 + dtype_bytes, "eager": 1 + arch.num_attention_heads // tp * (dtype_bytes + 4)}[packed_mask]
    return (layer + captured + head + n * n * per_pair) / 2**30


def fitting_size(fits: Any, arch: TargetArch, most: int = 64) -> int | None:
    """The smallest TP size the target's shape can be split into for which `fits(tp)` holds."""
    for tp in range(1, most + 1):
        if tensor_parallel_problem(arch, tp) is None and fits(tp):
            return tp
    return None


def local_world_size() -> int | None:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None
