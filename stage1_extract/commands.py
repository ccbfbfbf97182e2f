"""Stage 1's verbs: download, extract, reprocess, verify here; generate in `generate_command.py`, plan
in `plan.py`, status in `status.py` (named here too, so `commands` holds every verb).

Each takes the composed RunConfig, resolves what its steps need once (`resolve.py`: the target's
record, the store's header and files, the tokenized rows) and hands those steps sections and records,
never the RunConfig; it returns a JSON-able dict, which `__main__` prints.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.config import RunConfig
from shared.errors import ConfigError, DataError, StoreError
from shared.identity import AUTO_SETTINGS, header_changes, header_key
from shared.paths import RunPaths
from shared.store import StoreConfig, StoreFiles
from shared.target import TargetConfig
from shared.target_model import load_target_model, resolve_device, runnable_problem
from shared.token_cache import TOKENS_VERSION
from stage1_extract.batching import ShardPlan, plan_shards, windows_for_rank
from stage1_extract.distributed import (
    agreed_done,
    all_ok,
    distributed_context,
    from_rank_0,
    join_ranks,
    leave_ranks,
    on_rank_0,
    rank_device,
    store_lock,
    wait_for_ranks,
)
from stage1_extract.extract import ExtractConfig, run_shards
from stage1_extract.forward import check_output_head, check_packed_forward
from stage1_extract.generate_command import cmd_generate  # noqa: F401  (a verb: `commands` names them all)
from stage1_extract.header import SETTING_OF, load_or_pin_plan, other_data_problem, plan_problem
from stage1_extract.merge import done_shards, merge_manifest, part_path, part_records, row_accounting
from stage1_extract.outliers import ensure_outlier_channels, pinned_outlier_channels
from stage1_extract.plan import cmd_plan  # noqa: F401  (a verb: `commands` names them all)
from stage1_extract.prepare import Prepared, check_space, discard_token_cache, shard_size
from stage1_extract.resolve import prepare_run, resolve_store
from stage1_extract.status import cmd_status, shard_report  # noqa: F401  (a verb: `commands` names them all)
from stage1_extract.tensor_parallel import (
    Layout,
    check_split,
    launch_problem,
    layout,
    local_world_size,
    process_group_backend,
    split_arguments,
    tensor_parallel_mesh,
)
from stage1_extract.verify import REBUILD, check_store

log = logging.getLogger(__name__)


def cmd_download(cfg: RunConfig) -> dict[str, Any]:
    """Fetch the Hub ids the config names, target.path and model.init_from, into the local Hugging
    Face cache: the one command that fetches from the Hub (every other one reads the cache; only `export
    --push-to-hub` uploads, and W&B syncs when online)."""
    from shared.hub import download, is_hub_id

    fetched = {}
    for setting in ("target.path", "model.init_from"):
        value = cfg.value(setting)
        if isinstance(value, str) and is_hub_id(value):
            log.info("downloading %s=%s", setting, value)
            snapshot = download(value, setting)
            fetched[setting] = {**snapshot.record(), "folder": str(snapshot.folder)}
    if not fetched:
        return {"downloaded": {}, "note": "target.path and model.init_from name no Hub id (org/name[@revision]): nothing to fetch"}
    return {"downloaded": fetched}


def cmd_extract(cfg: RunConfig, force: bool = False, progress: bool = True, reprocess: bool = False) -> dict[str, Any]:
    rank, world, local_rank = distributed_context()
    _join(cfg, rank, world)
    try:
        with store_lock(RunPaths.of(cfg).store, rank, world, "reprocess" if reprocess else "extract") as lock:
            return {**_extract(cfg, force, progress and rank == 0, rank, world, local_rank, reprocess), "lock": lock}
    finally:
        leave_ranks(world)


def _join(cfg: RunConfig, rank: int, world: int) -> None:
    """The launch checked, then the job's process group joined (a no-op when already joined)."""
    tensor_parallel = layout(rank, world, cfg.extract.tensor_parallel_size, local_world_size())  # before any collective
    problem = launch_problem(tensor_parallel.tp, world, f"the {world} processes of this job")
    if problem is not None:  # on every rank, before one tokenizes a row or pins the size in plan.json
        raise ConfigError(problem)
    # Barriers and agreements travel over gloo (CPU tensors); a tensor-parallel target's activations over NCCL.
    join_ranks(world, process_group_backend(resolve_device(cfg.extract.device), tensor_parallel.tp))


def _extract(
    cfg: RunConfig, force: bool, progress: bool, rank: int, world: int, local_rank: int, reprocess: bool
) -> dict[str, Any]:
    """The verb's work under the store lock: resolve and tokenize once, pin the plan, then hand the
    extraction its sections."""
    started = time.perf_counter()
    prepared = _prepare_all_ranks(cfg, rank, world, local_rank)
    if prepared.generated_problem is not None:  # every rank: each prepared the same inputs
        raise DataError(prepared.generated_problem)
    prepare_seconds = time.perf_counter() - started
    shards, samples_per_shard, model, records = _pin_plan(cfg, prepared, rank, world, reprocess, local_rank)
    return extract_store(
        prepared, shards, samples_per_shard, cfg.store, cfg.extract, cfg.target, (rank, world, local_rank),
        force=force, progress=progress, prepare_seconds=prepare_seconds, model=model, records=records,
    )


def _prepare_all_ranks(cfg: RunConfig, rank: int, world: int, local_rank: int) -> Prepared:
    """Tokenize each row once per cache folder: global rank 0 first (in parallel processes) and
    caches; then each other node's local rank 0, which finds that cache if the folder is shared
    or builds its node's own if data.cache_dir is node-local; then everyone else reads it. Every
    rank reaches every barrier, also on bad input: the others then meet the same error themselves."""
    phase = 0 if rank == 0 else 1 if local_rank == 0 else 2
    prepared, error = None, None
    for turn in range(3):
        if turn == phase:
            try:
                prepared = prepare_run(cfg)
            except BaseException as exc:  # noqa: BLE001 - raised after the last barrier
                error = exc
        wait_for_ranks(world)
    if error is not None:
        raise error
    return prepared


def _pin_plan(
    cfg: RunConfig, prepared: Prepared, rank: int, world: int, reprocess: bool, local_rank: int
) -> tuple[list[ShardPlan], int, Any, dict[int, dict[str, Any]] | None]:
    """Rank 0 pins samples_per_shard (the computed size, not the first shard's, which a short first
    run would make small forever), reads the part records and (extract, not reprocess) refuses shards
    made from other rows, saves the resolved config beside the store and, for fp4, pins the outlier
    channels (a bounded forward the others wait for); every rank learns rank 0's verdict at once,
    then checks the pinned header and plans the shards: (the shards, samples_per_shard, the target
    when rank 0 loaded it to fit the channels, the part records rank 0 read)."""
    files, model, records, error, per = prepared.files, None, None, None, None
    if rank == 0:
        try:
            before = files.read_json("plan.json")["header"] if files.exists("plan.json") else None
            per = load_or_pin_plan(files, prepared.header, shard_size(prepared, cfg.store), len(prepared.rows), repin=reprocess)
            planned = plan_shards(prepared.rows, per, header_key(prepared.header))
            records = part_records(files, planned, beyond_plan=True)
            problem = None if reprocess else other_data_problem(files, planned, records, prepared.source)
            if problem is not None:
                raise StoreError(problem)
            if "://" not in files.url:
                cfg.write_resolved(Path(files.url) / "extract_config.yaml")
            if cfg.store.dtype == "fp4":
                device = rank_device(cfg.extract.device, local_rank)
                model = ensure_outlier_channels(prepared, before, cfg.store, cfg.extract, cfg.target, device)
        except BaseException as exc:  # noqa: BLE001 - raised after the agreement, which every rank reaches
            error = exc
    if not all_ok(world, error is None, behind_work=True):
        if error is not None:
            raise error
        raise StoreError(f"{files.url}: rank 0 refused to extract into it (its error says why)")
    # Rank 0 read the plan and checked the header against it; a rank that cannot see plan.json yet
    # would pin another one (0 samples per shard) over it. Rank 0 reads nothing again here: an error
    # after the agreement would leave the others waiting in the broadcast.
    samples_per_shard = from_rank_0(per, world)
    # Each rank resolved the auto settings on its own node (flash-attn importable, native bf16): one that
    # differs from rank 0's pinned header would store its windows under another, found only by the merge.
    differs = header_changes(from_rank_0(prepared.header if rank == 0 else None, world), prepared.header)
    if not all_ok(world, not differs, behind_work=True):
        field_name, (pinned, here) = next(iter(differs.items()), (None, (None, None)))
        raise ConfigError(
            f"rank {rank} resolved {field_name}={here!r}, rank 0 {pinned!r} (its node differs); set it explicitly "
            f"({SETTING_OF.get(field_name, field_name)}={pinned}) so every node extracts alike" if differs else
            f"{files.url}: another rank resolved other settings than rank 0 (its error names them); nothing was extracted")
    return plan_shards(prepared.rows, samples_per_shard, header_key(prepared.header)), samples_per_shard, model, records


def extract_store(
    prepared: Prepared,
    shards: list[ShardPlan],
    samples_per_shard: int,
    store: StoreConfig,
    extract: ExtractConfig,
    target_cfg: TargetConfig,
    ranks: tuple[int, int, int],
    *,
    force: bool,
    progress: bool,
    prepare_seconds: float,
    model: Any = None,
    records: dict[int, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Extract this rank's shards not yet done (`ranks`: rank, world size, local rank), then rank 0
    merges the manifest. `model`: the target when rank 0 already loaded it (fp4's channel fit);
    `records`: the part records when this rank read them already (one read per record on an object store)."""
    rank, world, local_rank = ranks
    lay = layout(rank, world, extract.tensor_parallel_size)
    files = prepared.files
    # Rank 0's channel set on every rank: a rank reading a stale plan.json would encode with another.
    # Its reading is agreed first, so a refusal (no channels, another count) reaches every rank.
    channels = from_rank_0(on_rank_0(rank, world, lambda: pinned_outlier_channels(files, store, len(prepared.layer_ids)),
                                     f"{files.url}: rank 0 could not read the fp4 outlier channels (its error says why)"), world)
    done = agreed_done(done_shards(files, shards, records) if rank == 0 or world == 1 else set(), len(shards), world)
    # Rank 0 decides (ranks on other nodes see other disks' free space), and every rank learns it.
    on_rank_0(rank, world, lambda: check_space(prepared, store, shards, done, force),
              f"{files.url}: rank 0 found too little free space for the shards left (its error says how much)")
    # A tensor-parallel group (consecutive ranks) shares its windows: the data-parallel place is the group's.
    windows = windows_for_rank(shards, extract.window_shards, lay.dp_rank, lay.dp_size)
    mine = [s for w in windows for s in w if s.index not in done]
    result, mesh = None, None
    if lay.tp > 1:  # the mesh's groups are made by every rank, also those with nothing left to extract
        mesh = tensor_parallel_mesh(rank_device(extract.device, local_rank), lay)
    if mine:
        device = rank_device(extract.device, local_rank)
        result = _run_windows(prepared, windows, done, device, target_cfg, store, extract, progress and lay.writes, model, channels, (lay, mesh))
    wait_for_ranks(world)
    summary: dict[str, Any] = {
        "store": files.url,
        "rank": rank,
        "world_size": world,
        "shards_total": len(shards),
        "shards_already_done": len(done),
        "shards_extracted_here": result.writer.shards_written if result is not None else 0,  # what this rank wrote
        "prepare_seconds": round(prepare_seconds, 2),  # read + tokenize every row (on every rank)
    }
    if lay.tp > 1:
        summary["tensor_parallel"] = {"size": lay.tp, "group": lay.dp_rank, "groups": lay.dp_size, "writes": lay.writes}
    if result is not None and lay.writes:
        summary.update(
            {
                "tokens": result.tokens,
                "seconds": round(result.seconds, 2),
                "forward_seconds": round(result.forward_seconds, 2),
                "tok_per_s": round(result.tokens / max(result.seconds, 1e-9), 1),
                # Who limits extraction: the forward waits on the writer for writer_queue_wait_s; the
                # writer threads were busy writer_seconds (summed) against forward_seconds of target.
                "writer_queue_wait_s": round(result.writer.queue_wait_seconds, 3),
                "writer_seconds": round(result.writer.write_seconds, 2),
                "writer_threads": result.writer_threads,
                "writer_absorb_s": round(result.writer.absorb_seconds, 2),
                "writer_peak_queue_mb": round(result.writer.peak_queue_bytes / 2**20, 1),
            }
        )
    if rank == 0:
        summary.update(_merge(prepared, shards, samples_per_shard, channels))
    wait_for_ranks(world)
    return summary


def _run_windows(
    prepared: Prepared,
    windows: list[list[ShardPlan]],
    done: set[int],
    device: str,
    target_cfg: TargetConfig,
    store: StoreConfig,
    extract: ExtractConfig,
    progress: bool,
    model: Any = None,
    channels: Any = None,
    tensor_parallel: tuple[Layout, Any] | None = None,
) -> Any:
    """Load the target as the store's header says (split across its TP group when
    `tensor_parallel` = (layout, mesh) says so) and extract this rank's windows."""
    settings = prepared.header["extraction"]  # what the header promises is what runs
    problem = runnable_problem(settings, device)
    if problem is not None and model is None:
        chosen = [AUTO_SETTINGS[k] for k in ("attn_implementation", "compute_dtype", "packed")]
        raise ConfigError(
            f"{prepared.files.url} was extracted with {settings['attn_implementation']} attention, "
            f"{settings['compute_dtype']} compute, packed={settings['packed']} ({', '.join(chosen)} left auto read them "
            f"back from the store); {problem}. Run on a machine that can, or ask for other settings explicitly "
            f"(e.g. target.attn_implementation=sdpa extract.packed=off), which makes every shard stale: "
            f"`python -m stage1_extract reprocess` re-extracts them all"
        )
    lay, mesh = tensor_parallel or (Layout(0, 1, 1), None)
    if model is None:  # else rank 0's, loaded with these settings to fit fp4's outlier channels
        split = split_arguments(lay, mesh) if lay.tp > 1 else None
        model = load_target_model(
            target_cfg, device, dtype=settings["compute_dtype"], attn_implementation=settings["attn_implementation"], split=split
        )
        if split is not None:
            check_split(model, lay)
    check_output_head(model)  # every rank (a tensor-parallel forward is collective), fp4's rank 0 too
    if settings["packed"]:
        check_packed_forward(model)
    if model.config._attn_implementation != settings["attn_implementation"]:
        raise RuntimeError(
            f"the target loaded with attention {model.config._attn_implementation!r}, the store's header says "
            f"{settings['attn_implementation']!r}"
        )
    return run_shards(
        model, windows, done, prepared.files.url, store, extract, prepared.layer_ids, settings["packed"], progress, channels,
        write=lay.writes,
    )


def _merge(prepared: Prepared, shards: list[ShardPlan], samples_per_shard: int, channels: Any) -> dict[str, Any]:
    """Rank 0: the manifest from every rank's part records, written last."""
    extra = {
        "data": {
            "source": str(prepared.source),
            "source_sha256": prepared.source_sha256,
            "format": prepared.data_format,  # how the export doctor reads the rows again
            "num_rows": len(prepared.rows),
            "rows_read": prepared.stats.rows,  # rows of `source` read, bad ones included
            "row_settings": prepared.selection,  # what chose the rows, for checks without a token cache
            "bad_rows_skipped": prepared.stats.bad_rows,  # by extract, reading `source`
            "leading_turns_dropped": prepared.stats.leading_turns_dropped,  # turns before a row's first user turn
            # Regenerated answers generate.max_new_tokens cut (their end-of-turn marker unsupervised), and
            # those whose file predates the record (read as ended).
            "answers_cut": prepared.stats.answers_cut,
            "answers_cut_unknown": prepared.stats.answers_cut_unknown,
            # Assistant turns kept as unsupervised context (the template renders them otherwise once a user
            # turn follows: Qwen3's reasoning before the last user query), regenerated answers whose ids the
            # template gave no place (their text tokenized instead).
            "context_turns": prepared.stats.context_turns,
            "tokens_version": TOKENS_VERSION,  # how stage 1 tokenized (stage 2 warns when it cannot compare tokens)
            "ids_fallbacks": prepared.stats.ids_fallbacks,
            # data.regenerate: what generate counted on the way from the user's file to `source`
            # (data.generate_record; None when generated.parquet predates those counts).
            **({"generate": prepared.generate} if prepared.regenerated else {}),
        },
        "target_source": {**prepared.target.source, "folder": str(prepared.target.target_dir)},  # provenance, not identity
        "samples_per_shard": samples_per_shard,
        "created_unix": int(time.time()),
    }
    if channels is not None:
        extra["fp4_outlier_channels"] = channels.tolist()
    started = time.perf_counter()
    manifest = merge_manifest(prepared.files, prepared.header, shards, extra)
    rows = row_accounting(manifest["data"], manifest["num_samples"], manifest["num_skipped"])
    out = {"merge_seconds": round(time.perf_counter() - started, 2), "leading_turns_dropped": rows["leading_turns_dropped"],
           "bad_rows_skipped": prepared.stats.bad_rows, "answers_cut": prepared.stats.answers_cut,
           "answers_cut_unknown": prepared.stats.answers_cut_unknown, "context_turns": prepared.stats.context_turns,
           "ids_fallbacks": prepared.stats.ids_fallbacks, "rows": rows}
    out.update({k: manifest[k] for k in ("num_samples", "num_tokens", "num_bytes", "num_truncated", "num_skipped", "num_empty_turns",
                                          "num_duplicates", "split_key")})
    if prepared.stats.ids_fallbacks:
        log.warning(
            "%d regenerated answer(s) could not be placed as the target's own token ids (the chat template drops or "
            "closes them otherwise): their text was tokenized instead, which can merge or split tokens the target "
            "never produced (ids_fallbacks in the manifest)", prepared.stats.ids_fallbacks
        )
    if manifest["num_empty_turns"]:
        log.warning(
            "%d assistant turns are empty: only their end-of-turn tokens are supervised (counted in the manifest as "
            "num_empty_turns); drop or regenerate those rows if they are not meant to be empty", manifest["num_empty_turns"]
        )
    return out


def cmd_reprocess(cfg: RunConfig, force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Re-extract only stale and missing shards, drop orphans, rewrite the manifest last. Every rank
    joins first: rank 0's reading of the shards re-tokenizes a changed data file (minutes at 800K
    rows) while the others wait on the work group (WORK_TIMEOUT), not in the join (JOIN_TIMEOUT)."""
    rank, world, _ = distributed_context()
    _join(cfg, rank, world)
    try:
        before = on_rank_0(rank, world, lambda: shard_report(cfg),
                           f"{RunPaths.of(cfg).store}: rank 0 could not read the store's shards (its error says why)")
    except BaseException:
        leave_ranks(world)
        raise
    summary = cmd_extract(cfg, force=force, progress=progress, reprocess=True)  # joined already: it keeps the group
    if rank == 0:
        summary["before"] = before["counts"]
        summary["settings_changed"] = before["settings_changed"]
        summary["reextracted"] = [r["index"] for r in before["shards"] if r["state"] != "current"]
        summary["orphans_removed"] = before["orphaned"]
    return summary


def cmd_verify(cfg: RunConfig, repair: bool = False, progress: bool = True, deep: bool = False) -> dict[str, Any]:
    """Every shard against its manifest record, field by field (`verify.py`); with `deep`, also
    against the input data tokenized afresh. With repair, a shard whose record alone is wrong (its
    part record agrees with it) gets its record rebuilt from the part records, re-extracting
    nothing; every other bad shard is deleted with its part record and extracted again (after a deep
    mismatch the token cache is rebuilt first: it is what stood between the data and the store).
    A tensor-parallel store is repaired under torchrun (its TP size of processes): rank 0 verifies
    and deletes, every rank extracts; one process refuses before deleting anything."""
    paths = RunPaths.of(cfg)
    fresh: list[Prepared] = []  # the data tokenized afresh (--deep), once

    def tokenized_afresh() -> Prepared:
        if not fresh:
            fresh.append(prepare_run(cfg, use_token_cache=False))
        return fresh[0]

    if not repair:
        return check_store(paths.store, tokenized_afresh if deep else None)
    rank, world, local_rank = distributed_context()
    if world > 1:  # one process on a TP store: refused below, and only when a shard needs extracting
        _join(cfg, rank, world)  # the others wait while rank 0 verifies (a deep check tokenizes every row)
    try:
        return _repair(cfg, paths, (rank, world, local_rank), progress, tokenized_afresh if deep else None)
    finally:
        leave_ranks(world)


def _repair(
    cfg: RunConfig, paths: RunPaths, ranks: tuple[int, int, int], progress: bool, afresh: Callable[[], Prepared] | None
) -> dict[str, Any]:
    """verify --repair on every rank: rank 0 verifies and (when the job can extract the store's TP
    size) deletes what must be extracted again; every rank then extracts and rank 0 merges."""
    (rank, world, local_rank), url = ranks, paths.store

    def verified() -> dict[str, Any]:
        report = check_store(url, afresh)
        tp = cfg.extract.tensor_parallel_size
        if report["bad_shards"] and world == 1 and tp > 1:
            raise ConfigError(
                f"verify --repair: {url} was extracted with extract.tensor_parallel_size={tp}, which one process "
                f"cannot run, so its {len(report['bad_shards'])} bad shard(s) ({report['bad_shards'][0]['shard']}, ...) "
                f"were left as they are; run `torchrun --nproc_per_node {tp} -m stage1_extract verify --repair` "
                f"with this run's --config and overrides"
            )
        # Refuse before deleting: a config that cannot continue the store would leave the bad
        # shards deleted and the manifest listing them.
        problem = plan_problem(StoreFiles(url), resolve_store(cfg)[2]) if report["bad_shards"] else None
        if problem:
            raise StoreError(f"verify --repair deleted nothing: {problem}")
        return report

    report = on_rank_0(rank, world, verified, f"{url}: rank 0 could not verify it (its error says why)")
    if all_ok(world, rank != 0 or not report["bad_shards"]):  # rank 0's verdict: nothing to repair
        return report if rank == 0 else {"store": url, "rank": rank, "ok": True, "repaired": []}
    with store_lock(url, rank, world, "verify --repair"):
        if rank == 0:
            bad = report["bad_shards"]
            if any(b.get("deep") for b in bad):
                discard_token_cache(paths.token_cache)
            files = StoreFiles(url)
            for b in bad:
                if b.get("fix") != REBUILD:
                    files.remove(f"shards/{b['shard']}")
                    files.remove(part_path(b["index"]))
        extracted = _extract(cfg, False, progress and rank == 0, rank, world, local_rank, False)  # then merges the manifest
    if rank != 0:
        return {"store": url, "rank": rank, "ok": True, "extract": extracted}
    after = check_store(url, afresh)
    after["repaired"] = [b["shard"] for b in bad]
    after["records_rebuilt"] = [b["shard"] for b in bad if b.get("fix") == REBUILD]
    after["reextracted"] = [b["shard"] for b in bad if b.get("fix") != REBUILD]
    return after
