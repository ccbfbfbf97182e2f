"""The dry run's view of the steps to come (`python -m stage2_train batches`): what each optimizer
step of the sampler's plan holds, from its position, across epochs and ranks. Moves nothing.

    describe_steps(sampler, 20)     # [{"epoch", "tokens", "length_p50", "rank_tokens", "blocks", ...}, ...]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stage2_train.data.sampler import LengthMixedSampler


def describe_steps(sampler: LengthMixedSampler, num_steps: int) -> list[dict[str, Any]]:
    """The next `num_steps` optimizer steps from the sampler's position (crossing epochs), all ranks.

    For the dry run `python -m stage2_train batches`. Moves nothing.
    """
    cfg, lengths, blocks = sampler.cfg, sampler.lengths, sampler.blocks
    ga = sampler.grad_accum
    out: list[dict[str, Any]] = []
    epoch, step = sampler.epoch, sampler.step_in_epoch
    while len(out) < num_steps:
        plan = sampler.plan_epoch(epoch)
        if step >= len(plan):
            epoch, step = epoch + 1, 0
            continue
        bins = plan[step]
        step_lengths = np.concatenate([lengths[b] for b in bins])
        tokens = int(step_lengths.sum())
        bin_blocks = [int(blocks[b].sum()) for b in bins]
        p10, p50, p90 = np.percentile(step_lengths, [10, 50, 90])
        out.append(
            {
                "epoch": epoch,
                "step_in_epoch": step,
                "tokens": tokens,
                "num_samples": len(step_lengths),
                "length_p10": float(p10),
                "length_p50": float(p50),
                "length_p90": float(p90),
                "length_max": int(step_lengths.max()),
                "padding_fraction": 1.0 - tokens / (cfg.micro_batch_tokens * len(bins)),
                "rank_tokens": [
                    int(sum(lengths[b].sum() for b in bins[r * ga : (r + 1) * ga]))
                    for r in range(sampler.world_size)
                ],
                "blocks": sum(bin_blocks),
                "block_fill": sum(bin_blocks) / (sampler.micro_batch_blocks * len(bins)),
                "max_micro_batch_blocks": max(bin_blocks),
                "rank_blocks": [sum(bin_blocks[r * ga : (r + 1) * ga]) for r in range(sampler.world_size)],
            }
        )
        step += 1
    return out
