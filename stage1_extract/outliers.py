"""The outlier channels of an fp4 store (`store.dtype: fp4`, shared/fp4.py): fitted once per store
on the first shard's samples by rank 0, and pinned in plan.json before any shard is written.

    model = ensure_outlier_channels(prepared, header_before, store, extract, target_cfg, device)   # rank 0
    channels_LN = pinned_outlier_channels(files, store, num_layers)          # every rank, after the barrier

Every rank reads the set from plan.json, so every shard of the store (and every resumed, repaired
or reprocessed run, which find it there) is encoded with the same one; merge copies it into the
manifest, and each shard also holds it (`hidden_outlier_channels`), which verify compares. It is
fitted again only when a reprocess changes the store's settings, which rewrites every shard.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from shared.errors import ConfigError, StoreError
from shared.fp4 import check_hidden_size, fit_outlier_channels
from shared.identity import header_differences, header_key
from shared.store import StoreConfig, StoreFiles
from shared.target import TargetConfig
from shared.target_model import LayerCapture, load_target_model
from stage1_extract.batching import token_budget_batches
from stage1_extract.extract import ExtractConfig
from stage1_extract.forward import forward_batch
from stage1_extract.prepare import Prepared, planned_shards

log = logging.getLogger(__name__)

PLAN_KEY = "fp4_outlier_channels"
# Bounds the calibration forward that the other ranks wait for at the plan barrier (~1 s of an 8B
# target on one GPU); mean |x| of the massive-activation channels is settled long before.
FIT_MAX_TOKENS = 65536


def pinned_outlier_channels(files: StoreFiles, store: StoreConfig, num_layers: int) -> np.ndarray | None:
    """The store's channel set, int32 [L, N], from plan.json; None unless store.dtype is fp4."""
    if store.dtype != "fp4":
        return None
    count = store.fp4_outlier_channels
    pinned = files.read_json("plan.json").get(PLAN_KEY)
    if pinned is None:
        raise StoreError(
            f"{files.url}/plan.json holds no fp4 outlier channels (rank 0 fits them before any shard is written, and "
            f"failed or was stopped first); rerun `python -m stage1_extract extract`"
        )
    channels = np.asarray(pinned["channels"], dtype=np.int32)
    if channels.shape != (num_layers, count):
        raise StoreError(
            f"{files.url}/plan.json: the fp4 outlier channels are {list(channels.shape)} (layers x channels), the config "
            f"asks {num_layers} x {count}; run `python -m stage1_extract reprocess`"
        )
    return channels


def ensure_outlier_channels(
    prepared: Prepared,
    header_before: dict[str, Any] | None,
    store: StoreConfig,
    extract: ExtractConfig,
    target_cfg: TargetConfig,
    device: str,
) -> Any:
    """Rank 0, after the plan is pinned: fit and pin the channel set unless plan.json holds one for
    these settings. Returns the target when it loaded one (the caller extracts with it), else None."""
    files = prepared.files
    plan = files.read_json("plan.json")
    changed = header_before is not None and header_differences(
        {k: header_before.get(k) for k in prepared.header}, prepared.header
    )
    # The set records the header it was fitted under: a reprocess that repinned the header and was
    # stopped before the fit (the target failed to load) leaves the old set beside the new header,
    # and the rerun, seeing no change of header, would encode every shard with channels fitted on other
    # layers or another target.
    key = header_key(prepared.header)
    fitted_for = (plan.get(PLAN_KEY) or {}).get("header_key")
    if plan.get(PLAN_KEY) is not None and not changed and fitted_for in (None, key):
        return None
    hidden_size, count = prepared.header["target"]["hidden_size"], store.fp4_outlier_channels
    problem = check_hidden_size(hidden_size, count)
    if problem:
        raise ConfigError(f"store.dtype=fp4: {problem}; use store.dtype=fp8")
    shard = next(s for s in planned_shards(prepared, store) if s.kept)
    rows, tokens = [], 0
    for row in shard.kept:
        if rows and tokens + len(row.input_ids) > FIT_MAX_TOKENS:
            break
        rows.append(row)
        tokens += len(row.input_ids)
    settings = prepared.header["extraction"]  # the store's settings, as the extraction loop loads the target
    model = load_target_model(
        target_cfg, device, dtype=settings["compute_dtype"], attn_implementation=settings["attn_implementation"]
    )
    abs_sum_LH = np.zeros((len(prepared.layer_ids), hidden_size), dtype=np.float64)
    capture = LayerCapture(model, prepared.layer_ids)
    try:
        for batch in token_budget_batches(rows, extract.batch_tokens, extract.max_samples_per_batch):
            for hidden_TLH, _, _ in forward_batch(model, capture, batch, extract.top_k, extract.lm_head_chunk_tokens, settings["packed"]):
                abs_sum_LH += hidden_TLH.float().abs().sum(dim=0).cpu().numpy()
    finally:
        capture.close()
    channels = fit_outlier_channels(abs_sum_LH, count)
    plan[PLAN_KEY] = {"channels": channels.tolist(), "fitted_on": {"shard": shard.index, "samples": len(rows), "tokens": tokens},
                      "header_key": key}
    files.write_json("plan.json", plan)
    log.info("fp4: outlier channels fitted on %d tokens of shard %d: %s", tokens, shard.index, channels.tolist())
    return model
