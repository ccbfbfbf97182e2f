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

What would make those figures mean less than they seem is said in `online["notes"]` (printed by `eval`)
and marked where it applies: outputs that differ from the target's greedy output (per proposer, n of m
prompts; a paired difference over them compares decodes of different texts: `diff_texts_differ`), fewer
prompts than asked, too few prompts for an interval, prompts with no verifying forward (left out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.config import RunConfig
from shared.errors import CheckpointError, ConfigError, StoreError
from shared.paths import RunPaths
from shared.target import TargetInfo, cached_tokenizer, resolve_target, stop_token_ids
from shared.target_parts import load_embed_and_head
from stage2_train.data.view import open_store, split_indices
from stage2_train.model.config import DrafterConfig
from stage2_train.model.description import describe
from stage2_train.model.drafter import DFlashDrafter, build_drafter
from stage2_train.serve.load import LoadedDrafter, load_drafter
from stage2_train.serve.online_eval import (
    MIN_INTERVAL_PROMPTS,
    acceptance_gap,
    bootstrap_drafted,
    bootstrap_tau,
    heldout_prompts,
    interval_text,
    load_online_target,
    online_eval,
)
from stage2_train.serve.speculative import DFlashProposer, NgramProposer
from stage2_train.serve.trained_on import SPLIT_KEYS, TrainedOn, heldout_split, other_store
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
            "data_source": Path(str((reader.manifest.get("data") or {}).get("source", "unknown"))).name,
            "trained_on_store": None if trained_on is None or not trained_on.store_digest else problem is None,
        }
        return cls(target, reader, heldout, load_embed_and_head(target.target_dir), split, notes)

    def load(self, source: Any, runtime: DrafterConfig | None = None, device: Any = "cpu") -> LoadedDrafter:
        """A saved drafter (checkpoint or folder), as its description says, on `device`."""
        loaded = load_drafter(source, self.target, runtime=runtime, parts=self.parts)
        same_layers(loaded.drafter, self.target, str(source))
        self.same_split(loaded.trained_on)
        loaded.drafter.to(device)
        return loaded

    def same_split(self, record: TrainedOn | None) -> None:
        """Refuse a drafter trained with another held-out split than this set's (a set opened from the
        config, as bench/compare.py and bench/learning.py open one for several drafters): its held-out
        samples would include ones it trained on. A drafter that recorded no split is scored as it is."""
        if record is None:
            return
        differ = [f"eval.{key}={getattr(record, key)}, this held-out set {self.split[key]}" for key in SPLIT_KEYS
                  if getattr(record, key) is not None and getattr(record, key) != self.split.get(key)]
        if differ:
            own = " ".join(f"eval.{key}={getattr(record, key)}" for key in SPLIT_KEYS if getattr(record, key) is not None)
            raise ConfigError(
                f"{record.where} was trained with {'; '.join(differ)}: the set holds samples it trained on, which would "
                f"count as held-out; evaluate it on its own split ({own})"
            )

    def untrained(self, cfg: RunConfig, like: Any = None, device: Any = "cpu", *, trained: DFlashDrafter | None = None) -> DFlashDrafter:
        """A drafter of the same description as `like` (or the config's) from cfg.seed: the floor. A
        projected drafter's (model.feature_projection=pca) takes `trained`'s projection, which was fitted
        from the data before training and never trained (left zero, the floor would read no feature)."""
        description = like if like is not None else describe(cfg.model, self.target)
        drafter = build_drafter(description, *self.parts, runtime=cfg.model, seed=cfg.seed)
        if description.feature_projection == "pca" and trained is not None and getattr(trained, "projection_RF", None) is not None:
            drafter.set_projection(trained.projection_RF.detach().cpu())
        return drafter.to(device).eval()

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
    num_prompts_asked: int | None = None,
    gamma: float | None = None,
) -> dict[str, Any]:
    """Offline (the drafters named in `offline`, default all) and online evaluation of `drafters` and
    the n-gram drafter on `prompts`; intervals on all prompts and on each of `groups` (prompt indices),
    paired against `baseline`. `confidence_stops`: per drafter, a DSpark early stop other than
    `eval.confidence_stop`. `num_prompts_asked`: how many held-out prompts were asked for, when
    `prompts` may hold fewer (a note says so). `gamma`: the offline ce's position weights, when not
    loss.gamma (a saved drafter's own, `trained_on.drafter_gamma`)."""
    eval_cfg = cfg.eval
    for name, drafter in drafters.items():
        same_layers(drafter, heldout.target, name)
    offline_rows = {
        name: offline_eval(
            drafters[name], heldout.reader, heldout.heldout[: eval_cfg.offline_max_samples].tolist(),
            max_anchors_per_seq=None, batch_tokens=eval_cfg.offline_batch_tokens, seed=cfg.seed,
            gamma=cfg.loss.gamma if gamma is None else gamma,
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
    for name, proposer in proposers.items():
        # A DSpark early stop changes tau and drafted/step: what was measured says so (a card restates it).
        online["proposers"][name]["confidence_stop"] = early_stop(proposer)
    add_intervals(online, baseline, groups)
    online.update({"dtype": eval_cfg.online_dtype, "num_prompts_asked": num_prompts_asked or len(prompts)})
    online["notes"] = online_notes(online, baseline)
    gaps = {name: acceptance_gap(row, online["proposers"][name]["tau"]) for name, row in offline_rows.items()}
    return {"offline": offline_rows, "online": online, "gap": gaps, "baseline": baseline}


def early_stop(proposer: Any) -> float | None:
    """The confidence stop a proposer drafts with: a DSpark drafter's with a confidence head, else None
    (whole blocks: a DFlash or DFlash2 drafter, the n-gram drafter, DSpark without a stop)."""
    drafter = getattr(proposer, "drafter", None)
    if getattr(drafter, "confidence_head", None) is None:
        return None
    return proposer.confidence_stop


def _prompts(num: int) -> str:
    return f"{num} prompt{'' if num == 1 else 's'}"


def _rounded(interval: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in interval.items()}


def add_intervals(online: dict[str, Any], baseline: str, groups: dict[str, Sequence[int]] | None = None) -> None:
    """Each proposer's `groups` (all prompts, then each of `groups`): tau's interval and, against
    `baseline`, the paired difference with `diff_texts_differ` (prompts on which either output differs
    from the target's greedy one: there the pair decoded different texts); `interval` (all prompts)
    and `drafted_interval`. In place, on `online_eval`'s result."""
    groups = {"all": range(online["num_prompts"]), **(groups or {})}
    base = online["proposers"][baseline]
    for name, entry in online["proposers"].items():
        entry["groups"] = {}
        for group, index in groups.items():
            index = list(index)
            if not index:
                continue
            paired = None if name == baseline else [base["per_prompt"][i] for i in index]
            interval = bootstrap_tau([entry["per_prompt"][i] for i in index], baseline=paired)
            if paired is not None:
                interval["diff_texts_differ"] = sum(
                    not (entry["exact_per_prompt"][i] and base["exact_per_prompt"][i]) for i in index
                )
            entry["groups"][group] = _rounded(interval)
        entry["interval"] = entry["groups"]["all"]
        entry["drafted_interval"] = _rounded(bootstrap_drafted(entry["per_prompt"]))


def online_notes(online: dict[str, Any], baseline: str) -> list[str]:
    """What a reader of the taus must know: outputs that differ from the target's greedy output (and
    why), fewer prompts than asked, too few for an interval, prompts with no verifying forward."""
    notes = []
    total, proposers = online["num_prompts"], online["proposers"]
    differ = {name: total - p["num_exact"] for name, p in proposers.items() if p["num_exact"] < total}
    if differ:
        dtype = online.get("dtype")
        why = (
            f"the target ran with eval.online_dtype={dtype}: verifying a block and decoding one token at a time "
            f"round near-tied logits differently (ties and rounding change the argmax), and the text after it "
            f"changes; eval.online_dtype=fp32 gives exact outputs"
            if dtype not in (None, "fp32") else
            "in fp32 verification should reproduce it exactly: logits tied to within rounding, or a decoding bug"
        )
        counts = ", ".join(f"{name} on {num} of {total} prompts" for name, num in differ.items())
        notes.append(
            f"outputs differ from the target's greedy output: {counts}. Why: {why}. Those decodes follow other "
            f"texts, so their tau is not measured on the greedy text and a paired difference over them (marked "
            f"'different texts') compares decodes of different texts"
        )
    asked = online.get("num_prompts_asked")
    if asked is not None and asked > total:
        notes.append(f"{_prompts(total)} decoded of the {asked} asked (eval.online_num_prompts): the held-out "
                     f"split has no more samples with a prompt (tokens before their first supervised one)")
    empty = {name: sum(row[1] == 0 for row in p["per_prompt"]) for name, p in proposers.items()}
    if any(empty.values()):
        counts = (f"{max(empty.values())} of {total} prompts" if len(set(empty.values())) == 1 else
                  ", ".join(f"{name} {num} of {total} prompts" for name, num in empty.items() if num))
        notes.append(f"{counts} ended at their first token (the prefill's token ended the turn): no verifying "
                     f"forward, so they are left out of tau and its interval")
    kept = proposers[baseline]["interval"]["num_prompts"]
    if kept < MIN_INTERVAL_PROMPTS:
        notes.append(f"{_prompts(kept)} with a verifying forward: too few for a 95% interval over prompts (it takes "
                     f"{MIN_INTERVAL_PROMPTS}); the taus are point values only")
    return notes


def one_line(report: dict[str, Any], trained: str = "trained") -> str:
    """`eval`'s last line: trained tau [interval] vs untrained vs n-gram (every proposer, `trained`
    first), each with its interval, and on how many prompts its output differed from the target's
    greedy output."""
    if report["online"] is None:
        row = report["offline"].get(trained, {})
        return f"{trained}: offline only (eval.online_num_prompts=0), accept_len {row.get('accept_len', float('nan')):.3f}"
    parts = []
    total = report["online"]["num_prompts"]
    proposers = report["online"]["proposers"]
    for name in [trained, *(n for n in proposers if n != trained)]:
        entry = proposers[name]
        i = entry["interval"]
        text = f"{name} tau {interval_text(i)}, {entry['drafted_per_step']:.1f} drafted/step"
        if entry["num_exact"] < total:
            text += f", output differs from greedy on {total - entry['num_exact']} of {total} prompts"
        if i.get("diff") is not None:
            diff = interval_text(i, "diff", "+.3f") if i.get("diff_lo") is not None else f"{i['diff']:+.3f}"
            text += f" ({diff} vs {trained}{', different texts' if i.get('diff_texts_differ') else ''})"
        parts.append(text)
    return " | ".join(parts)
