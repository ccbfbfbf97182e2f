"""The drafter's model FLOPs for one training step: what MFU divides by the device's peak.

    shape = DrafterShape.of(cfg.model, target.arch, len(target.layer_ids))
    works = step_work(data.sampler, data.anchors, sample_ids, loss_masks, log_rows)   # each logged step
    train_step_flops(shape, works[0])["total"]
    utilization(shape, works, log_rows, peak=989e12)["mfu"]

`train_step_flops` counts what drafter.py and loss.py compute for one step; `step_work` rebuilds the
exact work of each logged step (tokens, blocks, scored rows, attention pairs) from the trainer's own
sampler and anchor sampler (`open_run_data`), so the count follows the plan the trainer followed.
A DSpark or DFlash2 drafter's own modules are counted too ("variant"; docs/variants.md), and a DSpark
step's scored rows are its shifted labels (`step_work(..., label_shift=1)`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shared.target import TargetArch
from stage2_train.data.anchors import AnchorSampler
from stage2_train.data.batch import supervised_slots
from stage2_train.data.sampler import LengthMixedSampler
from stage2_train.model.config import DrafterConfig


@dataclass(frozen=True)
class DrafterShape:
    hidden: int  # H
    heads: int  # A
    kv_heads: int  # G
    head_dim: int  # D
    intermediate: int  # I
    vocab: int  # V
    num_layers: int  # drafter layers
    num_feature_layers: int  # target layers concatenated into the fc input (F = this x H)
    block_size: int  # B
    # A variant's own modules (model/dspark.py, model/dflash2.py); zero for the others.
    markov_rank: int = 0  # dspark: r
    markov_head: str = ""  # dspark: vanilla | gated | rnn
    confidence_head: bool = False  # dspark
    conv_kernel_size: int = 0  # dflash2: taps
    conv_group_size: int = 0  # dflash2: channels per dynamic coefficient
    selector_rank: int = 0  # dflash2: r
    selector_top_k: int = 0  # dflash2: K candidates

    @classmethod
    def of(cls, model: DrafterConfig, arch: TargetArch, num_feature_layers: int) -> DrafterShape:
        """The shape of the drafter `model` builds on `arch` (as DFlashDrafter sizes its layers, and the
        variant its own modules)."""
        if model.variant == "dspark":
            extra = {"markov_rank": model.markov_rank, "markov_head": model.markov_head, "confidence_head": model.confidence_head}
        elif model.variant == "dflash2":
            extra = {"conv_kernel_size": model.conv_kernel_size, "conv_group_size": model.conv_group_size,
                     "selector_rank": model.selector_rank, "selector_top_k": model.selector_top_k}
        else:
            extra = {}
        return cls(arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim,
                   model.intermediate_size or arch.intermediate_size, arch.vocab_size, model.num_layers,
                   num_feature_layers, model.block_size, **extra)


@dataclass(frozen=True)
class StepWork:
    """What one optimizer step computed over (all micro-batches)."""

    context_tokens: int  # T: packed context tokens
    blocks: int  # N: blocks (anchors); each runs B slots through every layer
    scored_rows: int  # M: slots with a supervised label (1..B-1; DSpark 0..B-1), the rows the LM head scores
    attention_pairs: int  # sum over blocks of B x (anchor + B): visible (query, key) pairs per head and layer


def train_step_flops(shape: DrafterShape, work: StepWork) -> dict[str, float]:
    """Model FLOPs of one drafter training step (forward + backward), by part, and their "total".

    A matmul [m, k] x [k, n] costs 2mkn forward, and backward 2mkn for its input's gradient plus 2mkn
    for its weight's:
    - layers: every block slot (N x B rows, slot 0 included) goes through q/k/v/o and the MLP of each
      layer, 6 x (H*A*D + 2*H*G*D + A*D*H + 3*H*I) per row and layer: "6 x params x tokens" over the
      layer weights, with block tokens as the tokens;
    - context keys/values: each layer's k_proj and v_proj also run over the T context tokens, whose
      fused features need gradients (they come from the trainable fc): 6 x 2*H*G*D per token and layer;
    - fc: concat(features) [T, F*H] -> [T, H], once per step; its input is data, so backward computes
      only the weight gradient: 4 x F*H*H per context token;
    - attention: per layer and head, one (query row, visible key) pair costs 2D for q.k and 2D for p.v
      forward and twice that backward, 12 x D x A per pair and layer; a block's B query rows see the
      context of its sample before the anchor (`anchor` keys) and the B slots of the block itself;
    - LM head (the target's, frozen): scored rows only, 2*V*H forward and 2*V*H backward for the
      hidden states' gradient; none for the frozen weight;
    - variant (trained, so 6 x weights per row): DSpark's Markov bias W2 z over the vocabulary on the
      scored rows (6*V*r), its gate (6*(H+r)*r) or recurrence (6*(2r+H)*3r) and confidence head
      (6*(H+r)) on every block row; DFlash2's two convolutions per layer on every block row (the
      kernel projection H -> 2 sides x taps x H/group, 6*H*2*taps*H/group, and the taps' products,
      6*H*taps a side), its selector's projection P (6*H*r) on every block row and its K candidate
      scores on the scored rows (6*K*r). The W1 / codebook lookups are gathers, not counted.
    Not counted: norms, RoPE, softmax and log-softmax, embedding lookups, the optimizer, and recomputed
    work (loss.py reruns each LM-head chunk under activation checkpointing; flex attention's backward
    recomputes the scores): MFU counts the model's FLOPs, not the hardware's.
    """
    H, A, G, D, I, V = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate, shape.vocab  # noqa: E741 (drafter.py legend)
    L, B = shape.num_layers, shape.block_size
    layer_params = H * A * D + 2 * H * G * D + A * D * H + 3 * H * I
    parts = {
        "layers": 6.0 * layer_params * work.blocks * B * L,
        "context_kv": 6.0 * 2 * H * G * D * work.context_tokens * L,
        "fc": 4.0 * shape.num_feature_layers * H * H * work.context_tokens,
        "attention": 12.0 * D * A * work.attention_pairs * L,
        "lm_head": 4.0 * V * H * work.scored_rows,
    }
    if shape.markov_rank or shape.selector_rank:  # a DSpark or DFlash2 drafter
        parts["variant"] = variant_flops(shape, work)
    parts["total"] = sum(parts.values())
    return parts


def variant_flops(shape: DrafterShape, work: StepWork) -> float:
    """The FLOPs of a variant's own modules (see train_step_flops); 0 for DFlash."""
    H, V, B = shape.hidden, shape.vocab, shape.block_size
    rows = work.blocks * B
    if shape.markov_rank:
        r = shape.markov_rank
        per_row = {"vanilla": 0, "gated": (H + r) * r, "rnn": (2 * r + H) * 3 * r}[shape.markov_head]
        per_row += (H + r) if shape.confidence_head else 0
        return 6.0 * (V * r * work.scored_rows + per_row * rows)
    if shape.selector_rank:
        taps, groups = shape.conv_kernel_size, H // shape.conv_group_size
        conv = 2 * (H * 2 * taps * groups + 2 * H * taps)  # two convolutions a layer, each on both sides
        return 6.0 * (conv * rows * shape.num_layers + H * shape.selector_rank * rows
                      + shape.selector_top_k * shape.selector_rank * work.scored_rows)
    return 0.0


def step_work(
    sampler: LengthMixedSampler, anchors: AnchorSampler, sample_ids: np.ndarray, loss_masks: Mapping[int, Any],
    rows: list[dict[str, Any]], label_shift: int = 0,
) -> list[StepWork]:
    """The work of each logged step (train_log.jsonl rows: `epoch`, `step_in_epoch`) from the plan the
    trainer followed: the sampler's bins of that step (indices into `sample_ids`, the training
    samples) and the anchors drawn for each sample that epoch, on its loss mask (`loss_masks`, by
    sample id: stage 1's tokenization, so no features are read). `label_shift` 1: a DSpark run, whose
    slot k is scored on the token at anchor + k + 1 (data/batch.py collate)."""
    B = anchors.block_size
    out = []
    for row in rows:
        tokens = blocks = scored = pairs = 0
        for index in (i for bin_ in sampler.plan_epoch(row["epoch"])[row["step_in_epoch"]] for i in bin_):
            sample_id = int(sample_ids[index])
            mask = np.asarray(loss_masks[sample_id], dtype=bool)
            drawn = anchors.anchors(torch.from_numpy(mask), sample_id=sample_id, epoch=row["epoch"]).numpy()
            tokens += len(mask)
            blocks += len(drawn)
            scored += int(supervised_slots(torch.from_numpy(mask), torch.from_numpy(drawn), B, label_shift)[0].sum())
            pairs += int((drawn + B).sum()) * B
        out.append(StepWork(tokens, blocks, scored, pairs))
    return out


def utilization(shape: DrafterShape, works: list[StepWork], rows: list[dict[str, Any]], peak: float | None = None) -> dict[str, Any]:
    """What logged steps achieved (train_log.jsonl rows, each with its `works` entry): their model FLOPs
    over their wall time (`step_s`) and over their compute alone (forward + backward + optimizer), in
    TFLOP/s and as a share of `peak` FLOP/s (MFU; None without a peak), and the FLOPs' split by part."""
    flops = [train_step_flops(shape, work) for work in works]
    total = sum(f["total"] for f in flops)
    step_s = sum(r["step_s"] for r in rows)
    compute_s = sum(r["forward_s"] + r["backward_s"] + r["optim_s"] for r in rows)
    return {
        "tflop_per_step": total / len(rows) / 1e12,
        "flops_share": {k: sum(f[k] for f in flops) / total for k in flops[0] if k != "total"},
        "achieved_tflops": total / step_s / 1e12,
        "achieved_tflops_compute_only": total / compute_s / 1e12,
        "mfu": total / step_s / peak if peak else None,
        "mfu_compute_only": total / compute_s / peak if peak else None,
    }
