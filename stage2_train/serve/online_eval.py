"""The online evaluation: real speculative decoding with the target, the ground truth for acceptance.

    prompts = heldout_prompts(reader, heldout_indices, 8)
    online = online_eval(target, {"trained": DFlashProposer(...), "ngram": NgramProposer(15)}, prompts, ...)

The prompts of held-out conversations (the tokens before the first supervised token) are decoded
greedily by the target alone and by speculative decoding with each proposer (the trained drafter,
an untrained one, the n-gram baseline). It reports tau (tokens per verifying target forward, bonus
included), whether every output equals the target's own greedy output (it must), and the
wall-clock speedup (CPU numbers: reported, not a goal). `acceptance_gap` compares the offline
estimate (`walk_tau`, stage2_train/train/evaluate.py) with decoding's tau: offline blocks sit on
the stored (sampled) continuations, online ones on the target's greedy path, so some gap remains;
a large one means training inputs differ from what decoding feeds the drafter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shared.errors import DataError
from stage2_train.serve.speculative import Proposer, speculative_generate, target_greedy


def load_online_target(target_cfg: Any, online_dtype: str, device: str = "cpu") -> Any:
    """The target as online evaluation runs it: in `eval.online_dtype` (fp32 by default), so that
    bf16 ties do not make verification and greedy decoding disagree for reasons not the drafter's."""
    from shared.target_model import load_target_model

    return load_target_model(target_cfg.model_copy(update={"dtype": online_dtype}), device)


def heldout_prompts(reader: Any, indices: Sequence[int], max_prompts: int) -> list[tuple[int, list[int]]]:
    """(sample_id, prompt ids) of up to `max_prompts` samples: the tokens before the first
    supervised token (samples with no supervised token, or nothing before it, are skipped)."""
    prompts = []
    for index in indices:
        if len(prompts) >= max_prompts:
            break
        sample = reader[index]
        supervised = torch.nonzero(sample["loss_mask_T"].bool())
        if len(supervised) == 0 or int(supervised[0]) == 0:
            continue
        prompts.append((int(sample["sample_id"]), sample["input_ids_T"][: int(supervised[0])].tolist()))
    return prompts


@torch.no_grad()
def online_eval(
    target: Any,
    proposers: dict[str, Proposer],
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: int | list[int] | None,
) -> dict[str, Any]:
    """Greedy target decoding vs speculative decoding with each proposer on the same prompts.

    Per proposer: tau (tokens per verifying forward, pooled over prompts), drafted tokens per forward,
    the acceptance-length histogram, exact (every output == the target's greedy output), wall time and
    speedup."""
    if not prompts:
        raise DataError("online eval: no held-out sample has a prompt (tokens before its first supervised one)")
    # A short untimed decode of each first: on a GPU the first drafter call compiles its attention
    # (tens of seconds) and the first target calls warm the kernels, which the first proposer's and
    # the greedy wall times would otherwise carry.
    warm = min(max_new_tokens, 2 * max((p.max_draft for p in proposers.values()), default=1) + 2)
    target_greedy(target, prompts[0], max_new_tokens=warm, eos_token_ids=eos_token_ids)
    for proposer in proposers.values():
        speculative_generate(target, proposer, prompts[0], max_new_tokens=warm, eos_token_ids=eos_token_ids)
    greedy_wall = 0.0
    stats = {
        name: {"tokens": 0, "forwards": 0, "drafted": 0, "num_exact": 0, "wall_s": 0.0, "draft_s": 0.0, "hist": {}, "per_prompt": []}
        for name in proposers
    }
    for prompt in prompts:
        reference = target_greedy(target, prompt, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)
        greedy_wall += reference.wall_s
        for name, proposer in proposers.items():
            result = speculative_generate(
                target, proposer, prompt, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids
            )
            s = stats[name]
            s["tokens"] += sum(result.acceptance_lengths)
            s["forwards"] += result.num_target_forwards
            s["drafted"] += sum(result.drafted)
            s["per_prompt"].append([sum(result.acceptance_lengths), result.num_target_forwards, sum(result.drafted)])
            s["num_exact"] += int(result.tokens == reference.tokens)
            s["wall_s"] += result.wall_s
            s["draft_s"] += result.draft_s
            for length in result.acceptance_lengths:
                s["hist"][length] = s["hist"].get(length, 0) + 1
    summary = {}
    for name, s in stats.items():
        max_len = max(s["hist"], default=1)
        summary[name] = {
            "tau": s["tokens"] / s["forwards"] if s["forwards"] else 1.0,
            # tokens verified besides the anchor per forward: what a step costs the target (a DSpark
            # block drafts B, a confidence stop fewer; the n-gram drafter only what it finds)
            "drafted_per_step": s["drafted"] / s["forwards"] if s["forwards"] else 0.0,
            "exact": s["num_exact"] == len(prompts),
            "num_exact": s["num_exact"],
            "accept_hist": [s["hist"].get(j, 0) for j in range(1, max_len + 1)],
            "wall_s": round(s["wall_s"], 4),
            "draft_s": round(s["draft_s"], 4),
            "speedup": greedy_wall / s["wall_s"] if s["wall_s"] > 0 else None,
            "per_prompt": s["per_prompt"],  # [tokens, verifying forwards, drafted] per prompt: intervals over prompts
        }
    return {
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "greedy_wall_s": round(greedy_wall, 4),
        "proposers": summary,
    }


def acceptance_gap(offline: dict[str, Any], online_tau: float) -> dict[str, Any]:
    """How far the offline estimates are from decoding's tau; `relative` uses the best estimate
    available (walk_tau when every anchor was scored, else the block mean accept_len)."""
    best = offline["walk_tau"] if offline.get("walk_tau") is not None else offline["accept_len"]
    return {
        "offline_walk_tau": offline.get("walk_tau"),
        "offline_accept_len": offline["accept_len"],
        "online_tau": online_tau,
        "relative": (best - online_tau) / online_tau,
    }


def bootstrap_tau(per_prompt: list[list[int]], resamples: int = 2000, seed: int = 0, baseline: list[list[int]] | None = None) -> dict[str, float]:
    """tau pooled over prompts (tokens / forwards) and its 95% bootstrap interval over prompts; with
    `baseline` (the same prompts under another proposer), the paired difference and its interval:
    resampling prompts jointly removes the prompts' own spread from the comparison."""
    import numpy as np

    own = np.asarray(per_prompt, dtype=np.float64)[:, :2]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(own), size=(resamples, len(own)))
    tau = own[:, 0].sum() / own[:, 1].sum()
    samples = own[picks, 0].sum(1) / own[picks, 1].sum(1)
    out = {"tau": float(tau), "lo": float(np.quantile(samples, 0.025)), "hi": float(np.quantile(samples, 0.975))}
    if baseline is not None:
        base = np.asarray(baseline, dtype=np.float64)[:, :2]
        diff = samples - base[picks, 0].sum(1) / base[picks, 1].sum(1)
        out.update({"diff": float(tau - base[:, 0].sum() / base[:, 1].sum()),
                    "diff_lo": float(np.quantile(diff, 0.025)), "diff_hi": float(np.quantile(diff, 0.975))})
    return out


def bootstrap_drafted(per_prompt: list[list[int]], resamples: int = 2000, seed: int = 0) -> dict[str, float]:
    """Drafted tokens per verifying forward pooled over prompts, with its 95% bootstrap interval."""
    out = bootstrap_tau([[p[2], p[1]] for p in per_prompt], resamples, seed)
    return {"drafted_per_step": out["tau"], "lo": out["lo"], "hi": out["hi"]}
