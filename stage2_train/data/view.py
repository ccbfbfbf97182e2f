"""Stage 2's view of the feature store: open it, check it against the target, split, batch.

    target = resolve_target(cfg.target)                   # shared.target: the target's record
    data = open_train_data(cfg.store.url(cfg.run_dir), target, cfg.sampler, DataSettings(block_size=16))
    for loaded in data.loader: ...                         # this rank's micro-batches, train split only

The manifest must agree with the target on the schema version, the weight fingerprint, hidden size,
layer count and vocab, the tokenizer and the feature layer ids (from target.layer_ids or the DFlash
rule over the target's layers); a mismatch is a StoreError naming the field. A KL term needs stored
top-k: how many is the manifest's `top_k`, never stage 1's config.

The held-out split is `heldout_mask(reader.split_keys, holdout_fraction, split_seed)`: it depends on
the store's per-sample keys only (each row's opening: copies and rows sharing a first question share one), so
it is the same for any rank count, shard layout or training seed, and no held-out sample ever reaches
the training sampler (`TrainData.train_indices`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.errors import StoreError
from shared.reader import StoreReader
from shared.store import check_manifest_matches
from shared.target import TargetInfo
from stage2_train.data.anchors import AnchorSampler
from stage2_train.data.loader import PrefetchLoader
from stage2_train.data.sampler import LengthMixedSampler, SamplerConfig
from stage2_train.data.split import heldout_mask, spread_over_keys


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

    def read(self, index: int, **kwargs: Any) -> dict[str, Any]:
        return self.reader.read(int(self.indices[index]), **kwargs)

    @property
    def feature_shape(self) -> tuple[int, int] | None:
        return self.reader.feature_shape

    def describe(self, index: int) -> str:
        return self.reader.describe(int(self.indices[index]))

    def order_key(self, index: int) -> tuple[int, int]:
        return self.reader.order_key(int(self.indices[index]))


def expected_manifest(target: TargetInfo) -> dict[str, Any]:
    """Dotted manifest key -> the value this target needs (schema_version is checked on open)."""
    return {
        "target.weights_sha256": target.weights_sha256,
        "target.hidden_size": target.arch.hidden_size,
        "target.num_hidden_layers": target.arch.num_hidden_layers,
        "target.vocab_size": target.arch.vocab_size,
        "tokenizer_sha256": target.tokenizer_sha256,
        "layer_ids": target.layer_ids,
    }


def open_store(
    url: str, target: TargetInfo, *, need_topk: bool = False, options: dict[str, Any] | None = None, hold: str | None = None
) -> StoreReader:
    """The store, refused by field name when it was made for another target, tokenizer or layers
    (or, when the loss needs it, without top-k). Training and evaluation both open it here;
    `options` are StoreReader's (`StoreConfig.reader_options()`). With `hold` (the command), a local
    store is claimed until the reader's `close()`: stage-1 writers are refused while it reads."""
    reader = StoreReader(url, **(options or {}))  # refuses a missing or damaged manifest, or another schema version
    if hold is not None:
        reader.hold(hold)
    try:
        check_store(reader, target, need_topk)
    except BaseException:
        reader.close()
        raise
    return reader


def check_store(reader: StoreReader, target: TargetInfo, need_topk: bool) -> None:
    url = reader.url
    check_manifest_matches(reader.manifest, expected_manifest(target), url)
    if need_topk and not reader.manifest.get("top_k"):
        raise StoreError(
            f"{url}/manifest.json: top_k is {reader.manifest.get('top_k')!r}, but loss.kl_weight > 0, "
            f"loss.full_vocab_slots or model.variant=dspark/dflash2 needs stored top-k; re-extract with "
            f"extract.top_k > 0, or set loss.kl_weight=0 and loss.full_vocab_slots=null"
        )
    if len(reader) == 0:
        raise StoreError(f"{url}: the store holds no samples")


def split_indices(reader: StoreReader, holdout_fraction: float, split_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices ascending, held-out indices one per split key first: `spread_over_keys`) into the
    reader. Rows that share a split key (their opening; in older stores a prompt or content hash)
    always fall on the same side."""
    held = heldout_mask(reader.split_keys, holdout_fraction, split_seed)
    train, heldout = np.flatnonzero(~held), spread_over_keys(reader.split_keys, np.flatnonzero(held))
    if len(train) == 0:
        raise StoreError(f"eval.holdout_fraction={holdout_fraction} leaves no training samples in {reader.url}")
    return train, heldout


@dataclass(frozen=True)
class DataSettings:
    """How stage 2 cuts the store into training batches, beyond the sampler's own config."""

    block_size: int
    seed: int = 0
    holdout_fraction: float = 0.02
    split_seed: int = 0
    gather_topk: bool = False  # collate the stored top-k (the KL term needs it)
    num_threads: int = 2
    prefetch: int = 4
    reader_options: dict[str, Any] | None = None  # StoreReader's (caches)
    pin_memory: bool = False  # pinned, reused host buffers (a CUDA trainer: asynchronous copies)
    grad_accum: int = 1  # train.grad_accum: micro-batches per optimizer step (the trainer holds them on the host at once)
    distill_all: bool = False  # blocks anywhere the target read (loss.distill_positions=all)
    label_shift: int = 0  # 1: slot k predicts anchor + k + 1 (model.variant=dspark)


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
        self.reader.close()


def open_train_data(
    url: str,
    target: TargetInfo,
    sampler_cfg: SamplerConfig,
    settings: DataSettings,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> TrainData:
    # Held for the run (TrainData.close): a `reprocess` meanwhile would replace shards under it.
    reader = open_store(url, target, need_topk=settings.gather_topk, options=settings.reader_options, hold="stage2_train train")
    try:
        return _train_data(reader, target, sampler_cfg, settings, rank, world_size)
    except BaseException:
        reader.close()
        raise


def _train_data(
    reader: StoreReader, target: TargetInfo, sampler_cfg: SamplerConfig, settings: DataSettings, rank: int, world_size: int
) -> TrainData:
    train, heldout = split_indices(reader, settings.holdout_fraction, settings.split_seed)
    train_reader = SubsetReader(reader, train)
    anchors = AnchorSampler(sampler_cfg, block_size=settings.block_size, seed=settings.seed, everywhere=settings.distill_all)
    # Blocks per sample from the manifest's counts (a store that predates them: its loss masks), never its features.
    pairs = None if settings.distill_all else reader.supervised_pairs()[train]
    sampler = LengthMixedSampler(
        sampler_cfg, train_reader.lengths, seed=settings.seed, rank=rank, world_size=world_size,
        grad_accum=settings.grad_accum, blocks=anchors.block_counts(train_reader.lengths, pairs),
    )
    loader = PrefetchLoader(
        train_reader,
        sampler,
        anchors,
        mask_token_id=target.mask_token_id,
        num_threads=settings.num_threads,
        prefetch=settings.prefetch,
        gather_topk=settings.gather_topk,
        pin_memory=settings.pin_memory,
        held_by_consumer=settings.grad_accum,
        distill_all=settings.distill_all,
        label_shift=settings.label_shift,
    )
    return TrainData(target, reader, train, heldout, train_reader, sampler, anchors, loader)
