"""The DFlash training loss and its metrics.

Cross-entropy on slots 1..B-1 with position weights w_k = exp(-(k-1)/gamma) (SpecForge
`specforge/core/dflash.py`, commit ffc4ab79 "align with paper"), normalised per token:
loss = sum(w * CE over valid slots) / sum(w over valid slots). gamma = 7 for B=16, 5 for B=10,
4 for B=8.

`loss.weighting=dpace` (D-PACE, arXiv 2605.18810; speculators' `dpace_loss_decay`, SpecForge's
`loss_type: dpace`, same weights): with q_k = exp(-CE_k) detached and m_k the scored slots,
s_k = (1 - alpha) q_k + alpha (1 where m_k = 0), P_k = prod_{j<=k} s_j, w_k = m_k * sum_{j>=k} m_j P_j.
A slot weighs the chance that decoding reaches it and what accepting it leads to. The weights need
the forward's CE, so the step's normaliser cannot be their sum (known only after every micro-batch's
forward): D-PACE divides by the step's count of scored slots, over all micro-batches and ranks (an
exact per-token mean for any layout). speculators divides by its packed row's mask sum (per rank,
per micro-batch); SpecForge by the number of sequences.

The reported metrics (loss, ce, kl, accuracy, accept_len) are the same whatever the weighting and
`distill_positions`: decay-weighted, over the supervised (assistant) slots, so runs compare; the
objective backpropagated is the configured one (`objective_normalizer` says what divides it).

Optional top-k KL term (`kl_weight` > 0), with the same position weights. Its exact definition:
p = softmax over the K stored target log-probs (the target's top-k, renormalised to sum to 1);
log q = the drafter's log-softmax over the FULL vocabulary, gathered at the K stored ids;
KL_topk = sum_k p_k * (log p_k - log q_k). It is >= 0 (sum_k q_k <= 1) and 0 only when the
drafter puts all its mass on the stored ids in the target's proportions; its gradient is that of
cross-entropy against the soft target p.

The LM head runs on scored rows only, in chunks of `ce_chunk_blocks` blocks' worth of rows, each chunk
under activation checkpointing, so at most one chunk of [rows, V] logits exists at a time
(forward and backward).

Metrics are tensors (no .item()). Counts (COUNT_KEYS, and a variant's `X_num` / `X_den` pairs) can be
summed over micro-batches and ranks; `finalize_metrics(counts, cfg)` turns summed counts into ratios
exactly (a pair gives the metric X).

The variants (model/dspark.py, model/dflash2.py) reuse all of this: `dflash_loss(..., variant=drafter)`
hands each LM-head chunk to the drafter's `loss_rows` object, which may change the chunk's logits
(DSpark's Markov bias), add per-row terms (its confidence target; DFlash2's selector), its own objective
terms and its own counts. DSpark's batches are shifted (`DrafterBatch.label_shift`): slot k predicts
anchor + k + 1, so its first scored slot is 0 and every rule below that says "slot 1" means the batch's
`first_slot`; the decay is then exp(-k/gamma) from slot 0, speculators' weights for it.

Shape legend: N blocks, B block size, H hidden, V vocab, K stored top-k, M scored rows, C candidates,
P = B - first_slot scored positions (slot k = first_slot..B-1 at index k - first_slot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from stage2_train.data.batch import IGNORE, DrafterBatch, with_scored_index
from stage2_train.model.config import LossConfig

COUNT_KEYS = (
    "ce_sum",  # sum of w * CE over scored slots
    "kl_sum",  # sum of w * KL_topk over scored slots
    "weight_sum",  # sum of w over scored slots
    "num_valid",  # scored slots
    "correct_per_pos",  # [P] argmax == label, per slot 1..B-1
    "valid_per_pos",  # [P] scored slots per position
    "accept_sum",  # sum over scored blocks of 1 + consecutive correct slots from slot 1
    "num_blocks",  # blocks with at least one scored slot
)


def position_weights(block_size: int, gamma: float, device: torch.device | str | None = None, first: int = 1) -> torch.Tensor:
    """w_B: 0 before the first scored slot (slot 0, the anchor's own token), exp(-(k-first)/gamma) from it:
    the d-th draft of a block weighs exp(-(d-1)/gamma) whichever slot carries it."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - first) / gamma)
    w[:first] = 0.0
    return w


def loss_weights(labels_NB: torch.Tensor, gamma: float, first: int = 1) -> torch.Tensor:
    """w_NB: the position weight where a slot is scored, else 0. Its sum is the loss normaliser,
    so a trainer can sum it over micro-batches first for an exact token-level mean."""
    w_B = position_weights(labels_NB.shape[1], gamma, labels_NB.device, first)
    return torch.where(labels_NB != IGNORE, w_B, 0.0)


def objective_normalizer(batch: DrafterBatch, cfg: LossConfig) -> torch.Tensor:
    """What this micro-batch adds to the step's normaliser, known before any forward: the decay
    weights' sum, or (D-PACE, whose weights come from the forward) the count of scored slots."""
    if cfg.weighting == "dpace":
        return (batch.labels_NB != IGNORE).sum().float()
    return loss_weights(batch.labels_NB, cfg.gamma, batch.first_slot).sum()


def dpace_weights(ce_NB: torch.Tensor, mask_NB: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's w_NB from detached per-slot CE and the scored-slot mask (see the module docstring)."""
    with torch.no_grad():
        m_NB = mask_NB.float()
        s_NB = torch.where(mask_NB, (1.0 - alpha) * torch.exp(-ce_NB.float()) + alpha, torch.ones_like(m_NB))
        prefix_NB = torch.cumprod(s_NB, dim=1)
        suffix_NB = torch.flip(torch.cumsum(torch.flip(prefix_NB * m_NB, dims=[1]), dim=1), dims=[1])
        return suffix_NB * m_NB


def _chunk_terms(hidden_MH, lm_head_VH, labels_M, topk_lp_MK, topk_ids_MK, variant=None) -> dict[str, torch.Tensor]:
    """Per row of one chunk: CE of the label, KL to the target's top-k (zeros without top-k), the
    argmax and whether it is the label; and the variant's terms on the same logits."""
    logits_MV = F.linear(hidden_MH.to(lm_head_VH.dtype), lm_head_VH).float()
    if variant is not None:
        logits_MV = variant.adjust(logits_MV, None)
    logq_MV = logits_MV.log_softmax(-1)
    ce_M = -logq_MV.gather(1, labels_M[:, None])[:, 0]
    pred_M = logits_MV.argmax(-1) if variant is None else variant.pick(logits_MV, None)
    out = {"ce": ce_M, "kl": torch.zeros_like(ce_M), "pred": pred_M, "correct": pred_M == labels_M}
    if topk_lp_MK is not None:
        logp_MK = topk_lp_MK.float().log_softmax(-1)  # the target's top-k, renormalised
        p_MK = logp_MK.exp()
        logq_MK = logq_MV.gather(1, topk_ids_MK)
        out["kl"] = torch.where(p_MK > 0, p_MK * (logp_MK - logq_MK), 0.0).sum(-1)
    if variant is not None:
        out.update(variant.terms(logits_MV, logq_MV, None, labels_M, topk_lp_MK, topk_ids_MK))
    return out


def _candidate_terms(hidden_MH, lm_head_VH, labels_M, topk_lp_MK, topk_ids_MK, variant=None) -> dict[str, torch.Tensor]:
    """The same terms over C = [label, the target's stored top-k ids] only (a sampled softmax whose
    samples are the target's own likely tokens, the hard negatives): CE of the label and KL to the
    target's renormalised top-k, both against the drafter's softmax over C; "correct" means the
    label wins among C. A top-k id equal to the label is masked so the label is counted once."""
    cand_MC = torch.cat([labels_M[:, None], topk_ids_MK], dim=1)
    weight_MCH = lm_head_VH[cand_MC].to(hidden_MH.dtype)
    logits_MC = torch.einsum("mh,mch->mc", hidden_MH, weight_MCH).float()
    if variant is not None:
        logits_MC = variant.adjust(logits_MC, cand_MC)
    duplicate_MC = torch.cat([torch.zeros_like(labels_M[:, None], dtype=torch.bool), topk_ids_MK == labels_M[:, None]], 1)
    logits_MC = logits_MC.masked_fill(duplicate_MC, float("-inf"))
    logq_MC = logits_MC.log_softmax(-1)
    ce_M = -logq_MC[:, 0]
    if variant is None:
        pred_M = cand_MC.gather(1, logq_MC.argmax(-1, keepdim=True))[:, 0]
    else:
        pred_M = variant.pick(logits_MC, cand_MC)
    logp_MK = topk_lp_MK.float().log_softmax(-1)
    p_MK = logp_MK.exp()
    logq_MK = torch.where(duplicate_MC[:, 1:], logq_MC[:, :1], logq_MC[:, 1:])  # the label's column stands in
    kl_M = torch.where(p_MK > 0, p_MK * (logp_MK - logq_MK), 0.0).sum(-1)
    out = {"ce": ce_M, "kl": kl_M, "pred": pred_M, "correct": pred_M == labels_M}
    if variant is not None:
        out.update(variant.terms(logits_MC, logq_MC, cand_MC, labels_M, topk_lp_MK, topk_ids_MK))
    return out


@dataclass
class ScoredRows:
    """The scored slots of a micro-batch as rows: M = slots whose label is not IGNORE."""

    rows_M: torch.Tensor  # indices into the N * B slots
    slot_M: torch.Tensor  # each row's slot k in 1..B-1
    hidden_MH: torch.Tensor
    labels_M: torch.Tensor
    w_M: torch.Tensor
    topk_lp_MK: torch.Tensor | None
    topk_ids_MK: torch.Tensor | None
    per_slot: tuple[int, ...] = ()  # scored rows per slot 0..B-1 (rows are slot-major)
    sup_M: torch.Tensor | None = None  # rows where CE and the metrics apply (None: all)
    first: int = 1  # the batch's first scorable slot


def scored_rows(hidden_NBH: torch.Tensor, batch: DrafterBatch, gamma: float, with_topk: bool) -> ScoredRows:
    """The scored slots as rows, slot-major (`DrafterBatch.scored_M`, found on the host)."""
    N, B, H = hidden_NBH.shape
    labels_NB = batch.labels_NB
    if with_topk and (batch.topk_logprobs_NBK is None or batch.topk_ids_NBK is None):
        raise ValueError(
            "loss.kl_weight > 0, loss.full_vocab_slots or model.variant=dspark/dflash2 needs a store with top-k (the batch has none)"
        )
    rows_M = with_scored_index(batch).scored_M
    topk_lp_MK = topk_ids_MK = None
    if with_topk:
        K = batch.topk_ids_NBK.shape[-1]
        topk_lp_MK = batch.topk_logprobs_NBK.reshape(N * B, K)[rows_M]
        topk_ids_MK = batch.topk_ids_NBK.reshape(N * B, K)[rows_M].long()
    return ScoredRows(
        rows_M=rows_M,
        slot_M=rows_M % B,
        hidden_MH=hidden_NBH.reshape(N * B, H)[rows_M],
        labels_M=labels_NB.reshape(-1)[rows_M],
        w_M=loss_weights(labels_NB, gamma, batch.first_slot).reshape(-1)[rows_M],
        topk_lp_MK=topk_lp_MK,
        topk_ids_MK=topk_ids_MK,
        per_slot=with_scored_index(batch).scored_per_slot,
        first=batch.first_slot,
        sup_M=None if batch.supervised_NB is None else batch.supervised_NB.reshape(-1)[rows_M],
    )


def lm_head_terms(
    rows: ScoredRows,
    lm_head_VH: torch.Tensor,
    rows_per_chunk: int,
    like: torch.Tensor,
    full_vocab_slots: int | None = None,
    variant: Any = None,
) -> dict[str, torch.Tensor]:
    """Per-row terms (ce, kl, pred, correct and the variant's) of every scored row through the frozen
    LM head, `rows_per_chunk` rows at a time, each chunk under activation checkpointing when it needs a
    backward (one [rows, V] at a time; what a chunk returns is a vector per row). With
    `full_vocab_slots`, rows past the first N drafts take the candidate softmax instead. `variant`: the
    drafter's `loss_rows` object (None for DFlash), sliced per chunk."""
    M = rows.rows_M.shape[0]
    # Rows are slot-major, so the full-vocabulary drafts are a prefix whose length the host already
    # knows: no data-dependent indexing on the device.
    num_full = M if full_vocab_slots is None else sum(rows.per_slot[: rows.first + full_vocab_slots])
    needs_grad = torch.is_grad_enabled() and like.requires_grad
    def args(sel: slice) -> tuple:
        topk_lp, topk_ids = rows.topk_lp_MK, rows.topk_ids_MK
        return (
            rows.hidden_MH[sel], lm_head_VH, rows.labels_M[sel], None if topk_lp is None else topk_lp[sel],
            None if topk_ids is None else topk_ids[sel], None if variant is None else variant.chunk(sel),
        )

    parts: list[dict[str, torch.Tensor]] = []
    for terms, (lo, hi) in ((_chunk_terms, (0, num_full)), (_candidate_terms, (num_full, M))):
        chunked = hi - lo > rows_per_chunk and needs_grad
        for start in range(lo, hi, rows_per_chunk):
            sel = slice(start, min(start + rows_per_chunk, hi))
            parts.append(checkpoint(terms, *args(sel), use_reentrant=False) if chunked else terms(*args(sel)))
    if not parts:  # nothing scored: an empty chunk gives every term its (empty) row vector
        parts.append(_chunk_terms(*args(slice(0, 0))))
    out = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
    # `like.sum() * 0` keeps the graph connected when nothing is scored (every rank still reduces)
    out["ce"] = out["ce"] + like.sum() * 0.0
    return out


def dflash_loss(
    hidden_NBH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    batch: DrafterBatch,
    cfg: LossConfig,
    normalizer: torch.Tensor | float | None = None,
    variant: Any = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics). Slot k's hidden state is scored against labels_NB[:, k] (no shift: the batch
    put each slot's label there).

    `normalizer`: divide the objective by this instead of this micro-batch's own
    (`objective_normalizer`; pass the sum over the whole optimizer step for an exact per-token mean).
    `variant`: a DSpark or DFlash2 drafter (its `loss_rows` adds its heads' terms); None: DFlash.
    """
    N, B, _ = hidden_NBH.shape
    extra = None if variant is None else variant.loss_rows(hidden_NBH, batch, cfg)
    rows = scored_rows(hidden_NBH, batch, cfg.gamma, with_topk=cfg.needs_topk or (extra is not None and extra.needs_topk))
    if extra is not None:
        extra = extra.select(rows)
    terms = lm_head_terms(rows, lm_head_VH, cfg.ce_chunk_blocks * B, hidden_NBH, cfg.full_vocab_slots, extra)
    ce_M, kl_M, correct_M = terms["ce"], terms["kl"], terms["correct"]
    if cfg.weighting == "dpace":
        w_train_M = dpace_row_weights(ce_M, rows, N, B, batch.labels_NB != IGNORE, cfg.dpace_alpha)
    else:
        w_train_M = rows.w_M
    sup_M = torch.ones_like(correct_M) if rows.sup_M is None else rows.sup_M
    objective = cfg.ce_weight * (w_train_M * sup_M * ce_M).sum() + cfg.kl_weight * (w_train_M * kl_M).sum()
    if extra is not None:
        objective = objective + extra.objective(terms, rows, w_train_M, cfg)
    denom = objective_normalizer(batch, cfg).clamp_min(1e-12) if normalizer is None else normalizer
    loss = objective / denom
    with torch.no_grad():
        labels_NB = batch.labels_NB
        correct_NB = torch.zeros(N * B, dtype=torch.bool, device=labels_NB.device)
        correct_NB[rows.rows_M] = correct_M
        w_M = rows.w_M * sup_M  # the metrics: decay weights, supervised slots
        counts = block_counts(
            correct_NB.view(N, B), batch.supervised(), loss_weights(labels_NB, cfg.gamma, batch.first_slot),
            (w_M * ce_M.detach()).sum(), (w_M * kl_M.detach()).sum(), batch.first_slot, batch.continues_N,
        )
        if extra is not None:
            counts.update(extra.counts(terms, rows, cfg))
    return loss, {**counts, **finalize_metrics(counts, cfg)}


def dpace_row_weights(
    ce_M: torch.Tensor, rows: ScoredRows, N: int, B: int, mask_NB: torch.Tensor, alpha: float
) -> torch.Tensor:
    """D-PACE's weights of the scored rows, from their CE laid back into blocks."""
    ce_NB = torch.zeros(N * B, device=ce_M.device)
    ce_NB[rows.rows_M] = ce_M.detach()
    return dpace_weights(ce_NB.view(N, B), mask_NB, alpha).reshape(-1)[rows.rows_M]


def block_counts(
    correct_NB: torch.Tensor, valid_NB: torch.Tensor, w_NB: torch.Tensor, ce_sum: torch.Tensor, kl_sum: torch.Tensor,
    first: int = 1, continues_N: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The COUNT_KEYS of some blocks (`first`: the first scorable slot, 0 for DSpark's shifted blocks).

    A block's acceptance length is what one verification of it would yield: its run of correct
    scored slots from the first draft, plus the target's bonus token, except when the run ran into an
    unscored slot or through the block's last slot at the end of the response (`continues_N`
    false): decoding stops there, with no bonus. So offline
    blocks give decoding's numbers at response ends too. Only blocks whose first draft is scored count
    for accept_len: decoding drafts only where the next token is the response's (with
    loss.distill_positions=all a block anchored in the prompt scores KL-only slots first and CE
    slots later; its "run" would read 0)."""
    scored_N = valid_NB[:, first]
    accept_N = accept_lengths(correct_NB, valid_NB, first, continues_N)
    return {
        "ce_sum": ce_sum.float(),
        "kl_sum": kl_sum.float(),
        "weight_sum": (w_NB * valid_NB).sum().float(),
        "num_valid": valid_NB.sum(),
        "correct_per_pos": (correct_NB & valid_NB)[:, first:].sum(0),
        "valid_per_pos": valid_NB[:, first:].sum(0),
        "accept_sum": (accept_N * scored_N).sum(),
        "num_blocks": scored_N.sum(),
    }


def accept_lengths(
    correct_NB: torch.Tensor, valid_NB: torch.Tensor, first: int = 1, continues_N: torch.Tensor | None = None
) -> torch.Tensor:
    """Per block: 1 + correct scored slots in a row from slot `first`, less the bonus when that run
    ended at an unscored slot, or ran through the whole block and the response ends with it
    (`continues_N` false; None: it goes on): decoding gets no token past the response's end."""
    run_N = (correct_NB[:, first:] & valid_NB[:, first:]).long().cumprod(1).sum(1)
    B = correct_NB.shape[1]
    stop_N = (run_N + first).clamp(max=B - 1)  # the slot where the run stopped
    whole_N = run_N == B - first
    ran_out_N = ~whole_N & ~valid_NB.gather(1, stop_N[:, None])[:, 0]
    if continues_N is not None:
        ran_out_N = ran_out_N | (whole_N & ~continues_N.to(whole_N.device))
    return run_N + (~ran_out_N).long()


def finalize_metrics(counts: dict[str, torch.Tensor], cfg: LossConfig) -> dict[str, torch.Tensor]:
    """Ratios from (summed) counts; each metric is defined once here (docs/training.md: "Metrics, defined once").

    accuracy     scored slots whose argmax equals the label
    acc_per_pos  the same per slot 1..B-1
    accept_len   mean over scored blocks of 1 + accepted drafts (the bonus token included): the
                 tokens a verification of that block would give. vllm-project/speculators 0.9.0
                 reports this as `eal`. Every anchor counts once, so easy stretches weigh more than
                 in decoding; `walk_tau` (offline eval) corrects that, `tau` is measured decoding."""
    c = {k: counts[k].float() for k in COUNT_KEYS}
    weight = c["weight_sum"].clamp_min(1e-12)
    ratios = {  # a variant's X_num / X_den pairs: its own metrics (confidence_loss, selector_accuracy, ...)
        key[: -len("_num")]: counts[key].float() / counts[key[: -len("_num")] + "_den"].float().clamp_min(1e-12)
        for key in sorted(counts) if key.endswith("_num") and key[: -len("_num")] + "_den" in counts
    }
    return {
        "loss": (cfg.ce_weight * c["ce_sum"] + cfg.kl_weight * c["kl_sum"]) / weight,
        "ce": c["ce_sum"] / weight,
        "kl": c["kl_sum"] / weight,
        "accuracy": c["correct_per_pos"].sum() / c["num_valid"].clamp_min(1),
        "acc_per_pos": c["correct_per_pos"] / c["valid_per_pos"].clamp_min(1),
        "accept_len": c["accept_sum"] / c["num_blocks"].clamp_min(1),
        **ratios,
    }


def logged_metrics(counts: dict[str, torch.Tensor], cfg: LossConfig) -> dict[str, Any]:
    """finalize_metrics as a log row's plain numbers, each None when the counts hold no scored block:
    0.0 there read as a perfect loss and as an accuracy cliff (the doctor's detectors skip None)."""
    scored = bool(counts["num_blocks"])
    return {k: (v.tolist() if v.dim() else v.item()) if scored else None for k, v in finalize_metrics(counts, cfg).items()}


def count_keys(metrics: dict[str, torch.Tensor]) -> list[str]:
    """The summable entries of a loss's metrics: COUNT_KEYS and a variant's X_num / X_den pairs."""
    return [*COUNT_KEYS, *sorted(k for k in metrics if k.endswith(("_num", "_den")))]


def sum_counts(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Add the counts of several micro-batches or packs (ranks: `all_reduce` the same keys)."""
    return {k: torch.stack([p[k].float() for p in parts]).sum(0) for k in count_keys(parts[0])}
