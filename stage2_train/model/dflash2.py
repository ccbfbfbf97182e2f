"""DFlash2: grouped dynamic convolutions over the block in every layer, and a candidate selector.

Reimplemented from what z-lab/dflash 0.1.0 (`DFlash2DraftModel`) and vllm-project/speculators 0.9.0
(`models/dflash2/`, which credits z-lab's tensor contract) compute; no code copied. The DFlash drafter
holds as it is (slot k predicts anchor + k, slot 0 unscored, B - 1 drafts), with two additions:

- Convolutions. Each decoder layer wraps attention and MLP in a `GroupedDynamicConv`: one projection of
  the sublayer's (normed) input gives dynamic kernels for both sides, D = kernel_projection(x) viewed as
  [2, taps, groups]; the input is convolved before the sublayer and the output after it:
  out[t, c] = sum_{tau < taps, tau <= t} (base[side, tau, c] + D[t, side, tau, c // G]) x[t - tau, c],
  over the B slots of each block only (causal, zero across the block start; the context features are not
  convolved), the dynamic coefficient taken at the output slot t. base starts as the identity (tap 0 = 1)
  and kernel_projection at zero, so a new DFlash2 layer computes the DFlash layer exactly.
- Candidate selector. For slot k with final hidden h_k, unary logits U_k = lm_head(h_k) and the token
  before it u (the anchor for slot 1, then each draft), the candidates C_k are U_k's top K and
  score(c) = U_k[c] + <A[u] * (P h_k), S[c]>, A and S [V, r] codebooks, P [r, H]. Decoding takes
  argmax score left to right. Training: the unary terms as DFlash (CE, top-k KL, decay or D-PACE), plus
  `loss.selector_weight` x the selector's cross-entropy over C_k whose label is the target's top-1
  token (speculators' label: the verifier's argmax, here the stored top-1), conditioned on the data
  tokens (teacher forcing); a label outside C_k replaces the weakest candidate (speculators) or gives
  no selector loss (`loss.selector_misses=drop`, SpecForge). On candidate-softmax slots
  (`loss.full_vocab_slots`) C_k is the top K among the label and the stored top-k, not the vocabulary.

Weight names are the on-disk names of all three peers: `layers.i.{attention,mlp}_conv.base_kernel`
[2, taps, H], `layers.i.{attention,mlp}_conv.kernel_projection.weight` [2 taps H/G, H],
`candidate_selector.{predecessor,successor}_codebook` [V, r] (bare parameters), and
`candidate_selector.hidden_projection.weight` [r, H]; the selector starts at N(0, init_std) (speculators).

Shape legend: N blocks, B block size, H hidden, V vocab, R selector rank, K candidates, G group size,
Q = H / G groups, T taps, M scored rows, C candidate columns.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shared.target import TargetArch
from stage2_train.data.batch import DrafterBatch
from stage2_train.model.attention import AttentionPlan, MaskKind
from stage2_train.model.config import DrafterConfig, LossConfig
from stage2_train.model.drafter import DecoderLayer, DFlashDrafter


def grouped_conv(x_NBH: torch.Tensor, delta_NBTQ: torch.Tensor, base_TH: torch.Tensor, group: int) -> torch.Tensor:
    """The causal convolution of each block's slots (see the module docstring), per channel group."""
    N, B, H = x_NBH.shape
    taps, Q = base_TH.shape[0], H // group
    x_NBQG = x_NBH.view(N, B, Q, group)
    out_NBQG = torch.zeros_like(x_NBQG)
    for tau in range(taps):
        shifted = x_NBQG if tau == 0 else F.pad(x_NBQG[:, : B - tau], (0, 0, 0, 0, tau, 0))
        coefficient = base_TH[tau].view(1, 1, Q, group).to(x_NBH.dtype) + delta_NBTQ[:, :, tau, :, None]
        out_NBQG = out_NBQG + shifted * coefficient
    return out_NBQG.view(N, B, H)


class GroupedDynamicConv(nn.Module):
    def __init__(self, hidden_size: int, taps: int, group: int):
        super().__init__()
        self.taps, self.group, self.num_groups = taps, group, hidden_size // group
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity on both sides: the layer computes what a DFlash layer computes."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x_NBH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the convolved sublayer input, the output side's dynamic kernels)."""
        N, B, _ = x_NBH.shape
        delta = self.kernel_projection(x_NBH).view(N, B, 2, self.taps, self.num_groups)
        return grouped_conv(x_NBH, delta[:, :, 0], self.base_kernel[0], self.group), delta[:, :, 1]

    def finish(self, y_NBH: torch.Tensor, delta_NBTQ: torch.Tensor) -> torch.Tensor:
        return grouped_conv(y_NBH, delta_NBTQ, self.base_kernel[1], self.group)


class DFlash2Layer(DecoderLayer):
    def __init__(self, arch: TargetArch, intermediate_size: int, kind: MaskKind, taps: int, group: int):
        super().__init__(arch, intermediate_size, kind)
        self.attention_conv = GroupedDynamicConv(arch.hidden_size, taps, group)
        self.mlp_conv = GroupedDynamicConv(arch.hidden_size, taps, group)

    def forward(self, h_NBH, ctx_TH, rope, plans: dict[MaskKind, AttentionPlan]) -> torch.Tensor:
        x_NBH, delta = self.attention_conv.prepare(self.input_layernorm(h_NBH))
        h_NBH = h_NBH + self.attention_conv.finish(self.self_attn(x_NBH, ctx_TH, rope, plans[self.kind]), delta)
        x_NBH, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h_NBH))
        return h_NBH + self.mlp_conv.finish(self.mlp(x_NBH), delta)


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def reset_parameters(self, std: float) -> None:
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(weight, std=std)

    def context(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """A[u] * (P h): the predecessor's and the slot's part of every candidate's score, [..., R]."""
        codes = self.predecessor_codebook[prev]
        return codes * self.hidden_projection(hidden).to(codes.dtype)

    def scores(self, unary_MK: torch.Tensor, ctx_MR: torch.Tensor, ids_MK: torch.Tensor) -> torch.Tensor:
        """U[c] + <ctx, S[c]> of candidates `ids_MK` whose unary logits are `unary_MK`; fp32."""
        successor_MKR = self.successor_codebook[ids_MK]
        return unary_MK.float() + torch.einsum("mr,mkr->mk", ctx_MR.to(successor_MKR.dtype), successor_MKR).float()

    def pick(self, logits_MC: torch.Tensor, ctx_MR: torch.Tensor, cand_MC: torch.Tensor | None) -> torch.Tensor:
        """The token each row's selector takes among the top candidates of `logits_MC` (columns are the
        vocabulary, or the ids `cand_MC`)."""
        col_MK = logits_MC.topk(min(self.top_k, logits_MC.shape[1]), dim=-1).indices
        ids_MK = col_MK if cand_MC is None else cand_MC.gather(1, col_MK)
        best_M = self.scores(logits_MC.gather(1, col_MK), ctx_MR, ids_MK).argmax(-1)
        return ids_MK.gather(1, best_M[:, None])[:, 0]


class DFlash2Drafter(DFlashDrafter):
    def __init__(self, cfg: DrafterConfig, arch: TargetArch, num_feature_layers: int, mask_token_id: int):
        if arch.hidden_size % cfg.conv_group_size:
            raise ValueError(f"model.conv_group_size={cfg.conv_group_size} must divide the hidden size {arch.hidden_size}")
        super().__init__(cfg, arch, num_feature_layers, mask_token_id)
        self.candidate_selector = CandidateSelector(arch.vocab_size, arch.hidden_size, cfg.selector_rank, cfg.selector_top_k)
        self.candidate_selector.reset_parameters(cfg.init_std)

    def make_layer(self, arch: TargetArch, intermediate_size: int, kind: MaskKind) -> DecoderLayer:
        return DFlash2Layer(arch, intermediate_size, kind, self.cfg.conv_kernel_size, self.cfg.conv_group_size)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        for layer in self.layers:
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()
        if getattr(self, "candidate_selector", None) is not None:
            self.candidate_selector.reset_parameters(self.cfg.init_std)

    def loss_rows(self, hidden_NBH: torch.Tensor, batch: DrafterBatch, cfg: LossConfig | None = None) -> SelectorRows:
        if batch.prev_ids_NB is None:
            raise ValueError("a DFlash2 drafter trains on blocks collated with prev_ids (data/batch.py collate)")
        ctx_NBR = self.candidate_selector.context(batch.prev_ids_NB, hidden_NBH)
        misses = "inject" if cfg is None else cfg.selector_misses
        return SelectorRows(self.candidate_selector, ctx_NBR.flatten(0, 1), misses)

    @torch.no_grad()
    def draft(self, hidden_BH: torch.Tensor, anchor: int, confidence_stop: float | None = None) -> list[int]:
        """Greedy, left to right over slots 1..B-1: each slot's selector pick among its unary top K, given
        the token before it (the anchor, then each draft)."""
        logits_BV = self.logits(hidden_BH[1:]).float()
        prev = torch.tensor([anchor], device=hidden_BH.device)
        drafts = []
        for k in range(logits_BV.shape[0]):
            ctx_1R = self.candidate_selector.context(prev, hidden_BH[k + 1 : k + 2])
            prev = self.candidate_selector.pick(logits_BV[k : k + 1], ctx_1R, None)
            drafts.append(int(prev))
        return drafts


class SelectorRows:
    """What DFlash2 adds to `model/loss.py`'s chunks: the selector's pick as the prediction, its
    cross-entropy against the target's top-1 over the candidates, its objective term and counts."""

    needs_topk = True  # the selector's label: the stored top-1

    def __init__(self, selector: CandidateSelector, ctx_XR: torch.Tensor, misses: str):
        self.selector, self.ctx, self.misses = selector, ctx_XR, misses

    def select(self, rows: Any) -> SelectorRows:
        index_M = rows.rows_M if hasattr(rows, "rows_M") else rows
        return SelectorRows(self.selector, self.ctx[index_M], self.misses)

    def chunk(self, sel: slice) -> SelectorRows:
        return SelectorRows(self.selector, self.ctx[sel], self.misses)

    def adjust(self, logits: torch.Tensor, cand_MC: torch.Tensor | None) -> torch.Tensor:
        return logits

    def pick(self, logits: torch.Tensor, cand_MC: torch.Tensor | None) -> torch.Tensor:
        with torch.no_grad():
            return self.selector.pick(logits, self.ctx, cand_MC)

    def terms(self, logits, logq, cand_MC, labels_M, topk_lp_MK, topk_ids_MK) -> dict[str, torch.Tensor]:
        if topk_lp_MK is None:
            return {}
        K = min(self.selector.top_k, logits.shape[1])
        best_M = topk_lp_MK.argmax(-1)
        top1_M = topk_ids_MK.gather(1, best_M[:, None])[:, 0]  # the target's greedy token
        col_MK = logits.topk(K, dim=-1).indices  # the drafter's own candidates (what decoding reranks)
        ids_MK = col_MK if cand_MC is None else cand_MC.gather(1, col_MK)
        match_MK = ids_MK == top1_M[:, None]
        contains_M = match_MK.any(-1)
        if cand_MC is None:
            top1_col_M = top1_M
        else:  # its column among [label, top-k]: the label's when equal (the duplicate is masked)
            top1_col_M = torch.where(top1_M == labels_M, 0, best_M + 1)
        train_col_MK, train_ids_MK = col_MK.clone(), ids_MK.clone()
        train_col_MK[:, -1] = torch.where(contains_M, col_MK[:, -1], top1_col_M)
        train_ids_MK[:, -1] = torch.where(contains_M, ids_MK[:, -1], top1_M)
        position_M = torch.where(contains_M, match_MK.long().argmax(-1), K - 1)
        scores_MK = self.selector.scores(logits.gather(1, train_col_MK), self.ctx, train_ids_MK)
        ce_M = F.cross_entropy(scores_MK, position_M, reduction="none")
        with torch.no_grad():
            serving_MK = self.selector.scores(logits.gather(1, col_MK), self.ctx, ids_MK)
            hit_M = ids_MK.gather(1, serving_MK.argmax(-1, keepdim=True))[:, 0] == top1_M
            unary_hit_M = ids_MK[:, 0] == top1_M  # topk is sorted: column 0 is the unary argmax
        keep_M = contains_M | torch.full_like(contains_M, self.misses == "inject")
        return {
            "sel_ce": ce_M, "sel_keep": keep_M.float(), "sel_hit": hit_M.float(), "unary_hit": unary_hit_M.float(),
            "recall": contains_M.float(),
        }

    def objective(self, terms: dict[str, torch.Tensor], rows: Any, w_train_M: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
        """selector_weight x the selector CE under the unary's slot weights (decay or D-PACE)."""
        if "sel_ce" not in terms:
            return terms["ce"].new_zeros(())
        return cfg.selector_weight * (w_train_M * terms["sel_keep"] * terms["sel_ce"]).sum()

    def counts(self, terms: dict[str, torch.Tensor], rows: Any, cfg: LossConfig) -> dict[str, torch.Tensor]:
        if "sel_ce" not in terms:
            return {}
        n = torch.ones_like(terms["recall"]).sum()
        w_keep = rows.w_M * terms["sel_keep"]
        return {
            "selector_loss_num": (w_keep * terms["sel_ce"].detach()).sum(), "selector_loss_den": w_keep.sum(),
            # against the target's top-1, teacher-forced: the selector's pick and the unary argmax (the lift)
            "selector_accuracy_num": terms["sel_hit"].sum(), "selector_accuracy_den": n,
            "unary_top1_accuracy_num": terms["unary_hit"].sum(), "unary_top1_accuracy_den": n.clone(),
            "candidate_recall_num": terms["recall"].sum(), "candidate_recall_den": n.clone(),
        }
