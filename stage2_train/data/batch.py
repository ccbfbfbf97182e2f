"""The packed micro-batch the drafter trains on.

Shape legend: T = packed context tokens of all samples in the micro-batch (no padding),
F = num_feature_layers * hidden, N = blocks (anchors) in the micro-batch, B = block size,
K = stored top-k.

A block n drafts tokens anchor_pos_N[n] + 0..B-1 of sample block_seq_N[n]. Its queries see
the context tokens of the same sample strictly before the anchor, and the B slots of their own
block (bidirectional); nothing else. Slot 0 holds the anchor token. With `label_shift` 0 (DFlash,
DFlash2) slot k predicts the token at anchor + k and slot 0 is never scored; with 1 (DSpark, its
`sample_from_anchor`) slot k, at the same RoPE position anchor + k, predicts anchor + k + 1, so every
slot is scored. `prev_ids_NB` is the data token just before each slot's label (the anchor for the
first scored slot): what the DSpark Markov head and the DFlash2 selector condition on in training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

IGNORE = -100  # label of a slot that carries no loss (cross_entropy's ignore_index)


@dataclass
class DrafterBatch:
    context_TF: torch.Tensor  # float, concatenated target features (layers in ascending id order)
    context_pos_T: torch.Tensor  # long, position of each token inside its sample
    context_seq_T: torch.Tensor  # long, index of the token's sample inside this micro-batch
    block_ids_NB: torch.Tensor  # long, [anchor token, mask, mask, ...]
    block_seq_N: torch.Tensor  # long, sample of each block
    anchor_pos_N: torch.Tensor  # long, position of the anchor inside its sample
    labels_NB: torch.Tensor  # long, token at anchor + k; -100 where not scored (slot 0, past the end of the sample or the response)
    topk_logprobs_NBK: torch.Tensor | None = None  # target log-probs for the token at anchor + k
    topk_ids_NBK: torch.Tensor | None = None
    num_samples: int = 0
    num_tokens: int = 0  # real context tokens (== T)
    # The scored slots (label != IGNORE) as flat indices into N*B, slot-major: every scored slot 1,
    # then every slot 2, ... and how many there are per slot (host ints). Found where the batch is
    # built (on the host, in the loader's threads), so the loss needs no `nonzero` on the device,
    # which would be one more host sync per micro-batch (and cannot be traced with fake tensors).
    scored_M: torch.Tensor | None = None
    scored_per_slot: tuple[int, ...] | None = None
    # Where cross-entropy and the metrics apply (assistant tokens) when more slots are scored by the
    # KL term alone (loss.distill_positions=all); None: every scored slot.
    supervised_NB: torch.Tensor | None = None
    label_shift: int = 0  # 1: slot k is labelled with the token at anchor + k + 1 (every slot scored)
    prev_ids_NB: torch.Tensor | None = None  # long, the data token before each slot's label
    # bool, the response goes on past the block's last slot: only then does a block drafted right to
    # its end earn decoding's bonus token (at the end of turn decoding stops). None: assume it does.
    continues_N: torch.Tensor | None = None

    @property
    def first_slot(self) -> int:
        """The first slot that can be scored: 1 (slot 0 is the anchor's own token), 0 with label_shift 1."""
        return 1 - self.label_shift

    def supervised(self) -> torch.Tensor:
        return (self.labels_NB != IGNORE) if self.supervised_NB is None else self.supervised_NB

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> DrafterBatch:
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value.to(device, non_blocking=True)
                if dtype is not None and value.is_floating_point() and f.name == "context_TF":
                    value = value.to(dtype)
            moved[f.name] = value
        return DrafterBatch(**moved)


def scored_index(labels_NB: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(flat indices of the scored slots, slot-major; scored slots per slot 0..B-1), on the host."""
    labels_NB = labels_NB.cpu()
    N, B = labels_NB.shape
    valid_BN = (labels_NB != IGNORE).T
    slot_B, block_B = valid_BN.nonzero(as_tuple=True)
    return block_B * B + slot_B, tuple(int(c) for c in valid_BN.sum(1).tolist())


def with_scored_index(batch: DrafterBatch) -> DrafterBatch:
    """The batch with its scored-slot index (computed once, on the host)."""
    if batch.scored_M is not None:
        return batch
    scored_M, per_slot = scored_index(batch.labels_NB)
    return replace(batch, scored_M=scored_M.to(batch.labels_NB.device), scored_per_slot=per_slot)


def check_sample(sample: dict[str, Any], anchors_A: torch.Tensor, expected_length: int | None = None) -> None:
    """ValueError when a sample's tensors disagree with each other, the store index, or its anchors."""
    num_tokens = sample["input_ids_T"].shape[0]
    if expected_length is not None and num_tokens != expected_length:
        raise ValueError(f"has {num_tokens} tokens but the store's lengths say {expected_length}")
    shapes = {
        "input_ids_T": (num_tokens,),
        "loss_mask_T": (num_tokens,),
        "hidden_TLH": (num_tokens, None, None),
        "topk_logprobs_TK": (num_tokens, None),
        "topk_ids_TK": (num_tokens, None),
    }
    for name, want in shapes.items():
        got = tuple(sample[name].shape)
        if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
            raise ValueError(f"{name} has shape {list(got)}, expected {num_tokens} tokens x {len(want)} dims")
    if len(anchors_A) and (int(anchors_A.min()) < 0 or int(anchors_A.max()) >= num_tokens):
        raise ValueError(f"anchors {anchors_A.tolist()[:8]}... fall outside [0, {num_tokens})")


def supervised_slots(
    loss_mask_T: torch.Tensor, anchors_A: torch.Tensor, block_size: int, label_shift: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(supervised_AB: the slots cross-entropy scores, continues_A: whether the response goes on past
    the block's last slot) of blocks anchored at `anchors_A`; the one rule `collate` and the FLOP
    count (model/flops.py) follow. A slot is supervised where the token it predicts lies in the block's
    first run of supervised tokens (slot 0 never when label_shift is 0): past that run's end the response
    is over (decoding stops there), and a later run is the next answer, after a user turn or tool
    result the block never sees."""
    mask_T = loss_mask_T.bool()
    num_tokens = mask_T.shape[0]
    pos_AB = anchors_A.long()[:, None] + torch.arange(block_size + 1) + label_shift  # one slot past the block too
    run_AB = (pos_AB < num_tokens) & mask_T[pos_AB.clamp(max=num_tokens - 1)]
    starts_AB = run_AB.clone()
    starts_AB[:, 1:] &= ~run_AB[:, :-1]
    run_AB &= starts_AB.cumsum(1) <= 1
    supervised_AB = run_AB[:, :block_size].clone()
    supervised_AB[:, : 1 - label_shift] = False
    return supervised_AB, run_AB[:, block_size]


def collate(
    samples: Sequence[dict[str, Any]],
    anchors_per_sample: Sequence[torch.Tensor],
    *,
    block_size: int,
    mask_token_id: int,
    gather_topk: bool = True,
    context_TF: torch.Tensor | None = None,
    distill_all: bool = False,
    label_shift: int = 0,
) -> DrafterBatch:
    """Pack samples (no padding) and build their blocks, labels and target top-k.

    Block n of sample s anchored at a: slots a+0 .. a+B-1. With c = a + k + label_shift the position
    slot k predicts: labels[n, k] = input_ids[c] when c < T and loss_mask holds from the block's
    first supervised position through c (and k >= 1 when label_shift is 0); else -100. Top-k for
    slot k comes from position c-1 (row t holds the target's prediction of token t+1) and is zero
    where the label is -100; prev_ids[n, k] = input_ids[c-1] (at least the anchor, at most the last
    token). continues[n]: the response goes on at the position a slot B would predict.

    `context_TF`, when given, already holds the samples' features packed in order (the loader read
    them into it): their hidden_TLH are its slices and are not copied again.

    `distill_all`: every in-sample slot gets a label and the target's top-k (the KL term scores
    it); `supervised_NB` keeps loss_mask[a+k], where cross-entropy and the metrics apply.
    """
    if len(samples) != len(anchors_per_sample):
        raise ValueError(f"{len(samples)} samples but {len(anchors_per_sample)} anchor lists")
    if label_shift not in (0, 1):
        raise ValueError(f"label_shift must be 0 or 1, got {label_shift}")
    k_B = torch.arange(block_size)
    context, positions, seqs = [], [], []
    block_ids, block_seq, anchor_pos, labels, topk_lp, topk_ids, supervised, prev = [], [], [], [], [], [], [], []
    continues = []
    for s, (sample, anchors_A) in enumerate(zip(samples, anchors_per_sample)):
        ids_T, mask_T = sample["input_ids_T"].long(), sample["loss_mask_T"].bool()
        num_tokens = ids_T.shape[0]
        if context_TF is None:
            context.append(sample["hidden_TLH"].reshape(num_tokens, -1))
        positions.append(torch.arange(num_tokens))
        seqs.append(torch.full((num_tokens,), s, dtype=torch.long))
        anchors_A = anchors_A.long()
        pos_AB = anchors_A[:, None] + k_B[None, :] + label_shift  # the position each slot predicts
        inside_AB = pos_AB < num_tokens
        prev.append(ids_T[torch.maximum(pos_AB - 1, anchors_A[:, None]).clamp(max=num_tokens - 1)])
        pos_AB = pos_AB.clamp(max=num_tokens - 1)
        supervised_AB, continues_A = supervised_slots(mask_T, anchors_A, block_size, label_shift)
        continues.append(continues_A)
        scored_AB = inside_AB.clone() if distill_all else supervised_AB
        scored_AB[:, : 1 - label_shift] = False
        supervised.append(supervised_AB)
        labels.append(torch.where(scored_AB, ids_T[pos_AB], IGNORE))
        blocks_AB = torch.full_like(pos_AB, mask_token_id)
        blocks_AB[:, 0] = ids_T[anchors_A]
        block_ids.append(blocks_AB)
        block_seq.append(torch.full((len(anchors_A),), s, dtype=torch.long))
        anchor_pos.append(anchors_A)
        if gather_topk:
            prev_AB = (pos_AB - 1).clamp(min=0)
            keep_AB1 = scored_AB[..., None]
            topk_lp.append(torch.where(keep_AB1, sample["topk_logprobs_TK"][prev_AB].float(), 0.0))
            topk_ids.append(torch.where(keep_AB1, sample["topk_ids_TK"][prev_AB].long(), 0))
    num_tokens = sum(len(p) for p in positions)
    if context_TF is None:
        context_TF = torch.cat(context)
    elif context_TF.shape[0] != num_tokens:
        raise ValueError(f"the packed context holds {context_TF.shape[0]} tokens, the samples {num_tokens}")
    labels_NB = torch.cat(labels)
    scored_M, per_slot = scored_index(labels_NB)
    return DrafterBatch(
        context_TF=context_TF,
        context_pos_T=torch.cat(positions),
        context_seq_T=torch.cat(seqs),
        block_ids_NB=torch.cat(block_ids),
        block_seq_N=torch.cat(block_seq),
        anchor_pos_N=torch.cat(anchor_pos),
        labels_NB=labels_NB,
        topk_logprobs_NBK=torch.cat(topk_lp) if gather_topk else None,
        topk_ids_NBK=torch.cat(topk_ids) if gather_topk else None,
        num_samples=len(samples),
        num_tokens=num_tokens,
        scored_M=scored_M,
        scored_per_slot=per_slot,
        supervised_NB=torch.cat(supervised) if distill_all else None,
        label_shift=label_shift,
        prev_ids_NB=torch.cat(prev),
        continues_N=torch.cat(continues),
    )
