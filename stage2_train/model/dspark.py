"""DSpark: the DFlash backbone plus a Markov head and a confidence head.

Reimplemented from what vllm-project/speculators 0.9.0 (`models/dspark/`) and DeepSpec compute; no
code copied. Everything of the DFlash drafter holds (fc + hidden_norm over the target features, KV
injection, the block [anchor, MASK x (B-1)] at RoPE positions anchor..anchor+B-1, the frozen embedding
and LM head), with three differences:

- `sample_from_anchor`: slot k predicts the token at anchor + k + 1, so every slot is scored and a
  block drafts B tokens (DFlash: anchor + k, B - 1 drafts). Batches built with `label_shift=1`
  (`data/batch.py`): slot k's label is input_ids[a+k+1], its target top-k row a+k, supervised where
  a+k+1 < T and loss_mask[a+k+1] (DeepSpec's rule; speculators masks by loss_mask[a+k]).
- Markov head: slot k's logits are lm_head(h_k) + W2 z_k, z_k a rank-r code of the token before the
  slot's prediction (`prev`: the anchor for slot 0, then the previous slot's token): vanilla z = W1[prev];
  gated z = sigmoid(gate([h ; W1[prev]])) * W1[prev]; rnn z = tanh(o) of a state s carried along the block
  ([a; c; o] = joint([s ; W1[prev] ; h]), s <- sigmoid(a) s + (1 - sigmoid(a)) tanh(c)). Training conditions
  on the data tokens (teacher forcing, `DrafterBatch.prev_ids_NB`); decoding on its own drafts, left to right.
- Confidence head: c_k = proj([h_k ; W1[prev_k]]), trained with BCE against the slot's acceptance
  estimate alpha_k (detached). speculators' alpha is 1 - TV(p, q) over the full vocabulary; from a
  top-k store alpha_K = sum over the stored ids of min(p_target, q_drafter), a lower bound whose gap is
  at most the stored top-k's missing mass (README, "The drafter variants"). Decoding may stop a block
  early when the predicted chance that every draft so far is accepted, prod_k sigmoid(c_k), falls below
  `eval.confidence_stop` (off by default; at least one draft).

Weights are named as speculators, SpecForge and vLLM name them: `markov_head.markov_w1.weight` [V, r],
`markov_head.markov_w2.weight` [V, r], `markov_head.gate_proj.*` / `joint_proj.*`,
`confidence_head.proj.{weight,bias}`; initialised as speculators does (W1 ~ N(0, 0.01), the rest
PyTorch's default Linear init, never the backbone's N(0, init_std)).

Shape legend: N blocks, B block size, H hidden, V vocab, R Markov rank, M scored rows, C candidates, K top-k.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shared.errors import CheckpointError
from shared.target import TargetArch
from stage2_train.data.batch import DrafterBatch
from stage2_train.model.config import DrafterConfig, LossConfig
from stage2_train.model.drafter import DFlashDrafter


class MarkovHead(nn.Module):
    """The low-rank bias W2 z of a slot from the token before it (see the module docstring)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, kind: str):
        super().__init__()
        if kind not in ("vanilla", "gated", "rnn"):
            raise ValueError(f"markov head must be vanilla, gated or rnn, got {kind!r}")
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        for module in (self.markov_w2, getattr(self, "gate_proj", None), getattr(self, "joint_proj", None)):
            if module is not None:
                module.reset_parameters()  # PyTorch's default, as speculators leaves them

    def step(self, e_NR: torch.Tensor, h_NH: torch.Tensor, state_NR: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(z, the next state) of one slot from its previous token's code e = W1[prev] and its hidden h."""
        if self.kind == "vanilla":
            return e_NR, state_NR
        h_NH = h_NH.to(e_NR.dtype)
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([h_NH, e_NR], -1))) * e_NR, state_NR
        state_NR = e_NR.new_zeros(e_NR.shape) if state_NR is None else state_NR
        # F.linear, not the module: it runs once per slot, and module hooks (the memory plan's tracker) expect one call
        joint = self.joint_proj
        gate_NR, cand_NR, out_NR = F.linear(torch.cat([state_NR, e_NR, h_NH], -1), joint.weight, joint.bias).chunk(3, -1)
        gate_NR = torch.sigmoid(gate_NR)
        state_NR = gate_NR * state_NR + (1.0 - gate_NR) * torch.tanh(cand_NR)
        return torch.tanh(out_NR), state_NR

    def codes(self, prev_NB: torch.Tensor, hidden_NBH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(z_NBR, e_NBR) of every slot given the tokens before them (teacher forcing)."""
        e_NBR = self.markov_w1(prev_NB)
        if self.kind != "rnn":
            return self.step(e_NBR, hidden_NBH, None)[0], e_NBR
        state, z = None, []
        for k in range(prev_NB.shape[1]):
            z_NR, state = self.step(e_NBR[:, k], hidden_NBH[:, k], state)
            z.append(z_NR)
        return torch.stack(z, 1), e_NBR

    def bias(self, z_MR: torch.Tensor, cand_MC: torch.Tensor | None = None) -> torch.Tensor:
        """W2 z over the whole vocabulary [M, V], or at candidate ids only [M, C]; fp32."""
        w2_VR = self.markov_w2.weight
        if cand_MC is None:
            return F.linear(z_MR.to(w2_VR.dtype), w2_VR).float()
        return torch.einsum("mr,mcr->mc", z_MR.to(w2_VR.dtype), w2_VR[cand_MC]).float()


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, hidden_NBH: torch.Tensor, e_NBR: torch.Tensor) -> torch.Tensor:
        """The confidence logit of each slot from [h ; W1[prev]] (speculators' confidence_head_with_markov)."""
        return self.proj(torch.cat([hidden_NBH, e_NBR.to(hidden_NBH.dtype)], -1)).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    label_shift = 1  # slot k predicts anchor + k + 1

    def __init__(self, cfg: DrafterConfig, arch: TargetArch, num_feature_layers: int, mask_token_id: int):
        super().__init__(cfg, arch, num_feature_layers, mask_token_id)
        self.markov_head = MarkovHead(arch.vocab_size, arch.hidden_size, cfg.markov_rank, cfg.markov_head)
        self.confidence_head = ConfidenceHead(arch.hidden_size + cfg.markov_rank) if cfg.confidence_head else None

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self, "markov_head", None) is not None:  # built after the backbone: not there on the first call
            self.markov_head.reset_parameters()
            if self.confidence_head is not None:
                self.confidence_head.proj.reset_parameters()

    @property
    def max_draft(self) -> int:
        return self.block_size

    def loss_rows(self, hidden_NBH: torch.Tensor, batch: DrafterBatch, cfg: LossConfig | None = None) -> MarkovRows:
        if batch.prev_ids_NB is None or batch.label_shift != 1:
            raise ValueError(
                "a DSpark drafter trains on blocks collated with label_shift=1 and prev_ids (model.variant=dspark)"
            )
        z_NBR, e_NBR = self.markov_head.codes(batch.prev_ids_NB, hidden_NBH)
        conf_NB = None if self.confidence_head is None else self.confidence_head(hidden_NBH, e_NBR)
        return MarkovRows(self.markov_head, z_NBR.flatten(0, 1), None if conf_NB is None else conf_NB.flatten())

    @torch.no_grad()
    def draft(self, hidden_BH: torch.Tensor, anchor: int, confidence_stop: float | None = None) -> list[int]:
        """Greedy, left to right: slot k's token is argmax(lm_head(h_k) + W2 z(prev)), prev the anchor then
        each draft; with `confidence_stop`, the block ends before the slot where the predicted chance that
        every draft so far is accepted falls below it (at least one draft is kept)."""
        logits_BV = self.logits(hidden_BH).float()
        prev = torch.tensor([anchor], device=hidden_BH.device)
        state, survival, drafts = None, 1.0, []
        for k in range(hidden_BH.shape[0]):
            e_1R = self.markov_head.markov_w1(prev)
            z_1R, state = self.markov_head.step(e_1R, hidden_BH[k : k + 1], state)
            if confidence_stop is not None and self.confidence_head is not None:
                survival *= float(torch.sigmoid(self.confidence_head(hidden_BH[k : k + 1], e_1R).float()))
                if drafts and survival < confidence_stop:
                    break
            prev = (logits_BV[k : k + 1] + self.markov_head.bias(z_1R)).argmax(-1)
            drafts.append(int(prev))
        return drafts


class MarkovRows:
    """What DSpark adds to `model/loss.py`'s chunks: the Markov bias on the logits, the confidence
    target alpha_K (detached) and the confidence BCE per row; its objective term and its counts."""

    def __init__(self, head: MarkovHead, z_XR: torch.Tensor, conf_X: torch.Tensor | None):
        self.head, self.z, self.conf = head, z_XR, conf_X
        self.needs_topk = conf_X is not None

    def select(self, rows: Any) -> MarkovRows:
        """The rows `rows.rows_M` (flat slot indices) of the micro-batch, in that order."""
        index_M = rows.rows_M if hasattr(rows, "rows_M") else rows
        return MarkovRows(self.head, self.z[index_M], None if self.conf is None else self.conf[index_M])

    def chunk(self, sel: slice) -> MarkovRows:
        return MarkovRows(self.head, self.z[sel], None if self.conf is None else self.conf[sel])

    def adjust(self, logits: torch.Tensor, cand_MC: torch.Tensor | None) -> torch.Tensor:
        return logits + self.head.bias(self.z, cand_MC)

    def pick(self, logits: torch.Tensor, cand_MC: torch.Tensor | None) -> torch.Tensor:
        pred = logits.argmax(-1)
        return pred if cand_MC is None else cand_MC.gather(1, pred[:, None])[:, 0]

    def terms(self, logits, logq, cand_MC, labels_M, topk_lp_MK, topk_ids_MK) -> dict[str, torch.Tensor]:
        if self.conf is None or topk_lp_MK is None:
            return {}
        conf_M = self.conf.float()
        if cand_MC is not None:
            # q here is the softmax over ~K+1 candidates, not the vocabulary: sum_K min(p, q) would
            # overstate the overlap (0.33 against 0.004 on the same rows), so these rows train no
            # confidence (loss.full_vocab_slots null trains it on every slot). `conf_M * 0` keeps
            # the head in the graph: every DDP rank reduces its gradient.
            none_M = torch.zeros_like(conf_M, dtype=torch.bool)
            return {"alpha": torch.zeros_like(conf_M), "conf_bce": conf_M * 0.0, "conf_prob": torch.sigmoid(conf_M).detach(),
                    "conf_on": none_M}
        with torch.no_grad():
            # alpha_K = sum_K min(p, q): p un-renormalised (the stored full-vocabulary log-probs), q
            # the drafter's full softmax at the stored ids: a lower bound of the overlap 1 - TV(p, q)
            alpha_M = torch.minimum(topk_lp_MK.float().exp(), logq.gather(1, topk_ids_MK).exp()).sum(-1).clamp(0.0, 1.0)
        bce_M = F.binary_cross_entropy_with_logits(conf_M, alpha_M, reduction="none")
        return {"alpha": alpha_M, "conf_bce": bce_M, "conf_prob": torch.sigmoid(conf_M).detach(),
                "conf_on": torch.ones_like(conf_M, dtype=torch.bool)}

    def objective(self, terms: dict[str, torch.Tensor], rows: Any, w_train_M: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
        """confidence_weight x the decay-weighted BCE (speculators keeps it on the fixed decay under D-PACE too),
        over the rows scored against the full vocabulary."""
        if "conf_bce" not in terms:
            return terms["ce"].new_zeros(())
        return cfg.confidence_weight * (rows.w_M * terms["conf_bce"] * terms["conf_on"]).sum()

    def counts(self, terms: dict[str, torch.Tensor], rows: Any, cfg: LossConfig) -> dict[str, torch.Tensor]:
        if "conf_bce" not in terms:
            return {}
        on = terms["conf_on"].float()
        n = on.sum()
        alpha, prob = terms["alpha"], terms["conf_prob"]
        w_M = rows.w_M * on
        return {
            "confidence_loss_num": (w_M * terms["conf_bce"].detach()).sum(), "confidence_loss_den": w_M.sum(),
            "accept_rate_num": (alpha * on).sum(), "accept_rate_den": n,  # mean alpha_K: the drafter's overlap with the target
            "confidence_pred_mean_num": (prob * on).sum(), "confidence_pred_mean_den": n.clone(),
            "confidence_abs_error_num": ((prob - alpha).abs() * on).sum(), "confidence_abs_error_den": n.clone(),
        }


def check_dspark_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The DSpark fields of a speculators config.json as our description's, refusing what this
    drafter does not compute (a confidence head without the Markov code in its input, no Markov head)."""
    rank = config.get("markov_rank", 256)
    if not isinstance(rank, int) or rank < 1:
        raise CheckpointError(f"{where}: markov_rank={rank!r}: this pipeline builds DSpark with a Markov head (rank >= 1)")
    kind = config.get("markov_head_type", "vanilla")
    if kind not in ("vanilla", "gated", "rnn"):
        raise CheckpointError(f"{where}: markov_head_type={kind!r} is not vanilla, gated or rnn")
    confidence = bool(config.get("enable_confidence_head", True))
    if confidence and not config.get("confidence_head_with_markov", True):
        raise CheckpointError(
            f"{where}: confidence_head_with_markov=false: this pipeline's confidence head reads [hidden ; W1[prev]]"
        )
    if not config.get("sample_from_anchor", True):
        raise CheckpointError(f"{where}: a DSpark drafter with sample_from_anchor=false is not one this pipeline trains")
    return {"markov_rank": rank, "markov_head": kind, "confidence_head": confidence}
