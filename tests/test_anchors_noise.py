"""Anchor sampling (validity, cap, per-epoch redraw, determinism) and the noise schedule (it moves)."""

from __future__ import annotations

import math

import pytest
import torch

from stage2_train.data.anchors import AnchorSampler, valid_anchor_positions
from stage2_train.data.config import SamplerConfig
from stage2_train.train.config import NoiseConfig
from stage2_train.train.schedules import NoiseSchedule, noise_generator

BLOCK = 4


def chat_mask(num_tokens: int) -> torch.Tensor:
    """Prompt (10 tokens), answer, a second prompt at 40..49, answer to the end."""
    mask = torch.ones(num_tokens, dtype=torch.bool)
    mask[:10] = False
    mask[40:50] = False
    return mask


def test_valid_positions_follow_the_rule_exactly():
    mask = chat_mask(60)
    got = valid_anchor_positions(mask, BLOCK).tolist()
    want = [t for t in range(59) if mask[t] and mask[t + 1]]  # up to the response's end (SpecForge)
    assert got == want
    assert got[0] == 10 and 38 in got and 39 not in got and 50 in got and got[-1] == 58  # the last pair (58, 59)
    # A sample shorter than a block still trains: its slots past the end carry no loss.
    assert valid_anchor_positions(torch.ones(BLOCK - 1, dtype=torch.bool), BLOCK).tolist() == list(range(BLOCK - 2))
    assert valid_anchor_positions(torch.ones(1, dtype=torch.bool), BLOCK).tolist() == []
    assert valid_anchor_positions(torch.tensor([True, False, True]), BLOCK).tolist() == []
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        AnchorSampler(SamplerConfig(), block_size=1, seed=0)


def test_anchors_capped_inside_supervision_and_deterministic():
    mask = chat_mask(400)
    sampler = AnchorSampler(SamplerConfig(max_anchors_per_seq=32), block_size=BLOCK, seed=7)
    anchors = sampler.anchors(mask, sample_id=5, epoch=0)
    assert anchors.dtype == torch.long and len(anchors) == 32
    assert torch.equal(anchors, anchors.sort().values) and len(set(anchors.tolist())) == 32
    for t in anchors.tolist():
        assert mask[t] and mask[t + 1] and t + BLOCK <= 400
    again = AnchorSampler(SamplerConfig(max_anchors_per_seq=32), block_size=BLOCK, seed=7)
    assert torch.equal(again.anchors(mask, sample_id=5, epoch=0), anchors)
    assert not torch.equal(sampler.anchors(mask, sample_id=5, epoch=1), anchors)  # redrawn per epoch
    assert not torch.equal(sampler.anchors(mask, sample_id=6, epoch=0), anchors)
    # Over epochs every valid position gets drawn: the draw covers the whole supervised range.
    drawn = set()
    for epoch in range(200):
        drawn.update(sampler.anchors(mask, sample_id=5, epoch=epoch).tolist())
    assert drawn == set(valid_anchor_positions(mask, BLOCK).tolist())


def test_few_or_no_valid_anchors():
    sampler = AnchorSampler(SamplerConfig(), block_size=BLOCK, seed=0)
    mask = chat_mask(60)
    assert (
        sampler.anchors(mask, sample_id=0, epoch=3).tolist() == valid_anchor_positions(mask, BLOCK).tolist()
    )
    assert len(sampler.anchors(torch.zeros(50, dtype=torch.bool), sample_id=0, epoch=0)) == 0
    alternating = torch.arange(50) % 2 == 0  # never two supervised tokens in a row
    assert len(sampler.anchors(alternating, sample_id=0, epoch=0)) == 0


def test_anchor_state_refuses_other_settings():
    sampler = AnchorSampler(SamplerConfig(), block_size=16, seed=0)
    state = sampler.state_dict()
    sampler.load_state_dict(state)
    with pytest.raises(ValueError, match="block_size was 16 when saved, is 8 now"):
        AnchorSampler(SamplerConfig(), block_size=8, seed=0).load_state_dict(state)


def test_noise_config_validation():
    with pytest.raises(ValueError, match=r"noise\.std must be"):
        NoiseConfig(std=-0.1)
    with pytest.raises(ValueError, match=r"noise\.warmup_steps"):
        NoiseConfig.from_dict({"warmup_steps": -1})
    with pytest.raises(ValueError, match=r"noise\.kind must be one of"):
        NoiseConfig.from_dict({"kind": "laplace"})


def test_noise_schedule_moves():
    schedule = NoiseSchedule(NoiseConfig(std=0.08, warmup_steps=100))
    assert schedule.std_at(0) == 0.0
    assert schedule.std_at(25) == pytest.approx(0.02)
    assert schedule.std_at(50) == pytest.approx(0.04)
    assert schedule.std_at(100) == pytest.approx(0.08)
    assert schedule.std_at(10_000) == pytest.approx(0.08)
    values = [schedule.std_at(s) for s in range(0, 101, 10)]
    assert all(b > a for a, b in zip(values, values[1:]))  # strictly increasing through warmup
    assert NoiseSchedule(NoiseConfig(std=0.05, warmup_steps=0)).std_at(0) == 0.05


def test_zero_std_is_exactly_off():
    schedule = NoiseSchedule(NoiseConfig(std=0.0, warmup_steps=10))
    context = torch.randn(8, 6)
    for step in (0, 5, 10, 1000):
        assert schedule.std_at(step) == 0.0
        before = context.clone()
        assert schedule.apply_(context, step, noise_generator(0, step, 0)) is context and torch.equal(context, before)


@pytest.mark.parametrize("kind", ["uniform", "gaussian"])
def test_applied_noise_has_the_scheduled_std(kind):
    schedule = NoiseSchedule(NoiseConfig(std=0.05, warmup_steps=100, kind=kind))
    for step in (30, 100):
        noise = schedule.apply_(torch.zeros(400, 500), step, noise_generator(1, step, 0), rows=128)
        want = schedule.std_at(step)
        assert noise.std().item() == pytest.approx(want, rel=0.02)
        assert abs(noise.mean().item()) < 0.01 * want
        if kind == "uniform":
            assert noise.abs().max().item() <= want * math.sqrt(3) + 1e-7
            assert noise.abs().max().item() > 0.99 * want * math.sqrt(3)
    assert torch.equal(schedule.apply_(torch.zeros(400, 500), 0, noise_generator(1, 0, 0)), torch.zeros(400, 500))


def test_noise_is_added_in_place_without_a_copy_of_the_context():
    """The context of the step is noised where it lies: the result is the same tensor (storage), and
    chunking the rows changes nothing of what a generator draws on CPU."""
    schedule = NoiseSchedule(NoiseConfig(std=0.05, warmup_steps=0))
    context = torch.zeros(300, 40)
    pointer = context.data_ptr()
    out = schedule.apply_(context, 5, noise_generator(0, 5, 0), rows=64)
    assert out.data_ptr() == pointer and context.std().item() > 0
    whole = schedule.apply_(torch.zeros(300, 40), 5, noise_generator(0, 5, 0), rows=1000)
    assert torch.equal(context, whole)


def test_noise_is_reproducible_per_step_and_rank():
    schedule = NoiseSchedule(NoiseConfig(std=0.05))
    def noised(step, rank):
        return schedule.apply_(torch.zeros(4, 16, dtype=torch.bfloat16), step, noise_generator(0, step, rank))

    a = noised(3, 0)
    assert a.dtype == torch.bfloat16
    assert torch.equal(a, noised(3, 0))
    assert not torch.equal(a, noised(3, 1))
    assert not torch.equal(a, noised(4, 0))


def test_noise_state_refuses_another_schedule():
    state = NoiseSchedule(NoiseConfig(std=0.05, warmup_steps=10)).state_dict()
    NoiseSchedule(NoiseConfig(std=0.05, warmup_steps=10)).load_state_dict(state)
    with pytest.raises(ValueError, match="noise.warmup_steps was 10 when saved, is 0 now") as refused:
        NoiseSchedule(NoiseConfig(std=0.05)).load_state_dict(state)
    # What fixes it: the saved value, or one of the ways to start anew.
    assert "noise.warmup_steps=10" in str(refused.value) and "train.resume=never" in str(refused.value)


def test_blocks_at_the_end_of_a_response_score_only_the_tokens_that_exist():
    """The end-of-turn token is learnt from slot 1: an anchor on the token before it is valid, and
    the slots past the sample end are IGNORE (no loss), as in SpecForge's DFlash training."""
    from stage2_train.data.batch import IGNORE, collate

    T = 12
    mask = torch.tensor([False] * 4 + [True] * (T - 4))
    sample = tiny_sample(mask, top_k=1)
    anchors = torch.from_numpy(valid_anchor_positions(mask, BLOCK))
    assert anchors.tolist() == list(range(4, T - 1))
    batch = collate([sample], [anchors], block_size=BLOCK, mask_token_id=7, gather_topk=False)
    last = batch.labels_NB[-1].tolist()  # anchor T-2: slot 1 is the last token (the end of turn)
    assert last == [IGNORE, 100 + T - 1] + [IGNORE] * (BLOCK - 2)


@pytest.mark.parametrize("label_shift", [0, 1])
def test_a_block_reaching_past_a_user_turn_scores_nothing_of_the_next_answer(label_shift):
    """Two answers separated by a short user turn (or tool result): a block anchored near the end of the
    first may reach into the second, whose tokens follow text the block never sees and that decoding
    never drafts across (the target ends its turn first). Its slots there are not supervised; the KL
    of distill_positions=all still reaches them (the target read them)."""
    from stage2_train.data.batch import IGNORE, collate

    # prompt 0-1 | answer 2-5 (5: end of turn) | user 6-7 | answer 8-13
    mask = torch.tensor([False] * 2 + [True] * 4 + [False] * 2 + [True] * 6)
    B = 8
    sample = tiny_sample(mask, top_k=3)
    anchors = torch.tensor([3, 4])  # 4: its slot 1 (or, shifted, slot 0) is the end of the first turn
    batch = collate([sample], [anchors], block_size=B, mask_token_id=7, gather_topk=False, label_shift=label_shift)
    first = 1 - label_shift
    for n, a in enumerate(anchors.tolist()):
        labels = batch.labels_NB[n].tolist()
        scored = [100 + a + k + label_shift if first <= k and a + k + label_shift <= 5 else IGNORE for k in range(B)]
        assert labels == scored, (a, labels)
    everywhere = collate([sample], [anchors], block_size=B, mask_token_id=7, label_shift=label_shift, distill_all=True)
    assert (everywhere.labels_NB[:, first:] != IGNORE).all()
    assert everywhere.supervised_NB.tolist() == (batch.labels_NB != IGNORE).tolist()


def test_the_recipes_noise_is_speculators_noise_not_sqrt3_wider():
    """speculators' AddUniformNoise(std=0.05) adds 2 * (rand - 0.5) * 0.05: U(-0.05, 0.05), whose
    standard deviation is 0.05 / sqrt(3). The recipe said "std 0.05 as speculators" and drew
    U(-0.087, 0.087). The recipe's preset and the default now draw what speculators draws."""
    from shared.config import load_run_config

    theirs = 2 * (torch.rand(400, 500, generator=torch.Generator().manual_seed(0)) - 0.5) * 0.05
    for cfg in (NoiseConfig(), load_run_config("qwen3-8b").noise, load_run_config("configs/recipe.yaml").noise):
        ours = NoiseSchedule(cfg).apply_(torch.zeros(400, 500), 10**6, noise_generator(1, 0, 0))
        assert ours.abs().max().item() == pytest.approx(0.05, rel=0.01) and ours.abs().max().item() <= 0.0501
        assert ours.std().item() == pytest.approx(theirs.std().item(), rel=0.02)


def tiny_sample(mask: torch.Tensor, top_k: int) -> dict[str, torch.Tensor]:
    """A store sample of len(mask) tokens (ids 100..), one layer of width 2, zero features and top-k."""
    T = len(mask)
    return {
        "input_ids_T": torch.arange(100, 100 + T), "loss_mask_T": mask, "hidden_TLH": torch.zeros(T, 1, 2),
        "topk_logprobs_TK": torch.zeros(T, top_k), "topk_ids_TK": torch.zeros(T, top_k, dtype=torch.long),
    }
