"""The DFlash training loss and its metrics.

Cross-entropy on slots 1..B-1 with position weights w_k = exp(-(k-1)/gamma) (SpecForge
`specforge/core/dflash.py`, commit ffc4ab79 "align with paper"), normalised per token:
loss = sum(w * CE over valid slots) / sum(w over valid slots). gamma = 7 for B=16, 5 for B=10,
4 for B=8.

Optional top-k KL term (`kl_weight` > 0), with the same position weights. Its exact definition:
p = softmax over the K stored target log-probs (the target's top-k, renormalised to sum to 1);
log q = the drafter's log-softmax over the FULL vocabulary, gathered at the K stored ids;
KL_topk = sum_k p_k * (log p_k - log q_k). It is >= 0 (sum_k q_k <= 1) and 0 only when the
drafter puts all its mass on the stored ids in the target's proportions; its gradient is that of
cross-entropy against the soft target p.

The LM head runs on scored rows only, in chunks of `ce_chunk` blocks' worth of rows, each chunk
under activation checkpointing, so at most one chunk of [rows, V] logits exists at a time
(forward and backward).

Metrics are tensors (no .item()). Counts (COUNT_KEYS) can be summed over micro-batches and ranks;
`finalize_metrics(counts, cfg)` turns summed counts into ratios exactly.

Shape legend: N blocks, B block size, H hidden, V vocab, K stored top-k, M scored rows,
P = B - 1 scored positions (slot k = 1..B-1 at index k-1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shared.config import Section
from stage2_train.batch import DrafterBatch

IGNORE = -100
RECIPE_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
COUNT_KEYS = (
    "ce_sum",  # sum of w * CE over scored slots
    "kl_sum",  # sum of w * KL_topk over scored slots
    "weight_sum",  # sum of w over scored slots
    "num_valid",  # scored slots
    "correct_per_pos",  # [P] argmax == label, per slot 1..B-1
    "valid_per_pos",  # [P] scored slots per position
    "streak_sum",  # sum over blocks of consecutive correct slots from slot 1
    "num_blocks",  # blocks with at least one scored slot
)


def recipe_gamma(block_size: int) -> float | None:
    """The published gamma for a block size, or None where the paper gives none."""
    return RECIPE_GAMMA.get(block_size)


@dataclass(kw_only=True)
class LossConfig(Section):
    section: ClassVar[str] = "loss"
    gamma: float = 7.0  # position decay; 7 for B=16 (5 for B=10, 4 for B=8)
    ce_weight: float = 1.0
    kl_weight: float = 0.0  # top-k KL against the stored target distribution; 0 in the recipe
    ce_chunk: int = 128  # blocks per LM-head chunk (Qwen3, V=151936: 128*16 rows ~ 1.2 GB fp32)

    def validate(self) -> None:
        self.require(self.gamma > 0 and math.isfinite(self.gamma), "gamma", "must be a finite number > 0")
        self.require(self.ce_weight >= 0, "ce_weight", "must be >= 0")
        self.require(self.kl_weight >= 0, "kl_weight", "must be >= 0")
        self.require(
            self.ce_weight + self.kl_weight > 0, "ce_weight", "and loss.kl_weight must not both be 0"
        )
        self.require(self.ce_chunk >= 1, "ce_chunk", "must be >= 1")

    def recipe_warnings(self, block_size: int | None = None) -> list[str]:
        """Departures from the recipe; the gamma check needs model.block_size."""
        warnings = []
        if self.kl_weight > 0 or self.ce_weight != 1.0:
            warnings.append(
                f"loss.ce_weight={self.ce_weight}, loss.kl_weight={self.kl_weight}: the recipe trains CE only (1, 0)"
            )
        if block_size is not None:
            expected = recipe_gamma(block_size)
            if expected is None:
                warnings.append(
                    f"loss.gamma={self.gamma}: no published gamma for model.block_size={block_size} "
                    f"(published: {', '.join(f'B={b}: {g:g}' for b, g in RECIPE_GAMMA.items())})"
                )
            elif self.gamma != expected:
                warnings.append(
                    f"loss.gamma={self.gamma:g} departs from the recipe: {expected:g} for model.block_size={block_size}"
                )
        return warnings


def position_weights(block_size: int, gamma: float, device: torch.device | str | None = None) -> torch.Tensor:
    """w_B: 0 at slot 0 (never scored), exp(-(k-1)/gamma) at slot k >= 1."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def loss_weights(labels_NB: torch.Tensor, gamma: float) -> torch.Tensor:
    """w_NB: the position weight where a slot is scored, else 0. Its sum is the loss normaliser,
    so a trainer can sum it over micro-batches first for an exact token-level mean."""
    w_B = position_weights(labels_NB.shape[1], gamma, labels_NB.device)
    return torch.where(labels_NB != IGNORE, w_B, 0.0)


def _chunk_terms(hidden_MH, lm_head_VH, labels_M, w_M, topk_lp_MK, topk_ids_MK):
    """Weighted CE and KL sums of one chunk of rows, and which rows the argmax gets right."""
    logits_MV = F.linear(hidden_MH.to(lm_head_VH.dtype), lm_head_VH).float()
    logq_MV = logits_MV.log_softmax(-1)
    ce_M = -logq_MV.gather(1, labels_M[:, None])[:, 0]
    ce_sum = (w_M * ce_M).sum()
    correct_M = logits_MV.argmax(-1) == labels_M
    if topk_lp_MK is None:
        return ce_sum, ce_sum.new_zeros(()), correct_M
    logp_MK = topk_lp_MK.float().log_softmax(-1)  # the target's top-k, renormalised
    p_MK = logp_MK.exp()
    logq_MK = logq_MV.gather(1, topk_ids_MK)
    kl_M = torch.where(p_MK > 0, p_MK * (logp_MK - logq_MK), 0.0).sum(-1)
    return ce_sum, (w_M * kl_M).sum(), correct_M


def dflash_loss(
    hidden_NBH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    batch: DrafterBatch,
    cfg: LossConfig,
    normalizer: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics). Slot k's hidden state is scored against labels_NB[:, k] (no shift).

    `normalizer`: divide the weighted sums by this instead of this micro-batch's weight sum
    (pass the weight sum of the whole optimizer step for an exact per-token mean).
    """
    N, B, H = hidden_NBH.shape
    labels_NB = batch.labels_NB
    use_kl = cfg.kl_weight > 0
    if use_kl and (batch.topk_logprobs_NBK is None or batch.topk_ids_NBK is None):
        raise ValueError("loss.kl_weight > 0 needs a store with top-k log-probs (the batch has none)")

    w_NB = loss_weights(labels_NB, cfg.gamma)
    valid_NB = labels_NB != IGNORE
    rows_M = valid_NB.reshape(-1).nonzero()[:, 0]
    hidden_MH = hidden_NBH.reshape(N * B, H)[rows_M]
    labels_M = labels_NB.reshape(-1)[rows_M]
    w_M = w_NB.reshape(-1)[rows_M]
    topk_lp_MK = topk_ids_MK = None
    if use_kl:
        K = batch.topk_ids_NBK.shape[-1]
        topk_lp_MK = batch.topk_logprobs_NBK.reshape(N * B, K)[rows_M]
        topk_ids_MK = batch.topk_ids_NBK.reshape(N * B, K)[rows_M].long()

    ce_sum = kl_sum = hidden_NBH.sum() * 0.0  # keeps the graph when nothing is scored
    correct_parts = []
    rows_per_chunk = cfg.ce_chunk * B
    chunked = len(rows_M) > rows_per_chunk and torch.is_grad_enabled() and hidden_NBH.requires_grad
    for start in range(0, len(rows_M), rows_per_chunk):
        sl = slice(start, start + rows_per_chunk)
        args = (
            hidden_MH[sl],
            lm_head_VH,
            labels_M[sl],
            w_M[sl],
            None if topk_lp_MK is None else topk_lp_MK[sl],
            None if topk_ids_MK is None else topk_ids_MK[sl],
        )
        if chunked:
            c_sum, k_sum, correct_M = checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            c_sum, k_sum, correct_M = _chunk_terms(*args)
        ce_sum = ce_sum + c_sum
        kl_sum = kl_sum + k_sum
        correct_parts.append(correct_M)

    weight_sum = w_M.sum()
    denom = weight_sum.clamp_min(1e-12) if normalizer is None else normalizer
    loss = (cfg.ce_weight * ce_sum + cfg.kl_weight * kl_sum) / denom

    with torch.no_grad():
        correct_NB = torch.zeros(N * B, dtype=torch.bool, device=labels_NB.device)
        if correct_parts:
            correct_NB[rows_M] = torch.cat(correct_parts)
        correct_NB = correct_NB.view(N, B)
        streak_N = correct_NB[:, 1:].long().cumprod(1).sum(1)  # unscored slots count as wrong
        counts = {
            "ce_sum": ce_sum.detach().float(),
            "kl_sum": kl_sum.detach().float(),
            "weight_sum": weight_sum.float(),
            "num_valid": valid_NB.sum(),
            "correct_per_pos": correct_NB[:, 1:].sum(0),
            "valid_per_pos": valid_NB[:, 1:].sum(0),
            "streak_sum": streak_N.sum(),
            "num_blocks": valid_NB.any(1).sum(),
        }
    return loss, {**counts, **finalize_metrics(counts, cfg)}


def expected_acceptance_length(acc_P: torch.Tensor) -> torch.Tensor:
    """eal = sum_k prod_{i<=k} acc_i (speculators `models/dflash/metrics.py`)."""
    return acc_P.cumprod(-1).sum(-1)


def finalize_metrics(counts: dict[str, torch.Tensor], cfg: LossConfig) -> dict[str, torch.Tensor]:
    """Ratios from (summed) counts. A position with no scored slot has accuracy 0."""
    c = {k: counts[k].float() for k in COUNT_KEYS}
    acc_P = c["correct_per_pos"] / c["valid_per_pos"].clamp_min(1)
    return {
        "loss": (cfg.ce_weight * c["ce_sum"] + cfg.kl_weight * c["kl_sum"])
        / c["weight_sum"].clamp_min(1e-12),
        "ce": c["ce_sum"] / c["weight_sum"].clamp_min(1e-12),
        "kl": c["kl_sum"] / c["weight_sum"].clamp_min(1e-12),
        "accuracy": c["correct_per_pos"].sum() / c["num_valid"].clamp_min(1),
        "acc_per_pos": acc_P,
        "avg_streak": c["streak_sum"] / c["num_blocks"].clamp_min(1),
        "eal": expected_acceptance_length(acc_P),
    }


def sum_counts(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Add the counts of several micro-batches (for ranks: all_reduce each COUNT_KEYS tensor)."""
    return {k: torch.stack([p[k].float() for p in parts]).sum(0) for k in COUNT_KEYS}
