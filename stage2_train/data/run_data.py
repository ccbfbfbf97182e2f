"""A run's training data from its config: the store checked against the target, the split, the
sampler and the loader; and the one rule that keeps every DDP rank's micro-batch trainable.

    data = open_run_data(cfg, rank=rank, world_size=world)      # the trainer and the `batches` dry run
    batch = with_a_block(loaded.batch, data.target.mask_token_id)
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from shared.config import RunConfig
from shared.errors import ConfigError
from shared.mask_token import check_mask_token
from shared.target import resolve_target
from stage2_train.data.batch import IGNORE, DrafterBatch
from stage2_train.data.view import DataSettings, TrainData, open_train_data

log = logging.getLogger(__name__)


def open_run_data(
    cfg: RunConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    num_threads: int | None = None,
    prefetch: int | None = None,
    pin_memory: bool = False,
) -> TrainData:
    """The training data of a run config (store checked against the target, split, sampler, loader),
    refusing a block size no sample can fill."""
    settings = DataSettings(
        block_size=cfg.model.block_size,
        seed=cfg.seed,
        holdout_fraction=cfg.eval.holdout_fraction,
        split_seed=cfg.eval.split_seed,
        gather_topk=cfg.loss.needs_topk or cfg.model.reads_topk,
        label_shift=cfg.model.label_shift,
        num_threads=num_threads or cfg.train.num_data_threads,
        prefetch=prefetch or cfg.train.prefetch_micro_batches,
        reader_options=cfg.store.reader_options(),
        pin_memory=pin_memory,
        grad_accum=cfg.train.grad_accum,
        distill_all=cfg.loss.distill_positions == "all",
    )
    url = cfg.store.url(cfg.run_dir)
    target = resolve_target(cfg.target)
    check_mask_token(cfg.target, target)
    data = open_train_data(url, target, cfg.sampler, settings, rank=rank, world_size=world_size)
    longest = int(data.reader.lengths.max())
    if cfg.model.block_size > longest:
        data.close()
        raise ConfigError(
            f"model.block_size={cfg.model.block_size} is longer than every sample of {url} (the longest has "
            f"{longest} tokens, data.max_length was {data.reader.manifest.get('max_length')}): no block could "
            f"fill its slots; use a block size of at most {longest} (published drafters: 16)"
        )
    if rank == 0 and cfg.eval.holdout_fraction > 0 and len(data.heldout_indices) == 0:
        # Said before the run, not by `eval` after it: the split is the drafter's for good.
        log.warning("eval.holdout_fraction=%s holds out none of the %d samples of %s: this run is never scored on samples it "
                    "did not train on, and `python -m stage2_train eval` will have none; raise eval.holdout_fraction (to %.2g: "
                    "about 3 samples) or extract more data", cfg.eval.holdout_fraction, len(data.reader), url,
                    min(0.5, max(0.05, 3 / max(1, len(data.reader)))))
    return data


def with_a_block(batch: DrafterBatch, mask_token_id: int) -> DrafterBatch:
    """The batch itself, or, when none of its samples yields a block (answers shorter than a block),
    the batch plus one unscored block: every rank must run forward and backward for DDP to reduce,
    and a block whose labels are all IGNORE adds nothing to the loss, the gradients or the metrics."""
    if batch.labels_NB.shape[0] > 0:
        return batch
    B = batch.labels_NB.shape[1]
    topk = {}
    if batch.topk_ids_NBK is not None:
        K = batch.topk_ids_NBK.shape[-1]
        topk = {"topk_logprobs_NBK": torch.zeros(1, B, K), "topk_ids_NBK": torch.zeros(1, B, K, dtype=torch.long)}
    return replace(
        batch,
        block_ids_NB=torch.full((1, B), mask_token_id, dtype=torch.long),
        block_seq_N=torch.zeros(1, dtype=torch.long),
        anchor_pos_N=torch.zeros(1, dtype=torch.long),
        labels_NB=torch.full((1, B), IGNORE, dtype=torch.long),
        scored_M=torch.zeros(0, dtype=torch.long),
        scored_per_slot=(0,) * B,
        prev_ids_NB=None if batch.prev_ids_NB is None else torch.full((1, B), mask_token_id, dtype=torch.long),
        supervised_NB=None if batch.supervised_NB is None else torch.zeros(1, B, dtype=torch.bool),
        continues_N=None if batch.continues_N is None else torch.zeros(1, dtype=torch.bool),
        **topk,
    )


