"""The DFlash attention mask over a packed micro-batch: plans and backends.

Block n's queries see the context tokens of its own sample at positions < anchor_pos_N[n], and
the B slots of block n (bidirectional); nothing else. No row is ever fully masked: a block always
sees itself. A plan holds what every layer shares and is built once per forward:

- "flex": one BlockMask over the whole pack (CUDA; compiled once with dynamic shapes);
- "sdpa" / "eager": blocks grouped by sample and by chunks of `attention_chunk_blocks`, each group
  attending to its sample's context prefix only, so no mask spans the whole pack;
- "naive": a loop per block with the rule written out (tests only).

Shape legend: T context tokens of the pack, N blocks, B block size, A attention heads, G key/value
heads, D head dim, Q = n*B query rows of one group, C = keys of one group (visible context + n*B
block slots).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shared.errors import ConfigError
from stage2_train.data.batch import DrafterBatch

BACKENDS = ("sdpa", "flex", "eager", "naive")



@dataclass
class _Group:
    """One SDPA call: some blocks of one sample and the context prefix they can see."""

    ctx_idx: torch.Tensor  # [c] indices into T
    blk_idx: torch.Tensor  # [n] indices into N
    mask_QC: torch.Tensor  # bool, True = may attend; C = c + n*B


@dataclass
class AttentionPlan:
    """Everything about the mask that all layers share, built once per forward."""

    backend: str
    block_size: int
    groups: list[_Group] | None = None
    inverse_N: torch.Tensor | None = None  # positions of blocks in cat(group.blk_idx) -> original order
    block_mask: Any = None  # flex BlockMask over [blocks sorted ; context sorted]
    ctx_order_T: torch.Tensor | None = None
    blk_order_N: torch.Tensor | None = None
    batch: DrafterBatch | None = None  # naive reference only


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


def _plan_groups(batch: DrafterBatch, block_size: int, chunk_blocks: int, backend: str) -> AttentionPlan:
    ctx_order_T, blk_order_N, num_samples = _sort_pack(batch)
    device = batch.anchor_pos_N.device
    ctx_counts = torch.bincount(batch.context_seq_T, minlength=num_samples).tolist()
    blk_counts = torch.bincount(batch.block_seq_N, minlength=num_samples).tolist()
    ctx_pos_sorted = batch.context_pos_T[ctx_order_T]
    anchor_sorted = batch.anchor_pos_N[blk_order_N]
    anchor_cpu = anchor_sorted.tolist()
    ctx_pos_cpu = ctx_pos_sorted.cpu()

    groups: list[_Group] = []
    ctx_start = blk_start = 0
    for s in range(num_samples):
        ctx_end, blk_end = ctx_start + ctx_counts[s], blk_start + blk_counts[s]
        for b0 in range(blk_start, blk_end, chunk_blocks):
            b1 = min(b0 + chunk_blocks, blk_end)
            n = b1 - b0
            # Anchors ascend within the sample, so the visible context is a prefix of its positions.
            c = int(torch.searchsorted(ctx_pos_cpu[ctx_start:ctx_end], anchor_cpu[b1 - 1]).item())
            ctx_idx = ctx_order_T[ctx_start : ctx_start + c]
            see_ctx_nc = ctx_pos_sorted[ctx_start : ctx_start + c][None, :] < anchor_sorted[b0:b1, None]
            own_nn = torch.eye(n, dtype=torch.bool, device=device)
            mask_QC = torch.cat(
                [
                    see_ctx_nc[:, None, :].expand(n, block_size, c),
                    own_nn[:, None, :, None].expand(n, block_size, n, block_size).reshape(n, block_size, -1),
                ],
                dim=-1,
            ).reshape(n * block_size, c + n * block_size)
            groups.append(_Group(ctx_idx=ctx_idx, blk_idx=blk_order_N[b0:b1], mask_QC=mask_QC))
        ctx_start, blk_start = ctx_end, blk_end
    inverse_N = torch.empty_like(blk_order_N)
    inverse_N[torch.cat([g.blk_idx for g in groups])] = torch.arange(len(blk_order_N), device=device)
    return AttentionPlan(backend=backend, block_size=block_size, groups=groups, inverse_N=inverse_N)


@functools.cache
def _flex_attention(compiled: bool) -> Any:
    """flex_attention, imported lazily; compiled once (dynamic shapes) for CUDA. Uncompiled, it is
    an unfused reference that materialises the scores: CPU tests of the mask logic only."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if compiled else flex_attention


def flex_importable() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _plan_flex(batch: DrafterBatch, block_size: int, compiled: bool = True) -> AttentionPlan:
    """One BlockMask: queries are the blocks sorted by (sample, anchor), keys are the context
    sorted by (sample, position) followed by the block slots in the same block order."""
    from torch.nn.attention.flex_attention import create_block_mask

    ctx_order_T, blk_order_N, _ = _sort_pack(batch)
    seq_T = batch.context_seq_T[ctx_order_T].contiguous()
    pos_T = batch.context_pos_T[ctx_order_T].contiguous()
    seq_N = batch.block_seq_N[blk_order_N].contiguous()
    anchor_N = batch.anchor_pos_N[blk_order_N].contiguous()
    num_ctx, num_blocks = len(seq_T), len(seq_N)

    def mask_mod(b, h, q_idx, kv_idx):
        n = q_idx // block_size
        t = kv_idx.clamp(max=num_ctx - 1)
        sees_ctx = (kv_idx < num_ctx) & (seq_T[t] == seq_N[n]) & (pos_T[t] < anchor_N[n])
        sees_own = (kv_idx >= num_ctx) & ((kv_idx - num_ctx) // block_size == n)
        return sees_ctx | sees_own

    block_mask = create_block_mask(
        mask_mod,
        B=None,
        H=None,
        Q_LEN=num_blocks * block_size,
        KV_LEN=num_ctx + num_blocks * block_size,
        device=batch.anchor_pos_N.device,
        _compile=compiled,
    )
    return AttentionPlan(
        backend="flex",
        block_size=block_size,
        block_mask=block_mask,
        ctx_order_T=ctx_order_T,
        blk_order_N=blk_order_N,
    )


def _softmax_attend(q_AQD, k_GCD, v_GCD, mask_QC, scale) -> torch.Tensor:
    """Plain attention in fp32 (eager/naive). Rows are never fully masked (a block sees itself)."""
    groups = q_AQD.shape[0] // k_GCD.shape[0]
    k_ACD = k_GCD.repeat_interleave(groups, dim=0).float()
    v_ACD = v_GCD.repeat_interleave(groups, dim=0).float()
    scores_AQC = (q_AQD.float() @ k_ACD.transpose(-1, -2)) * scale
    scores_AQC = scores_AQC.masked_fill(~mask_QC, torch.finfo(torch.float32).min)
    return (scores_AQC.softmax(-1) @ v_ACD).to(q_AQD.dtype)


def packed_attention(q_NBAD, k_ctx_TGD, v_ctx_TGD, k_blk_NBGD, v_blk_NBGD, plan: AttentionPlan, scale: float):
    """Attention of every block under the DFlash mask; returns [N, B, A, D]."""
    N, B, A, D = q_NBAD.shape
    G = k_blk_NBGD.shape[2]
    if plan.backend == "flex":
        attend = _flex_attention(compiled=q_NBAD.is_cuda)
        order = plan.blk_order_N
        q = q_NBAD[order].reshape(N * B, A, D).transpose(0, 1)[None]
        k = torch.cat([k_ctx_TGD[plan.ctx_order_T], k_blk_NBGD[order].reshape(N * B, G, D)]).transpose(0, 1)[
            None
        ]
        v = torch.cat([v_ctx_TGD[plan.ctx_order_T], v_blk_NBGD[order].reshape(N * B, G, D)]).transpose(0, 1)[
            None
        ]
        out = attend(q, k, v, block_mask=plan.block_mask, scale=scale, enable_gqa=G != A)
        out_NBAD = out[0].transpose(0, 1).reshape(N, B, A, D)
        return out_NBAD[torch.argsort(order)]
    if plan.backend == "naive":
        return _naive_attention(q_NBAD, k_ctx_TGD, v_ctx_TGD, k_blk_NBGD, v_blk_NBGD, plan.batch, scale)

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


def _naive_attention(q_NBAD, k_ctx_TGD, v_ctx_TGD, k_blk_NBGD, v_blk_NBGD, batch: DrafterBatch, scale: float):
    """Reference: one block at a time, context selected by the rule itself. Tests only."""
    outs = []
    for n in range(q_NBAD.shape[0]):
        visible_T = (batch.context_seq_T == batch.block_seq_N[n]) & (
            batch.context_pos_T < batch.anchor_pos_N[n]
        )
        k_GCD = torch.cat([k_ctx_TGD[visible_T], k_blk_NBGD[n]]).transpose(0, 1)
        v_GCD = torch.cat([v_ctx_TGD[visible_T], v_blk_NBGD[n]]).transpose(0, 1)
        q_ABD = q_NBAD[n].transpose(0, 1)
        mask = torch.ones(q_ABD.shape[1], k_GCD.shape[1], dtype=torch.bool, device=q_ABD.device)
        outs.append(_softmax_attend(q_ABD, k_GCD, v_GCD, mask, scale).transpose(0, 1))
    return torch.stack(outs)


def plan_attention(batch: DrafterBatch, backend_name: str, block_size: int, chunk_blocks: int) -> AttentionPlan:
    """The mask plan for this batch on its device (see the module docstring for the backends)."""
    backend = resolve_backend(backend_name, batch.anchor_pos_N.device)
    if backend == "flex":
        if batch.context_TF.shape[0] == 0:
            backend = "sdpa"  # flex needs at least one key before the blocks
        else:
            return _plan_flex(batch, block_size, compiled=batch.context_TF.is_cuda)
    if backend == "naive":
        return AttentionPlan(backend="naive", block_size=block_size, batch=batch)
    return _plan_groups(batch, block_size, chunk_blocks, backend)


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
