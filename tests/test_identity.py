"""A store's identity and freshness: what `status` calls stale, `train` refuses (issue 31, items 1, 2, 5).

One config describes both stages (as `make extract` then `make train` use it). Each test copies a
small extracted store with its data, changes one thing the way a user would, and checks that stage 1's
`status` and stage 2's `train` agree, naming the same shards and fields.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shared.config import load_run_config
from shared.errors import DataError, StoreError
from shared.identity import STAGE1_DEFAULTS
from shared.store import read_manifest
from stage1_extract import commands as stage1
from stage1_extract.resolve import prepare_run
from stage2_train import commands as stage2
from stage2_train.observe.metrics import read_log
from testkit.data import chat_rows, stage1_overrides, write_jsonl

TRAIN = {  # a one-step run: the check comes before it
    "sampler.micro_batch_tokens": 512, "sampler.max_anchors_per_seq": 4, "model.block_size": 8, "loss.gamma": 4.0,
    "train.max_steps": 1, "train.num_data_threads": 1, "eval.holdout_fraction": 0.2, "eval.offline_max_samples": 2,
    "log.wandb": "disabled",
}


def test_stage1_defaults_known_to_shared_are_stage1s_own():
    """shared.identity reads stage-1 settings with these defaults when a config does not set them
    (stage 2 keeps stage 1's sections as given): they must be stage 1's own."""
    from stage1_extract.data import DataConfig
    from stage1_extract.extract import ExtractConfig
    from stage1_extract.generate import GenerateConfig

    sections = {"data": DataConfig(), "extract": ExtractConfig(), "generate": GenerateConfig()}
    for key, default in STAGE1_DEFAULTS.items():
        section, name = key.split(".")
        assert getattr(sections[section], name) == default, key


@pytest.fixture(scope="module")
def built(tiny_target_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("identity")
    write_jsonl(root / "chat.jsonl", chat_rows(30))
    stage1.cmd_extract(config(tiny_target_dir, root), progress=False)
    return root


def config(target_dir: Path, root: Path, **extra):
    settings = {**TRAIN, **extra}
    return load_run_config("configs/default.yaml", stage1_overrides(target_dir, root / "chat.jsonl", root / "run", **settings))


@pytest.fixture
def root(built, tmp_path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "copy"))


def stale_in_status(cfg) -> list[tuple[int, str]]:
    return [(r["index"], r["why"]) for r in stage1.cmd_status(cfg)["shards"] if r["state"] != "current"]


def test_a_current_store_trains(root, tiny_target_dir):
    cfg = config(tiny_target_dir, root)
    assert stale_in_status(cfg) == []
    assert stage2.cmd_train(cfg, progress=False)["steps"] == 1


def test_an_edited_row_is_refused_naming_its_shard(root, tiny_target_dir):
    rows = [json.loads(line) for line in (root / "chat.jsonl").read_text().splitlines()]
    rows[27]["messages"][1]["content"] = "an edited answer that is entirely new"
    write_jsonl(root / "chat.jsonl", rows)
    cfg = config(tiny_target_dir, root)
    # Before any stage-1 command saw the edit: the data's hash tells, status names the shards.
    with pytest.raises(StoreError, match=r"chat.jsonl changed since extraction .* `python -m stage1_extract status`"):
        stage2.cmd_train(cfg, progress=False)
    assert stale_in_status(cfg) == [(1, "input rows changed")]  # status tokenized it: the cache holds its rows
    with pytest.raises(StoreError, match=r"shard\(s\) 1 stale \(input rows changed\).*reprocess.*allow_stale_store"):
        stage2.cmd_train(cfg, progress=False)
    assert not (root / "run" / "train_log.jsonl").exists()  # refused before anything was written
    stage1.cmd_reprocess(cfg, progress=False)
    assert stage2.cmd_train(cfg, progress=False)["steps"] == 1


@pytest.mark.parametrize(
    "change, field",
    [
        ({"extract.top_k": 4}, "top_k"),
        ({"data.max_length": 128}, "max_length"),
        ({"data.on_long": "skip"}, "on_long"),
        ({"store.dtype": "fp8"}, "storage.dtype"),
        ({"target.num_feature_layers": 2}, "layer_ids"),
    ],
)
def test_a_changed_setting_is_refused_as_status_calls_it_stale(root, tiny_target_dir, change, field):
    cfg = config(tiny_target_dir, root, **change)
    assert {why for _, why in stale_in_status(cfg)} == {f"settings changed: {field}"}
    # (layer ids and the target are also checked when the store is opened, naming the field there)
    with pytest.raises(StoreError, match=rf"(shard\(s\) 0, 1 stale \(settings changed: |manifest.json: ){field}.*reprocess"):
        stage2.cmd_train(cfg, progress=False)


def test_a_changed_chat_template_is_refused(root, tiny_target_dir, tmp_path):
    target = Path(shutil.copytree(tiny_target_dir, tmp_path / "target"))
    template = target / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|im_start|>system", "<|im_start|>system "))
    cfg = config(target, root)
    assert {why for _, why in stale_in_status(cfg)} == {"settings changed: chat_template_sha256"}
    with pytest.raises(StoreError, match=r"settings changed: chat_template_sha256"):
        stage2.cmd_train(cfg, progress=False)


def test_allow_stale_store_trains_and_logs_what_differs(root, tiny_target_dir):
    cfg = config(tiny_target_dir, root, **{"extract.top_k": 4, "train.allow_stale_store": True})
    assert stage2.cmd_train(cfg, progress=False)["steps"] == 1
    events = [r for r in read_log(root / "run" / "train_log.jsonl") if r.get("event") == "stale_store"]
    assert len(events) == 1 and events[0]["stale_shards"][0] == {"index": 0, "why": "settings changed: top_k"}


def test_a_data_file_absent_here_trains_on_the_store_as_its_manifest_records_it(root, tiny_target_dir, caplog):
    """Training on another cluster than the one that holds the data: nothing to re-check the rows
    against, so the manifest's record stands, with a warning naming the absent file."""
    (root / "chat.jsonl").unlink()
    with caplog.at_level("WARNING", logger="shared.freshness"):
        assert stage2.cmd_train(config(tiny_target_dir, root), progress=False)["steps"] == 1
    assert f"rows not re-checked: {root / 'chat.jsonl'} absent" in caplog.text


def test_a_quick_runs_max_samples_is_refused_once_dropped_with_no_token_cache_for_it(root, tiny_target_dir):
    """Extracted with data.max_samples=12, trained without: the data's bytes are unchanged, so only the
    recorded row settings tell that the store holds 12 of the 30 rows (no cache of the new settings
    exists until a stage-1 command makes one)."""
    quick = config(tiny_target_dir, root, **{"data.max_samples": 12})
    stage1.cmd_reprocess(quick, progress=False)
    cfg = config(tiny_target_dir, root)
    with pytest.raises(StoreError, match=r"data\.max_samples changed since extraction \(12 -> None\)"):
        stage2.cmd_train(cfg, progress=False)
    assert stale_in_status(cfg)  # status tokenizes the whole file and agrees



def test_row_settings_that_select_the_same_rows_are_not_a_change(root, tiny_target_dir):
    """A limit the file ended before, a bad-row rule with no bad row, a format `auto` read: the
    store holds the rows the config selects, as `status` says; training is not refused over them."""
    generous = config(tiny_target_dir, root, **{"data.max_samples": 1000, "data.on_bad_row": "skip", "data.format": "openai"})
    stage1.cmd_reprocess(generous, progress=False)
    made = json.loads((root / "run" / "store" / "manifest.json").read_text())["data"]["row_settings"]
    assert made == {"on_bad_row": "skip", "max_samples": 1000, "format": "openai"}
    cfg = config(tiny_target_dir, root, **{"data.token_cache": False})  # max_samples null, on_bad_row raise, format auto
    assert stage1.cmd_status(config(tiny_target_dir, root))["complete"]
    assert stage2.cmd_train(cfg, progress=False)["steps"] == 1


def test_a_shard_record_removed_by_hand_is_refused_without_a_token_cache(root, tiny_target_dir):
    store = root / "run" / "store"
    manifest = json.loads((store / "manifest.json").read_text())
    last = manifest["shards"].pop()
    shutil.rmtree(store / "shards" / last["name"])
    (store / "manifest.json").write_text(json.dumps(manifest))
    cfg = config(tiny_target_dir, root, **{"data.token_cache": False})
    with pytest.raises(StoreError, match=rf"shard\(s\) {last['index']} stale \(missing from the manifest\)"):
        stage2.cmd_train(cfg, progress=False)


# ---- item 1: generated answers belong to the prompts, target and settings they were made from ----


def test_answers_generated_from_other_prompts_are_refused_and_status_says_so(tiny_target_dir, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", chat_rows(4, seed=1))
    b = write_jsonl(tmp_path / "b.jsonl", chat_rows(4, seed=2))

    def cfg_for(data: Path):
        return load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "run", **{
            "data.regenerate": True, "generate.max_new_tokens": 4, "generate.rows_per_part": 2, "extract.device": "cpu",
        }))

    stage1.cmd_generate(cfg_for(a), progress=False)
    with pytest.raises(DataError, match=rf"generated from {a} with other inputs .*the prompts' content \({b}\)"):
        stage1.cmd_extract(cfg_for(b), progress=False)
    assert not (tmp_path / "run" / "store" / "manifest.json").exists()
    status = stage1.cmd_status(cfg_for(b))
    assert str(a) in status["generated_data"] and not status["complete"]
    stage1.cmd_extract(cfg_for(a), progress=False)  # the answers' own prompts: accepted
    assert stage1.cmd_status(cfg_for(a))["generated_data"] == "current"
    with pytest.raises(StoreError, match="generated from"):  # train agrees with status
        stage2.cmd_train(load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, b, tmp_path / "run", **{
            **TRAIN, "data.regenerate": True, "generate.max_new_tokens": 4, "generate.rows_per_part": 2,
        })), progress=False)
    stage1.cmd_generate(cfg_for(b), progress=False)  # regenerated for b: b's store may be made
    stage1.cmd_reprocess(cfg_for(b), progress=False)
    assert stage1.cmd_status(cfg_for(b))["complete"]


# ---- item 5: a store's identity does not depend on the machine a command runs on -------------------


def test_auto_settings_are_read_back_from_the_store_not_resolved_again(root, tiny_target_dir, monkeypatch):
    """A store made on a GPU node (flash-attn, packed, bf16 from `auto`) is current on a CPU login node,
    and reprocess there refuses rather than re-extract it on CPU settings."""
    import shared.identity as identity

    cfg = config(tiny_target_dir, root, **{"target.dtype": "auto"})
    plan = root / "run" / "store" / "plan.json"
    manifest = root / "run" / "store" / "manifest.json"
    gpu = {"compute_dtype": "bf16", "attn_implementation": "flash_attention_2", "packed": True}
    # Rewrite the store as the GPU node would have made it (its auto settings resolved there).
    monkeypatch.setattr(identity, "resolve_device", lambda setting: "cuda")
    monkeypatch.setattr(identity, "pick_attn_implementation", lambda requested, device, dtype=None: "flash_attention_2")
    gpu_header = identity.store_header(cfg, prepare_run(cfg).target)
    assert gpu_header["extraction"] | gpu == gpu_header["extraction"]
    monkeypatch.undo()
    key = identity.header_key(gpu_header)
    for path in (plan, manifest):
        data = json.loads(path.read_text())
        data.update(gpu_header) if path == manifest else data.update(header=gpu_header)
        for record in data.get("shards", []):
            record["header_key"] = key
        path.write_text(json.dumps(data))
    for part in (root / "run" / "store" / "parts").glob("*.json"):
        record = json.loads(part.read_text())
        part.write_text(json.dumps({**record, "header_key": key}))
    # On this CPU machine: current for status and for train's check.
    assert stage1.cmd_status(cfg)["complete"]
    assert prepare_run(cfg).header["extraction"] == gpu_header["extraction"]
    # An edited row: reprocess must not re-extract on CPU settings implicitly.
    rows = [json.loads(line) for line in (root / "chat.jsonl").read_text().splitlines()]
    rows[3]["messages"][1]["content"] = "edited"
    write_jsonl(root / "chat.jsonl", rows)
    with pytest.raises(ValueError, match=r"flash_attention_2 attention.*target.attn_implementation=sdpa"):
        stage1.cmd_reprocess(cfg, progress=False)
    assert json.loads(plan.read_text())["header"]["extraction"] == gpu_header["extraction"]  # plan.json untouched


# ---- review items 3 and 13: what is not part of a store's identity ----------------------------------


@pytest.fixture(scope="module")
def generated(tiny_target_dir, tmp_path_factory) -> Path:
    """A store extracted from the target's own answers (data.regenerate, the recipe), generate.seed 0."""
    root = tmp_path_factory.mktemp("generated")
    write_jsonl(root / "prompts.jsonl", chat_rows(8, seed=3))
    stage1.cmd_generate(generated_config(tiny_target_dir, root), progress=False)
    stage1.cmd_extract(generated_config(tiny_target_dir, root), progress=False)
    return root


def generated_config(target_dir: Path, root: Path, run_dir: Path | None = None, **extra):
    settings = {**TRAIN, "data.regenerate": True, "generate.max_new_tokens": 8, "generate.rows_per_part": 4,
                "extract.device": "cpu", **extra}
    return load_run_config("configs/default.yaml", stage1_overrides(target_dir, root / "prompts.jsonl", run_dir or root / "run", **settings))


@pytest.fixture
def generated_copy(generated, tmp_path) -> Path:
    return Path(shutil.copytree(generated, tmp_path / "copy"))


def test_another_training_seed_trains_on_answers_generated_with_generate_seed(generated_copy, tiny_target_dir):
    """The run's seed is training's (initialisation, batches, anchors, noise); the answers have their
    own, generate.seed: a new training seed never asks to regenerate them."""
    cfg = generated_config(tiny_target_dir, generated_copy, seed=1)
    assert stage1.cmd_status(cfg)["complete"]
    assert stage2.cmd_train(cfg, progress=False)["steps"] == 1
    other = generated_config(tiny_target_dir, generated_copy, **{"generate.seed": 1})
    assert r"generate.seed (0 -> 1)" in stage1.cmd_status(other)["generated_data"]
    # the free fix first: answers generated before generate.seed existed carry the run's old seed
    with pytest.raises(StoreError, match=r"generate\.seed \(0 -> 1\); set generate\.seed=0 to use them as they are, or run"):
        stage2.cmd_train(other, progress=False)


def test_a_new_run_dir_trains_on_an_existing_store_without_its_generated_data(generated_copy, tiny_target_dir, caplog):
    """Training on another cluster: run_dir is new (no data/generated.parquet there), store.path points
    at the store. The manifest's record of its source stands, with a warning naming the absent file."""
    elsewhere = generated_copy / "elsewhere"
    cfg = generated_config(tiny_target_dir, generated_copy, elsewhere, **{"store.path": str(generated_copy / "run" / "store")})
    with caplog.at_level("WARNING", logger="shared.freshness"):
        assert stage2.cmd_train(cfg, progress=False)["steps"] == 1
    assert f"rows not re-checked: {elsewhere / 'data' / 'generated.parquet'} absent" in caplog.text


def rewrite_header(store: Path, header: dict) -> None:
    """Make a store's plan, manifest and part records say `header` made it (as an older or another
    machine's extraction would have written them)."""
    from shared.identity import header_key

    key = header_key(header)
    for path in (store / "plan.json", store / "manifest.json"):
        data = json.loads(path.read_text())
        data.update(header) if path.name == "manifest.json" else data.update(header=header)
        for record in data.get("shards", []):
            record["header_key"] = key
        path.write_text(json.dumps(data))
    for part in (store / "parts").glob("*.json"):
        part.write_text(json.dumps({**json.loads(part.read_text()), "header_key": key}))


def test_a_store_made_when_the_batch_shape_was_identity_keeps_its_keys_and_continues_with_another_batch(root, tiny_target_dir):
    """A store extracted at identity version 2 recorded the batch shape in its header and keys: it is
    judged by what it recorded (current, whatever batch the config gives now) and reprocessed as a
    version-2 store, so no shard goes stale for the upgrade."""
    import shared.identity as identity

    cfg = config(tiny_target_dir, root)
    store = root / "run" / "store"
    target = prepare_run(cfg).target
    assert identity.store_header(cfg, target)["identity_version"] == 7
    header = identity.store_header(cfg, target, version=3)
    assert header["identity_version"] == 3 and "batch_tokens" not in header["extraction"]
    batching = {"batch_tokens": 512, "max_samples_per_batch": 64, "window_shards": 1, "lm_head_chunk_tokens": 2048}
    rewrite_header(store, {**header, "identity_version": 2, "extraction": {**header["extraction"], **batching}})
    smaller = config(tiny_target_dir, root, **{"extract.batch_tokens": 64})
    assert stage1.cmd_status(cfg)["complete"] and stage1.cmd_status(smaller)["complete"]
    assert stage2.cmd_train(smaller, progress=False)["steps"] == 1
    rows = [json.loads(line) for line in (root / "chat.jsonl").read_text().splitlines()]
    rows[3]["messages"][1]["content"] = "edited"
    write_jsonl(root / "chat.jsonl", rows)
    assert stage1.cmd_reprocess(smaller, progress=False)["reextracted"] == [0]
    manifest = read_manifest(str(store))
    assert manifest["identity_version"] == 2 and manifest["extraction"]["batch_tokens"] == 512  # what it pinned
    assert manifest["shards"][0]["batching"]["batch_tokens"] == 64 and stage1.cmd_status(smaller)["complete"]


def test_a_store_made_at_identity_version_3_is_not_judged_by_the_target_fields_it_never_recorded(root, tiny_target_dir):
    import shared.identity as identity

    cfg = config(tiny_target_dir, root)
    header = identity.store_header(cfg, prepare_run(cfg).target, version=3)
    assert "config_sha256" not in header["target"] and "tokenizer_probe_sha256" not in header
    rewrite_header(root / "run" / "store", header)
    assert stage1.cmd_status(cfg)["complete"] and stage2.cmd_train(cfg, progress=False)["steps"] == 1


@pytest.mark.parametrize("edit, field", [("config", "target.config_sha256"), ("merges", "tokenizer_probe_sha256")])
def test_a_target_whose_config_or_tokenizer_changed_beside_the_same_weights_and_vocabulary_is_stale(
        root, tiny_target_dir, tmp_path, edit, field):
    """A config-only update of a model repository (rope_theta: the same weights compute other states)
    and a tokenizer fix that keeps the vocabulary (one merge dropped: " the" becomes two ids)."""
    target = Path(shutil.copytree(tiny_target_dir, tmp_path / "target"))
    stage1.cmd_reprocess(config(target, root), progress=False)  # the store made from this folder
    if edit == "config":
        settings = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**settings, "rope_theta": 1e6, "transformers_version": "9.9"}))
    else:
        tokenizer = json.loads((target / "tokenizer.json").read_text())
        tokenizer["model"]["merges"] = [m for m in tokenizer["model"]["merges"] if m not in (["Ġ", "t"], "Ġ t")]
        (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    cfg = config(target, root)
    assert {why for _, why in stale_in_status(cfg)} == {f"settings changed: {field}"}
    with pytest.raises(StoreError, match=rf"settings changed: {field}"):
        stage2.cmd_train(cfg, progress=False)


def test_config_json_written_again_by_another_transformers_is_the_same_target(root, tiny_target_dir, tmp_path):
    target = Path(shutil.copytree(tiny_target_dir, tmp_path / "target"))
    stage1.cmd_reprocess(config(target, root), progress=False)
    settings = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**settings, "transformers_version": "9.9", "use_cache": False}, indent=4))
    assert stale_in_status(config(target, root)) == []


# ---- review item 4: one verdict for every rank ---------------------------------------------------------


def check_store_on_rank(rank: int, port: int, root: str, target_dir: str, out: str) -> None:
    """One of two gloo ranks: Trainer._check_store while only one rank sees the answers as changed (a
    file only its node sees), once with rank 1 seeing it and once with rank 0."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    import shared.freshness as freshness
    from shared.target import resolve_target
    from stage2_train.train.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg = config(Path(target_dir), Path(root))
    url = cfg.store.url(cfg.run_dir)
    reader = SimpleNamespace(manifest=read_manifest(url), url=url)
    trainer = SimpleNamespace(cfg=cfg, data=SimpleNamespace(target=resolve_target(cfg.target), reader=reader), rank=rank, world_size=2)
    real, results = freshness.generated_problem, {}
    try:
        for seer in (1, 0):
            looked = []

            def seen(*args, seer=seer, looked=looked):
                looked.append(rank)
                return "the answers changed (this rank's view)" if rank == seer else real(*args)

            freshness.generated_problem = seen
            try:
                Trainer._check_store(trainer)
                results[seer] = ["trains", bool(looked)]
            except StoreError:
                results[seer] = ["raises", bool(looked)]
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.slow
def test_ranks_that_see_different_files_get_rank_0s_verdict_together(root, tiny_target_dir, tmp_path):
    """Each rank deciding alone, a rank that sees a stale store raises while the others wait in DDP's
    set-up until the NCCL timeout. Rank 0 decides (and alone reads and hashes the files) and every
    rank gets its verdict: both train when rank 0 sees a current store, both raise when it sees a stale one."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(check_store_on_rank, args=(port, str(root), str(tiny_target_dir), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # {seer: [verdict, whether this rank computed it]}: rank 1 seeing it alone changes nothing
    assert results[0] == {"1": ["trains", True], "0": ["raises", True]}
    assert results[1] == {"1": ["trains", False], "0": ["raises", False]}
