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

The variants subclass it (`drafter_class`): DSpark (model/dspark.py) adds a Markov and a confidence
head and shifts the labels by one; DFlash2 (model/dflash2.py) wraps each layer's sublayers in grouped
dynamic convolutions (`make_layer`) and adds a candidate selector. Each says what it adds to the loss
(`loss_rows`) and how it drafts a block greedily (`draft`).

Attention in a packed micro-batch (`stage2_train/data/batch.py`) follows the DFlash mask, planned
once per forward by `stage2_train/model/attention.py` (flex on CUDA, SDPA on CPU).

Parameter names equal the reference's exported names, so the export is `state_dict()`; the frozen
embedding and LM head are non-persistent buffers, never saved and never trained.

Shape legend: T context tokens of the pack, F = num_feature_layers * H, N blocks, B block size,
H hidden, A attention heads, G key/value heads, D head dim, I MLP width, V vocab.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shared.errors import CheckpointError
from shared.target import TargetArch
from stage2_train.data.batch import DrafterBatch
from stage2_train.model.attention import (
    AttentionPlan,
    MaskKind,
    layer_kinds,
    packed_attention,
    plan_attention,
)
from stage2_train.model.config import DrafterConfig
from stage2_train.model.description import DrafterDescription

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
    def __init__(self, arch: TargetArch, intermediate_size: int, kind: MaskKind):
        super().__init__()
        self.kind = kind  # full or sliding-window attention: which of the forward's plans it uses
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch.hidden_size, intermediate_size)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, h_NBH, ctx_TH, rope, plans: dict[MaskKind, AttentionPlan]) -> torch.Tensor:
        # The context feature enters k/v as is: the layer's input norm applies to the block only.
        h_NBH = h_NBH + self.self_attn(self.input_layernorm(h_NBH), ctx_TH, rope, plans[self.kind])
        return h_NBH + self.mlp(self.post_attention_layernorm(h_NBH))


class DFlashDrafter(nn.Module):
    # DDP must not broadcast the frozen target parts every step (they can be >1 GB).
    # Frozen or constant, identical on every rank: DDP would otherwise broadcast them from rank 0 at
    # every step (the projection is R x F fp32, 335 MB at Qwen3-8B's shape).
    _ddp_params_and_buffers_to_ignore: ClassVar[list[str]] = ["embed_VH", "lm_head_VH", "projection_RF"]
    # The variants (model/dspark.py, model/dflash2.py) subclass this drafter; what they change:
    label_shift: ClassVar[int] = 0  # slot k predicts anchor + k + label_shift (the batch is collated so)

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
        F_in = num_feature_layers * H
        if cfg.feature_projection == "pca":
            # The fitted basis (stage2_train/data/projection.py): a buffer, saved in checkpoints, folded into fc on export.
            self.register_buffer("projection_RF", torch.zeros(cfg.projection_dim or H, F_in))
            F_in = self.projection_RF.shape[0]
        self.fc = nn.Linear(F_in, H, bias=False)
        self.hidden_norm = RMSNorm(H, arch.rms_norm_eps)
        inner = cfg.intermediate_size or arch.intermediate_size
        self.kinds = layer_kinds(cfg.layer_types, cfg.num_layers, cfg.sliding_window, cfg.is_causal)
        self.layers = nn.ModuleList(self.make_layer(arch, inner, kind) for kind in self.kinds)
        self.norm = RMSNorm(H, arch.rms_norm_eps)
        self.register_buffer("embed_VH", None, persistent=False)
        self.register_buffer("lm_head_VH", None, persistent=False)
        self.attention_backend = cfg.attention  # resolved per batch device; tests set "naive"
        self.description: DrafterDescription | None = None  # set by build_drafter: what the drafter is
        self.reset_parameters()

    def make_layer(self, arch: TargetArch, intermediate_size: int, kind: MaskKind) -> DecoderLayer:
        return DecoderLayer(arch, intermediate_size, kind)

    @property
    def max_draft(self) -> int:
        """Tokens one block drafts: B - 1 (slot 0 holds the anchor); B for DSpark."""
        return self.block_size - 1

    def loss_rows(self, hidden_NBH: torch.Tensor, batch: DrafterBatch, cfg: Any = None) -> Any:
        """What a variant adds to the loss's LM-head chunks (model/loss.py); DFlash adds nothing."""
        return None

    @torch.no_grad()
    def draft(self, hidden_BH: torch.Tensor, anchor: int, confidence_stop: float | None = None) -> list[int]:
        """Greedy drafts of one block from its final hidden states: argmax of slots 1..B-1."""
        return self.logits(hidden_BH[1:]).argmax(-1).tolist()

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

    def forward(self, batch: DrafterBatch) -> torch.Tensor:
        """Final-normed hidden states of every slot, [N, B, H]."""
        if self.embed_VH is None:
            raise RuntimeError("call set_frozen_parts(embed, lm_head) before forward")
        N, B = batch.block_ids_NB.shape
        if B != self.block_size:
            raise ValueError(f"batch blocks have {B} slots, model.block_size is {self.block_size}")
        # Under autocast the matmuls choose their dtype: casting the [T, n*H] context (or the block
        # embeddings) to the fp32 master weights would make a second copy of it (~1.3 GB per 8B
        # micro-batch) for autocast to cast straight back. Without autocast the weights' dtype rules.
        autocast = torch.is_autocast_enabled(batch.context_TF.device.type)
        dtype = self.fc.weight.dtype
        ctx_TF = batch.context_TF if autocast else batch.context_TF.to(dtype)
        if self.cfg.feature_projection == "pca":
            ctx_TF = F.linear(ctx_TF, self.projection_RF.to(ctx_TF.dtype) if not autocast else self.projection_RF)
        ctx_TH = self.hidden_norm(self.fc(ctx_TF))
        h_NBH = F.embedding(batch.block_ids_NB, self.embed_VH)
        h_NBH = h_NBH if autocast else h_NBH.to(dtype)
        D, theta = self.arch.head_dim, self.arch.rope_theta
        pos_NB = batch.anchor_pos_N[:, None] + torch.arange(B, device=batch.anchor_pos_N.device)
        rope = (*rope_cos_sin(batch.context_pos_T, D, theta), *rope_cos_sin(pos_NB, D, theta))
        plans = plan_attention(batch, self.attention_backend, self.block_size, self.cfg.attention_chunk_blocks, self.kinds)
        recompute = self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                h_NBH = checkpoint(layer, h_NBH, ctx_TH, rope, plans, use_reentrant=False)
            else:
                h_NBH = layer(h_NBH, ctx_TH, rope, plans)
        return self.norm(h_NBH)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """nn.Module's, refusing weights that do not fit by name and shape (a resume, an init_from)."""
        if strict:
            check_fit(self, state_dict, "the checkpoint's model")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def set_projection(self, P_RF: torch.Tensor) -> None:
        if self.cfg.feature_projection != "pca" or tuple(P_RF.shape) != tuple(self.projection_RF.shape):
            raise ValueError(f"a projection of shape {tuple(P_RF.shape)} does not fit this drafter")
        self.projection_RF.copy_(P_RF.to(self.projection_RF.dtype))

    def folded_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights of the equivalent standard drafter: fc.weight @ P in place of fc and P
        (`fc_r(P x) == (fc_r P) x` for every x), what export writes."""
        state = dict(self.state_dict())
        if "projection_RF" in state:
            P_RF = state.pop("projection_RF")
            state["fc.weight"] = (state["fc.weight"].double() @ P_RF.double()).to(state["fc.weight"].dtype)
        return state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits through the target's frozen LM head, in its dtype."""
        return F.linear(hidden.to(self.lm_head_VH.dtype), self.lm_head_VH)


def build_drafter(
    description: DrafterDescription,
    embed_VH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    *,
    runtime: DrafterConfig | None = None,
    weights: dict[str, torch.Tensor] | None = None,
    seed: int | None = None,
    frozen_dtype: torch.dtype | None = None,
) -> DFlashDrafter:
    """The drafter `description` describes (model/description.py), with the target's frozen parts
    (cast to `frozen_dtype` when given) and, when given, `weights` (every name and shape checked; the
    drafter takes their dtype). `runtime`: how to run it (attention backend, activation checkpointing,
    init scale), which a description leaves open. Without weights it is initialised from `seed`
    without touching the global RNG."""
    cfg = description.model_config(runtime)
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        drafter = drafter_class(cfg.variant)(cfg, description.arch(), len(description.target_layer_ids), description.mask_token_id)
    drafter.description = description
    if weights is not None:
        check_fit(drafter, weights, f"model.num_layers={cfg.num_layers}, {len(description.target_layer_ids)} feature layers")
        drafter.load_state_dict(weights)
        drafter.to(next(iter(weights.values())).dtype)
    if frozen_dtype is not None:
        tied = embed_VH is lm_head_VH
        embed_VH = embed_VH.to(frozen_dtype)
        lm_head_VH = embed_VH if tied else lm_head_VH.to(frozen_dtype)
    drafter.set_frozen_parts(embed_VH, lm_head_VH)
    return drafter


def drafter_class(variant: str) -> type[DFlashDrafter]:
    """The module of a variant (model.variant)."""
    if variant == "dflash":
        return DFlashDrafter
    # The variants subclass DFlashDrafter, so their modules import this one: imported here, when asked.
    if variant == "dspark":
        from stage2_train.model.dspark import DSparkDrafter

        return DSparkDrafter
    if variant == "dflash2":
        from stage2_train.model.dflash2 import DFlash2Drafter

        return DFlash2Drafter
    raise ValueError(f"model.variant must be dflash, dspark or dflash2, got {variant!r}")


def check_fit(module: nn.Module, weights: dict[str, torch.Tensor], described: str) -> None:
    """Refuse by name weights that do not fit `module`: a missing or unexpected tensor, or one whose
    shape differs (both shapes named), instead of torch's traceback."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"weights do not fit the drafter ({described}): missing {missing[:6]}, unexpected {unexpected[:6]}"
        )
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"weights do not fit the drafter ({described}): {name} has shape {tuple(tensor.shape)}, this "
                f"drafter's is {tuple(expected[name].shape)}"
            )


def init_from_target_layers(drafter: DFlashDrafter, parts: dict[str, torch.Tensor]) -> list[str]:
    """Copy `shared.target_parts.load_target_layers` tensors into the drafter (shapes checked);
    fc then passes the deepest feature layer through and hidden_norm takes the first copied layer's
    input norm, so the context keys and values start as that layer's own. Returns what was copied."""
    state = drafter.state_dict()
    copied = []
    with torch.no_grad():
        for name, tensor in parts.items():
            if name in state and state[name].shape == tensor.shape:
                state[name].copy_(tensor.to(state[name].dtype))
                copied.append(name)
        H, n = drafter.arch.hidden_size, drafter.num_feature_layers
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, (n - 1) * H :].copy_(torch.eye(H))
        if "layers.0.input_layernorm.weight" in parts:
            drafter.hidden_norm.weight.copy_(parts["layers.0.input_layernorm.weight"].to(drafter.hidden_norm.weight.dtype))
    return copied
