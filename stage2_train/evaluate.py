"""Evaluation that predicts real acceptance: offline on held-out store samples, online by real decoding.

    .venv/bin/python -m stage2_train eval --json [--checkpoint PATH]

Offline (`offline_eval`, cheap enough for the trainer to call every `eval.every_steps`): the drafter
runs over blocks of held-out samples exactly as in training (AnchorSampler + collate, epoch 0, so
the same blocks every time) and reports, per block position, the accuracy of its argmax; eal =
sum_k prod_{i<=k} acc_k (speculators' metric); and the acceptance-length histogram: per block,
1 + the number of consecutive correct slots from slot 1 (1 = only the bonus token, B = all
drafts accepted), whose mean is `tau`. That block mean overstates decoding's tau: decoding visits
anchor t + a(t) after anchor t, so it crosses easy stretches in few blocks. With every anchor
scored (`max_anchors_per_seq=None`) `walk_tau` replays that walk over the sample and is the
estimate to trust (on the target's own greedy text it equals decoding's tau).

Online (`online_eval`): the prompts of held-out conversations (the tokens before the first
supervised token) are decoded greedily by the target alone and by speculative decoding with each
proposer (the trained drafter, an untrained one, the n-gram baseline). It reports tau, whether
every output equals the target's own greedy output (it must), and the wall-clock speedup (CPU
numbers: reported, not a goal).

`cmd_eval` returns {"offline", "online", "gap"}; gap.relative = (offline walk_tau - online tau) /
online tau. Offline blocks sit on the stored (sampled) continuations, online ones on the target's
greedy path, so some gap remains; a large one means training inputs differ from what decoding
feeds the drafter.

Settings come from the `eval` section (`stage2_train.data.EvalConfig`, the trainer's own: the
same held-out split, holdout_fraction and split_seed).

Shape legend: N blocks, B block size, H hidden, V vocab, M rows scored in one chunk.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.config import RunConfig
from stage2_train.anchors import AnchorSampler
from stage2_train.batch import DrafterBatch
from stage2_train.loader import collate
from stage2_train.loss import COUNT_KEYS, IGNORE, LossConfig, finalize_metrics, loss_weights, recipe_gamma
from stage2_train.model import DFlashDrafter
from stage2_train.sampler import SamplerConfig
from stage2_train.speculative import (
    DFlashProposer,
    NgramProposer,
    Proposer,
    speculative_generate,
    target_greedy,
)

DENSE_ANCHORS = 1 << 30  # "every valid anchor" for AnchorSampler
# ---------------------------------------------------------------------------------------------
# Offline


@torch.no_grad()
def score_blocks(
    drafter: DFlashDrafter, batch: DrafterBatch, gamma: float, rows_per_chunk: int = 1024
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """(counts with loss.py's COUNT_KEYS, accept_len_N, pred_NB) for one batch.

    pred_NB is the drafter's argmax at slots 1..B-1 (-1 at slot 0); a slot is correct when it
    equals a scored label; accept_len = 1 + consecutive correct slots from slot 1 (an unscored slot
    ends the streak, as in the training metrics)."""
    hidden_NBH = drafter(batch)
    N, B, H = hidden_NBH.shape
    labels_NB = batch.labels_NB
    hidden_MH = hidden_NBH[:, 1:].reshape(-1, H)
    labels_M = labels_NB[:, 1:].reshape(-1)
    preds, logprobs = [], []
    for start in range(0, hidden_MH.shape[0], rows_per_chunk):
        logits_MV = drafter.logits(hidden_MH[start : start + rows_per_chunk]).float()
        preds.append(logits_MV.argmax(-1))
        label_M = labels_M[start : start + rows_per_chunk].clamp(min=0)
        logprobs.append(logits_MV.log_softmax(-1).gather(1, label_M[:, None])[:, 0])
    pred_NB = torch.full_like(labels_NB, -1)
    pred_NB[:, 1:] = torch.cat(preds).view(N, B - 1)
    valid_NB = labels_NB != IGNORE
    ce_NB = torch.zeros(N, B, device=labels_NB.device)
    ce_NB[:, 1:] = -torch.cat(logprobs).view(N, B - 1)
    w_NB = loss_weights(labels_NB, gamma)
    correct_NB = valid_NB & (pred_NB == labels_NB)
    streak_N = correct_NB[:, 1:].long().cumprod(1).sum(1)
    ce_sum = (w_NB * torch.where(valid_NB, ce_NB, 0.0)).sum()
    counts = {
        "ce_sum": ce_sum,
        "kl_sum": torch.zeros((), device=ce_sum.device),
        "weight_sum": w_NB.sum(),
        "num_valid": valid_NB.sum(),
        "correct_per_pos": correct_NB[:, 1:].sum(0),
        "valid_per_pos": valid_NB[:, 1:].sum(0),
        "streak_sum": streak_N.sum(),
        "num_blocks": valid_NB.any(1).sum(),
    }
    return counts, streak_N + 1, pred_NB


def _packs(indices: Sequence[int], lengths: np.ndarray, token_budget: int) -> list[list[int]]:
    """Consecutive samples, at most `token_budget` tokens per pack (a longer sample goes alone)."""
    packs, current, tokens = [], [], 0
    for index in indices:
        n = int(lengths[index])
        if current and tokens + n > token_budget:
            packs.append(current)
            current, tokens = [], 0
        current.append(int(index))
        tokens += n
    if current:
        packs.append(current)
    return packs


def decode_walk(accept_by_anchor: dict[int, int]) -> list[tuple[int, int]]:
    """The (anchor, acceptance length) pairs greedy decoding visits, replayed over one sample's blocks.

    Decoding does not visit every anchor: from anchor t it accepts a(t) tokens and drafts next
    from t + a(t). Averaging a(t) over all anchors over-weights easy stretches (decoding crosses
    them in few blocks), so the replayed walk, not the block mean, is what tau measures. Needs
    a(t) at every valid anchor; where the walk lands on an invalid one (an unsupervised span such
    as the next user turn) it resumes at the next valid anchor."""
    anchors = sorted(accept_by_anchor)
    visits = []
    i = 0
    while i < len(anchors):
        a = accept_by_anchor[anchors[i]]
        visits.append((anchors[i], a))
        i = bisect.bisect_left(anchors, anchors[i] + a, lo=i + 1)
    return visits


@torch.no_grad()
def offline_eval(
    drafter: DFlashDrafter,
    reader: Any,
    indices: Sequence[int],
    *,
    max_anchors_per_seq: int | None = 64,
    token_budget: int = 8192,
    seed: int = 0,
    gamma: float | None = None,
) -> dict[str, Any]:
    """Block metrics of `drafter` on samples `indices` of a store reader (lengths, reader[i]).

    Deterministic: anchors are AnchorSampler's epoch-0 draw. `max_anchors_per_seq=None` scores
    every valid anchor (dearer) and adds `walk_tau`, the tau that decoding these very sequences
    would get (see `decode_walk`). The drafter is put in eval mode and restored to its mode."""
    block_size = drafter.block_size
    gamma = gamma if gamma is not None else (recipe_gamma(block_size) or 7.0)
    dense = max_anchors_per_seq is None
    anchor_sampler = AnchorSampler(
        SamplerConfig(max_anchors_per_seq=DENSE_ANCHORS if dense else max_anchors_per_seq),
        block_size=block_size,
        seed=seed,
    )
    device = drafter.fc.weight.device
    parts: list[dict[str, torch.Tensor]] = []
    hist_B = torch.zeros(block_size, dtype=torch.long)
    walk_tokens = walk_forwards = 0
    num_samples = num_without_anchor = 0
    was_training = drafter.training
    drafter.eval()
    try:
        for pack in _packs(indices, np.asarray(reader.lengths), token_budget):
            samples, anchors = [], []
            for index in pack:
                sample = reader[index]
                anchors_A = anchor_sampler.anchors(
                    sample["loss_mask_T"], sample_id=int(sample["sample_id"]), epoch=0
                )
                num_samples += 1
                if len(anchors_A) == 0:
                    num_without_anchor += 1
                    continue
                samples.append(sample)
                anchors.append(anchors_A)
            if not samples:
                continue
            batch = collate(
                samples,
                anchors,
                block_size=block_size,
                mask_token_id=drafter.mask_token_id,
                gather_topk=False,
            ).to(device)
            counts, accept_N, _ = score_blocks(drafter, batch, gamma)
            parts.append({k: v.float().cpu() for k, v in counts.items()})
            accept_N = accept_N.cpu()
            hist_B += torch.bincount(accept_N - 1, minlength=block_size)
            if dense:
                seq_N, anchor_N = batch.block_seq_N.cpu().tolist(), batch.anchor_pos_N.cpu().tolist()
                for s in range(len(samples)):
                    visits = decode_walk(
                        {a: n for q, a, n in zip(seq_N, anchor_N, accept_N.tolist()) if q == s}
                    )
                    walk_tokens += sum(a for _, a in visits)
                    walk_forwards += len(visits)
    finally:
        drafter.train(was_training)
    if not parts:
        raise ValueError(
            f"offline eval: none of the {num_samples} samples has a valid anchor for block size {block_size}"
        )
    summed = {k: torch.stack([p[k] for p in parts]).sum(0) for k in COUNT_KEYS}
    metrics = finalize_metrics(summed, LossConfig(gamma=gamma))
    return {
        "num_samples": num_samples,
        "num_samples_without_anchor": num_without_anchor,
        "num_blocks": int(hist_B.sum()),
        "ce": float(metrics["ce"]),
        "accuracy": float(metrics["accuracy"]),
        "acc_per_pos": [round(float(a), 6) for a in metrics["acc_per_pos"]],
        "eal": float(metrics["eal"]),
        "tau": 1.0 + float(metrics["avg_streak"]),  # mean acceptance length over the scored blocks
        "walk_tau": walk_tokens / walk_forwards if dense else None,
        "accept_hist": hist_B.tolist(),  # index j: blocks with acceptance length j + 1
    }


# ---------------------------------------------------------------------------------------------
# Online


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

    Per proposer: tau (tokens per verifying forward, pooled over prompts), the acceptance-length
    histogram, exact (every output == the target's greedy output), wall time and speedup."""
    if not prompts:
        raise ValueError("online eval: no prompts")
    greedy_wall = 0.0
    stats = {
        name: {"tokens": 0, "forwards": 0, "num_exact": 0, "wall_s": 0.0, "draft_s": 0.0, "hist": {}}
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
            "exact": s["num_exact"] == len(prompts),
            "num_exact": s["num_exact"],
            "accept_hist": [s["hist"].get(j, 0) for j in range(1, max_len + 1)],
            "wall_s": round(s["wall_s"], 4),
            "draft_s": round(s["draft_s"], 4),
            "speedup": greedy_wall / s["wall_s"] if s["wall_s"] > 0 else None,
        }
    return {
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "greedy_wall_s": round(greedy_wall, 4),
        "proposers": summary,
    }


def acceptance_gap(offline: dict[str, Any], online_tau: float) -> dict[str, Any]:
    """How far the offline estimates are from decoding's tau; `relative` uses the best estimate
    available (walk_tau when every anchor was scored, else the block mean)."""
    best = offline["walk_tau"] if offline.get("walk_tau") is not None else offline["tau"]
    return {
        "offline_walk_tau": offline.get("walk_tau"),
        "offline_block_tau": offline["tau"],
        "offline_eal_plus_bonus": 1.0 + offline["eal"],
        "online_tau": online_tau,
        "relative": (best - online_tau) / online_tau,
    }


# ---------------------------------------------------------------------------------------------
# CLI


def _eos_ids(tokenizer: Any, target: Any) -> list[int]:
    ids = set()
    configured = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    for value in (tokenizer.eos_token_id, configured):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


def cmd_eval(cfg: RunConfig, args: Any) -> dict[str, Any]:
    """`python -m stage2_train eval [--checkpoint PATH]`: offline and online evaluation of the latest
    (or given) checkpoint on the held-out split; also written to run_dir/eval/<checkpoint>.json."""
    from shared.target import load_target_model
    from shared.target_parts import load_embed_and_head
    from stage2_train.data import EvalConfig, open_store, resolve_target, tokenizer_and_hash
    from stage2_train.export import (
        build_drafter,
        checkpoints_dir,
        find_checkpoint,
        read_checkpoint_weights,
        section,
    )
    from stage2_train.model import DrafterConfig
    from stage2_train.split import heldout_mask

    target = resolve_target(cfg)
    cfg_model = section(cfg, "model", DrafterConfig)
    eval_cfg = section(cfg, "eval", EvalConfig)
    layer_ids, mask_token_id = target.layer_ids, target.mask_token_id
    reader = open_store(cfg, target)  # the trainer's checks: target, tokenizer, sizes, layers
    fraction = eval_cfg.holdout_fraction
    heldout = np.flatnonzero(heldout_mask(reader.sample_ids, fraction, eval_cfg.split_seed))
    if len(heldout) == 0:
        raise ValueError(f"eval.holdout_fraction={fraction} leaves no held-out sample among {len(reader)}")

    tokenizer, _ = tokenizer_and_hash(str(target.target_dir))
    embed_VH, lm_head_VH = load_embed_and_head(target.target_dir)
    checkpoint = find_checkpoint(getattr(args, "checkpoint", None) or checkpoints_dir(cfg))
    common = (cfg_model, target.arch, len(layer_ids), mask_token_id, embed_VH, lm_head_VH)
    trained = build_drafter(*common, weights=read_checkpoint_weights(checkpoint))
    untrained = build_drafter(*common, seed=cfg.seed)

    offline = offline_eval(
        trained,
        reader,
        heldout[: eval_cfg.offline_max_samples],
        max_anchors_per_seq=eval_cfg.offline_max_anchors_per_seq,
        token_budget=eval_cfg.offline_token_budget,
        seed=cfg.seed,
    )
    target_model = load_target_model(cfg.target)
    prompts = heldout_prompts(reader, heldout, eval_cfg.online_num_prompts)
    feature_dtype = torch.bfloat16  # the store holds bf16 (fp8 decodes to bf16): what training saw
    proposers = {
        "trained": DFlashProposer(trained, layer_ids, feature_dtype=feature_dtype, name="trained"),
        "untrained": DFlashProposer(untrained, layer_ids, feature_dtype=feature_dtype, name="untrained"),
        "ngram": NgramProposer(cfg_model.block_size - 1),
    }
    online = online_eval(
        target_model,
        proposers,
        [p for _, p in prompts],
        max_new_tokens=eval_cfg.online_max_new_tokens,
        eos_token_ids=_eos_ids(tokenizer, target_model),
    )
    online["sample_ids"] = [sid for sid, _ in prompts]
    result = {
        "checkpoint": str(checkpoint),
        "num_heldout": int(len(heldout)),
        "offline": offline,
        "online": online,
        "gap": acceptance_gap(offline, online["proposers"]["trained"]["tau"]),
    }
    out = Path(cfg.run_dir) / "eval" / f"{checkpoint.parent.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)
    result["written_to"] = str(out)
    return result
