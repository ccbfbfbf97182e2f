"""The offline evaluation: the drafter on held-out store samples, as in training, no target needed.

    row = offline_eval(drafter, reader, heldout_indices, max_anchors_per_seq=None)   # + walk_tau

The drafter runs over blocks of held-out samples exactly as in training (AnchorSampler + collate,
epoch 0, so the same blocks every time) and reports the metrics of `model/loss.py` (accuracy,
acc_per_pos, accept_len: 1 + accepted drafts per block) and the acceptance-length histogram.
accept_len averages over every anchor, which overstates decoding's tau: decoding visits anchor
t + a(t) after anchor t, so it crosses easy stretches in few blocks. With every anchor scored
(`max_anchors_per_seq=None`) `walk_tau` replays that walk over the sample and is the estimate to
trust (on the target's own greedy text it equals decoding's tau). The trainer calls it every
`eval.every_steps` and at the end; `stage2_train/serve/online_eval.py` measures real decoding.

Shape legend: N blocks, B block size, H hidden, V vocab, M rows scored in one chunk.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from shared.errors import DataError
from stage2_train.data.anchors import AnchorSampler
from stage2_train.data.batch import IGNORE, DrafterBatch, collate
from stage2_train.data.config import SamplerConfig
from stage2_train.model.config import LossConfig, recipe_gamma
from stage2_train.model.drafter import DFlashDrafter
from stage2_train.model.loss import (
    accept_lengths,
    block_counts,
    finalize_metrics,
    loss_weights,
    sum_counts,
)

DENSE_ANCHORS = 1 << 30  # "every valid anchor" for AnchorSampler


# ---------------------------------------------------------------------------------------------
# Offline


@torch.no_grad()
def score_blocks(
    drafter: DFlashDrafter, batch: DrafterBatch, gamma: float, rows_per_chunk: int = 1024
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """(counts with loss.py's COUNT_KEYS, accept_len_N, pred_NB) for one batch.

    pred_NB is the drafter's argmax at every slot 1..B-1 (-1 at slot 0); a slot is correct when it
    equals a scored label; accept_len = 1 + consecutive correct slots from slot 1 (an unscored slot
    ends the run, as in the training metrics)."""
    hidden_NBH = drafter(batch)
    N, B, H = hidden_NBH.shape
    labels_NB = batch.labels_NB
    hidden_MH = hidden_NBH[:, 1:].reshape(-1, H)
    labels_M = labels_NB[:, 1:].reshape(-1)
    preds, logprobs = [], []
    for start in range(0, hidden_MH.shape[0], rows_per_chunk):
        logits_MV = drafter.logits(hidden_MH[start : start + rows_per_chunk]).float()
        preds.append(logits_MV.argmax(-1))
        label_M = labels_M[start : start + rows_per_chunk].clamp(min=0)
        logprobs.append(logits_MV.log_softmax(-1).gather(1, label_M[:, None])[:, 0])
    pred_NB = torch.full_like(labels_NB, -1)
    pred_NB[:, 1:] = torch.cat(preds).view(N, B - 1)
    valid_NB = labels_NB != IGNORE
    ce_NB = torch.zeros(N, B, device=labels_NB.device)
    ce_NB[:, 1:] = -torch.cat(logprobs).view(N, B - 1)
    w_NB = loss_weights(labels_NB, gamma)
    correct_NB = valid_NB & (pred_NB == labels_NB)
    ce_sum = (w_NB * torch.where(valid_NB, ce_NB, 0.0)).sum()
    counts = block_counts(correct_NB, valid_NB, w_NB, ce_sum, torch.zeros((), device=ce_sum.device))
    return counts, accept_lengths(correct_NB, valid_NB), pred_NB


def _packs(indices: Sequence[int], lengths: np.ndarray, token_budget: int) -> list[list[int]]:
    """Consecutive samples, at most `token_budget` tokens per pack (a longer sample goes alone)."""
    packs, current, tokens = [], [], 0
    for index in indices:
        n = int(lengths[index])
        if current and tokens + n > token_budget:
            packs.append(current)
            current, tokens = [], 0
        current.append(int(index))
        tokens += n
    if current:
        packs.append(current)
    return packs


def decode_walk(accept_by_anchor: dict[int, int]) -> list[tuple[int, int]]:
    """The (anchor, acceptance length) pairs greedy decoding visits, replayed over one sample's blocks.

    Decoding does not visit every anchor: from anchor t it accepts a(t) tokens and drafts next
    from t + a(t). Averaging a(t) over all anchors over-weights easy stretches (decoding crosses
    them in few blocks), so the replayed walk, not the block mean, is what tau measures. Needs
    a(t) at every valid anchor; where the walk lands on an invalid one (an unsupervised span such
    as the next user turn) it resumes at the next valid anchor."""
    anchors = sorted(accept_by_anchor)
    visits = []
    i = 0
    while i < len(anchors):
        a = accept_by_anchor[anchors[i]]
        visits.append((anchors[i], a))
        i = bisect.bisect_left(anchors, anchors[i] + a, lo=i + 1)
    return visits


@torch.no_grad()
def offline_eval(
    drafter: DFlashDrafter,
    reader: Any,
    indices: Sequence[int],
    *,
    max_anchors_per_seq: int | None = 64,
    batch_tokens: int = 8192,
    seed: int = 0,
    gamma: float | None = None,
) -> dict[str, Any]:
    """Block metrics of `drafter` on samples `indices` of a store reader (lengths, reader[i]).

    Deterministic: anchors are AnchorSampler's epoch-0 draw. `max_anchors_per_seq=None` scores
    every valid anchor (dearer) and adds `walk_tau`, the tau that decoding these very sequences
    would get (see `decode_walk`). The drafter is put in eval mode and restored to its mode."""
    block_size = drafter.block_size
    gamma = gamma if gamma is not None else (recipe_gamma(block_size) or 7.0)
    dense = max_anchors_per_seq is None
    anchor_sampler = AnchorSampler(
        SamplerConfig(max_anchors_per_seq=DENSE_ANCHORS if dense else max_anchors_per_seq),
        block_size=block_size,
        seed=seed,
    )
    device = drafter.fc.weight.device
    parts: list[dict[str, torch.Tensor]] = []
    hist_B = torch.zeros(block_size, dtype=torch.long)
    walk_tokens = walk_forwards = 0
    num_samples = num_without_anchor = 0
    was_training = drafter.training
    drafter.eval()
    try:
        for pack in _packs(indices, np.asarray(reader.lengths), batch_tokens):
            batch, without = _pack_batch(reader, pack, anchor_sampler, drafter.mask_token_id)
            num_samples += len(pack)
            num_without_anchor += without
            if batch is None:
                continue
            counts, accept_N, _ = score_blocks(drafter, batch.to(device), gamma)
            parts.append({k: v.float().cpu() for k, v in counts.items()})
            accept_N = accept_N.cpu()
            hist_B += torch.bincount(accept_N - 1, minlength=block_size)
            if dense:
                tokens, forwards = _walk_totals(batch, accept_N)
                walk_tokens, walk_forwards = walk_tokens + tokens, walk_forwards + forwards
    finally:
        drafter.train(was_training)
    if not parts:
        raise DataError(
            f"offline eval: none of the {num_samples} samples has a valid anchor for block size {block_size}"
        )
    return _offline_row(parts, hist_B, gamma, num_samples, num_without_anchor, walk_tokens / walk_forwards if dense else None)


def _offline_row(
    parts: list[dict[str, torch.Tensor]], hist_B: torch.Tensor, gamma: float, num_samples: int, num_without_anchor: int, walk_tau: float | None
) -> dict[str, Any]:
    metrics = finalize_metrics(sum_counts(parts), LossConfig(gamma=gamma))
    return {
        "num_samples": num_samples,
        "num_samples_without_anchor": num_without_anchor,
        "num_blocks": int(hist_B.sum()),
        "ce": float(metrics["ce"]),
        "accuracy": float(metrics["accuracy"]),
        "acc_per_pos": [round(float(a), 6) for a in metrics["acc_per_pos"]],
        "accept_len": float(metrics["accept_len"]),  # mean over the scored blocks, bonus included
        "walk_tau": walk_tau,
        "accept_hist": hist_B.tolist(),  # index j: blocks with acceptance length j + 1
    }


def _pack_batch(reader: Any, pack: list[int], anchor_sampler: AnchorSampler, mask_token_id: int) -> tuple[DrafterBatch | None, int]:
    """(the pack's samples as one batch, or None, and how many of them have no valid anchor)."""
    samples, anchors = [], []
    for index in pack:
        sample = reader[index]
        anchors_A = anchor_sampler.anchors(sample["loss_mask_T"], sample_id=int(sample["sample_id"]), epoch=0)
        if len(anchors_A):
            samples.append(sample)
            anchors.append(anchors_A)
    without = len(pack) - len(samples)
    if not samples:
        return None, without
    batch = collate(samples, anchors, block_size=anchor_sampler.block_size, mask_token_id=mask_token_id, gather_topk=False)
    return batch, without


def _walk_totals(batch: DrafterBatch, accept_N: torch.Tensor) -> tuple[int, int]:
    """(tokens, verifying forwards) of replaying decoding over every sample of the batch."""
    seq_N, anchor_N, accepted = batch.block_seq_N.tolist(), batch.anchor_pos_N.tolist(), accept_N.tolist()
    tokens = forwards = 0
    for s in sorted(set(seq_N)):
        visits = decode_walk({a: n for q, a, n in zip(seq_N, anchor_N, accepted) if q == s})
        tokens += sum(a for _, a in visits)
        forwards += len(visits)
    return tokens, forwards
