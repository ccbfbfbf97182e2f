"""The held-out split: by a content key per sample, fixed by a seed, independent of shard layout
and rank count.

A sample is held out when a hash of (seed, key) falls under the fraction. The key is the hash the
store records per sample (`shared/shard_records.split_hashes`): the row's opening (its turns through
the first user turn, what online eval decodes from; older stores: a regenerated row's prompt, else the
sample's tokens; an opening shared by more than 16 rows keys them on their prompt or tokens,
`shared/reader.py` generic_threshold); so copies of a row, and rows that share a first question, fall
on the same side, and adding or re-extracting other samples never moves a sample between train and
eval (in a store made before identity version 7, whose generic threshold grows with the store, it can
move a shared opening's rows).
"""

from __future__ import annotations

import numpy as np

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash of each element (vectorised: 900K keys in milliseconds)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


def heldout_mask(keys: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """bool [S]: True where the sample belongs to the held-out split."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"eval.holdout_fraction must be in [0, 1), got {fraction}")
    keys = np.asarray(keys, dtype=np.int64).astype(np.uint64)
    if fraction == 0.0:
        return np.zeros(len(keys), dtype=bool)
    mixed = _splitmix64(keys ^ _splitmix64(np.full(len(keys), seed, dtype=np.int64).astype(np.uint64)))
    return (mixed >> np.uint64(11)).astype(np.float64) / 2.0**53 < fraction


def spread_over_keys(keys: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """`indices` reordered so that every key's first sample comes before any key's second one (store
    order within each round). Evaluations take the first N held-out samples: in store order, copies of
    a prompt that sit together could fill them, and their figures' intervals would count one prompt as
    several."""
    idx = np.asarray(indices, dtype=np.int64)
    if len(idx) == 0:
        return idx
    k = np.asarray(keys)[idx]
    by_key = np.argsort(k, kind="stable")
    first = np.r_[True, k[by_key][1:] != k[by_key][:-1]]
    start = np.maximum.accumulate(np.where(first, np.arange(len(idx)), 0))
    occurrence = np.empty(len(idx), dtype=np.int64)
    occurrence[by_key] = np.arange(len(idx)) - start
    return idx[np.lexsort((np.arange(len(idx)), occurrence))]
