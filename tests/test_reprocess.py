"""Reprocessing after the target or the data change, and integrity checks that catch corruption."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from shared.config import load_run_config
from shared.errors import ConfigError, StoreError
from shared.store import read_manifest
from stage1_extract import commands
from stage1_extract.merge import part_path

from .conftest import chat_rows, stage1_overrides, write_jsonl

ROOT = Path(__file__).resolve().parent.parent


def config(target, data, run_dir, **extra):
    return load_run_config(ROOT / "configs/default.yaml", stage1_overrides(target, data, run_dir, **extra))


def contents(cfg) -> list:
    return [(r["index"], r["checksum"], r["sample_ids"]) for r in read_manifest(cfg.store.url(cfg.run_dir))["shards"]]


@pytest.fixture(scope="module")
def pristine(tiny_target_dir, tmp_path_factory) -> Path:
    """One extracted store per module (extraction is most of this file's time); each test edits a copy."""
    root = tmp_path_factory.mktemp("reprocess_pristine")
    data = write_jsonl(root / "chat.jsonl", chat_rows(30))
    commands.cmd_extract(config(tiny_target_dir, data, root / "run"), progress=False)
    return root


@pytest.fixture
def built(pristine, tiny_target_dir, tmp_path):
    """A fresh copy of the module's store and its data, at this test's own paths."""
    for name in ("chat.jsonl", "run"):
        (shutil.copytree if (pristine / name).is_dir() else shutil.copy2)(pristine / name, tmp_path / name)
    return config(tiny_target_dir, tmp_path / "chat.jsonl", tmp_path / "run"), tmp_path / "chat.jsonl"


def test_unchanged_store_is_current_and_reprocess_does_nothing(built):
    cfg, _ = built
    report = commands.cmd_status(cfg)
    assert report["complete"] and report["counts"] == {"current": 2, "stale": 0, "missing": 0, "orphaned": 0}
    before = contents(cfg)
    out = commands.cmd_reprocess(cfg, progress=False)
    assert out["reextracted"] == [] and out["shards_extracted_here"] == 0
    assert contents(cfg) == before


def test_edited_row_reextracts_exactly_its_shard(built, tiny_target_dir, tmp_path):
    cfg, data = built
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[27]["messages"][1]["content"] = "an edited answer that is entirely new"
    write_jsonl(data, rows)
    report = commands.cmd_status(cfg)
    assert [(r["index"], r["state"], r["why"]) for r in report["shards"]] == [
        (0, "current", ""), (1, "stale", "input rows changed")
    ]
    out = commands.cmd_reprocess(cfg, progress=False)
    assert out["reextracted"] == [1] and out["shards_extracted_here"] == 1
    assert commands.cmd_status(cfg)["complete"]
    fresh = config(tiny_target_dir, data, tmp_path / "fresh")
    commands.cmd_extract(fresh, progress=False)
    assert contents(cfg) == contents(fresh)  # bit-identical to a full fresh extraction
    # The replaced shard's old group is gone; only listed groups remain.
    listed = {r["name"] for r in read_manifest(cfg.store.url(cfg.run_dir))["shards"]}
    assert set(p.name for p in (Path(cfg.store.url(cfg.run_dir)) / "shards").iterdir() if p.name.startswith("shard-")) == listed


def test_changed_target_marks_every_shard_stale(built, tiny_target_dir, tmp_path):
    cfg, data = built
    new_target = tmp_path / "retuned"
    shutil.copytree(tiny_target_dir, new_target)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(new_target, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    model.save_pretrained(new_target)
    changed = config(new_target, data, Path(cfg.run_dir))
    with pytest.raises(ValueError, match="reprocess"):
        commands.cmd_extract(changed, progress=False)
    report = commands.cmd_status(changed)
    assert report["counts"]["stale"] == 2
    # The target's identity is its content: its folder is provenance, not identity.
    assert "target.weights_sha256" in report["shards"][0]["why"] and report["settings_changed"] == ["target.weights_sha256"]
    out = commands.cmd_reprocess(changed, progress=False)
    assert out["reextracted"] == [0, 1]
    fresh = config(new_target, data, tmp_path / "fresh")
    commands.cmd_extract(fresh, progress=False)
    assert contents(changed) == contents(fresh)


def test_appended_and_removed_rows(built, tiny_target_dir):
    cfg, data = built
    sps = read_manifest(cfg.store.url(cfg.run_dir))["samples_per_shard"]
    write_jsonl(data, chat_rows(30) + chat_rows(2 * sps, seed=5)[:sps])
    report = commands.cmd_status(cfg)
    assert report["counts"]["missing"] >= 1 and report["counts"]["current"] >= 1
    commands.cmd_reprocess(cfg, progress=False)
    assert commands.cmd_status(cfg)["complete"]
    write_jsonl(data, chat_rows(10))
    report = commands.cmd_status(cfg)
    assert report["orphaned"] and report["counts"]["stale"] == 1
    out = commands.cmd_reprocess(cfg, progress=False)
    assert out["orphans_removed"]
    assert commands.cmd_status(cfg)["complete"] and read_manifest(cfg.store.url(cfg.run_dir))["num_samples"] == 10


def test_extract_refuses_a_store_made_from_other_data_and_reprocess_replaces_it(built, pristine, tmp_path):
    """A second dataset pointed at the same store (store.path shared by two runs) or an edited row:
    `extract` refuses naming the shards, both datasets and the two ways out, and touches nothing;
    `reprocess` is the verb that replaces shards."""
    cfg, data = built
    made_from = pristine / "chat.jsonl"  # the path the manifest recorded: the store is a copy
    before = contents(cfg)
    other = write_jsonl(tmp_path / "other.jsonl", chat_rows(30, seed=9))
    second = config(Path(cfg.target.path), other, Path(cfg.run_dir))
    with pytest.raises(StoreError, match=(
        rf"shard\(s\) 0, 1 were extracted from other input rows than {other} gives \(the store was made from {made_from}\); "
        r"extraction does not replace them.*`python -m stage1_extract reprocess`.*set store.path \(or run_dir\) to a new folder"
    )):
        commands.cmd_extract(second, progress=False)
    assert contents(cfg) == before and commands.cmd_status(cfg)["complete"]
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[-1]["messages"][1]["content"] = "an edited answer"
    write_jsonl(data, rows)
    with pytest.raises(StoreError, match=r"shard\(s\) 1 were extracted from other input rows"):
        commands.cmd_extract(cfg, progress=False)
    assert commands.cmd_reprocess(cfg, progress=False)["reextracted"] == [1]
    assert commands.cmd_status(cfg)["complete"]


def gone(name: str) -> str:
    return f"its group shards/{name} is not in the store (deleted?): `python -m stage1_extract extract` or `python -m stage1_extract reprocess` extracts it again"


@pytest.mark.parametrize("where, merged", [pytest.param("local", True, marks=pytest.mark.slow), ("local", False), ("memory", True)],
                         ids=["local", "local-interrupted", "fsspec"])
def test_a_shard_group_deleted_by_hand_is_missing_and_extract_makes_it_again(tiny_target_dir, tmp_path, where, merged):
    """Its part record (and manifest record) survive the group: status counts the shard missing,
    naming the group and the command, and extract writes it again instead of skipping it. `merged`
    False: the extraction was interrupted before the manifest was written. The store is read through
    fsspec (memory://), as an object store is."""
    import fsspec

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(30))
    store = {"store.path": f"memory://gone-{tmp_path.name}"} if where == "memory" else {}
    cfg = config(tiny_target_dir, data, tmp_path / "run", **store)
    commands.cmd_extract(cfg, progress=False)
    url = cfg.store.url(cfg.run_dir)
    before = contents(cfg)
    name = read_manifest(url)["shards"][1]["name"]
    fs, root = fsspec.core.url_to_fs(url)
    fs.rm(f"{root}/shards/{name}", recursive=True)
    if not merged:
        fs.rm(f"{root}/manifest.json")
    report = commands.cmd_status(cfg)
    assert [(r["index"], r["state"], r["why"]) for r in report["shards"]] == [
        (0, "current" if merged else "missing", "" if merged else "extracted, manifest not yet merged"), (1, "missing", gone(name))
    ]
    assert (report["shards_done"], report["shards_total"], report["complete"]) == (1, 2, False)
    out = commands.cmd_extract(cfg, progress=False)
    assert (out["shards_already_done"], out["shards_extracted_here"]) == (1, 1)
    assert fs.exists(f"{root}/shards/{name}/zarr.json") and contents(cfg) == before
    assert commands.cmd_status(cfg)["complete"] and commands.cmd_verify(cfg)["ok"]


def test_train_refuses_a_store_missing_a_shard_group_and_reprocess_makes_it_again(built, tiny_target_dir, tmp_path):
    """Training refuses at open, naming the shard and two commands; reprocess, which used to find
    nothing to do (status called the shard current), re-extracts exactly that shard."""
    from shared.reader import StoreReader
    from stage2_train.commands import cmd_train

    from .conftest import train_overrides_for

    cfg, _ = built
    url = cfg.store.url(cfg.run_dir)
    before = contents(cfg)
    name = read_manifest(url)["shards"][1]["name"]
    shutil.rmtree(Path(url) / "shards" / name)
    train = load_run_config(ROOT / "configs/default.yaml", train_overrides_for(tiny_target_dir, Path(url), tmp_path / "train", {
        "train.max_steps": 1, "log.wandb": "disabled",
    }))
    with pytest.raises(StoreError, match=rf"^{url}: shard {name} is missing \(1 shard\(s\) listed in manifest.json are\); run "
                                         r"`python -m stage1_extract verify --repair` or `python -m stage1_extract reprocess`$"):
        cmd_train(train, progress=False)
    out = commands.cmd_reprocess(cfg, progress=False)
    assert (out["reextracted"], out["shards_extracted_here"], out["before"]["missing"]) == ([1], 1, 1)
    assert contents(cfg) == before and len(StoreReader(url)) == sum(len(ids) for _, _, ids in before)


def test_a_shard_whose_rows_tokenize_otherwise_now_is_stale_and_reprocess_makes_it_again(built, tiny_target_dir, tmp_path):
    """Rows and settings alike, tokens not (stage 1 renders a chat template otherwise than when the
    shard was made: today's Qwen3 fixes): status, extract and train compared row hashes and settings
    only and called the shard current. Its tokens' hashes decide now."""
    import json

    from stage2_train.commands import cmd_train

    from .conftest import train_overrides_for

    cfg, _ = built
    url = Path(cfg.store.url(cfg.run_dir))
    before = contents(cfg)
    manifest = json.loads((url / "manifest.json").read_text())
    record = manifest["shards"][1]
    record["content_hashes"] = ["0" * 16, *record["content_hashes"][1:]]  # as an older tokenization stored it
    (url / "manifest.json").write_text(json.dumps(manifest))
    part = json.loads((url / part_path(1)).read_text())
    part["content_hashes"] = record["content_hashes"]
    (url / part_path(1)).write_text(json.dumps(part))
    assert [(r["index"], r["state"], r["why"]) for r in commands.cmd_status(cfg)["shards"]][1] == (
        1, "stale", "tokens changed: the same rows tokenize otherwise now (how stage 1 renders the chat template changed)")
    train = load_run_config(ROOT / "configs/default.yaml", train_overrides_for(tiny_target_dir, url, cfg.run_dir, {
        "train.max_steps": 1, "log.wandb": "disabled"}))  # the run_dir whose token cache status just wrote
    with pytest.raises(StoreError, match=r"shard\(s\) 1 stale \(tokens changed: the same rows tokenize otherwise now"):
        cmd_train(train, progress=False)
    assert commands.cmd_reprocess(cfg, progress=False)["reextracted"] == [1]
    assert contents(cfg) == before and commands.cmd_status(cfg)["complete"]


@pytest.mark.parametrize("preset", ["qwen3-8b", "llama-3.1-8b"])
def test_the_8b_presets_give_each_run_its_own_store(preset):
    """A user config inherits a preset and sets run_dir: its store is run_dir/store, never one path
    every run of the preset shares (a second dataset's extract would replace the first's shards)."""
    from shared.paths import RunPaths

    cfg = load_run_config(ROOT / "configs" / f"{preset}.yaml", ["run_dir=/scratch/runs/mine"])
    assert cfg.value("store.path") is None and RunPaths.of(cfg).store == "/scratch/runs/mine/store"


def chunk_file(cfg, array: str) -> Path:
    record = read_manifest(cfg.store.url(cfg.run_dir))["shards"][1]
    (path,) = [p for p in (Path(cfg.store.url(cfg.run_dir)) / "shards" / record["name"] / array / "c").rglob("*") if p.is_file()]
    return path


@pytest.mark.parametrize("damage", ["flip_byte", pytest.param("truncate", marks=pytest.mark.slow), "delete_shard"])
def test_verify_catches_damage_and_repair_fixes_it(built, damage):
    cfg, _ = built
    good = contents(cfg)
    name = read_manifest(cfg.store.url(cfg.run_dir))["shards"][1]["name"]
    if damage == "flip_byte":
        path = chunk_file(cfg, "topk_ids")
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 3] ^= 0x10
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        path = chunk_file(cfg, "hidden")
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        shutil.rmtree(Path(cfg.store.url(cfg.run_dir)) / "shards" / name)
    report = commands.cmd_verify(cfg)
    assert not report["ok"] and [b["shard"] for b in report["bad_shards"]] == [name]
    repaired = commands.cmd_verify(cfg, repair=True, progress=False)
    assert repaired["ok"] and repaired["repaired"] == [name]
    assert contents(cfg) == good


@pytest.mark.parametrize("where", ["chunk", "index"])
def test_a_bit_flipped_on_disk_is_an_error_when_read_never_features_trained_on(built, where):
    """Each inner chunk ends in a crc32c of its stored bytes and the chunk index in its own: a bit
    flipped in place (the shard's attributes and manifest untouched) stops the reader the training
    loop uses, naming the file and the fix; before, only `verify` saw it and `train` read the bytes."""
    from shared.reader import StoreReader

    cfg, _ = built
    url = cfg.store.url(cfg.run_dir)
    reader = StoreReader(url)
    position = reader.sample_ids.tolist().index(read_manifest(url)["shards"][1]["sample_ids"][0])
    good = reader[position]
    path = chunk_file(cfg, "hidden")
    raw = bytearray(path.read_bytes())
    raw[3 if where == "chunk" else len(raw) - 6] ^= 0x04
    path.write_bytes(bytes(raw))
    what = "inner chunk 0 (tokens 0-" if where == "chunk" else "its chunk index"
    with pytest.raises(StoreError, match=rf"{re.escape(str(path))}: {re.escape(what)}.* does not match its crc32c: .* run "
                                         r"`python -m stage1_extract verify --repair`"):
        StoreReader(url)[position]
    assert not commands.cmd_verify(cfg)["ok"]
    assert commands.cmd_verify(cfg, repair=True, progress=False)["ok"]
    again = StoreReader(url)[position]
    assert again.keys() == good.keys() and all(torch.equal(torch.as_tensor(again[k]), torch.as_tensor(good[k])) for k in good)


def test_one_process_refuses_to_repair_a_tensor_parallel_store_before_deleting_anything(built, tiny_target_dir, tmp_path):
    """A TP store's shards can only be extracted again by its TP size of processes: one process
    deletes nothing (the bad shard and its part record stay) and names the torchrun command."""
    cfg, data = built
    path = chunk_file(cfg, "hidden")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    split = config(tiny_target_dir, data, tmp_path / "run", **{"extract.tensor_parallel_size": 2})
    damaged = path.read_bytes()
    with pytest.raises(ConfigError, match=r"^verify --repair: .* extract.tensor_parallel_size=2, which one process cannot run, so "
                                          r"its 1 bad shard\(s\) .* were left as they are; run `torchrun --nproc_per_node 2 -m "
                                          r"stage1_extract verify --repair` with this run's --config and overrides$"):
        commands.cmd_verify(split, repair=True, progress=False)
    assert path.read_bytes() == damaged and (Path(cfg.store.url(cfg.run_dir)) / part_path(1)).exists()
    assert commands.cmd_verify(split, repair=False)["bad_shards"]  # verify alone still reports it


def test_repair_with_a_config_that_cannot_continue_the_store_deletes_nothing(built, tiny_target_dir, tmp_path):
    """Deleting first and refusing after would leave the bad shard gone and the manifest listing it:
    the refusal comes before anything is deleted, naming the setting that continues the store."""
    cfg, data = built
    path = chunk_file(cfg, "hidden")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    damaged = path.read_bytes()
    other = config(tiny_target_dir, data, tmp_path / "run", **{"extract.top_k": 4})
    with pytest.raises(StoreError, match=r"^verify --repair deleted nothing: .*plan.json: this store was started with "
                                         r"extract.top_k=8 \(top_k\), the config now gives 4: set extract.top_k=8 to continue"):
        commands.cmd_verify(other, repair=True, progress=False)
    assert path.read_bytes() == damaged and (Path(cfg.store.url(cfg.run_dir)) / part_path(1)).exists()
    assert commands.cmd_verify(cfg, repair=True, progress=False)["ok"]  # the store's own config repairs it


def test_verify_cli_exits_nonzero_naming_the_shard(built):
    import subprocess
    import sys

    cfg, data = built
    name = read_manifest(cfg.store.url(cfg.run_dir))["shards"][0]["name"]
    shutil.rmtree(Path(cfg.store.url(cfg.run_dir)) / "shards" / name)
    overrides = stage1_overrides(Path(cfg.target.path), data, Path(cfg.run_dir))
    out = subprocess.run([sys.executable, "-m", "stage1_extract", "verify", *overrides], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 1 and name in out.stdout


def test_part_records_are_listed_once_and_read_without_per_shard_exists(built, monkeypatch):
    """On an object store every exists/read is a request: a finished store's rerun lists parts/
    and reads each record (in parallel), with no per-shard existence checks."""
    from shared.store import StoreFiles

    cfg, _ = built
    calls: list[tuple[str, str]] = []
    for name in ("exists", "read_json", "list"):
        original = getattr(StoreFiles, name)

        def counting(self, rel, _original=original, _name=name):
            calls.append((_name, rel))
            return _original(self, rel)

        monkeypatch.setattr(StoreFiles, name, counting)
    shards = len(read_manifest(cfg.store.url(cfg.run_dir))["shards"])
    out = commands.cmd_extract(cfg, progress=False)
    assert out["shards_extracted_here"] == 0
    part_reads = [rel for name, rel in calls if name == "read_json" and rel.startswith("parts/")]
    assert sorted(set(part_reads)) == [f"parts/shard-{i:06d}.json" for i in range(shards)]
    assert len(part_reads) == 2 * shards  # the done check and the manifest merge
    assert not [rel for name, rel in calls if name == "exists" and rel.startswith("parts/")]
    assert [rel for name, rel in calls if name == "list"].count("parts") == 3  # done check, merge, orphan sweep


def test_a_target_that_only_moved_is_the_same_target(built, tiny_target_dir, tmp_path):
    cfg, data = built
    moved = shutil.copytree(tiny_target_dir, tmp_path / "elsewhere" / "same-weights")
    report = commands.cmd_status(config(moved, data, Path(cfg.run_dir)))
    assert report["complete"] and report["counts"]["stale"] == 0 and report["settings_changed"] == []


def test_weights_edited_in_place_with_size_and_mtime_restored_are_seen(built, tiny_target_dir, tmp_path):
    """64 bytes of the weights changed, the file's size kept and its mtime set back: the fingerprint
    cache must not answer from (size, mtime) alone; `status --deep` rehashes whatever it holds."""
    import os

    cfg, data = built
    target = shutil.copytree(tiny_target_dir, tmp_path / "target")
    moved = config(target, data, Path(cfg.run_dir))
    assert commands.cmd_status(moved)["complete"]  # fingerprint cached for this folder
    weights = target / "model.safetensors"
    before = weights.stat()
    with open(weights, "r+b") as fh:
        fh.seek(before.st_size - 200)
        chunk = bytearray(fh.read(64))
        fh.seek(before.st_size - 200)
        fh.write(bytes(b ^ 0x55 for b in chunk))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_size == before.st_size and weights.stat().st_mtime_ns == before.st_mtime_ns
    report = commands.cmd_status(moved)
    assert report["counts"]["stale"] == 2 and report["settings_changed"] == ["target.weights_sha256"]
    assert commands.cmd_status(moved, deep=True)["settings_changed"] == ["target.weights_sha256"]


def shift_lengths(record: dict) -> None:
    """Five tokens moved from the record's second sample to its first: the sum (num_tokens) holds."""
    record["lengths"][0] += 5
    record["lengths"][1] -= 5


def shift_pairs(record: dict) -> None:
    """Sample 0's supervised pairs one off (still a count its length allows): the block budget's input."""
    record["supervised_pairs"][0] += 1 if record["supervised_pairs"][0] == 0 else -1


@pytest.mark.parametrize(
    "field, edit",
    [
        ("lengths", shift_lengths),
        # The default run checks one count and the checksum; the other fields take the same path (test-all).
        pytest.param("sample_ids", lambda r: r["sample_ids"].__setitem__(slice(0, 2), r["sample_ids"][1::-1]), marks=pytest.mark.slow),
        pytest.param("content_hashes", lambda r: r["content_hashes"].__setitem__(3, "0" * 16), marks=pytest.mark.slow),
        pytest.param("supervised_pairs", lambda r: shift_pairs(r), marks=pytest.mark.slow),
        pytest.param("bytes", lambda r: r.update(bytes=r["bytes"] + 1), marks=pytest.mark.slow),
        ("checksum", lambda r: r.update(checksum="0" * 64)),
        ("index", lambda r: r.update(name=r["name"].replace("shard-000001-", "shard-000007-"))),
    ],
)
def test_verify_names_a_manifest_field_that_contradicts_its_shard_and_repair_rebuilds_the_record(built, field, edit):
    """The manifest record alone is wrong (its part record agrees with the shard): verify names the
    shard and the field, and --repair rebuilds the record without extracting anything."""
    cfg, _ = built
    url = cfg.store.url(cfg.run_dir)
    good = read_manifest(url)
    manifest = json.loads((Path(url) / "manifest.json").read_text())
    name = manifest["shards"][1]["name"]
    edit(manifest["shards"][1])
    (Path(url) / "manifest.json").write_text(json.dumps(manifest))
    report = commands.cmd_verify(cfg)
    (bad,) = report["bad_shards"]
    wanted = "name" if field == "index" else field  # a renamed group is not there
    assert not report["ok"] and wanted in bad["fields"] and bad["fix"] == "rebuild the record"
    assert bad["shard"] == manifest["shards"][1]["name"] and bad["index"] == 1
    repaired = commands.cmd_verify(cfg, repair=True, progress=False)
    assert repaired["ok"] and repaired["records_rebuilt"] == [bad["shard"]] and repaired["reextracted"] == []
    assert read_manifest(url)["shards"] == good["shards"] and read_manifest(url)["shards"][1]["name"] == name


@pytest.mark.parametrize("field, edit", [("lengths", shift_lengths), pytest.param("supervised_pairs", shift_pairs, marks=pytest.mark.slow)])
def test_verify_extracts_again_when_the_part_record_is_wrong_too(built, field, edit):
    """--repair never copies a wrong count from the part record: it checks that record against the shard too."""
    cfg, _ = built
    url = Path(cfg.store.url(cfg.run_dir))
    good = contents(cfg)
    for path in (url / "manifest.json", url / "parts" / "shard-000000.json"):
        data = json.loads(path.read_text())
        edit(data["shards"][0] if "shards" in data else data)
        path.write_text(json.dumps(data))
    (bad,) = commands.cmd_verify(cfg)["bad_shards"]
    assert bad["fields"] == [field] and bad["fix"] == "extract again"
    assert bad["error"].startswith(f"{field}: sample 0 has") and bad["index"] == 0
    repaired = commands.cmd_verify(cfg, repair=True, progress=False)
    assert repaired["ok"] and repaired["reextracted"] == [bad["shard"]]
    assert contents(cfg) == good


# ---- writers and a training run reading the same store ---------------------------------------------
def test_writers_are_refused_while_training_reads_the_store_naming_the_reader(built):
    """Training claims a local store for its run: `reprocess` and `extract` are refused naming it
    (command, pid, host, since); once training closes its data they run; a claim whose process
    died is passed over; and training does not start while a writer holds the store."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    from shared.errors import BusyError
    from shared.lock import exclusive
    from shared.target import resolve_target
    from stage2_train.data.view import DataSettings, open_train_data

    cfg, _ = built
    url = cfg.store.url(cfg.run_dir)
    data = open_train_data(url, resolve_target(cfg.target), cfg.sampler, DataSettings(block_size=4, holdout_fraction=0.0))
    reader = rf"is being read by `stage2_train train` \(pid {os.getpid()} on {socket.gethostname()}, since [\d-]+ [\d:]+\)"
    with pytest.raises(BusyError, match=reader + r"; wait for it to finish or stop it \(`stage1_extract reprocess` would replace shards under it\)"):
        commands.cmd_reprocess(cfg, progress=False)
    with pytest.raises(BusyError, match=reader):
        commands.cmd_extract(cfg, progress=False)
    data.close()
    assert commands.cmd_reprocess(cfg, progress=False)["shards_extracted_here"] == 0

    claim = "from shared.reader import StoreReader; import sys, time; r = StoreReader(sys.argv[1]).hold('stage2_train train'); print('held', flush=True); time.sleep(60)"
    dead = subprocess.Popen([sys.executable, "-c", claim, url], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert dead.stdout.readline().strip() == "held"
    with pytest.raises(BusyError, match=rf"is being read by `stage2_train train` \(pid {dead.pid} "):
        commands.cmd_reprocess(cfg, progress=False)
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    commands.cmd_reprocess(cfg, progress=False)  # the kernel dropped the dead reader's flock
    assert not list((Path(url) / ".dflash.readers").iterdir())

    with exclusive(url, "stage1_extract reprocess"):
        with pytest.raises(BusyError, match=r"is being written by `stage1_extract reprocess` .*; wait for it to finish before `stage2_train train` reads it"):
            open_train_data(url, resolve_target(cfg.target), cfg.sampler, DataSettings(block_size=4, holdout_fraction=0.0))


def test_a_shard_replaced_under_a_reader_without_a_claim_is_named_as_a_rewrite(built):
    """An object store (or a folder where no claim can be made): a reader finds a shard gone after
    `reprocess` replaced it. The store is fine: the error says it was rewritten while being read,
    not to repair it."""
    from shared.errors import StoreError
    from shared.reader import StoreReader

    cfg, data = built
    url = cfg.store.url(cfg.run_dir)
    reader = StoreReader(url)  # no claim
    old = reader.manifest["shards"][1]["name"]
    reader[0]
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[27]["messages"][1]["content"] = "an edited answer"
    write_jsonl(data, rows)
    assert commands.cmd_reprocess(cfg, progress=False)["reextracted"] == [1]
    with pytest.raises(StoreError, match=rf"shard {old} cannot be opened .*, and manifest\.json changed since this run opened the store: it was rewritten") as caught:
        reader[len(reader) - 1]
    assert "run `python -m stage1_extract verify --repair`" not in str(caught.value)
    fresh = StoreReader(url)  # a store damaged under an unchanged manifest still says what repairs it
    shutil.rmtree(Path(url) / "shards" / fresh.manifest["shards"][1]["name"] / "hidden")
    with pytest.raises(StoreError, match=r"lacks the array\(s\) \['hidden'\]; run `python -m stage1_extract verify --repair`"):
        fresh[len(fresh) - 1]


@pytest.mark.parametrize("rank", [0, 1])
def test_reprocess_under_torchrun_joins_before_rank_0_reads_the_shards(built, monkeypatch, rank):
    """Rank 0's reading of the shards may re-tokenize the whole data file: every rank has joined the
    process group first, so the others wait for it on the work group (hours), never in the join
    (JOIN_TIMEOUT, 10 minutes); only rank 0 reads."""
    cfg, _ = built
    calls = []
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(commands, "join_ranks", lambda world, backend: calls.append(("join", world, backend)))
    report = commands.shard_report(cfg)
    monkeypatch.setattr(commands, "shard_report", lambda c: calls.append("report") or report)
    from stage1_extract import distributed

    monkeypatch.setattr(distributed, "all_ok", lambda world, ok, behind_work=False: calls.append(("agree", ok, behind_work)) or ok)
    monkeypatch.setattr(commands, "cmd_extract", lambda c, **k: calls.append("extract") or {"rank": rank})
    commands.cmd_reprocess(cfg, progress=False)
    agreed = ("agree", True, True)  # on the work group
    assert calls == [("join", 2, "gloo"), "report", agreed, "extract"] if rank == 0 else [("join", 2, "gloo"), agreed, "extract"]
