"""The held-out split: by sample id, fixed by a seed, independent of shard layout and rank count.

A sample is held out when a hash of (seed, sample_id) falls under the fraction, so adding or
re-extracting other samples never moves a sample between train and eval.
"""

from __future__ import annotations

import hashlib

import numpy as np


def heldout_mask(sample_ids: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """bool [S]: True where the sample belongs to the held-out split."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"eval.holdout_fraction must be in [0, 1), got {fraction}")
    out = np.zeros(len(sample_ids), dtype=bool)
    if fraction == 0.0:
        return out
    for i, sid in enumerate(np.asarray(sample_ids, dtype=np.int64)):
        digest = hashlib.blake2b(f"{seed}:{int(sid)}".encode(), digest_size=8).digest()
        out[i] = int.from_bytes(digest, "little") / 2**64 < fraction
    return out
