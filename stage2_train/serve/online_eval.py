"""The online evaluation: real speculative decoding with the target, the ground truth for acceptance.

    prompts = heldout_prompts(reader, heldout_indices, 8)
    online = online_eval(target, {"trained": DFlashProposer(...), "ngram": NgramProposer(15)}, prompts, ...)

The prompts of held-out conversations (the tokens before the first supervised token) are decoded
greedily by the target alone and by speculative decoding with each proposer (the trained drafter,
an untrained one, the n-gram baseline). It reports tau (tokens per verifying target forward, bonus
included), whether each output equals the target's own greedy output (it must in fp32; in bf16 near-tied
logits can round to another argmax, and the decode then follows another text), and the wall-clock
speedup (CPU numbers: reported, not a goal). `bootstrap_tau` gives tau's 95% interval over prompts
when there are enough prompts for one (MIN_INTERVAL_PROMPTS); `interval_text` prints it. `acceptance_gap` compares the offline
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
    supervised token (samples with no supervised token, or nothing before it, are skipped, and so is
    a prompt already taken: copies decode alike, and tau's interval over prompts would count one as
    several)."""
    prompts, seen = [], set()
    for index in indices:
        if len(prompts) >= max_prompts:
            break
        sample = reader[index]
        supervised = torch.nonzero(sample["loss_mask_T"].bool())
        if len(supervised) == 0 or int(supervised[0]) == 0:
            continue
        ids = sample["input_ids_T"][: int(supervised[0])].tolist()
        if tuple(ids) in seen:
            continue
        seen.add(tuple(ids))
        prompts.append((int(sample["sample_id"]), ids))
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
        name: {"tokens": 0, "forwards": 0, "drafted": 0, "exact_per_prompt": [], "wall_s": 0.0, "draft_s": 0.0, "hist": {}, "per_prompt": []}
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
            s["exact_per_prompt"].append(result.tokens == reference.tokens)
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
            "exact": all(s["exact_per_prompt"]),
            "num_exact": sum(s["exact_per_prompt"]),
            "exact_per_prompt": s["exact_per_prompt"],  # which prompts' outputs equal the greedy ones: paired texts
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


# The pooled tau of any resample lies between the smallest and the largest per-prompt tau, and the range
# of n prompts' values holds the median prompt's tau with probability 1 - 2^(1 - n): 50% for 2 prompts,
# 88% for 4, 94% for 5, 97% for 6. Below 5 even the widest interval the prompts allow falls far short of
# 95% (one prompt gives [x, x]), so none is given; from 5 on it can come within a point of it.
MIN_INTERVAL_PROMPTS = 5


def _rows(per_prompt: list[list[int]]) -> Any:
    import numpy as np

    return np.asarray(per_prompt, dtype=np.float64).reshape(len(per_prompt), -1)[:, :2]


def bootstrap_tau(
    per_prompt: list[list[int]], resamples: int = 2000, seed: int = 0, baseline: list[list[int]] | None = None
) -> dict[str, Any]:
    """tau pooled over prompts (tokens / forwards) and its 95% bootstrap interval over prompts; with
    `baseline` (the same prompts under another proposer), the paired difference and its interval:
    resampling prompts jointly removes the prompts' own spread from the comparison.

    A prompt with no verifying forward (the prefill's token ended the turn, or max_new_tokens=1) has no
    tau: it is left out (of both proposers when paired) and counted in `num_without_forwards`, so that
    no resample divides 0 by 0. `num_prompts` counts the prompts kept; with fewer than
    MIN_INTERVAL_PROMPTS, `lo`, `hi` (and `diff_lo`, `diff_hi`) are None: no interval. With no prompt
    kept, `tau` (and `diff`) are None too."""
    import numpy as np

    own = _rows(per_prompt)
    kept = own[:, 1] > 0
    base = None
    if baseline is not None:
        base = _rows(baseline)
        kept &= base[:, 1] > 0
        base = base[kept]
    own = own[kept]
    num = len(own)
    out: dict[str, Any] = {
        "tau": float(own[:, 0].sum() / own[:, 1].sum()) if num else None, "lo": None, "hi": None,
        "num_prompts": num, "num_without_forwards": int(len(kept) - num),
    }
    if base is not None:
        out.update({"diff": float(out["tau"] - base[:, 0].sum() / base[:, 1].sum()) if num else None,
                    "diff_lo": None, "diff_hi": None})
    if num < MIN_INTERVAL_PROMPTS:
        return out
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, num, size=(resamples, num))
    samples = own[picks, 0].sum(1) / own[picks, 1].sum(1)
    out.update({"lo": float(np.quantile(samples, 0.025)), "hi": float(np.quantile(samples, 0.975))})
    if base is not None:
        diff = samples - base[picks, 0].sum(1) / base[picks, 1].sum(1)
        out.update({"diff_lo": float(np.quantile(diff, 0.025)), "diff_hi": float(np.quantile(diff, 0.975))})
    return out


def bootstrap_drafted(per_prompt: list[list[int]], resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Drafted tokens per verifying forward pooled over prompts, with its 95% bootstrap interval (None
    below MIN_INTERVAL_PROMPTS prompts with a verifying forward)."""
    out = bootstrap_tau([[p[2], p[1]] for p in per_prompt], resamples, seed)
    return {"drafted_per_step": out["tau"], "lo": out["lo"], "hi": out["hi"], "num_prompts": out["num_prompts"]}


def interval_text(interval: dict[str, Any], key: str = "tau", spec: str = ".3f") -> str:
    """`interval[key]` with its interval, "1.234 [1.100, 1.350]"; "1.000 (2 prompts: too few for an
    interval)" when there is none; `key` "diff" reads diff_lo/diff_hi. Results written before intervals
    could be missing (no `num_prompts`) print as they were."""
    value = interval.get(key)
    if value is None:
        return "none (no prompt had a verifying forward)"
    low, high = ("diff_lo", "diff_hi") if key == "diff" else ("lo", "hi")
    if interval.get(low) is not None:
        return f"{value:{spec}} [{interval[low]:{spec}}, {interval[high]:{spec}}]"
    num = interval.get("num_prompts")
    return f"{value:{spec}}" if num is None else f"{value:{spec}} ({num} prompt{'' if num == 1 else 's'}: too few for an interval)"
