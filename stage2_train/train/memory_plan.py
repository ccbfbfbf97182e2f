"""The GPU memory of one training step, from a real step traced with fake tensors.

    python -m stage2_train plan --config qwen3-8b                 # the preset's micro-batch on 80/141 GB
    python -m stage2_train plan --config qwen3-8b --search        # + the largest micro_batch_tokens that fits

The drafter of the config, at the target's shape, runs two real optimizer steps (forward under the
run's autocast, the DFlash loss with its chunked LM head, backward, AdamW) on CPU under torch's
FakeTensorMode, so no byte is allocated, while torch's MemTracker follows every tensor's storage:
weights, gradients, optimizer state, activations and temporaries, and the peak. Attention runs as
"memory" (`model/attention.py`): what compiled flex allocates and keeps for backward, without its
arithmetic. The micro-batch is `micro_batch_tokens` of samples of `sample_tokens` each, every
position supervised (the worst case: `max_anchors_per_seq` anchors per sample, all slots scored).

What the trace cannot see is added by formula and said so: DDP's gradient buckets (a second copy of
the gradients, fp32), and the CUDA context, NCCL buffers and allocator slack (`RESERVE_GB`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shared.target import TargetArch
from stage2_train.data.batch import IGNORE, DrafterBatch, scored_index
from stage2_train.model.config import DrafterConfig, LossConfig
from stage2_train.model.drafter import drafter_class
from stage2_train.model.loss import dflash_loss

TOP_K = 64  # the recipe's stored top-k (stage 2 reads K from the manifest; planning assumes this)
RESERVE_GB = 4.0  # CUDA context (~0.5-1 GB), NCCL buffers, allocator fragmentation: a margin, not a trace
GPUS = {"H100/A100 80 GB": 80.0, "H200 141 GB": 141.0}

# Published shapes, for planning on a machine that has only the preset (no weights).
KNOWN_TARGETS = {
    "qwen3-8b": TargetArch("qwen3", 4096, 12288, 36, 32, 8, 128, 151936, 1e-6, 1e6, 40960, False),
    "llama-3.1-8b": TargetArch("llama", 4096, 14336, 32, 32, 8, 128, 128256, 1e-5, 5e5, 131072, False),
}


@dataclass
class StepShape:
    micro_batch_tokens: int
    sample_tokens: int
    anchors_per_sample: int
    block_size: int

    @property
    def samples(self) -> int:
        return max(1, self.micro_batch_tokens // self.sample_tokens)

    @property
    def blocks(self) -> int:
        return self.samples * self.anchors_per_sample


def traced_step(
    model_cfg: DrafterConfig, loss_cfg: LossConfig, arch: TargetArch, num_feature_layers: int, shape: StepShape, bf16: bool = True
) -> dict[str, float]:
    """GiB by kind (Parameter, Buffer, Gradient, Activation, Temp, Optstate) at the peak of two
    traced optimizer steps, and its Total."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    T, S, A, B = shape.samples * shape.sample_tokens, shape.sample_tokens, shape.anchors_per_sample, shape.block_size
    n = shape.samples
    anchor_A = torch.linspace(0, S - B, A).long() if A > 1 else torch.zeros(1, dtype=torch.long)
    labels_NB = torch.randint(0, arch.vocab_size, (n * A, B))
    labels_NB[:, : 1 - model_cfg.label_shift] = IGNORE  # DSpark scores slot 0 too
    scored_M, per_slot = scored_index(labels_NB)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = drafter_class(model_cfg.variant)(model_cfg, arch, num_feature_layers, min(arch.vocab_size - 1, 151669))
        model.attention_backend = "memory"
        dtype = torch.bfloat16 if bf16 else torch.float32
        embed = torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype)
        head = embed if arch.tie_word_embeddings else torch.empty(arch.vocab_size, arch.hidden_size, dtype=dtype)
        model.set_frozen_parts(embed, head)
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        batch = DrafterBatch(
            context_TF=torch.empty(T, num_feature_layers * arch.hidden_size, dtype=dtype),
            context_pos_T=torch.arange(S).repeat(n),
            context_seq_T=torch.arange(n).repeat_interleave(S),
            block_ids_NB=torch.zeros(n * A, B, dtype=torch.long),
            block_seq_N=torch.arange(n).repeat_interleave(A),
            anchor_pos_N=anchor_A.repeat(n),
            labels_NB=labels_NB,
            num_samples=n,
            num_tokens=T,
            scored_M=scored_M,
            scored_per_slot=per_slot,
            label_shift=model_cfg.label_shift,
            prev_ids_NB=torch.zeros(n * A, B, dtype=torch.long),
        )
        if loss_cfg.needs_topk or model_cfg.reads_topk:  # the stored top-k the KL term or candidate softmax reads (K = TOP_K)
            batch.topk_logprobs_NBK = torch.empty(n * A, B, TOP_K)
            batch.topk_ids_NBK = torch.zeros(n * A, B, TOP_K, dtype=torch.long)
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            for _ in range(2):  # the second step holds the optimizer state the first one made
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    hidden_NBH = model(batch)
                    loss, _ = dflash_loss(hidden_NBH, model.lm_head_VH, batch, loss_cfg, None, variant=model)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                tracker.reset_mod_stats()
        peak = tracker.get_tracker_snapshot("peak")
    (_, by_kind), *_ = peak.items()
    return {str(getattr(k, "value", k)): round(v / 2**30, 3) for k, v in by_kind.items()}


def formula(model_cfg: DrafterConfig, arch: TargetArch, num_feature_layers: int, world_size: int) -> dict[str, float]:
    """GiB of what does not depend on the batch: fp32 weights, gradients and DDP's bucket copy of
    them, AdamW's two moments, the frozen embedding and LM head in bf16."""
    H, inner, L = arch.hidden_size, model_cfg.intermediate_size or arch.intermediate_size, model_cfg.num_layers
    attn = H * arch.num_attention_heads * arch.head_dim * 2 + H * arch.num_key_value_heads * arch.head_dim * 2
    params = L * (attn + 3 * H * inner + 2 * H + 2 * arch.head_dim) + num_feature_layers * H * H + 2 * H
    params += variant_params(model_cfg, arch)
    gib = 2**30
    frozen = arch.vocab_size * H * 2 * (1 if arch.tie_word_embeddings else 2)
    return {
        "params": round(params / 1e9, 3),  # billions
        "weights_fp32": round(4 * params / gib, 2),
        "grads_fp32": round(4 * params / gib, 2),
        "ddp_buckets_fp32": round(4 * params / gib, 2) if world_size > 1 else 0.0,
        "adamw_state_fp32": round(8 * params / gib, 2),
        "frozen_embed_and_head_bf16": round(frozen / gib, 2),
    }


def variant_params(model_cfg: DrafterConfig, arch: TargetArch) -> int:
    """What a variant adds to the drafter's trained parameters (model/dspark.py, model/dflash2.py). At
    Qwen3-8B (V 151,936, H 4096, r 256): DSpark's two [V, r] Markov matrices are 77.8 M (+4,353 for the
    confidence head); DFlash2's codebooks 77.8 M + 1.0 M, and its convolutions 2 x (2 taps x 2 sides x H/16
    x H + 2 x 2 x H) per layer, 8.4 M (42 M over 5 layers). Their activations are traced: the Markov
    bias is added inside each LM-head chunk, the selector's scores are [rows, K]."""
    V, H = arch.vocab_size, arch.hidden_size
    c = model_cfg
    if c.variant == "dspark":
        r = c.markov_rank
        heads = {"vanilla": 0, "gated": (H + r) * r + r, "rnn": (2 * r + H) * 3 * r + 3 * r}[c.markov_head]
        return 2 * V * r + heads + ((H + r + 1) if c.confidence_head else 0)
    if c.variant == "dflash2":
        conv = 2 * (2 * c.conv_kernel_size * (H // c.conv_group_size) * H + 2 * c.conv_kernel_size * H)
        return 2 * V * c.selector_rank + c.selector_rank * H + c.num_layers * conv
    return 0


def plan(
    model_cfg: DrafterConfig,
    loss_cfg: LossConfig,
    arch: TargetArch,
    num_feature_layers: int,
    micro_batch_tokens: int,
    sample_tokens: int,
    max_anchors: int,
    world_size: int = 8,
    search: bool = False,
) -> dict[str, Any]:
    """The plan `python -m stage2_train plan` prints: the traced peak of the configured micro-batch,
    with and without activation checkpointing, the formula's fixed parts, whether it fits each GPU,
    and (with `search`) the largest micro_batch_tokens (a multiple of sample_tokens) that fits."""
    anchors = min(max_anchors, sample_tokens - 1)
    shape = StepShape(micro_batch_tokens, sample_tokens, anchors, model_cfg.block_size)
    fixed = formula(model_cfg, arch, num_feature_layers, world_size)
    untraced = fixed["ddp_buckets_fp32"] + RESERVE_GB
    out: dict[str, Any] = {
        "target_shape": {k: getattr(arch, k) for k in ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads", "num_key_value_heads")},
        "micro_batch": {"tokens": shape.samples * sample_tokens, "samples": shape.samples, "anchors_per_sample": anchors, "block_rows": shape.blocks * shape.block_size},
        "assumption": f"samples of {sample_tokens} tokens, every position supervised: the worst case for anchors and scored slots",
        "formula_gib": fixed,
        "untraced_gib": {"ddp_buckets": fixed["ddp_buckets_fp32"], "cuda_context_nccl_fragmentation": RESERVE_GB},
    }
    traces = {}
    for checkpointing in (True, False):
        cfg = model_cfg.model_copy(update={"activation_checkpointing": checkpointing})
        traced = traced_step(cfg, loss_cfg, arch, num_feature_layers, shape)
        traces["with_checkpointing" if checkpointing else "without_checkpointing"] = {**traced, "peak_with_untraced": round(traced["Total"] + untraced, 2)}
    out["traced_peak_gib"] = traces
    configured = traces["with_checkpointing" if model_cfg.activation_checkpointing else "without_checkpointing"]["peak_with_untraced"]
    out["peak_gib"] = configured
    out["fits"] = {name: configured <= gb for name, gb in GPUS.items()}
    if search:
        out["largest_micro_batch_tokens"] = {
            name: largest_fitting(model_cfg, loss_cfg, arch, num_feature_layers, sample_tokens, anchors, gb - untraced)
            for name, gb in GPUS.items()
        }
    return out


def largest_fitting(
    model_cfg: DrafterConfig, loss_cfg: LossConfig, arch: TargetArch, num_feature_layers: int, sample_tokens: int, anchors: int, budget_gib: float
) -> dict[str, Any]:
    """Doubling then bisection over whole samples: the largest micro-batch whose traced peak fits."""

    def peak(samples: int) -> float:
        shape = StepShape(samples * sample_tokens, sample_tokens, anchors, model_cfg.block_size)
        return traced_step(model_cfg, loss_cfg, arch, num_feature_layers, shape)["Total"]

    lo, hi = 0, 1
    while peak(hi) <= budget_gib:
        lo, hi = hi, hi * 2
        if hi > 4096:
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= budget_gib else (lo, mid)
    return {"micro_batch_tokens": lo * sample_tokens, "samples": lo, "traced_peak_gib": round(peak(lo), 2) if lo else None}
