"""What a saved drafter was trained on, read back wherever it is used: the held-out split and the store.

    record = read_trained_on(step_dir_or_folder)          # None when nothing was recorded
    fraction, seed, notes = heldout_split(cfg, record)     # the split `eval` scores: the drafter's own
    other_store(record, manifest)                          # None, or why this store is not the one trained on

A checkpoint saves its run's resolved config (train/state.py `RunRecord`: eval.holdout_fraction,
eval.split_seed, resolved.store_digest); an export copies those three into its config.json
(`dflash_pipeline.training`). A held-out set cut with another fraction or seed holds samples the
drafter trained on, so `eval` always uses the drafter's own split: a value given on the command line
that contradicts it is refused naming both, one from a config file is ignored with a note (the policy
of `model.*` values, commands.py `_saved_drafter`). A store of other contents (reprocessed, or
another one) is refused by `eval` unless eval.allow_other_store, and a model card states the store's
figures only when it is the one trained on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.config import RunConfig
from shared.errors import ConfigError
from stage2_train.train.checkpoint.format import saved_run_config
from stage2_train.train.state import store_digest

TRAINING_KEY = "training"  # config.json's dflash_pipeline.training
SPLIT_KEYS = ("holdout_fraction", "split_seed")


@dataclass(frozen=True)
class TrainedOn:
    where: str  # what recorded it: a checkpoint step folder, or an export's config.json
    holdout_fraction: float | None = None
    split_seed: int | None = None
    store_digest: str | None = None
    # The chat template's variables its data was rendered with (`data.chat_template_kwargs`: Qwen3's
    # enable_thinking), which its prompts must be rendered with wherever it is decoded; None = none set.
    chat_template_kwargs: dict[str, Any] | None = None
    # Where that store was (a checkpoint's resolved.store; an export records no machine path): None unknown.
    store: str | None = None
    # The loss.gamma it trained with, which weights its held-out cross-entropy (`drafter_gamma`): None unknown.
    loss_gamma: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """What an export records (`dflash_pipeline.training`)."""
        return {"holdout_fraction": self.holdout_fraction, "split_seed": self.split_seed, "store_digest": self.store_digest,
                **({"chat_template_kwargs": self.chat_template_kwargs} if self.chat_template_kwargs else {}),
                **({"loss_gamma": self.loss_gamma} if self.loss_gamma is not None else {})}


def read_trained_on(path: str | Path) -> TrainedOn | None:
    """The record of a checkpoint step folder (its saved run config) or of a drafter folder (config.json's
    `dflash_pipeline.training`); None when there is none (a published drafter, a bare checkpoint)."""
    path = Path(path)
    folder = path.parent if path.is_file() else path
    if (folder / "meta.json").is_file():
        saved = saved_run_config(folder)
        if saved is None:
            return None
        split, resolved = saved.get("eval") or {}, saved.get("resolved") or {}
        return TrainedOn(str(folder), *(split.get(k) for k in SPLIT_KEYS), resolved.get("store_digest"),
                         (saved.get("data") or {}).get("chat_template_kwargs") or None, resolved.get("store"),
                         (saved.get("loss") or {}).get("gamma"))
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    training = (config.get("dflash_pipeline") or {}).get(TRAINING_KEY) if isinstance(config, dict) else None
    if not isinstance(training, dict):
        return None
    return TrainedOn(f"{config_path} (dflash_pipeline.{TRAINING_KEY})", *(training.get(k) for k in SPLIT_KEYS), training.get("store_digest"),
                     training.get("chat_template_kwargs") or None, loss_gamma=training.get("loss_gamma"))


def heldout_split(cfg: RunConfig, record: TrainedOn | None) -> tuple[float, int, list[str]]:
    """(holdout_fraction, split_seed) to evaluate `record`'s drafter on: its own where recorded, else
    the config's; and a note for each config-file value that was ignored. A command-line value
    (cfg.overridden) that contradicts the record is refused naming both."""
    values: dict[str, Any] = {}
    refused, notes = [], []
    for key in SPLIT_KEYS:
        mine = getattr(cfg.eval, key)
        saved = None if record is None else getattr(record, key)
        values[key] = mine if saved is None else saved
        if saved is None or saved == mine:
            continue
        if f"eval.{key}" in cfg.overridden:
            refused.append(f"eval.{key}: the drafter was trained with {saved}, the command line gives {mine}")
        else:
            notes.append(f"eval.{key}: the drafter was trained with {saved}, the config gives (ignored) {mine}")
    if refused:
        raise ConfigError(
            f"{record.where} was trained with another held-out split than the command line gives: " + "; ".join(refused)
            + ". Another split would score samples it trained on, so eval uses the drafter's own: drop those overrides"
        )
    return float(values["holdout_fraction"]), int(values["split_seed"]), notes


def drafter_gamma(cfg: RunConfig, record: TrainedOn | None, block_size: int) -> tuple[float, list[str]]:
    """The gamma that weights a saved drafter's held-out cross-entropy: the loss.gamma it trained with
    (its run's evals reported ce so), else the published one for its block size, else the config's;
    and a note when the config's loss.gamma, which would have weighted it, differs. The config's was
    used: a drafter trained with loss.gamma=5 scored under a config of 7 gave another ce than its
    own evals, for the same weights and held-out samples."""
    from stage2_train.model.config import recipe_gamma

    own = record.loss_gamma if record is not None and record.loss_gamma is not None else recipe_gamma(block_size)
    if own is None or own == cfg.loss.gamma:
        return cfg.loss.gamma, []
    why = f"the drafter was trained with {own:g} ({record.where})" if record is not None and record.loss_gamma is not None \
        else f"{own:g} is the published value for its block size {block_size} (its training's is not recorded)"
    return float(own), [f"loss.gamma: the held-out ce is weighted with the drafter's own: {why}; the config gives (ignored) {cfg.loss.gamma:g}"]


def init_split_problem(cfg: RunConfig, record: TrainedOn | None, manifest: dict[str, Any]) -> str | None:
    """Why a run starting from `record`'s drafter (model.init_from) on the store of `manifest` would
    score samples that drafter trained on as held-out, or None. With another split, its held-out
    samples include that drafter's training samples: on the same store, and on another that shares its
    rows (the same store reprocessed with rows appended: the usual reason to start from one's own
    drafter). Every held-out figure of the new run (its evals, `eval`, an export's card) would be
    inflated with no sign of it. Another store is judged by the split keys of the store the drafter was
    trained on where that is still readable here, else refused (whether they share rows is unknown)."""
    if record is None or record.store_digest is None:
        return None
    theirs = {k: getattr(record, k) for k in SPLIT_KEYS}
    mine = {k: getattr(cfg.eval, k) for k in SPLIT_KEYS}
    if None in theirs.values():
        return None
    if theirs == mine:
        return _moved_by_store(record, manifest, mine)
    split = f"eval.holdout_fraction={theirs['holdout_fraction']}, eval.split_seed={theirs['split_seed']} (recorded in {record.where})"
    fix = (f"Set eval.holdout_fraction={theirs['holdout_fraction']} eval.split_seed={theirs['split_seed']} to keep its held-out "
           f"samples unseen")
    ours = f"this run's split (holdout_fraction={mine['holdout_fraction']}, split_seed={mine['split_seed']})"
    other = other_store(record, manifest)
    if other is None:
        return f"model.init_from: that drafter was trained on this store with {split}; {ours} would hold out samples it trained on. {fix}"
    leaked = _trained_heldout(record, manifest, mine)
    if leaked == 0:
        return None
    if leaked is not None:
        return (f"model.init_from: that drafter was trained on {record.store} with {split}; {leaked} sample(s) of this store "
                f"that {ours} holds out are rows it trained on there. {fix}")
    return (
        f"model.init_from: that drafter was trained on another store ({other}) with {split}; {ours} would hold out "
        f"any row this store shares with that one that it trained on (a store reprocessed with rows appended shares them "
        f"all), and that store ({record.store or 'its path not recorded'}) cannot be read here as it was (moved, deleted "
        f"or reprocessed since) to tell. {fix} (a store sharing no row with it is split as well by it)"
    )


def _moved_by_store(record: TrainedOn, manifest: dict[str, Any], split: dict[str, Any]) -> str | None:
    """With the drafter's own split on another store, the samples of that store it holds out that the
    drafter trained on in its own store where that is readable: the same split settings cut another
    split when the stores key their rows otherwise (a store made before identity version 7 judges a
    generic opening by its share of the store, so rows appended to it move others; a new store made
    from its rows judges it by a fixed count, `shared/reader.py` generic_threshold)."""
    from shared.reader import GENERIC_OPENING_MIN

    if other_store(record, manifest) is None:
        return None
    leaked = _trained_heldout(record, manifest, split)
    if not leaked:
        return None  # None: not readable as it was; a store keyed as the drafter's one moves no row
    return (
        f"model.init_from: that drafter was trained on {record.store} with the same split (holdout_fraction="
        f"{split['holdout_fraction']}, split_seed={split['split_seed']}, recorded in {record.where}), yet {leaked} sample(s) of "
        f"this store that it holds out are rows it trained on there: the two stores key their rows otherwise (an opening "
        f"shared by more than {GENERIC_OPENING_MIN} rows is split by its share of a store made before identity version 7, by "
        f"a fixed count from 7), so every held-out figure of this run would count them. Train without model.init_from, or on the store "
        f"it was trained on ({record.store})"
    )


def _trained_heldout(record: TrainedOn, manifest: dict[str, Any], split: dict[str, Any]) -> int | None:
    """How many samples of the store of `manifest` that `split` holds out share their split key, or are
    the same row (prompt or tokens: where the stores key a row otherwise, its split keys differ), with a
    sample `record`'s drafter trained on in its own store; None when that store is not readable here
    as it was (moved, deleted, or reprocessed since)."""
    import numpy as np

    from shared.errors import StoreError
    from shared.reader import content_keys
    from shared.shard_records import duplicate_hashes
    from shared.store import read_manifest
    from stage2_train.data.split import heldout_mask

    if not record.store:
        return None
    try:
        then = read_manifest(record.store)
    except StoreError:
        return None
    if store_digest(then) != record.store_digest:
        return None

    def keys(made: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        ids = np.concatenate([np.asarray(r["sample_ids"], dtype=np.int64) for r in made["shards"]]) if made["shards"] else np.zeros(0, np.int64)
        rows = duplicate_hashes(made["shards"])
        return content_keys(made["shards"], ids, made.get("identity_version")), np.asarray(rows[1] if rows else [], dtype=object)

    (trained_keys, trained_rows), (now, now_rows) = keys(then), keys(manifest)
    trained = ~heldout_mask(trained_keys, record.holdout_fraction, record.split_seed)
    held = heldout_mask(now, split["holdout_fraction"], split["split_seed"])
    leaked = np.isin(now[held], trained_keys[trained])
    if len(trained_rows) and len(now_rows):
        leaked |= np.isin(now_rows[held], trained_rows[trained])
    return int(leaked.sum())


def other_store(record: TrainedOn | None, manifest: dict[str, Any]) -> str | None:
    """Why the store of `manifest` is not the one `record`'s drafter was trained on, or None (the same
    store, or nothing recorded to compare with)."""
    if record is None or not record.store_digest:
        return None
    digest = store_digest(manifest)
    if digest == record.store_digest:
        return None
    return f"store digest {digest}, the drafter was trained on {record.store_digest} (recorded in {record.where})"
