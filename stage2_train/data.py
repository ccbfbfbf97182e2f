"""Stage 2's view of the feature store: open it, check it against the config, split, batch.

    data = open_train_data(cfg, rank=0, world_size=1)      # refuses a store that does not match
    for loaded in data.loader: ...                         # this rank's micro-batches, train split only

The manifest must agree with the config on the schema version, the target's weight fingerprint,
hidden size, layer count and vocab, the tokenizer, the feature layer ids (from target.layer_ids or
the DFlash rule over the target's layers) and, when the KL term is used, the stored top-k
(extract.top_k when the config has it); a mismatch is a StoreError naming the field.

The held-out split is `heldout_mask(sample_ids, eval.holdout_fraction, eval.split_seed)`: it depends
on sample ids only, so it is the same for any rank count, shard layout or training seed, and no
held-out sample ever reaches the training sampler (`TrainData.train_indices`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from shared.config import RunConfig, Section
from shared.store import StoreReader, check_manifest_matches
from shared.target import (
    TargetArch,
    TargetConfig,
    default_mask_token_id,
    load_tokenizer,
    resolve_layer_ids,
    resolve_target_dir,
    tokenizer_fingerprints,
    weights_fingerprint,
)
from stage2_train.anchors import AnchorSampler
from stage2_train.loader import PrefetchLoader
from stage2_train.sampler import LengthMixedSampler
from stage2_train.split import heldout_mask


@dataclass(kw_only=True)
class EvalConfig(Section):
    """The held-out split and the evaluations on it (`stage2_train/evaluate.py` reads the same keys)."""

    section: ClassVar[str] = "eval"
    holdout_fraction: float = 0.02  # share of samples (by id) never trained on
    split_seed: int = 0  # fixes the split independently of the training seed
    every_steps: int = 0  # offline eval during training every N optimizer steps; 0 = only at the end
    offline_max_samples: int = 16  # held-out samples scored by the offline eval
    offline_max_anchors_per_seq: int | None = None  # None: every anchor (gives walk_tau; dearer)
    offline_token_budget: int = 8192  # tokens per offline-eval forward
    online_num_prompts: int = 8  # `eval` command: held-out prompts decoded speculatively
    online_max_new_tokens: int = 64

    def validate(self) -> None:
        self.require(0.0 <= self.holdout_fraction < 1.0, "holdout_fraction", "must be in [0, 1)")
        self.require(self.every_steps >= 0, "every_steps", "must be >= 0")
        self.require(self.offline_max_samples >= 1, "offline_max_samples", "must be >= 1")
        self.require(
            self.offline_max_anchors_per_seq is None or self.offline_max_anchors_per_seq >= 1,
            "offline_max_anchors_per_seq",
            "must be >= 1 or null (every anchor)",
        )
        self.require(self.offline_token_budget >= 1, "offline_token_budget", "must be >= 1")
        self.require(self.online_num_prompts >= 0, "online_num_prompts", "must be >= 0")
        self.require(self.online_max_new_tokens >= 1, "online_max_new_tokens", "must be >= 1")


def store_url(cfg: RunConfig) -> str:
    """store.path, or the stage-1 default run_dir/store."""
    return cfg.store.path or str(Path(cfg.run_dir) / "store")


class SubsetReader:
    """A StoreReader restricted to some sample indices (the training split), same interface."""

    def __init__(self, reader: StoreReader, indices: np.ndarray):
        self.reader = reader
        self.indices = np.asarray(indices, dtype=np.int64)
        self.lengths = reader.lengths[self.indices]
        self.sample_ids = reader.sample_ids[self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.reader[int(self.indices[index])]


@dataclass
class TargetInfo:
    """What stage 2 needs to know about the target (read from its folder, never the full model)."""

    target_dir: Path
    arch: TargetArch
    layer_ids: list[int]
    mask_token_id: int
    weights_sha256: str
    tokenizer_sha256: str


@functools.lru_cache(maxsize=4)
def tokenizer_and_hash(target_dir: str) -> tuple[Any, str]:
    """Loading a tokenizer and hashing its vocabulary takes a second or two; do it once per folder."""
    tokenizer = load_tokenizer(TargetConfig(path=target_dir))
    return tokenizer, tokenizer_fingerprints(tokenizer)["tokenizer_sha256"]


def resolve_target(cfg: RunConfig) -> TargetInfo:
    target_dir = resolve_target_dir(cfg.target)
    arch = TargetArch.from_dir(target_dir)
    tokenizer, tokenizer_sha256 = tokenizer_and_hash(str(target_dir))
    return TargetInfo(
        target_dir=target_dir,
        arch=arch,
        layer_ids=resolve_layer_ids(cfg.target, arch),
        mask_token_id=default_mask_token_id(cfg.target, arch, tokenizer),
        weights_sha256=weights_fingerprint(target_dir),
        tokenizer_sha256=tokenizer_sha256,
    )


def expected_manifest(cfg: RunConfig, target: TargetInfo, kl_weight: float = 0.0) -> dict[str, Any]:
    """Dotted manifest key -> the value this config needs (schema_version is checked on open)."""
    expected: dict[str, Any] = {
        "target.weights_sha256": target.weights_sha256,
        "target.hidden_size": target.arch.hidden_size,
        "target.num_hidden_layers": target.arch.num_hidden_layers,
        "target.vocab_size": target.arch.vocab_size,
        "tokenizer_sha256": target.tokenizer_sha256,
        "layer_ids": target.layer_ids,
    }
    extract = getattr(cfg, "extract", None)
    if kl_weight > 0 and isinstance(extract, dict) and "top_k" in extract:
        expected["top_k"] = extract["top_k"]
    return expected


def open_store(cfg: RunConfig, target: TargetInfo, kl_weight: float = 0.0) -> StoreReader:
    """The store, refused by field name when it was made for another target, tokenizer or layers
    (or, with a KL term, without top-k). Training and evaluation both open it here."""
    url = store_url(cfg)
    reader = StoreReader(url)  # refuses a missing manifest or another schema version
    check_manifest_matches(reader.manifest, expected_manifest(cfg, target, kl_weight), url)
    if kl_weight > 0 and not reader.manifest.get("top_k"):
        raise ValueError(f"loss.kl_weight={kl_weight} needs stored top-k, but {url} has top_k=0")
    if len(reader) == 0:
        raise ValueError(f"{url}: the store holds no samples")
    return reader


def split_indices(reader: StoreReader, cfg: EvalConfig) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices) into the reader, both ascending."""
    held = heldout_mask(reader.sample_ids, cfg.holdout_fraction, cfg.split_seed)
    train, heldout = np.flatnonzero(~held), np.flatnonzero(held)
    if len(train) == 0:
        raise ValueError(f"eval.holdout_fraction={cfg.holdout_fraction} leaves no training samples")
    return train, heldout


@dataclass
class TrainData:
    target: TargetInfo
    reader: StoreReader
    train_indices: np.ndarray  # into `reader`
    heldout_indices: np.ndarray  # into `reader`
    train_reader: SubsetReader
    sampler: LengthMixedSampler
    anchors: AnchorSampler
    loader: PrefetchLoader

    def close(self) -> None:
        self.loader.close()


def open_train_data(
    cfg: RunConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    target: TargetInfo | None = None,
    num_threads: int = 2,
    prefetch: int = 4,
) -> TrainData:
    target = target or resolve_target(cfg)
    reader = open_store(cfg, target, cfg.loss.kl_weight)
    train, heldout = split_indices(reader, cfg.eval)
    train_reader = SubsetReader(reader, train)
    sampler = LengthMixedSampler(cfg.sampler, train_reader.lengths, seed=cfg.seed, rank=rank, world_size=world_size)
    anchors = AnchorSampler(cfg.sampler, block_size=cfg.model.block_size, seed=cfg.seed)
    loader = PrefetchLoader(
        train_reader,
        sampler,
        anchors,
        mask_token_id=target.mask_token_id,
        num_threads=num_threads,
        prefetch=prefetch,
        gather_topk=cfg.loss.kl_weight > 0,
    )
    return TrainData(target, reader, train, heldout, train_reader, sampler, anchors, loader)

