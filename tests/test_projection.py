"""The projected-feature prototype: a basis fitted on the training split, fc on P x, folded into a
standard fc at export so serving engines compute exactly what was trained.

    .venv/bin/python -m pytest tests/test_projection.py -q
"""

from __future__ import annotations

import numpy as np
import torch

from stage2_train.data.projection import basis, energy_kept, fit_distributed, fit_projection, second_moment
from testkit.drafter import MASK_ID, three_sample_batch, tiny_arch, tiny_drafter


class Reader:
    def __init__(self, samples):
        self.samples, self.reads = samples, []
        self.lengths = np.array([len(x) for x in samples])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        self.reads.append(i)
        return {"hidden_TLH": self.samples[i]}


def features(n=6, T=40, L=2, H=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(L * H, L * H, generator=g)
    out = []
    for _ in range(n):
        low = torch.randn(T, 5, generator=g) @ torch.randn(5, L * H, generator=g)  # mostly 5-dimensional
        x = low + 0.01 * torch.randn(T, L * H, generator=g) @ mix
        x[:, 3] *= 300.0  # one massive outlier dimension, as hidden states have
        out.append(x.view(T, L, H))
    return out


def test_the_basis_keeps_the_energy_the_features_have_and_the_scale_changes_what_it_favours():
    moment, tokens = second_moment(Reader(features()), range(6))
    assert tokens == 240 and moment.dtype == torch.float64
    assert energy_kept(moment, tokens, 32, "none") > 0.999999  # full rank: everything
    assert energy_kept(moment, tokens, 6, "none") > 0.999  # the outlier and the 5-dim signal
    assert energy_kept(moment, tokens, 1, "none") > 0.99  # the outlier alone holds most of the energy...
    assert energy_kept(moment, tokens, 1, "rms") < energy_kept(moment, tokens, 1, "none")  # ...which the scale spreads
    P, s = basis(moment, tokens, 6, "rms")
    assert P.shape == (6, 32) and s[3] > 50 * s[0]


def test_a_projected_drafter_exports_as_a_standard_one_computing_the_same():
    """fc_r(P x) == (fc_r P) x: the exported drafter on full features against the trained one."""
    arch = tiny_arch(kv_heads=2)
    projected = tiny_drafter(arch, num_layers=2, feature_projection="pca", projection_dim=24, projection_scale="rms")
    batch = three_sample_batch(arch)
    moment = batch.context_TF.double().T @ batch.context_TF.double()
    P, _ = basis(moment, batch.context_TF.shape[0], 24, "rms")
    projected.set_projection(P)
    plain = tiny_drafter(arch, num_layers=2)
    plain.load_state_dict(projected.folded_state_dict())
    plain.set_frozen_parts(projected.embed_VH, projected.lm_head_VH)
    with torch.no_grad():
        a, b = projected(batch), plain(batch)
        assert (projected.logits(a) - plain.logits(b)).abs().max() < 1e-4
        assert torch.equal(projected.logits(a).argmax(-1), plain.logits(b).argmax(-1))
    assert "projection_RF" not in projected.folded_state_dict() and projected.fc.weight.shape == (64, 24)


def test_init_from_a_full_drafter_maps_fc_through_the_basis():
    from stage2_train.data.projection import project_init_weights

    arch = tiny_arch(kv_heads=2)
    full = tiny_drafter(arch, num_layers=1)
    batch = three_sample_batch(arch)
    moment = batch.context_TF.double().T @ batch.context_TF.double()
    P, _ = basis(moment, batch.context_TF.shape[0], 128, "rms")  # full rank: the map is exact
    weights = project_init_weights(full.state_dict(), P)
    projected = tiny_drafter(arch, num_layers=1, feature_projection="pca", projection_dim=128)
    projected.load_state_dict(weights)
    projected.set_frozen_parts(full.embed_VH, full.lm_head_VH)
    with torch.no_grad():
        torch.testing.assert_close(projected(batch), full(batch), atol=2e-4, rtol=1e-4)
    assert MASK_ID < arch.vocab_size


def test_the_fit_reads_a_seeded_token_budget_of_the_split_not_all_of_it():
    """At Qwen3-8B (F = 20,480) each token costs F^2 fp64 multiply-adds: the whole of a 300K-sample
    split is days of fit before the first step. The budget's samples are the same for every rank."""
    everything = fit_projection(Reader(features(n=12)), range(12), 6, "rms")
    whole = Reader(features(n=12))
    assert torch.equal(fit_distributed(whole, 0, 1, 6, "rms", budget_tokens=480, seed=3), everything)  # 480 = all 12 x 40
    part = Reader(features(n=12))
    P = fit_distributed(part, 0, 1, 6, "rms", budget_tokens=100, seed=3)
    chosen = sorted(part.reads)
    assert len(chosen) == 3 and chosen != [0, 1, 2]  # 3 x 40 tokens reach 100; a seeded draw, not the first three
    assert torch.equal(P, fit_projection(Reader(features(n=12)), chosen, 6, "rms"))
    again = Reader(features(n=12))
    fit_distributed(again, 0, 1, 6, "rms", budget_tokens=100, seed=3)
    assert sorted(again.reads) == chosen
