"""The packed micro-batch the drafter trains on.

Shape legend: T = packed context tokens of all samples in the micro-batch (no padding),
F = num_feature_layers * hidden, N = blocks (anchors) in the micro-batch, B = block size,
K = stored top-k.

A block n drafts tokens anchor_pos_N[n] + 0..B-1 of sample block_seq_N[n]. Its queries see
the context tokens of the same sample strictly before the anchor, and the B slots of their own
block (bidirectional); nothing else. Slot 0 holds the anchor token and is never scored; slot k
predicts the token at anchor + k.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class DrafterBatch:
    context_TF: torch.Tensor  # float, concatenated target features (layers in ascending id order)
    context_pos_T: torch.Tensor  # long, position of each token inside its sample
    context_seq_T: torch.Tensor  # long, index of the token's sample inside this micro-batch
    block_ids_NB: torch.Tensor  # long, [anchor token, mask, mask, ...]
    block_seq_N: torch.Tensor  # long, sample of each block
    anchor_pos_N: torch.Tensor  # long, position of the anchor inside its sample
    labels_NB: torch.Tensor  # long, token at anchor + k; -100 where not scored (slot 0, past the end, unsupervised)
    topk_logprobs_NBK: torch.Tensor | None = None  # target log-probs for the token at anchor + k
    topk_ids_NBK: torch.Tensor | None = None
    num_samples: int = 0
    num_tokens: int = 0  # real context tokens (== T)

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
