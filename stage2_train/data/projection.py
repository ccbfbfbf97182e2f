"""A fitted basis for the target features: the stage-2 prototype of a projected feature store.

    P_RF = fit_projection(reader, train_indices, rank=576, scale="rms")    # fp32 [r, F]
    energy = energy_kept(second_moment, rank, scale)                        # bench/projection.py

The drafter reads the concatenated target features x (F = layers x hidden) only through fc, a
bias-free Linear(F -> H). With z = P x for a fixed P of shape [r, F] and an fc_r of shape [H, r],
`fc_r(z) = (fc_r P) x`: a drafter trained on z is exactly a standard drafter whose fc weight is
fc_r @ P, so serving engines feed it full features and compute what was trained (export folds P
in). What is lost is the part of x outside P's row space, which training never saw either.

P is fitted on the training split: the uncentred second moment C = sum x x^T (fc has no bias, so
the mean is signal, not something to subtract), accumulated in float64, optionally after a
per-dimension scale (`scale="rms"`: s_i = sqrt(C_ii / n); a few massive outlier dimensions of the
hidden states would otherwise take the basis), and P = U_r^T S^-1 with U_r the top-r eigenvectors
of S^-1 C S^-1. The basis depends on the store's features and the training split only: every rank
computes the same bytes from the same sums.

Shape legend: T tokens, F = layers x hidden, r the basis' rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from shared.errors import CheckpointError


def second_moment(reader: Any, indices: Iterable[int], device: Any = "cpu") -> tuple[torch.Tensor, int]:
    """(sum over tokens of x x^T in float64 [F, F] on `device`, tokens) of the samples `indices`."""
    total: torch.Tensor | None = None
    tokens = 0
    for index in indices:
        x_TF = reader[int(index)]["hidden_TLH"].flatten(1).to(device, torch.float64)
        if total is None:
            total = x_TF.T @ x_TF
        else:
            total.addmm_(x_TF.T, x_TF)  # in place: at F = 20,480 each [F, F] is 3.4 GB
        tokens += x_TF.shape[0]
    if total is None:
        raise ValueError("no sample to fit the feature basis on")
    return total, tokens


def fit_indices(lengths: np.ndarray, budget_tokens: int, seed: int) -> np.ndarray:
    """The training samples the basis is fitted on: all of them when their tokens are within
    `budget_tokens`, else a seeded random subset, in store order, whose tokens just reach it (the same
    on every rank: it depends on the lengths and the seed only)."""
    if int(lengths.sum()) <= budget_tokens:
        return np.arange(len(lengths))
    order = np.random.default_rng([seed, 0x9CA]).permutation(len(lengths))
    count = int(np.searchsorted(np.cumsum(lengths[order]), budget_tokens)) + 1
    return np.sort(order[:count])


def basis(moment_FF: torch.Tensor, tokens: int, rank: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(P_RF float32, per-dimension scale s_F float64) from the second moment."""
    F = moment_FF.shape[0]
    if not 1 <= rank <= F:
        raise ValueError(f"model.projection_dim={rank} must be in 1..{F} (the features' width)")
    s_F = (moment_FF.diagonal() / max(tokens, 1)).clamp_min(1e-30).sqrt() if scale == "rms" else torch.ones(F, dtype=torch.float64)
    scaled = moment_FF / (s_F[:, None] * s_F[None, :])
    _, vectors = torch.linalg.eigh(scaled)  # ascending eigenvalues
    U_FR = vectors[:, -rank:].flip(1)  # top-r, largest first
    return (U_FR.T / s_F[None, :]).float(), s_F


def energy_kept(moment_FF: torch.Tensor, tokens: int, rank: int, scale: str, measured_on: torch.Tensor | None = None) -> float:
    """The share of the features' second moment (trace of C) inside the basis' row space, measured
    in the original units: tr(Pi C Pi^T) / tr(C) with Pi the oblique projector S U U^T S^-1 of the
    basis fitted on `moment_FF`, and C `measured_on` (other samples' moment) or the same one."""
    P_RF, s_F = basis(moment_FF, tokens, rank, scale)
    moment_FF = moment_FF if measured_on is None else measured_on
    U_FR = (P_RF.double() * s_F[None, :]).T  # back to the orthonormal basis of the scaled space
    back_FR = s_F[:, None] * U_FR  # reconstruction x_hat = back @ (P x)
    Pi = back_FR @ P_RF.double()
    return float(torch.trace(Pi @ moment_FF @ Pi.T) / torch.trace(moment_FF))


def fit_projection(reader: Any, indices: Iterable[int], rank: int, scale: str) -> torch.Tensor:
    moment, tokens = second_moment(reader, indices)
    return basis(moment, tokens, rank, scale)[0]


def fit_distributed(
    reader: Any, rank: int, world_size: int, dim: int, scale: str, reduce_sum: Any = None, broadcast: Any = None,
    budget_tokens: int | None = None, seed: int = 0, device: Any = "cpu",
) -> torch.Tensor:
    """`fit_projection` over the training split (at most `budget_tokens` of it, `fit_indices`) shared
    by the ranks: each rank sums the second moments of its share's samples rank, rank + W, ... on
    `device`; `reduce_sum` (one all_reduce) gives every rank the total, and rank 0's basis is
    `broadcast` to all (eigh on other devices or nodes may differ in the last bits), so every rank
    holds the same bytes. Returns P_RF on the CPU."""
    chosen = np.arange(len(reader)) if budget_tokens is None else fit_indices(reader.lengths, budget_tokens, seed)
    moment, tokens = second_moment(reader, chosen[rank::world_size], device)
    if world_size > 1:
        packed = reduce_sum(torch.cat([moment.reshape(-1), torch.tensor([float(tokens)], dtype=torch.float64, device=moment.device)]))
        moment, tokens = packed[:-1].reshape(moment.shape), int(packed[-1])
    P_RF, _ = basis(moment, tokens, dim, scale)
    del moment
    return (broadcast(P_RF) if world_size > 1 else P_RF).cpu()


def project_init_weights(weights: dict[str, torch.Tensor], P_RF: torch.Tensor) -> dict[str, torch.Tensor]:
    """A full-feature drafter's weights (model.init_from) for a projected run: fc_r = W pinv(P),
    the least-squares fc on the basis (with P = U^T S^-1, pinv(P) = S U, so fc_r P = W on P's row
    space). A projected drafter has no full-feature form to start from but its own export."""
    if "projection_RF" in weights:
        return weights
    W_HF = weights["fc.weight"].double()
    if W_HF.shape[1] != P_RF.shape[1]:
        raise CheckpointError(
            f"model.init_from: its fc reads {W_HF.shape[1]} features, the projection expects {P_RF.shape[1]}"
        )
    return {**weights, "fc.weight": (W_HF @ torch.linalg.pinv(P_RF.double())).float(), "projection_RF": P_RF.float()}
