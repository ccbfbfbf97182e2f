"""The DFlash attention mask over a packed micro-batch: plans and backends.

Block n anchored at a (its query i sits at absolute position a + i) sees, on a full-attention
layer, the context tokens of its own sample at positions < a and the B slots of its own block
(bidirectional); on a sliding-window layer of window W (z-lab's `_attention_mask`, SpecForge's
PR #731) only the keys k with (a + i) - k < W, and inside its block only the slots j <= i (causal,
unless `is_causal` says otherwise: z-lab's top-level field, which then applies to every layer).
Nothing else, and no row is ever fully masked: a query always sees itself. `MaskKind` is one such
rule; a drafter's layers use one or two kinds, and a plan holds one mask per kind, built once per
forward and shared by the layers of that kind:

- "flex": one BlockMask per kind over the whole pack (CUDA). The mask is a function of index
  tensors only (per query: sample, position, block; per key: sample, position, block), so one
  compiled `create_block_mask` and one compiled `flex_attention` (dynamic shapes) serve every
  micro-batch: no recompilation per pack size, which would end in dynamo's recompile limit, an
  eager fallback that materialises the [queries, keys] scores, and ranks that stall each other;
- "sdpa" / "eager": blocks grouped by sample and by chunks of `attention_chunk_blocks`, each group
  attending to the context its rule can see (for a window, only the last W positions before its
  anchors), so no mask spans the whole pack and a window shrinks every mask;
- "naive": a loop per block with the rule written out (tests only);
- "memory": flex's memory without its arithmetic, for `python -m stage2_train plan`'s fake-tensor
  trace: an output and the tensors the fused kernel keeps for backward (q, k, v, out, logsumexp).

Shape legend: T context tokens of the pack, N blocks, B block size, A attention heads, G key/value
heads, D head dim, Q = n*B query rows of one group, C = keys of one group (visible context + n*B
block slots), K = T + N*B keys of the whole pack.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shared.errors import ConfigError
from stage2_train.data.batch import DrafterBatch

BACKENDS = ("sdpa", "flex", "eager", "naive", "memory")
# torch.compile's backend for flex. CPU tests use "aot_eager": dynamo's guards (which decide every
# recompilation) are the same, while torch 2.13's CPU inductor template cannot generate code for a
# mask_mod that gathers from both query- and key-indexed tensors (cur_qSplitSize codegen error).
COMPILE_BACKEND = "inductor"


@dataclass(frozen=True)
class MaskKind:
    """One attention rule: `window` W (None: full attention) and causality inside the block."""

    window: int | None = None
    causal: bool = False

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor, k_in_block: torch.Tensor) -> torch.Tensor:
        """Which keys a query may see, by absolute positions, among the keys its sample and block
        allow already (context before the anchor, its own block's slots); broadcasts."""
        ok = torch.ones_like(q_pos - k_pos, dtype=torch.bool)
        if self.causal:
            ok = ok & (~k_in_block | (k_pos <= q_pos))
        if self.window is not None:
            ok = ok & (q_pos - k_pos < self.window)
            if not self.causal:  # a bidirectional sliding block: |i - j| < W inside it
                ok = ok & (~k_in_block | (k_pos - q_pos < self.window))
        return ok


FULL = MaskKind()


def layer_kinds(layer_types: tuple[str, ...] | None, num_layers: int, window: int | None, is_causal: bool | None) -> list[MaskKind]:
    """The rule of each drafter layer, from `model.layer_types` / `sliding_window` / `is_causal`
    read as z-lab reads them: sliding layers are causal in the block unless is_causal says, full
    layers bidirectional unless is_causal is true."""
    types = list(layer_types) if layer_types else ["full_attention"] * num_layers
    kinds = []
    for kind in types:
        sliding = kind == "sliding_attention"
        causal = sliding if is_causal is None else bool(is_causal)
        kinds.append(MaskKind(window if sliding else None, causal))
    return kinds


@dataclass
class _Group:
    """One SDPA call: some blocks of one sample and the context they can see."""

    ctx_idx: torch.Tensor  # [c] indices into T
    blk_idx: torch.Tensor  # [n] indices into N
    mask_QC: torch.Tensor  # bool, True = may attend; C = c + n*B


@dataclass
class AttentionPlan:
    """Everything about one kind's mask that its layers share, built once per forward."""

    backend: str
    block_size: int
    kind: MaskKind = FULL
    groups: list[_Group] | None = None
    inverse_N: torch.Tensor | None = None  # positions of blocks in cat(group.blk_idx) -> original order
    block_mask: Any = None  # flex BlockMask over [blocks ; context], both in batch order
    compiled: bool = False  # flex: compiled (CUDA) or the unfused reference
    batch: DrafterBatch | None = None  # naive reference only


# ---- sdpa / eager: groups ------------------------------------------------------------------------
def _past_max(context_T: torch.Tensor, blocks_N: torch.Tensor) -> int:
    """One more than the largest value in either (the context may be empty)."""
    return int(max(context_T.max().item() if context_T.numel() else 0, blocks_N.max().item())) + 1


def _sort_pack(batch: DrafterBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Context ordered by (sample, position), blocks by (sample, anchor)."""
    span = _past_max(batch.context_pos_T, batch.anchor_pos_N)
    ctx_order_T = torch.argsort(batch.context_seq_T * span + batch.context_pos_T, stable=True)
    blk_order_N = torch.argsort(batch.block_seq_N * span + batch.anchor_pos_N, stable=True)
    num_samples = _past_max(batch.context_seq_T, batch.block_seq_N)
    return ctx_order_T, blk_order_N, num_samples


def _plan_groups(batch: DrafterBatch, block_size: int, chunk_blocks: int, backend: str, kind: MaskKind) -> AttentionPlan:
    """Groups of blocks with the context their rule lets them see (sdpa and eager; host syncs: the
    group sizes are data, which is why CUDA uses flex)."""
    ctx_order_T, blk_order_N, num_samples = _sort_pack(batch)
    device = batch.anchor_pos_N.device
    ctx_counts = torch.bincount(batch.context_seq_T, minlength=num_samples).tolist()
    blk_counts = torch.bincount(batch.block_seq_N, minlength=num_samples).tolist()
    ctx_pos_sorted = batch.context_pos_T[ctx_order_T]
    anchor_sorted = batch.anchor_pos_N[blk_order_N]
    anchor_cpu = anchor_sorted.tolist()
    ctx_pos_cpu = ctx_pos_sorted.cpu()
    i_B = torch.arange(block_size, device=device)

    groups: list[_Group] = []
    ctx_start = blk_start = 0
    for s in range(num_samples):
        ctx_end, blk_end = ctx_start + ctx_counts[s], blk_start + blk_counts[s]
        sample_pos = ctx_pos_cpu[ctx_start:ctx_end]
        for b0 in range(blk_start, blk_end, chunk_blocks):
            b1 = min(b0 + chunk_blocks, blk_end)
            n = b1 - b0
            # Anchors ascend within the sample: the context any of them sees is one span of
            # positions, [first anchor - W + 1, last anchor) with a window, a prefix without.
            hi = int(torch.searchsorted(sample_pos, anchor_cpu[b1 - 1]).item())
            lo = 0 if kind.window is None else int(torch.searchsorted(sample_pos, anchor_cpu[b0] - kind.window + 1).item())
            ctx_idx = ctx_order_T[ctx_start + lo : ctx_start + hi]
            anchor_n = anchor_sorted[b0:b1]
            q_pos_nB = anchor_n[:, None] + i_B  # absolute position of each query
            k_ctx_c = ctx_pos_sorted[ctx_start + lo : ctx_start + hi]
            see_ctx_nBc = (k_ctx_c[None, None, :] < anchor_n[:, None, None]) & kind.visible(
                q_pos_nB[:, :, None], k_ctx_c[None, None, :], torch.zeros((), dtype=torch.bool, device=device)
            )
            own_BB = kind.visible(i_B[:, None], i_B[None, :], torch.ones((), dtype=torch.bool, device=device))
            own_nn = torch.eye(n, dtype=torch.bool, device=device)
            see_blk = own_nn[:, None, :, None] & own_BB[None, :, None, :]  # [n, B, n, B]
            mask_QC = torch.cat(
                [see_ctx_nBc, see_blk.reshape(n, block_size, n * block_size)], dim=-1
            ).reshape(n * block_size, ctx_idx.numel() + n * block_size)
            groups.append(_Group(ctx_idx=ctx_idx, blk_idx=blk_order_N[b0:b1], mask_QC=mask_QC))
        ctx_start, blk_start = ctx_end, blk_end
    inverse_N = torch.empty_like(blk_order_N)
    inverse_N[torch.cat([g.blk_idx for g in groups])] = torch.arange(len(blk_order_N), device=device)
    return AttentionPlan(backend=backend, block_size=block_size, kind=kind, groups=groups, inverse_N=inverse_N)


# ---- flex ---------------------------------------------------------------------------------------
@functools.cache
def _flex_attention(compiled: bool) -> Any:
    """flex_attention, imported lazily; compiled once with dynamic shapes. Uncompiled, it is an
    unfused reference that materialises the scores: CPU tests of the mask logic only (CPU flex has
    no backward in torch 2.13)."""
    from torch.nn.attention.flex_attention import flex_attention

    if compiled:
        allow_recompiles()
    return torch.compile(flex_attention, dynamic=True, backend=COMPILE_BACKEND) if compiled else flex_attention


RECOMPILE_LIMIT = 64


def allow_recompiles() -> None:
    """Room for the graphs flex legitimately needs: one per mask kind (full, sliding, causal) x grad
    mode (training, evaluation) x the few shape specialisations (one 128-row tile or more). Past
    dynamo's default of 8 per function it stops compiling and runs flex unfused, which materialises
    the whole mask and scores: an out-of-memory hours into an 8B run, on whichever rank met the new
    combination first."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))


@functools.cache
def _block_mask_builder(compiled: bool) -> Any:
    """create_block_mask, compiled once (torch's own `_compile=True` wraps a fresh torch.compile per
    call, and its docs now ask for this instead)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if compiled:
        allow_recompiles()
    return torch.compile(create_block_mask, dynamic=True, backend=COMPILE_BACKEND) if compiled else create_block_mask


def flex_importable() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def dflash_mask_mod(
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    q_blk: torch.Tensor,
    k_seq: torch.Tensor,
    k_pos: torch.Tensor,
    k_blk: torch.Tensor,
    q_anchor: torch.Tensor,
    kind: MaskKind,
) -> Any:
    """The DFlash rule as a flex mask_mod over index tensors only. Query q is slot q % B of block
    q // B; key k is context token k (k_blk = -1) or a block slot (k_blk = its block). The tensors
    change every micro-batch but are graph inputs to the compiled code, never constants: no
    Python int of the batch reaches it (the window and causality are fixed for a model)."""

    def mask_mod(b, h, q_idx, kv_idx):
        in_block = k_blk[kv_idx] >= 0
        sees_ctx = ~in_block & (k_seq[kv_idx] == q_seq[q_idx]) & (k_pos[kv_idx] < q_anchor[q_idx])
        sees_own = in_block & (k_blk[kv_idx] == q_blk[q_idx])
        return (sees_ctx | sees_own) & kind.visible(q_pos[q_idx], k_pos[kv_idx], in_block)

    return mask_mod


def flex_index(batch: DrafterBatch, block_size: int) -> dict[str, torch.Tensor]:
    """The index tensors of `dflash_mask_mod` for a batch, in batch order (no sort, no host sync)."""
    N, B = batch.block_ids_NB.shape[0], block_size
    device = batch.anchor_pos_N.device
    i_B = torch.arange(B, device=device)
    blk_NB = torch.arange(N, device=device)[:, None].expand(N, B)
    q_anchor = batch.anchor_pos_N[:, None].expand(N, B)
    T = batch.context_pos_T.shape[0]
    index = {
        "q_seq": batch.block_seq_N[:, None].expand(N, B).reshape(-1),
        "q_pos": (q_anchor + i_B).reshape(-1),
        "q_blk": blk_NB.reshape(-1),
        "q_anchor": q_anchor.reshape(-1),
        "k_seq": torch.cat([batch.context_seq_T, batch.block_seq_N[:, None].expand(N, B).reshape(-1)]),
        "k_pos": torch.cat([batch.context_pos_T, (q_anchor + i_B).reshape(-1)]),
        "k_blk": torch.cat([torch.full((T,), -1, dtype=torch.long, device=device), blk_NB.reshape(-1)]),
    }
    # Contiguous: with one block, reshape(-1) of an expand is a stride-0 view, and the compiled code
    # guards on strides (a micro-batch of one block would compile its own graph).
    return {name: t.contiguous() for name, t in index.items()}


def _plan_flex(batch: DrafterBatch, block_size: int, kind: MaskKind, compiled: bool, index: dict | None = None) -> AttentionPlan:
    """One BlockMask: queries are the blocks' slots in batch order, keys the context in batch order
    followed by the block slots (collate packs samples and anchors in order, so the mask is
    block-sparse as it comes)."""
    index = index if index is not None else flex_index(batch, block_size)
    mask_mod = dflash_mask_mod(kind=kind, **index)
    build = _block_mask_builder(compiled)
    block_mask = build(
        mask_mod, None, None, index["q_seq"].shape[0], index["k_seq"].shape[0], device=batch.anchor_pos_N.device
    )
    return AttentionPlan(backend="flex", block_size=block_size, kind=kind, block_mask=block_mask, compiled=compiled)


# ---- attention --------------------------------------------------------------------------------
def _softmax_attend(q_AQD, k_GCD, v_GCD, mask_QC, scale) -> torch.Tensor:
    """Plain attention in fp32 (eager/naive). Rows are never fully masked (a query sees itself)."""
    groups = q_AQD.shape[0] // k_GCD.shape[0]
    k_ACD = k_GCD.repeat_interleave(groups, dim=0).float()
    v_ACD = v_GCD.repeat_interleave(groups, dim=0).float()
    scores_AQC = (q_AQD.float() @ k_ACD.transpose(-1, -2)) * scale
    scores_AQC = scores_AQC.masked_fill(~mask_QC, torch.finfo(torch.float32).min)
    return (scores_AQC.softmax(-1) @ v_ACD).to(q_AQD.dtype)


def packed_attention(q_NBAD, k_ctx_TGD, v_ctx_TGD, k_blk_NBGD, v_blk_NBGD, plan: AttentionPlan, scale: float):
    """Attention of every block under the plan's mask; returns [N, B, A, D]."""
    N, B, A, D = q_NBAD.shape
    G = k_blk_NBGD.shape[2]
    if plan.backend == "flex":
        attend = _flex_attention(compiled=plan.compiled)
        q = q_NBAD.reshape(N * B, A, D).transpose(0, 1)[None]
        k = torch.cat([k_ctx_TGD, k_blk_NBGD.reshape(N * B, G, D)]).transpose(0, 1)[None]
        v = torch.cat([v_ctx_TGD, v_blk_NBGD.reshape(N * B, G, D)]).transpose(0, 1)[None]
        # The sequence dims change every micro-batch. A pack of <= 128 query rows (one flex block: a
        # tail micro-batch of <= 8 blocks) compiles once more, then both graphs serve every shape.
        for t in (q, k, v):
            torch._dynamo.maybe_mark_dynamic(t, 2)
        out = attend(q, k, v, block_mask=plan.block_mask, scale=scale, enable_gqa=G != A)
        return out[0].transpose(0, 1).reshape(N, B, A, D)
    if plan.backend == "memory":
        k = torch.cat([k_ctx_TGD, k_blk_NBGD.reshape(N * B, G, D)])
        v = torch.cat([v_ctx_TGD, v_blk_NBGD.reshape(N * B, G, D)])
        return _FlexMemory.apply(q_NBAD, k, v)
    if plan.backend == "naive":
        return _naive_attention(q_NBAD, k_ctx_TGD, v_ctx_TGD, k_blk_NBGD, v_blk_NBGD, plan.batch, plan.kind, scale)

    outs = []
    for g in plan.groups:
        n = len(g.blk_idx)
        q_AQD = q_NBAD[g.blk_idx].reshape(n * B, A, D).transpose(0, 1)
        k_GCD = torch.cat([k_ctx_TGD[g.ctx_idx], k_blk_NBGD[g.blk_idx].reshape(n * B, G, D)]).transpose(0, 1)
        v_GCD = torch.cat([v_ctx_TGD[g.ctx_idx], v_blk_NBGD[g.blk_idx].reshape(n * B, G, D)]).transpose(0, 1)
        if plan.backend == "sdpa":
            if G != A and q_AQD.is_cuda:
                # CUDA SDPA with a mask and enable_gqa falls back to the quadratic math kernel.
                k_GCD, v_GCD = k_GCD.repeat_interleave(A // G, 0), v_GCD.repeat_interleave(A // G, 0)
            o_AQD = F.scaled_dot_product_attention(
                q_AQD[None],
                k_GCD[None],
                v_GCD[None],
                attn_mask=g.mask_QC,
                scale=scale,
                enable_gqa=k_GCD.shape[0] != A,
            )[0]
        else:
            o_AQD = _softmax_attend(q_AQD, k_GCD, v_GCD, g.mask_QC, scale)
        outs.append(o_AQD.transpose(0, 1).reshape(n, B, A, D))
    return torch.cat(outs)[plan.inverse_N]


class _FlexMemory(torch.autograd.Function):
    """What compiled flex attention allocates and saves, with no arithmetic (memory planning only)."""

    @staticmethod
    def forward(ctx, q_NBAD, k_KGD, v_KGD):
        out = torch.empty_like(q_NBAD)
        lse = q_NBAD.new_empty(q_NBAD.shape[:3], dtype=torch.float32)
        ctx.save_for_backward(q_NBAD, k_KGD, v_KGD, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _naive_attention(q_NBAD, k_ctx_TGD, v_ctx_TGD, k_blk_NBGD, v_blk_NBGD, batch: DrafterBatch, kind: MaskKind, scale: float):
    """Reference: one block at a time, context selected by the rule itself. Tests only."""
    outs = []
    B = q_NBAD.shape[1]
    i_B = torch.arange(B, device=q_NBAD.device)
    for n in range(q_NBAD.shape[0]):
        anchor = batch.anchor_pos_N[n]
        visible_T = (batch.context_seq_T == batch.block_seq_N[n]) & (batch.context_pos_T < anchor)
        k_GCD = torch.cat([k_ctx_TGD[visible_T], k_blk_NBGD[n]]).transpose(0, 1)
        v_GCD = torch.cat([v_ctx_TGD[visible_T], v_blk_NBGD[n]]).transpose(0, 1)
        q_ABD = q_NBAD[n].transpose(0, 1)
        k_pos = torch.cat([batch.context_pos_T[visible_T], anchor + i_B])
        in_block = torch.cat([torch.zeros(int(visible_T.sum()), dtype=torch.bool), torch.ones(B, dtype=torch.bool)])
        mask = kind.visible((anchor + i_B)[:, None], k_pos[None, :], in_block[None, :].to(q_ABD.device))
        outs.append(_softmax_attend(q_ABD, k_GCD, v_GCD, mask, scale).transpose(0, 1))
    return torch.stack(outs)


def plan_attention(
    batch: DrafterBatch, backend_name: str, block_size: int, chunk_blocks: int, kinds: list[MaskKind] | None = None
) -> dict[MaskKind, AttentionPlan]:
    """One mask plan per distinct rule among the layers (`kinds`, default: full attention), for this
    batch on its device (see the module docstring for the backends)."""
    backend = resolve_backend(backend_name, batch.anchor_pos_N.device)
    if backend == "flex" and batch.context_TF.shape[0] == 0:
        backend = "sdpa"  # flex needs at least one key before the blocks
    plans = {}
    index = flex_index(batch, block_size) if backend == "flex" else None
    for kind in dict.fromkeys(kinds or [FULL]):
        if backend == "flex":
            plans[kind] = _plan_flex(batch, block_size, kind, compiled=batch.context_TF.is_cuda, index=index)
        elif backend in ("naive", "memory"):
            plans[kind] = AttentionPlan(backend=backend, block_size=block_size, kind=kind, batch=batch)
        else:
            plans[kind] = _plan_groups(batch, block_size, chunk_blocks, backend, kind)
    return plans


def resolve_backend(name: str, device: torch.device) -> str:
    """ "auto": flex on CUDA when this torch has it, else sdpa. An explicit "flex" off CUDA runs the
    unfused reference (forward only): useful to test the mask, not to train."""
    if name == "auto":
        return "flex" if device.type == "cuda" and flex_importable() else "sdpa"
    if name not in BACKENDS:
        raise ConfigError(f"model.attention must be one of {BACKENDS}, got {name!r}")
    if name == "flex" and not flex_importable():
        raise ConfigError(
            "model.attention='flex' needs torch.nn.attention.flex_attention (torch >= 2.5); use 'sdpa'"
        )
    return name
