"""One evaluation of a set of drafters on a set of prompts: what `stage2_train eval`, `bench/compare.py`
and `bench/learning.py` all call.

    heldout = HeldoutSet.open(cfg)                                  # the target, the store, the one held-out rule
    heldout = HeldoutSet.open(cfg, trained_on=read_trained_on(step_dir))   # a saved drafter's own split and store
    drafters = {"trained": heldout.load(checkpoint, cfg.model).drafter, "untrained": heldout.untrained(cfg)}
    report = evaluate_drafters(drafters, heldout, prompts=heldout.prompts(12), eval_cfg=cfg.eval, ...)

Offline, each drafter scores every anchor of the held-out store samples (`train/evaluate.py`: accuracy
per position, accept_len, walk_tau and their standard errors). Online, the target decodes the same
prompts greedily and with speculative decoding under each drafter and the n-gram drafter
(`serve/online_eval.py`); every output must equal the target's own greedy output. Each proposer's tau
carries its 95% bootstrap interval over prompts and, against the baseline drafter, the paired
difference (the prompts resampled together, so their own spread cancels), on all prompts and per group
of prompts (`groups`: e.g. documentation excerpts against short questions). The target's embedding and
LM head are read once for every drafter of the set (at 8B they are ~5 GB).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shared.config import RunConfig
from shared.errors import CheckpointError, StoreError
from shared.paths import RunPaths
from shared.target import TargetInfo, cached_tokenizer, resolve_target, stop_token_ids
from shared.target_parts import load_embed_and_head
from stage2_train.data.view import open_store, split_indices
from stage2_train.model.config import DrafterConfig
from stage2_train.model.description import describe
from stage2_train.model.drafter import DFlashDrafter, build_drafter
from stage2_train.serve.load import LoadedDrafter, load_drafter
from stage2_train.serve.online_eval import (
    acceptance_gap,
    bootstrap_drafted,
    bootstrap_tau,
    heldout_prompts,
    load_online_target,
    online_eval,
)
from stage2_train.serve.speculative import DFlashProposer, NgramProposer
from stage2_train.serve.trained_on import TrainedOn, heldout_split, other_store
from stage2_train.train.evaluate import offline_eval
from stage2_train.train.state import store_digest


@dataclass
class HeldoutSet:
    """The target, its store and the store's held-out samples (`data/view.split_indices`: the one
    rule, by content hash and eval.split_seed), with the target's frozen parts read once."""

    target: TargetInfo
    reader: Any
    heldout: np.ndarray  # indices into `reader`
    parts: tuple[torch.Tensor, torch.Tensor]  # (embed_VH, lm_head_VH), shared by every drafter
    split: dict[str, Any] = field(default_factory=dict)  # the split and store used, and where they came from
    notes: list[str] = field(default_factory=list)  # config-file values ignored for the drafter's own

    @classmethod
    def open(cls, cfg: RunConfig, trained_on: TrainedOn | None = None) -> HeldoutSet:
        """The config's store and split; with `trained_on` (a saved drafter's record), the split it was
        trained with (`serve/trained_on.py`), on the store it was trained on unless eval.allow_other_store."""
        target = resolve_target(cfg.target)
        store = RunPaths.of(cfg).store
        reader = open_store(store, target, options=cfg.store.reader_options())
        fraction, seed, notes = heldout_split(cfg, trained_on)
        problem = other_store(trained_on, reader.manifest)
        if problem is not None and not cfg.eval.allow_other_store:
            raise StoreError(
                f"{store} is not the store {trained_on.where} was trained on ({problem}): its scores would not be the "
                f"held-out scores of that training; set store.path to the store it was trained on, or "
                f"eval.allow_other_store=true to evaluate it on this one"
            )
        _, heldout = split_indices(reader, fraction, seed)
        split = {
            "holdout_fraction": fraction, "split_seed": seed, "from": trained_on.where if trained_on else "config",
            "store_digest": store_digest(reader.manifest),
            "trained_on_store": None if trained_on is None or not trained_on.store_digest else problem is None,
        }
        return cls(target, reader, heldout, load_embed_and_head(target.target_dir), split, notes)

    def load(self, source: Any, runtime: DrafterConfig | None = None, device: Any = "cpu") -> LoadedDrafter:
        """A saved drafter (checkpoint or folder), as its description says, on `device`."""
        loaded = load_drafter(source, self.target, runtime=runtime, parts=self.parts)
        same_layers(loaded.drafter, self.target, str(source))
        loaded.drafter.to(device)
        return loaded

    def untrained(self, cfg: RunConfig, like: Any = None, device: Any = "cpu") -> DFlashDrafter:
        """A drafter of the same description as `like` (or the config's) from cfg.seed: the floor."""
        description = like if like is not None else describe(cfg.model, self.target)
        return build_drafter(description, *self.parts, runtime=cfg.model, seed=cfg.seed).to(device).eval()

    def prompts(self, count: int) -> list[tuple[int, list[int]]]:
        """(sample id, prompt ids) of up to `count` held-out conversations."""
        return heldout_prompts(self.reader, self.heldout, count)


def same_layers(drafter: DFlashDrafter, target: TargetInfo, where: str) -> None:
    """A drafter reads the features of the target layers it was trained on: fed other layers' (the
    store's and the config's), every score is of the wrong features and decoding stays exact, so
    nothing else would show it."""
    description = drafter.description
    if description is not None and list(description.target_layer_ids) != list(target.layer_ids):
        raise CheckpointError(
            f"{where}: the drafter reads target layers {list(description.target_layer_ids)}, the store and the config give "
            f"{list(target.layer_ids)}; evaluate it on a store extracted with target.layer_ids={list(description.target_layer_ids)}"
        )


def evaluate_drafters(
    drafters: dict[str, DFlashDrafter],
    heldout: HeldoutSet,
    *,
    prompts: Sequence[list[int]],
    cfg: RunConfig,
    baseline: str,
    offline: Sequence[str] | None = None,
    groups: dict[str, Sequence[int]] | None = None,
    max_new_tokens: int | None = None,
    device: Any = "cpu",
    confidence_stops: dict[str, float | None] | None = None,
) -> dict[str, Any]:
    """Offline (the drafters named in `offline`, default all) and online evaluation of `drafters` and
    the n-gram drafter on `prompts`; intervals on all prompts and on each of `groups` (prompt indices),
    paired against `baseline`. `confidence_stops`: per drafter, a DSpark early stop other than
    `eval.confidence_stop`."""
    eval_cfg = cfg.eval
    for name, drafter in drafters.items():
        same_layers(drafter, heldout.target, name)
    offline_rows = {
        name: offline_eval(
            drafters[name], heldout.reader, heldout.heldout[: eval_cfg.offline_max_samples].tolist(),
            max_anchors_per_seq=None, batch_tokens=eval_cfg.offline_batch_tokens, seed=cfg.seed, gamma=cfg.loss.gamma,
        )  # every anchor, as a run's final eval: walk_tau needs them all
        for name in (offline if offline is not None else drafters)
    }
    if not prompts and eval_cfg.online_num_prompts == 0:  # offline only, asked for: the target never loads
        return {"offline": offline_rows, "online": None, "gap": {}, "baseline": baseline}
    target_model = load_online_target(cfg.target, eval_cfg.online_dtype, device)
    tokenizer, _ = cached_tokenizer(str(heldout.target.target_dir))
    feature_dtype = torch.bfloat16  # the store holds bf16 (fp8 decodes to bf16): what training saw
    stops = confidence_stops or {}
    proposers = {
        n: DFlashProposer(d, heldout.target.layer_ids, feature_dtype=feature_dtype, name=n, confidence_stop=stops.get(n, eval_cfg.confidence_stop))
        for n, d in drafters.items()
    }
    # The n-gram drafter proposes as many tokens as the baseline drafter's block.
    proposers["ngram"] = NgramProposer(proposers[baseline].max_draft)
    online = online_eval(
        target_model, proposers, list(prompts), max_new_tokens=max_new_tokens or eval_cfg.online_max_new_tokens,
        eos_token_ids=stop_token_ids(tokenizer, target_model),
    )
    groups = {"all": range(len(prompts)), **(groups or {})}
    base = online["proposers"][baseline]["per_prompt"]
    for name, entry in online["proposers"].items():
        entry["groups"] = {}
        for group, index in groups.items():
            index = list(index)
            if not index:
                continue
            paired = None if name == baseline else [base[i] for i in index]
            interval = bootstrap_tau([entry["per_prompt"][i] for i in index], baseline=paired)
            entry["groups"][group] = {k: round(v, 4) for k, v in interval.items()}
        entry["interval"] = entry["groups"]["all"]
        entry["drafted_interval"] = {k: round(v, 4) for k, v in bootstrap_drafted(entry["per_prompt"]).items()}
    gaps = {name: acceptance_gap(row, online["proposers"][name]["tau"]) for name, row in offline_rows.items()}
    return {"offline": offline_rows, "online": online, "gap": gaps, "baseline": baseline}


def one_line(report: dict[str, Any], trained: str = "trained") -> str:
    """`eval`'s last line: trained tau [interval] vs untrained vs n-gram, each with its interval."""
    if report["online"] is None:
        row = report["offline"].get(trained, {})
        return f"{trained}: offline only (eval.online_num_prompts=0), accept_len {row.get('accept_len', float('nan')):.3f}"
    parts = []
    for name in (trained, "untrained", "ngram"):
        entry = report["online"]["proposers"].get(name)
        if entry is None:
            continue
        i = entry["interval"]
        text = f"{name} tau {i['tau']:.3f} [{i['lo']:.3f}, {i['hi']:.3f}], {entry['drafted_per_step']:.1f} drafted/step"
        if "diff" in i:
            text += f" ({i['diff']:+.3f} [{i['diff_lo']:+.3f}, {i['diff_hi']:+.3f}] vs {trained})"
        parts.append(text)
    return " | ".join(parts)
