"""The drafter's training FLOPs and MFU, for bench/gpu_check.py (and any GPU benchmark).

    from bench.gpu_flops import DrafterShape, StepWork, train_step_flops
    train_step_flops(DrafterShape(...), StepWork(...))["total"]   # model FLOPs of one optimizer step

`train_step_flops` counts what stage2_train/model.py and loss.py compute for one step; `replay_step_work`
rebuilds the exact work of each logged step (tokens, blocks, scored rows, attention pairs) from the
trainer's own plan; `train_figures` turns a train_log.jsonl into tokens/s and MFU.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

# Dense bf16 peaks (NVIDIA datasheets, SXM parts), by a substring of the device name. The H200 has
# the H100's arithmetic; KINDS.md measured ~790 TFLOP/s for a large bf16 matmul on one.


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


@dataclass(frozen=True)
class StepWork:
    """What one optimizer step computed over (all micro-batches)."""

    context_tokens: int  # T: packed context tokens
    blocks: int  # N: blocks (anchors); each runs B slots through every layer
    scored_rows: int  # M: slots 1..B-1 with a supervised label (the rows the LM head scores)
    attention_pairs: int  # sum over blocks of B x (anchor + B): visible (query, key) pairs per head and layer


def train_step_flops(shape: DrafterShape, work: StepWork) -> dict[str, float]:
    """Model FLOPs of one drafter training step (forward + backward), by part, and their "total".

    Read off stage2_train/model.py and loss.py. A matmul [m, k] x [k, n] costs 2mkn forward, and
    backward 2mkn for its input's gradient plus 2mkn for its weight's:
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
      hidden states' gradient; none for the frozen weight.
    Not counted: norms, RoPE, softmax and log-softmax, embedding lookups, the optimizer, and recomputed
    work (loss.py reruns each LM-head chunk under activation checkpointing; flex attention's backward
    recomputes the scores): MFU counts the model's FLOPs, not the hardware's.
    """
    H, A, G, D, I, V = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate, shape.vocab  # noqa: E741 (model.py legend)
    L, B = shape.num_layers, shape.block_size
    layer_params = H * A * D + 2 * H * G * D + A * D * H + 3 * H * I
    parts = {
        "layers": 6.0 * layer_params * work.blocks * B * L,
        "context_kv": 6.0 * 2 * H * G * D * work.context_tokens * L,
        "fc": 4.0 * shape.num_feature_layers * H * H * work.context_tokens,
        "attention": 12.0 * D * A * work.attention_pairs * L,
        "lm_head": 4.0 * V * H * work.scored_rows,
    }
    parts["total"] = sum(parts.values())
    return parts


def replay_step_work(cfg: Any, store_url: str, loss_masks: dict[int, Any], rows: list[dict]) -> list[StepWork]:
    """The exact work of each logged step, from the same plan the trainer followed: the sampler's bins
    for (epoch, step_in_epoch), the anchors drawn from (seed, epoch, sample id), and the loss masks
    stage 1 stored (taken from its tokenization of the same data)."""
    import numpy as np
    import torch

    from shared.reader import StoreReader
    from stage2_train.data.anchors import AnchorSampler
    from stage2_train.data.sampler import LengthMixedSampler
    from stage2_train.data.view import split_indices

    reader = StoreReader(store_url)
    train, _ = split_indices(reader, cfg.eval.holdout_fraction, cfg.eval.split_seed)
    sample_ids = reader.sample_ids[train]
    sampler = LengthMixedSampler(cfg.sampler, reader.lengths[train], seed=cfg.seed, grad_accum=cfg.train.grad_accum)
    B = cfg.model.block_size
    anchor_sampler = AnchorSampler(cfg.sampler, block_size=B, seed=cfg.seed)
    slots = np.arange(1, B)
    out = []
    for row in rows:
        tokens = blocks = scored = pairs = 0
        for index in (i for b in sampler.plan_epoch(row["epoch"])[row["step_in_epoch"]] for i in b):
            sample_id = int(sample_ids[index])
            mask = np.asarray(loss_masks[sample_id], dtype=bool)
            anchors = anchor_sampler.anchors(torch.from_numpy(mask), sample_id=sample_id, epoch=row["epoch"]).numpy()
            pos = anchors[:, None] + slots[None, :]
            tokens += len(mask)
            blocks += len(anchors)
            scored += int(((pos < len(mask)) & mask[np.minimum(pos, len(mask) - 1)]).sum())
            pairs += int((anchors + B).sum()) * B
        out.append(StepWork(tokens, blocks, scored, pairs))
    return out


def bf16_peak(device_name: str, override_tflops: float | None) -> tuple[float | None, str]:
    """The device's dense bf16 peak, from the datasheet figures `stage1_extract plan` sizes runs with."""
    from stage1_extract.plan import GPUS

    if override_tflops:
        return override_tflops * 1e12, f"{override_tflops:g} TFLOP/s (--peak-tflops)"
    for rates in GPUS.values():
        if rates.name.split()[0] in device_name:
            return rates.bf16_tflops * 1e12, f"{rates.name} dense bf16 {rates.bf16_tflops:g} TFLOP/s (datasheet)"
    return None, f"n/a: no bf16 peak known for {device_name!r} (pass --peak-tflops)"


def train_figures(rows: list[dict], works: list[StepWork] | None, shape: DrafterShape, skip: int,
                  peak: float | None) -> dict[str, Any]:
    """Throughput and MFU over the logged steps after the first `skip` (compilation)."""
    steady = list(range(skip, len(rows))) if len(rows) > skip + 1 else list(range(min(1, len(rows) - 1), len(rows)))
    B = shape.block_size
    out: dict[str, Any] = {
        "steps_logged": len(rows),
        "steps_measured": len(steady),
        "first_step_s": round(rows[0]["step_s"], 2),
        "step_s_median": round(statistics.median(rows[i]["step_s"] for i in steady), 4),
        "tok_per_s": round(statistics.median(rows[i]["tokens"] / rows[i]["step_s"] for i in steady), 1),
        "data_wait_frac": round(statistics.mean(rows[i]["data_wait_frac"] for i in steady), 4),
        "split_s": {k: round(statistics.mean(rows[i][k] for i in steady), 4) for k in ("data_s", "forward_s", "backward_s", "optim_s")},
        "loss_first_last": [round(rows[0]["loss"], 4), round(rows[-1]["loss"], 4)],
    }
    if works is None:
        return out
    flops = [train_step_flops(shape, works[i]) for i in steady]
    step_s = sum(rows[i]["step_s"] for i in steady)
    compute_s = sum(rows[i]["forward_s"] + rows[i]["backward_s"] + rows[i]["optim_s"] for i in steady)
    total = sum(f["total"] for f in flops)
    out.update({
        "block_tok_per_s": round(statistics.median(works[i].blocks * B / rows[i]["step_s"] for i in steady), 1),
        "blocks_per_step": round(statistics.mean(works[i].blocks for i in steady), 1),
        "context_tokens_per_step": round(statistics.mean(works[i].context_tokens for i in steady), 1),
        "tflop_per_step": round(total / len(steady) / 1e12, 4),
        "samples_per_step": round(statistics.mean(rows[i]["samples"] for i in steady), 1),
        "flops_share": {k: round(sum(f[k] for f in flops) / total, 4) for k in flops[0] if k != "total"},
        "achieved_tflops": round(total / step_s / 1e12, 4),
        "achieved_tflops_compute_only": round(total / compute_s / 1e12, 4),
        "mfu": round(total / step_s / peak, 4) if peak else None,
        "mfu_compute_only": round(total / compute_s / peak, 4) if peak else None,
    })
    return out
