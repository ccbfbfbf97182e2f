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
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
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
    COUNT_KEYS,
    accept_lengths,
    block_counts,
    finalize_metrics,
    loss_weights,
)

DENSE_ANCHORS = 1 << 30  # "every valid anchor" for AnchorSampler


# ---------------------------------------------------------------------------------------------
# Offline


@dataclass
class ScoredBlocks:
    """One batch through the drafter: the summable counts (loss.py's COUNT_KEYS) and, per block and
    slot, what they were made of (for per-sample statistics)."""

    counts: dict[str, torch.Tensor]
    accept_N: torch.Tensor  # 1 + accepted drafts per block (the bonus included, as in training)
    pred_NB: torch.Tensor  # the drafter's prediction at slots first..B-1 (-1 before)
    ce_NB: torch.Tensor  # CE of the label per slot (0 where unscored)
    w_NB: torch.Tensor  # the loss's position weight where scored, else 0
    correct_NB: torch.Tensor  # scored and argmax == label


@torch.no_grad()
def score_blocks(drafter: DFlashDrafter, batch: DrafterBatch, gamma: float, rows_per_chunk: int = 1024) -> ScoredBlocks:
    """Every block of `batch` scored: a slot is correct when its prediction equals a scored label;
    accept_len = 1 + consecutive correct slots from the first draft (an unscored slot ends the run,
    as in the training metrics). A variant predicts as it decodes, teacher-forced on the data tokens:
    DSpark's argmax of the Markov-corrected logits, DFlash2's selector pick (its CE stays the unary's)."""
    hidden_NBH = drafter(batch)
    N, B, H = hidden_NBH.shape
    first = batch.first_slot
    labels_NB = batch.labels_NB
    loss_rows = getattr(drafter, "loss_rows", None)
    extra = None if loss_rows is None else loss_rows(hidden_NBH, batch)
    if extra is not None:
        slots_M = (torch.arange(N, device=labels_NB.device)[:, None] * B + torch.arange(first, B, device=labels_NB.device)).reshape(-1)
        extra = extra.select(slots_M)
    hidden_MH = hidden_NBH[:, first:].reshape(-1, H)
    labels_M = labels_NB[:, first:].reshape(-1)
    preds, logprobs = [], []
    for start in range(0, hidden_MH.shape[0], rows_per_chunk):
        sel = slice(start, start + rows_per_chunk)
        logits_MV = drafter.logits(hidden_MH[sel]).float()
        if extra is not None:
            logits_MV = extra.chunk(sel).adjust(logits_MV, None)
        preds.append(logits_MV.argmax(-1) if extra is None else extra.chunk(sel).pick(logits_MV, None))
        label_M = labels_M[sel].clamp(min=0)
        logprobs.append(logits_MV.log_softmax(-1).gather(1, label_M[:, None])[:, 0])
    pred_NB = torch.full_like(labels_NB, -1)
    pred_NB[:, first:] = torch.cat(preds).view(N, B - first)
    valid_NB = labels_NB != IGNORE
    ce_NB = torch.zeros(N, B, device=labels_NB.device)
    ce_NB[:, first:] = -torch.cat(logprobs).view(N, B - first)
    ce_NB = torch.where(valid_NB, ce_NB, 0.0)
    w_NB = loss_weights(labels_NB, gamma, first)
    correct_NB = valid_NB & (pred_NB == labels_NB)
    ce_sum = (w_NB * ce_NB).sum()
    counts = block_counts(correct_NB, valid_NB, w_NB, ce_sum, torch.zeros((), device=ce_sum.device), first, batch.continues_N)
    accept_N = accept_lengths(correct_NB, valid_NB, first, batch.continues_N)
    return ScoredBlocks(counts, accept_N, pred_NB, ce_NB, w_NB, correct_NB)


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


# Per-sample metrics whose spread over the held-out samples gives each eval row its noise (`*_se`).
SAMPLE_METRICS = ("ce", "accuracy", "accept_len", "walk_tau")
TOTAL_KEYS = (
    *COUNT_KEYS,
    "accept_hist",  # [B] blocks with acceptance length j + 1
    "walk_tokens",
    "walk_forwards",
    "num_samples",
    "num_samples_without_anchor",
    *(f"sample_{m}_{part}" for m in SAMPLE_METRICS for part in ("n", "sum", "sq")),
)


def empty_totals(max_draft: int) -> dict[str, torch.Tensor]:
    """Zero totals: what a rank with no held-out sample contributes to the reduction (`max_draft`:
    the drafts of one block, B - 1, or B for DSpark)."""
    out = {k: torch.zeros((), dtype=torch.float64) for k in TOTAL_KEYS}
    for key in ("correct_per_pos", "valid_per_pos"):
        out[key] = torch.zeros(max_draft, dtype=torch.float64)
    out["accept_hist"] = torch.zeros(max_draft + 1, dtype=torch.float64)
    return out


def flatten_totals(totals: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([totals[k].reshape(-1).double() for k in TOTAL_KEYS])


def unflatten_totals(flat: torch.Tensor, max_draft: int) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for key, like in empty_totals(max_draft).items():
        out[key] = flat[offset : offset + like.numel()].reshape(like.shape).cpu()
        offset += like.numel()
    return out


@torch.no_grad()
def offline_totals(
    drafter: DFlashDrafter,
    reader: Any,
    indices: Sequence[int],
    *,
    max_anchors_per_seq: int | None = 64,
    batch_tokens: int = 8192,
    seed: int = 0,
    gamma: float | None = None,
) -> dict[str, torch.Tensor]:
    """The offline eval's sums over samples `indices` (TOTAL_KEYS, float64): they add up over ranks,
    so several ranks may each score a share of the held-out samples and one reduction gives the
    row a single rank would have computed (`offline_row`). Deterministic: anchors are
    AnchorSampler's epoch-0 draw per sample. The drafter is put in eval mode and restored."""
    block_size = drafter.block_size
    shift = getattr(drafter, "label_shift", 0)
    max_draft = block_size - 1 + shift
    gamma = gamma if gamma is not None else (recipe_gamma(block_size) or 7.0)
    dense = max_anchors_per_seq is None
    anchor_sampler = AnchorSampler(
        SamplerConfig(max_anchors_per_seq=DENSE_ANCHORS if dense else max_anchors_per_seq),
        block_size=block_size,
        seed=seed,
    )
    device = drafter.fc.weight.device
    totals = empty_totals(max_draft)
    was_training = drafter.training
    drafter.eval()
    try:
        for pack in _packs(indices, np.asarray(reader.lengths), batch_tokens):
            batch, without = _pack_batch(reader, pack, anchor_sampler, drafter.mask_token_id, shift)
            totals["num_samples"] += len(pack)
            totals["num_samples_without_anchor"] += without
            if batch is None:
                continue
            scored = score_blocks(drafter, batch.to(device), gamma)
            for key, value in scored.counts.items():
                totals[key] += value.double().cpu()
            accept_N = scored.accept_N.cpu()
            totals["accept_hist"] += torch.bincount(accept_N - 1, minlength=max_draft + 1).double()
            for metric, values in _sample_values(batch, scored, dense).items():
                v = torch.tensor(values, dtype=torch.float64)
                totals[f"sample_{metric}_n"] += len(values)
                totals[f"sample_{metric}_sum"] += v.sum()
                totals[f"sample_{metric}_sq"] += v.square().sum()
            if dense:
                tokens, forwards = _walk_totals(batch, accept_N)
                totals["walk_tokens"] += tokens
                totals["walk_forwards"] += forwards
    finally:
        drafter.train(was_training)
    return totals


def offline_row(totals: dict[str, torch.Tensor], gamma: float, dense: bool) -> dict[str, Any]:
    """The eval row of (reduced) totals: pooled metrics, and each per-sample metric's standard error
    over the held-out samples (the noise the doctor's generalisation rule compares against)."""
    counts = {k: totals[k].float() for k in COUNT_KEYS}
    if float(counts["num_blocks"]) == 0:
        raise DataError(
            f"offline eval: none of the {int(totals['num_samples'])} samples has a valid anchor for this block size"
        )
    metrics = finalize_metrics(counts, LossConfig(gamma=gamma))
    walk = dense and float(totals["walk_forwards"]) > 0
    row = {
        "num_samples": int(totals["num_samples"]),
        "num_samples_without_anchor": int(totals["num_samples_without_anchor"]),
        "num_blocks": int(counts["num_blocks"]),
        "ce": float(metrics["ce"]),
        "accuracy": float(metrics["accuracy"]),
        "acc_per_pos": [round(float(a), 6) for a in metrics["acc_per_pos"]],
        "accept_len": float(metrics["accept_len"]),  # mean over the scored blocks, bonus included
        "walk_tau": float(totals["walk_tokens"] / totals["walk_forwards"]) if walk else None,
        "accept_hist": [int(x) for x in totals["accept_hist"].tolist()],  # index j: blocks with acceptance length j + 1
    }
    for metric in SAMPLE_METRICS:
        row[f"{metric}_se"] = _standard_error(totals, metric) if (metric != "walk_tau" or walk) else None
    return row


def _standard_error(totals: dict[str, torch.Tensor], metric: str) -> float | None:
    """std / sqrt(n) of the per-sample values (n >= 2), from their count, sum and sum of squares."""
    n, total, sq = (float(totals[f"sample_{metric}_{p}"]) for p in ("n", "sum", "sq"))
    if n < 2:
        return None
    variance = max(0.0, (sq - total * total / n) / (n - 1))
    return (variance / n) ** 0.5


def _sample_values(batch: DrafterBatch, scored: ScoredBlocks, dense: bool) -> dict[str, list[float]]:
    """Each sample's own ce, accuracy, accept_len (and walk_tau when every anchor was scored)."""
    valid_NB = scored.w_NB > 0
    out: dict[str, list[float]] = {m: [] for m in SAMPLE_METRICS}
    seq_N = batch.block_seq_N.cpu()
    for s in torch.unique(seq_N).tolist():
        mine = seq_N == s
        valid = valid_NB[mine].cpu()
        if not valid.any():
            continue
        w = scored.w_NB[mine].cpu()
        out["ce"].append(float((w * scored.ce_NB[mine].cpu()).sum() / w.sum()))
        out["accuracy"].append(float(scored.correct_NB[mine].cpu().sum() / valid.sum()))
        scored_blocks = valid.any(1)
        out["accept_len"].append(float(scored.accept_N[mine].cpu()[scored_blocks].double().mean()))
        if dense:
            visits = decode_walk(dict(zip(batch.anchor_pos_N[mine].tolist(), scored.accept_N[mine].tolist())))
            out["walk_tau"].append(sum(a for _, a in visits) / len(visits))
    return out


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
    """Block metrics of `drafter` on samples `indices` of a store reader (lengths, reader[i]), in
    one process: `offline_row(offline_totals(...))`. `max_anchors_per_seq=None` scores every valid
    anchor (dearer) and adds `walk_tau`, the tau that decoding these very sequences would get."""
    gamma = gamma if gamma is not None else (recipe_gamma(drafter.block_size) or 7.0)
    totals = offline_totals(
        drafter, reader, indices, max_anchors_per_seq=max_anchors_per_seq, batch_tokens=batch_tokens, seed=seed, gamma=gamma
    )
    return offline_row(totals, gamma, dense=max_anchors_per_seq is None)


def _pack_batch(
    reader: Any, pack: list[int], anchor_sampler: AnchorSampler, mask_token_id: int, label_shift: int = 0
) -> tuple[DrafterBatch | None, int]:
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
    batch = collate(
        samples, anchors, block_size=anchor_sampler.block_size, mask_token_id=mask_token_id, gather_topk=False,
        label_shift=label_shift,
    )
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


class HeldoutEvaluator:
    """The held-out evaluation during training, spread over the ranks: rank r scores samples r, r + W,
    ... of the first `eval.offline_max_samples` held-out samples, and one all_reduce of the sums
    (`reduce_sum`) gives every rank the row one rank would compute. No rank waits in a collective
    while another evaluates alone (an NCCL timeout), and the eval takes 1/W of the time. A rank that
    fails says so in the same reduction, so every rank raises together."""

    def __init__(
        self, reader: Any, heldout: np.ndarray, eval_cfg: Any, *, seed: int, gamma: float, rank: int, world_size: int,
        reduce_sum: Any, autocast: Any = contextlib.nullcontext,
    ):
        self.reader, self.seed, self.gamma, self.batch_tokens = reader, seed, gamma, eval_cfg.offline_batch_tokens
        self.mine = heldout[: eval_cfg.offline_max_samples][rank::world_size].tolist()
        self.any = len(heldout) > 0
        # The training step's autocast: the eval computes as the step and the bf16 export do, and the
        # compiled attention serves both with one set of graphs (an fp32 eval would add its own).
        self.reduce_sum, self.autocast = reduce_sum, autocast

    def row(self, model: DFlashDrafter, anchors: int | None) -> dict[str, Any] | str | None:
        """The eval row of `anchors` per sample (None: every anchor) reduced over the ranks; None when
        there is no held-out sample, or why nothing could be scored (a string)."""
        if not self.any:
            return None
        error: BaseException | None = None
        max_draft = model.block_size - 1 + getattr(model, "label_shift", 0)
        totals = empty_totals(max_draft)
        try:
            with self.autocast():
                totals = offline_totals(
                    model, self.reader, self.mine, max_anchors_per_seq=anchors, batch_tokens=self.batch_tokens,
                    seed=self.seed, gamma=self.gamma,
                )
        except Exception as exc:  # noqa: BLE001 - raised after the reduction, on every rank
            error = exc
        flat = torch.cat([flatten_totals(totals), torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64)])
        flat = self.reduce_sum(flat).cpu()
        if error is not None:
            raise error
        if float(flat[-1]) > 0:
            raise RuntimeError("the held-out evaluation failed on another rank (its traceback is in that rank's log)")
        try:
            return offline_row(unflatten_totals(flat[:-1], max_draft), self.gamma, anchors is None)
        except ValueError as exc:  # e.g. no held-out sample long enough for one block
            return str(exc)
