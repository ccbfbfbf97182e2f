"""LengthMixedSampler: exactly-once coverage, equal steps per rank, both budgets (tokens and blocks),
mixing, exact resume."""

from __future__ import annotations

import numpy as np
import pytest

from stage2_train.data.config import SamplerConfig
from stage2_train.data.sampler import LengthMixedSampler
from stage2_train.data.steps import describe_steps


def lognormal_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(6.3, 0.8, n), 64, 3072).astype(np.int64)


def skewed_lengths(n: int, seed: int = 0) -> np.ndarray:
    """85% short (64-256 tokens), 15% long (1500-3000 tokens): about 72% of the tokens are long."""
    rng = np.random.default_rng(seed)
    long = rng.random(n) < 0.15
    return np.where(long, rng.integers(1500, 3001, n), rng.integers(64, 257, n)).astype(np.int64)


def supervised_data(kind: str, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, supervised pairs) of realistic stores: the pairs are what anchors are drawn from.

    short_answers: 64-400 tokens, a 10-40 token prompt, the rest a supervised answer (~1 block a token);
    long_prompts: 1,500-3,072 tokens whose answer is 16-200 tokens (few blocks per token);
    chat: lognormal lengths, 30-95% of each sample answer; mixture: all three shuffled together."""
    rng = np.random.default_rng(seed)
    if kind == "short_answers":
        lengths = rng.integers(64, 401, n)
        return lengths, np.maximum(lengths - rng.integers(10, 41, n) - 1, 0)
    if kind == "long_prompts":
        return rng.integers(1500, 3073, n), rng.integers(16, 201, n) - 1
    if kind == "chat":
        lengths = np.clip(rng.lognormal(6.6, 0.7, n), 64, 3072).astype(np.int64)
        return lengths, np.maximum((lengths * rng.uniform(0.3, 0.95, n)).astype(np.int64) - 1, 0)
    parts = [supervised_data(k, n, seed + 1 + j) for j, k in enumerate(("short_answers", "long_prompts", "chat"))]
    pick = rng.permutation(3 * n)[:n]
    return np.concatenate([p[0] for p in parts])[pick], np.concatenate([p[1] for p in parts])[pick]


def blocks_of(pairs: np.ndarray, cfg: SamplerConfig) -> np.ndarray:
    return np.minimum(pairs, cfg.max_anchors_per_seq)  # AnchorSampler.block_counts


def rank_batches(
    cfg: SamplerConfig, lengths: np.ndarray, world_size: int, seed: int = 0, epoch: int = 0, grad_accum: int = 1, blocks=None
):
    out = []
    for rank in range(world_size):
        sampler = LengthMixedSampler(
            cfg, lengths, seed=seed, rank=rank, world_size=world_size, grad_accum=grad_accum, blocks=blocks
        )
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def test_config_validation_names_the_key():
    with pytest.raises(ValueError, match=r"sampler\.micro_batch_tokens must be > 0, got 0"):
        SamplerConfig(micro_batch_tokens=0)
    with pytest.raises(ValueError, match=r"sampler\.grad_accum: moved to train\.grad_accum"):
        SamplerConfig.from_dict({"grad_accum": 2})
    with pytest.raises(ValueError, match=r"sampler\.budget: unknown key"):
        SamplerConfig.from_dict({"budget": 10})
    assert SamplerConfig(max_anchors_per_seq=256).recipe_warnings()
    assert not SamplerConfig().recipe_warnings()


def test_block_budget_is_validated_and_derived():
    with pytest.raises(ValueError, match=r"sampler\.micro_batch_blocks must be >= 512 \(the most blocks one sample"):
        SamplerConfig(micro_batch_blocks=511)
    assert SamplerConfig(micro_batch_tokens=16384).blocks_budget() == 8192  # null: tokens // 2
    assert SamplerConfig(micro_batch_tokens=600).blocks_budget() == 512  # at least one sample's blocks
    assert SamplerConfig(micro_batch_tokens=600, micro_batch_blocks=700).blocks_budget() == 700
    with pytest.raises(ValueError, match=r"sample 1 yields 40 blocks, more than sampler\.micro_batch_blocks=32"):
        LengthMixedSampler(
            SamplerConfig(micro_batch_tokens=64, max_anchors_per_seq=16), np.array([30, 50]), seed=0, blocks=np.array([3, 40])
        )


def test_sample_longer_than_budget_is_named():
    lengths = np.array([100, 200, 300, 5000, 100])
    with pytest.raises(ValueError, match=r"sample 3 has 5000 tokens, more than sampler.micro_batch_tokens=4096"):
        LengthMixedSampler(SamplerConfig(micro_batch_tokens=4096), lengths, seed=0)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_sample_exactly_once_per_epoch_and_equal_steps(world_size):
    lengths = lognormal_lengths(3000)
    cfg = SamplerConfig(micro_batch_tokens=8192)
    for epoch in (0, 1):
        per_rank = rank_batches(cfg, lengths, world_size, epoch=epoch, grad_accum=2)
        seen = [i for batches in per_rank for batch in batches for i in batch]
        assert sorted(seen) == list(range(len(lengths)))  # nothing dropped, nothing repeated
        counts = {len(batches) for batches in per_rank}
        assert len(counts) == 1 and counts.pop() % 2 == 0  # same micro-batches on every rank
        for batches in per_rank:
            assert all(batch for batch in batches)  # no empty micro-batch
            assert max(int(lengths[b].sum()) for b in batches) <= cfg.micro_batch_tokens


def test_max_samples_cap():
    lengths = np.full(500, 64)
    cfg = SamplerConfig(micro_batch_tokens=8192, max_samples_per_batch=10)
    batches = rank_batches(cfg, lengths, 1)[0]
    assert max(len(b) for b in batches) == 10
    assert sorted(i for b in batches for i in b) == list(range(500))


def test_tiny_data_set_is_an_error_not_a_hang():
    with pytest.raises(ValueError, match="cannot fill world_size \\* grad_accum = 8"):
        LengthMixedSampler(SamplerConfig(), np.full(5, 100), seed=0, world_size=2, grad_accum=4)


def test_small_random_data_sets_plan_correctly_or_refuse():
    """Awkward tails (few samples, near-budget lengths) still give exactly-once, non-empty plans."""
    rng = np.random.default_rng(0)
    planned = refused = 0
    for _ in range(300):
        budget = int(rng.integers(50, 400))
        lengths = rng.integers(1, budget + 1, int(rng.integers(4, 40)))
        world_size, grad_accum = int(rng.integers(1, 4)), int(rng.integers(1, 3))
        cfg = SamplerConfig(
            micro_batch_tokens=budget, window_slack=float(rng.random() * 0.2)
        )
        try:
            sampler = LengthMixedSampler(cfg, lengths, seed=0, world_size=world_size, grad_accum=grad_accum)
        except ValueError as exc:
            assert "cannot fill" in str(exc) or "too few samples" in str(exc)
            refused += 1
            continue
        plan = sampler.plan_epoch(0)
        assert sorted(i for step in plan for b in step for i in b) == list(range(len(lengths)))
        assert all(len(step) == world_size * grad_accum for step in plan)
        assert all(b and lengths[b].sum() <= budget for step in plan for b in step)
        planned += 1
    assert planned > 150 and refused > 0


def test_packing_is_dense_and_ranks_balanced():
    """Without blocks binding (a large block budget) the packing is the token packing it always was."""
    lengths = lognormal_lengths(6000)
    cfg = SamplerConfig(micro_batch_tokens=16384, micro_batch_blocks=10**6)
    sampler = LengthMixedSampler(cfg, lengths, seed=0, world_size=4)
    plan = sampler.plan_epoch(0)
    efficiency = lengths.sum() / (sum(len(step) for step in plan) * cfg.micro_batch_tokens)
    assert efficiency >= 0.98
    for step in plan:
        rank_tokens = np.array([lengths[b].sum() for b in step])
        assert rank_tokens.max() / rank_tokens.mean() <= 1.05


@pytest.mark.parametrize(
    ("kind", "blocks_bind"), [("short_answers", True), ("long_prompts", False), ("chat", False), ("mixture", False)]
)
def test_micro_batches_fill_whichever_budget_binds(kind, blocks_bind):
    """Short, fully supervised answers fill micro-batches by blocks (half the tokens of one with long
    prompts would be ~2x the block rows); long prompts with short answers by tokens; each micro-batch
    is full on its binding budget and the ranks carry equal shares of it."""
    lengths, pairs = supervised_data(kind, 6000)
    cfg = SamplerConfig(micro_batch_tokens=16384)
    blocks = blocks_of(pairs, cfg)
    sampler = LengthMixedSampler(cfg, lengths, seed=0, world_size=4, grad_accum=2, blocks=blocks)
    assert sampler.micro_batch_blocks == 8192  # null: micro_batch_tokens // 2
    plan = list(sampler.plan_epoch(0))
    bins = [b for step in plan for b in step]
    token_fill = lengths.sum() / (len(bins) * cfg.micro_batch_tokens)
    block_fill = blocks.sum() / (len(bins) * sampler.micro_batch_blocks)
    assert (block_fill > token_fill) == blocks_bind

    def share(b):  # of the budget that binds in this micro-batch
        return max(lengths[b].sum() / 16384, blocks[b].sum() / 8192)

    # Samples of 1,500-3,072 tokens leave up to a sample's gap in 16K; the others pack to 98% (the
    # last two steps share what is left of the epoch).
    body = [b for step in plan[:-2] for b in step]
    assert np.mean([share(b) for b in body]) >= (0.95 if kind == "long_prompts" else 0.98)
    for step in plan[:-2]:
        shares = np.array([share(b) for b in step])
        assert shares.max() / shares.mean() <= 1.08


def test_epochs_differ_and_are_reproducible():
    lengths = lognormal_lengths(1000)
    cfg = SamplerConfig(micro_batch_tokens=8192)
    a = LengthMixedSampler(cfg, lengths, seed=3)
    b = LengthMixedSampler(cfg, lengths, seed=3)
    assert a.plan_epoch(0) == b.plan_epoch(0)
    assert a.plan_epoch(1) == b.plan_epoch(1)
    assert a.plan_epoch(0) != a.plan_epoch(1)
    assert a.plan_epoch(0) != LengthMixedSampler(cfg, lengths, seed=4).plan_epoch(0)


def test_iteration_rolls_over_to_the_next_epoch():
    lengths = lognormal_lengths(400)
    sampler = LengthMixedSampler(SamplerConfig(micro_batch_tokens=8192), lengths, seed=0, grad_accum=2)
    first = list(sampler)
    assert len(first) == 2 * len(sampler.plan_epoch(0))
    assert (sampler.epoch, sampler.step_in_epoch, sampler.micro_step) == (1, 0, 0)
    second = list(sampler)
    assert sorted(i for b in second for i in b) == list(range(400)) and second != first


@pytest.mark.parametrize("consumed", [0, 5, 7, "epoch+3"])
def test_resume_mid_epoch_replays_exactly(consumed):
    lengths = lognormal_lengths(1500)
    cfg = SamplerConfig(micro_batch_tokens=8192)
    reference = LengthMixedSampler(cfg, lengths, seed=1, rank=1, world_size=2, grad_accum=2)
    expected = list(reference) + list(reference)  # two uninterrupted epochs

    first = LengthMixedSampler(cfg, lengths, seed=1, rank=1, world_size=2, grad_accum=2)
    n = len(first.remaining()) + 3 if consumed == "epoch+3" else consumed
    got = []
    while len(got) < n:
        for batch in first:
            got.append(batch)
            if len(got) == n:
                break
    state = first.state_dict()
    assert state["seed"] == 1 and "epoch" in state and "step_in_epoch" in state

    resumed = LengthMixedSampler(cfg, lengths, seed=1, rank=1, world_size=2, grad_accum=2)
    resumed.load_state_dict(state)
    while len(got) < len(expected):
        got.extend(resumed)
    assert got == expected


def test_resume_refuses_another_plan():
    lengths = lognormal_lengths(500)
    state = LengthMixedSampler(SamplerConfig(micro_batch_tokens=8192), lengths, seed=0, world_size=2).state_dict()
    other = LengthMixedSampler(SamplerConfig(micro_batch_tokens=8192), lengths, seed=0, world_size=1)
    with pytest.raises(ValueError, match="world_size was 2 when saved, is 1 now"):
        other.load_state_dict(state)
    shorter = LengthMixedSampler(SamplerConfig(micro_batch_tokens=8192), lengths[:-1], seed=0, world_size=2)
    with pytest.raises(ValueError, match="num_samples"):
        shorter.load_state_dict(state)


def long_token_share(lengths: np.ndarray, indices: list[int]) -> float:
    step = lengths[indices]
    return float(step[step >= 1500].sum() / step.sum())


def test_every_step_mixes_lengths_unlike_buckets():
    lengths = skewed_lengths(4000)
    cfg = SamplerConfig(micro_batch_tokens=8192)
    sampler = LengthMixedSampler(cfg, lengths, seed=0, world_size=2, grad_accum=2)
    data_share = long_token_share(lengths, list(range(len(lengths))))
    ours = []
    for step in sampler.plan_epoch(0):
        indices = [i for b in step for i in b]
        assert (lengths[indices] >= 1500).any() and (lengths[indices] < 1500).any()
        ours.append(abs(long_token_share(lengths, indices) - data_share))
    # The tail steps (where a greedy packer leaves the leftovers) mix as well as the rest.
    assert max(ours) < 0.15 and max(ours[-3:]) < 0.15 and np.median(ours) < 0.06

    # Two homogeneous buckets, as many steps, 4 micro-batches a step drawn from one bucket.
    rng = np.random.default_rng(0)
    bucket_devs = []
    for bucket in (np.flatnonzero(lengths < 1500), np.flatnonzero(lengths >= 1500)):
        for chunk in np.array_split(rng.permutation(bucket), max(1, int(lengths[bucket].sum() // 32768))):
            bucket_devs.append(abs(long_token_share(lengths, chunk.tolist()) - data_share))
    assert np.median(bucket_devs) > 3 * np.median(ours)


def test_describe_steps_reports_each_step():
    lengths = lognormal_lengths(800)
    cfg = SamplerConfig(micro_batch_tokens=8192)
    sampler = LengthMixedSampler(cfg, lengths, seed=0, world_size=2, grad_accum=2)
    steps_epoch0 = len(sampler.plan_epoch(0))
    rows = describe_steps(sampler, steps_epoch0 + 2)
    assert len(rows) == steps_epoch0 + 2
    assert [r["epoch"] for r in rows[-3:]] == [0, 1, 1] and rows[-1]["step_in_epoch"] == 1
    assert sum(r["tokens"] for r in rows[:steps_epoch0]) == lengths.sum()
    first = rows[0]
    assert sum(first["rank_tokens"]) == first["tokens"]
    assert first["padding_fraction"] == pytest.approx(1 - first["tokens"] / (8192 * 4))
    assert first["length_p10"] <= first["length_p50"] <= first["length_p90"] <= first["length_max"]
    assert (sampler.epoch, sampler.step_in_epoch) == (0, 0)  # describing moves nothing


def test_each_epoch_is_planned_once_and_ahead_of_its_boundary():
    """Handing out micro-batches across two epoch boundaries builds each epoch's plan exactly once
    (epoch 0 at construction, the next one in the background as soon as an epoch starts), never
    on the consumer's thread at the boundary, and keeps at most two plans."""
    import threading

    lengths = lognormal_lengths(3000, seed=5)
    cfg = SamplerConfig(micro_batch_tokens=4096)
    sampler = LengthMixedSampler(cfg, lengths, seed=1, rank=0, world_size=2, grad_accum=2)
    built_on: list[str] = []
    real = sampler._build_plan

    def recording(epoch):
        built_on.append(threading.current_thread().name)
        return real(epoch)

    sampler._build_plan = recording
    stream = sampler.upcoming()
    seen_epochs = []
    while sampler.epoch < 3:  # epochs 0, 1, 2: two boundaries
        ref = next(stream)
        if ref.step_in_epoch == 0 and ref.micro_step == 0:
            seen_epochs.append(ref.epoch)
            for thread in list(sampler._planning.values()):
                thread.join()  # an epoch lasts long enough for the look-ahead to finish
        sampler.mark_consumed(ref)
        assert len(sampler._plans) <= 2
    assert seen_epochs == [0, 1, 2]
    assert sampler.plan_builds == 1 + 3  # epoch 0 in the constructor; 1, 2 and the look-ahead 3
    assert built_on == ["dflash-plan"] * 3  # all after construction in the background thread
    assert sampler.estimated_total_steps(3) == 3 * len(sampler.plan_epoch(0))


def loss_masks(kind: str, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Loss masks of realistic stores: each sample is turns of an unsupervised prompt then a
    supervised answer. short_answers: one short prompt, a short answer (nearly every token an anchor);
    long_prompts: a 600-1,800-token prompt, a 2-60-token answer; multi_turn: 1-4 turns of any size;
    mixture: the three together."""
    if kind == "mixture":
        masks = [m for k in ("short_answers", "long_prompts", "multi_turn") for m in loss_masks(k, n, rng)]
        return [masks[i] for i in rng.permutation(len(masks))[:n]]
    masks = []
    for _ in range(n):
        if kind == "short_answers":
            turns = [(int(rng.integers(2, 12)), int(rng.integers(1, 120)))]
        elif kind == "long_prompts":
            turns = [(int(rng.integers(600, 1800)), int(rng.integers(2, 60)))]
        else:
            turns = [(int(rng.integers(1, 300)), int(rng.integers(0, 400))) for _ in range(int(rng.integers(1, 5)))]
        masks.append(np.concatenate([np.r_[np.zeros(p, bool), np.ones(a, bool)] for p, a in turns]))
    return masks


@pytest.mark.parametrize("kind", ["short_answers", "long_prompts", "multi_turn", "mixture"])
def test_no_micro_batch_exceeds_either_budget_in_the_anchors_it_draws(kind):
    """The property, end to end over random layouts: blocks are counted from the stored loss masks
    (`supervised_pairs`, what the manifest records) by `AnchorSampler.block_counts`; in two epochs,
    the anchors each micro-batch really draws never exceed `micro_batch_blocks`, its tokens never
    `micro_batch_tokens`, every sample comes exactly once, every rank runs the same steps."""
    import torch

    from shared.store import supervised_pairs
    from stage2_train.data.anchors import AnchorSampler

    rng = np.random.default_rng(["short_answers", "long_prompts", "multi_turn", "mixture"].index(kind))
    planned = 0
    for trial in range(6):
        masks = loss_masks(kind, int(rng.integers(40, 400)), rng)
        lengths = np.array([len(m) for m in masks])
        max_anchors = int(rng.choice([8, 64, 512]))
        tokens = int(lengths.max() * rng.uniform(1.0, 6.0))
        cfg = SamplerConfig(
            micro_batch_tokens=tokens, max_anchors_per_seq=max_anchors,
            micro_batch_blocks=None if trial % 2 else int(min(max_anchors, tokens - 1) * rng.uniform(1.0, 4.0)),
        )
        anchors = AnchorSampler(cfg, block_size=int(rng.choice([4, 16])), seed=trial)
        blocks = anchors.block_counts(lengths, np.array([supervised_pairs(m) for m in masks]))
        world_size, grad_accum = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        try:
            samplers = [
                LengthMixedSampler(cfg, lengths, seed=trial, rank=r, world_size=world_size, grad_accum=grad_accum, blocks=blocks)
                for r in range(world_size)
            ]
        except ValueError as exc:
            assert "cannot fill" in str(exc) or "too few samples" in str(exc)
            continue
        for epoch in (0, 1):
            per_rank = [list(s) for s in samplers]
            assert len({len(batches) for batches in per_rank}) == 1
            seen = sorted(i for batches in per_rank for b in batches for i in b)
            assert seen == list(range(len(masks)))
            for batches in per_rank:
                for b in batches:
                    drawn = sum(len(anchors.anchors(torch.from_numpy(masks[i]), sample_id=i, epoch=epoch)) for i in b)
                    assert b and drawn <= samplers[0].micro_batch_blocks and lengths[b].sum() <= tokens
        planned += 1
    assert planned >= 4


def test_resume_refuses_another_block_budget_or_other_blocks():
    lengths, pairs = supervised_data("chat", 600)
    cfg = SamplerConfig(micro_batch_tokens=8192)
    state = LengthMixedSampler(cfg, lengths, seed=0, blocks=blocks_of(pairs, cfg)).state_dict()
    assert state["micro_batch_blocks"] == 4096
    wider = SamplerConfig(micro_batch_tokens=8192, micro_batch_blocks=6000)
    with pytest.raises(ValueError, match=r"micro_batch_blocks was 4096 when saved, is 6000 now \(sampler\.micro_batch_blocks"):
        LengthMixedSampler(wider, lengths, seed=0, blocks=blocks_of(pairs, wider)).load_state_dict(state)
    with pytest.raises(ValueError, match=r"blocks_digest .* \(the samples' blocks"):
        LengthMixedSampler(cfg, lengths, seed=0, blocks=blocks_of(pairs // 2, cfg)).load_state_dict(state)
    saved_before = {k: v for k, v in state.items() if k not in ("micro_batch_blocks", "blocks_digest")}
    with pytest.raises(ValueError, match="micro_batch_blocks was None when saved.*before micro-batches had a block budget"):
        LengthMixedSampler(cfg, lengths, seed=0, blocks=blocks_of(pairs, cfg)).load_state_dict(saved_before)


def test_an_epoch_whose_order_packs_no_pair_still_plans_when_its_samples_fit_somewhere():
    """45 samples, 16 micro-batches a step, at most 2 samples each, nearly every one alone by its
    blocks: epoch 0's order packed a pair where epoch 1's packed none, and epoch 1 failed at its
    boundary after a whole epoch of training. Its last step's samples now join earlier micro-batches."""
    lengths = np.array([118, 147, 105, 217, 146, 200, 152, 125, 48, 24, 139, 122, 134, 3, 16, 215, 104, 60, 86, 5, 160, 130, 211,
                        222, 54, 175, 91, 174, 30, 209, 149, 70, 243, 202, 103, 184, 45, 200, 68, 230, 117, 168, 65, 17, 115])
    blocks = np.array([37, 41, 28, 5, 14, 59, 19, 31, 46, 23, 14, 47, 16, 0, 15, 50, 31, 1, 4, 4, 30, 44, 27, 39, 53, 60, 18, 34,
                       29, 16, 21, 38, 39, 23, 61, 1, 12, 51, 14, 10, 29, 31, 52, 16, 6])
    cfg = SamplerConfig(micro_batch_tokens=256, micro_batch_blocks=64, max_anchors_per_seq=64, max_samples_per_batch=2)
    sampler = LengthMixedSampler(cfg, lengths, seed=109, world_size=8, grad_accum=2, blocks=blocks)
    for epoch in range(6):
        plan = sampler.plan_epoch(epoch)
        bins = [b for step in range(len(plan)) for b in plan[step]]
        assert sorted(i for b in bins for i in b) == list(range(45))
        assert all(b and len(b) <= 2 and lengths[b].sum() <= 256 and blocks[b].sum() <= 64 for b in bins)
