"""The DFlash drafter: Qwen3-style decoder layers that draft a block of B tokens in parallel.

Architecture (z-lab/dflash `dflash/model.py`, `DFlashDraftModel`; reimplemented, not copied):
- the chosen target layers' features of every context token are fused once,
  `ctx = hidden_norm(fc(concat(features)))`, and that one tensor feeds the keys and values of
  EVERY drafter layer, without the layer's input norm;
- a block is `[anchor token, MASK x (B-1)]` embedded with the target's frozen embed_tokens;
- each layer: `h += o_proj(attn(input_layernorm(h)))`, `h += mlp(post_attention_layernorm(h))`;
  queries come from the block only, keys/values are `[k/v_proj(ctx) ; k/v_proj(block)]` with the
  same weights, q_norm/k_norm per head, then RoPE: context token at its own position, block slot j
  at anchor + j;
- `forward` returns the final-normed hidden states of all B slots; logits come from the target's
  frozen lm_head (`logits`), and slot k predicts the token at anchor + k (slot 0 is not scored).

Attention in a packed micro-batch (see `stage2_train/batch.py`): block n's queries see the
context tokens of its own sample at positions < anchor_pos_N[n], and the B slots of block n
(bidirectional); nothing else. No row is ever fully masked: a block always sees itself.
Backends: "flex" (one BlockMask over the whole pack, CUDA), "sdpa" / "eager" (blocks grouped by
sample and by chunks of `attention_chunk_blocks`, each group attending to its sample's context
prefix only, so no mask spans the whole pack), and "naive" (a loop per block, tests only).

Parameter names equal the reference's exported names, so the export is `state_dict()`; the frozen
embedding and LM head are non-persistent buffers, never saved and never trained.

Shape legend: T context tokens of the pack, F = num_feature_layers * H, N blocks, B block size,
H hidden, A attention heads, G key/value heads, D head dim, I MLP width, V vocab,
Q = n*B query rows of one group, C = keys of one group (visible context + n*B block slots).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shared.config import Section
from shared.target import TargetArch
from stage2_train.batch import DrafterBatch

BACKENDS = ("sdpa", "flex", "eager", "naive")


@dataclass(kw_only=True)
class DrafterConfig(Section):
    section: ClassVar[str] = "model"
    num_layers: int = 1  # 5 for the published Qwen3-8B drafter
    block_size: int = 16
    intermediate_size: int | None = None  # None: the target's
    attention: Literal["auto", "sdpa", "flex", "eager"] = "auto"  # auto: flex on CUDA, else sdpa
    attention_chunk_blocks: int = 64  # sdpa/eager: blocks per attention call (bounds the mask size)
    init_std: float = 0.02  # Qwen3 initializer_range
    # Keep only each layer's input for backward and recompute the rest: at 4096 wide a block row
    # saves ~0.6 MB per layer otherwise, so a micro-batch of 16K tokens x 512 anchors needs it.
    activation_checkpointing: bool = False

    def validate(self) -> None:
        self.require(self.num_layers >= 1, "num_layers", "must be >= 1")
        self.require(self.block_size >= 2, "block_size", "must be >= 2 (slot 0 is never scored)")
        self.require(
            self.intermediate_size is None or self.intermediate_size >= 1,
            "intermediate_size",
            "must be >= 1 or null (the target's)",
        )
        self.require(self.attention_chunk_blocks >= 1, "attention_chunk_blocks", "must be >= 1")
        self.require(0 < self.init_std < 1, "init_std", "must be in (0, 1)")

    def recipe_warnings(self) -> list[str]:
        if self.block_size != 16:
            return [f"model.block_size={self.block_size}: the published DFlash drafters use 16"]
        return []


# ---------------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: normalise in fp32; the output keeps the input's dtype.

    Under bf16 autocast the weight is an fp32 master copy, and `weight * x` would promote the
    output to fp32: q and k would reach attention in fp32 beside a bf16 v (flex attention then
    runs fp32 kernels or refuses mixed dtypes in backward)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (unscaled) RoPE tables in fp32, shape pos.shape + [D], HF's half-split layout."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim)
    )
    freqs = pos.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, D]; cos/sin [..., D] broadcast over heads."""
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# ---------------------------------------------------------------------------------------------
# The packed attention: plans and backends


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


def _sort_pack(batch: DrafterBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Context ordered by (sample, position), blocks by (sample, anchor)."""
    span = (
        int(
            max(
                batch.context_pos_T.max().item() if batch.context_pos_T.numel() else 0,
                batch.anchor_pos_N.max().item(),
            )
        )
        + 1
    )
    ctx_order_T = torch.argsort(batch.context_seq_T * span + batch.context_pos_T, stable=True)
    blk_order_N = torch.argsort(batch.block_seq_N * span + batch.anchor_pos_N, stable=True)
    num_samples = (
        int(
            max(
                batch.context_seq_T.max().item() if batch.context_seq_T.numel() else 0,
                batch.block_seq_N.max().item(),
            )
        )
        + 1
    )
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


_COMPILED_FLEX: list[Any] = []


def _flex_attention(compiled: bool) -> Any:
    """flex_attention, imported lazily; compiled once (dynamic shapes) for CUDA. Uncompiled, it is
    an unfused reference that materialises the scores: CPU tests of the mask logic only."""
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if not _COMPILED_FLEX:
        _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=True))
    return _COMPILED_FLEX[0]


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


# ---------------------------------------------------------------------------------------------
# The drafter


class Attention(nn.Module):
    def __init__(self, arch: TargetArch):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.head_dim,
        )
        H, A, G, D = arch.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(H, A * D, bias=False)
        self.k_proj = nn.Linear(H, G * D, bias=False)
        self.v_proj = nn.Linear(H, G * D, bias=False)
        self.o_proj = nn.Linear(A * D, H, bias=False)
        self.q_norm = RMSNorm(D, arch.rms_norm_eps)
        self.k_norm = RMSNorm(D, arch.rms_norm_eps)

    def forward(self, x_NBH, ctx_TH, rope, plan: AttentionPlan) -> torch.Tensor:
        N, B, _ = x_NBH.shape
        T = ctx_TH.shape[0]
        A, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        cos_ctx_TD, sin_ctx_TD, cos_blk_NBD, sin_blk_NBD = rope
        q_NBAD = apply_rope(self.q_norm(self.q_proj(x_NBH).view(N, B, A, D)), cos_blk_NBD, sin_blk_NBD)
        k_blk_NBGD = apply_rope(self.k_norm(self.k_proj(x_NBH).view(N, B, G, D)), cos_blk_NBD, sin_blk_NBD)
        v_blk_NBGD = self.v_proj(x_NBH).view(N, B, G, D)
        k_ctx_TGD = apply_rope(self.k_norm(self.k_proj(ctx_TH).view(T, G, D)), cos_ctx_TD, sin_ctx_TD)
        v_ctx_TGD = self.v_proj(ctx_TH).view(T, G, D)
        out_NBAD = packed_attention(q_NBAD, k_ctx_TGD, v_ctx_TGD, k_blk_NBGD, v_blk_NBGD, plan, scale=D**-0.5)
        return self.o_proj(out_NBAD.reshape(N, B, A * D))


class DecoderLayer(nn.Module):
    def __init__(self, arch: TargetArch, intermediate_size: int):
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch.hidden_size, intermediate_size)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, h_NBH, ctx_TH, rope, plan: AttentionPlan) -> torch.Tensor:
        # The context feature enters k/v as is: the layer's input norm applies to the block only.
        h_NBH = h_NBH + self.self_attn(self.input_layernorm(h_NBH), ctx_TH, rope, plan)
        return h_NBH + self.mlp(self.post_attention_layernorm(h_NBH))


class DFlashDrafter(nn.Module):
    # DDP must not broadcast the frozen target parts every step (they can be >1 GB).
    _ddp_params_and_buffers_to_ignore: ClassVar[list[str]] = ["embed_VH", "lm_head_VH"]

    def __init__(self, cfg: DrafterConfig, arch: TargetArch, num_feature_layers: int, mask_token_id: int):
        super().__init__()
        if num_feature_layers < 1:
            raise ValueError(f"num_feature_layers must be >= 1, got {num_feature_layers}")
        if not 0 <= mask_token_id < arch.vocab_size:
            raise ValueError(
                f"mask_token_id {mask_token_id} is outside the target vocab [0, {arch.vocab_size})"
            )
        if arch.num_attention_heads % arch.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {arch.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {arch.num_key_value_heads}"
            )
        self.cfg, self.arch = cfg, arch
        self.block_size = cfg.block_size
        self.num_feature_layers = num_feature_layers
        self.mask_token_id = mask_token_id
        H = arch.hidden_size
        self.fc = nn.Linear(num_feature_layers * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, arch.rms_norm_eps)
        inner = cfg.intermediate_size or arch.intermediate_size
        self.layers = nn.ModuleList(DecoderLayer(arch, inner) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, arch.rms_norm_eps)
        self.register_buffer("embed_VH", None, persistent=False)
        self.register_buffer("lm_head_VH", None, persistent=False)
        self.attention_backend = cfg.attention  # resolved per batch device; tests set "naive"
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def set_frozen_parts(self, embed_VH: torch.Tensor, lm_head_VH: torch.Tensor) -> None:
        """Borrow the target's embed_tokens and lm_head (kept in the dtype given; a tied head
        passed as the same tensor is stored once)."""
        H = self.arch.hidden_size
        for name, weight in (("embed", embed_VH), ("lm_head", lm_head_VH)):
            if weight.dim() != 2 or weight.shape[1] != H or weight.shape[0] <= self.mask_token_id:
                raise ValueError(
                    f"{name} must be [V, {H}] with V > mask_token_id {self.mask_token_id}, got {tuple(weight.shape)}"
                )
        device = self.fc.weight.device
        tied = embed_VH is lm_head_VH
        self.embed_VH = embed_VH.detach().to(device)
        self.lm_head_VH = self.embed_VH if tied else lm_head_VH.detach().to(device)

    def plan_attention(self, batch: DrafterBatch) -> AttentionPlan:
        backend = resolve_backend(self.attention_backend, batch.anchor_pos_N.device)
        if backend == "flex":
            if batch.context_TF.shape[0] == 0:
                backend = "sdpa"  # flex needs at least one key before the blocks
            else:
                return _plan_flex(batch, self.block_size, compiled=batch.context_TF.is_cuda)
        if backend == "naive":
            return AttentionPlan(backend="naive", block_size=self.block_size, batch=batch)
        return _plan_groups(batch, self.block_size, self.cfg.attention_chunk_blocks, backend)

    def forward(self, batch: DrafterBatch) -> torch.Tensor:
        """Final-normed hidden states of every slot, [N, B, H]."""
        if self.embed_VH is None:
            raise RuntimeError("call set_frozen_parts(embed, lm_head) before forward")
        N, B = batch.block_ids_NB.shape
        if B != self.block_size:
            raise ValueError(f"batch blocks have {B} slots, model.block_size is {self.block_size}")
        dtype = self.fc.weight.dtype
        ctx_TH = self.hidden_norm(self.fc(batch.context_TF.to(dtype)))
        h_NBH = F.embedding(batch.block_ids_NB, self.embed_VH).to(dtype)
        D, theta = self.arch.head_dim, self.arch.rope_theta
        pos_NB = batch.anchor_pos_N[:, None] + torch.arange(B, device=batch.anchor_pos_N.device)
        rope = (*rope_cos_sin(batch.context_pos_T, D, theta), *rope_cos_sin(pos_NB, D, theta))
        plan = self.plan_attention(batch)
        recompute = self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                h_NBH = checkpoint(layer, h_NBH, ctx_TH, rope, plan, use_reentrant=False)
            else:
                h_NBH = layer(h_NBH, ctx_TH, rope, plan)
        return self.norm(h_NBH)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits through the target's frozen LM head, in its dtype."""
        return F.linear(hidden.to(self.lm_head_VH.dtype), self.lm_head_VH)


def resolve_backend(name: str, device: torch.device) -> str:
    """ "auto": flex on CUDA when this torch has it, else sdpa. An explicit "flex" off CUDA runs the
    unfused reference (forward only): useful to test the mask, not to train."""
    if name == "auto":
        return "flex" if device.type == "cuda" and flex_importable() else "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"model.attention must be one of {BACKENDS}, got {name!r}")
    if name == "flex" and not flex_importable():
        raise ValueError(
            "model.attention='flex' needs torch.nn.attention.flex_attention (torch >= 2.5); use 'sdpa'"
        )
    return name
