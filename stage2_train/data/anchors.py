"""DFlash anchor sampling: which blocks of a sample are trained on in a given epoch.

Anchor t of a sample with T tokens is valid when
    loss_mask[t] and loss_mask[t + 1]     (the anchor and the first drafted token are supervised)
as in SpecForge's DFlash training. Anchors near the end of a response are allowed: a block's slots
past the sample end, or past the response's end, carry no loss (`collate` gives them IGNORE), so the
drafter learns the last tokens of an answer, its end-of-turn token included, from slot 1 too. Past the
response's end means past it for good: a later answer the block reaches across a short user turn or
tool result is not scored (SpecForge scores it), since its tokens follow text the block does not see
and decoding, which stops at the end of the turn, never drafts them.
Each epoch draws up to `sampler.max_anchors_per_seq` of them without replacement (all of them when
there are fewer), from a generator seeded by (seed, epoch, sample_id): no state, so resume is
exact by construction and two ranks never disagree. A sample with no valid anchor yields zero
blocks; the loader counts such samples.

How many blocks a sample yields is known before any feature is read (`AnchorSampler.block_counts`):
min(valid anchors, max_anchors_per_seq), every epoch, from the store's per-sample `supervised_pairs`
(or the lengths, with `everywhere`). The sampler packs micro-batches by it (`sampler.micro_batch_blocks`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shared.errors import CheckpointError
from stage2_train.data.config import SamplerConfig


def valid_anchor_positions(loss_mask_T: torch.Tensor, block_size: int) -> np.ndarray:
    """Positions t with loss_mask[t] & loss_mask[t + 1], ascending (int64)."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (slot 0 is the anchor), got {block_size}")
    mask = np.asarray(loss_mask_T.cpu().numpy(), dtype=bool)
    return np.flatnonzero(mask[:-1] & mask[1:]).astype(np.int64)


class AnchorSampler:
    def __init__(self, cfg: SamplerConfig, *, block_size: int, seed: int, everywhere: bool = False):
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2 (slot 0 is the anchor), got {block_size}")
        self.max_anchors = cfg.max_anchors_per_seq
        self.block_size = block_size
        self.seed = seed
        self.everywhere = everywhere  # loss.distill_positions=all: any position the target read

    def anchors(self, loss_mask_T: torch.Tensor, *, sample_id: int, epoch: int) -> torch.Tensor:
        """Sorted anchor positions (long) of one sample for one epoch; may be empty."""
        mask_T = torch.ones_like(loss_mask_T, dtype=torch.bool) if self.everywhere else loss_mask_T
        valid = valid_anchor_positions(mask_T, self.block_size)
        if len(valid) > self.max_anchors:
            rng = np.random.default_rng([self.seed, epoch, sample_id])
            valid = np.sort(rng.choice(valid, size=self.max_anchors, replace=False))
        return torch.from_numpy(valid)

    def block_counts(self, lengths: np.ndarray, supervised_pairs: np.ndarray | None) -> np.ndarray:
        """Blocks each sample yields in any epoch, len(anchors(...)) without reading it: its valid anchor
        positions (the store's `supervised_pairs`; with `everywhere`, every position but the last, and
        the pairs are not needed) capped at max_anchors_per_seq (int64)."""
        if self.everywhere:
            valid = np.asarray(lengths, dtype=np.int64) - 1
        elif supervised_pairs is None:
            raise ValueError("block_counts needs the samples' supervised_pairs (anchors are drawn on supervised tokens)")
        else:
            valid = np.asarray(supervised_pairs, dtype=np.int64)
        return np.minimum(np.maximum(valid, 0), self.max_anchors)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "max_anchors_per_seq": self.max_anchors, "block_size": self.block_size, "everywhere": self.everywhere}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing moves; a saved run drawn with other settings cannot be resumed exactly."""
        for key, value in self.state_dict().items():
            if state.get(key, False if key == "everywhere" else None) != value:
                raise CheckpointError(f"anchor state: {key} was {state.get(key)!r} when saved, is {value!r} now")
