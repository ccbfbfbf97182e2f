"""The token cache: tokenized once (in parallel), then read by every later command and rank."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shared import token_cache
from shared.config import load_run_config
from stage1_extract import commands, prepare, tokens
from stage1_extract.resolve import prepare_run
from testkit.data import chat_rows, stage1_overrides, write_jsonl


def prepared(tiny_target_dir, data, run_dir, **extra):
    cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, run_dir, **extra))
    return prepare_run(cfg)


def as_tuples(prep):
    return [
        (r.sample_id, r.row_hash, r.input_ids.tolist(), r.loss_mask.tolist(), r.truncated, r.skipped) for r in prep.rows
    ]


def test_second_prepare_reads_the_cache_and_equals_a_fresh_tokenization(tiny_target_dir, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(30))
    first = prepared(tiny_target_dir, data, tmp_path / "run", **{"data.max_length": 96})
    caches = list((tmp_path / "run" / "cache").glob("tokens-*"))
    assert len(caches) == 1 and (caches[0] / "meta.json").is_file()
    assert any(r.truncated for r in first.rows)  # the flags travel through the cache too

    uncached = prepared(tiny_target_dir, data, tmp_path / "other", **{"data.max_length": 96, "data.token_cache": False})
    assert as_tuples(uncached) == as_tuples(first)
    assert not (tmp_path / "other" / "cache").exists()

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again despite a matching cache")

    monkeypatch.setattr(prepare, "tokenize_all", no_tokenizing)
    second = prepared(tiny_target_dir, data, tmp_path / "run", **{"data.max_length": 96})
    assert as_tuples(second) == as_tuples(first)
    assert vars(second.stats) == vars(first.stats) and second.header == first.header
    assert not second.rows[0].input_ids.flags.writeable  # memory-mapped, read-only



def test_a_changed_row_or_setting_tokenizes_again_and_replaces_the_cache(tiny_target_dir, tmp_path):
    rows = chat_rows(12)
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    run = tmp_path / "run"
    before = prepared(tiny_target_dir, data, run)
    rows[5]["messages"][1]["content"] = "an edited answer"
    write_jsonl(data, rows)
    after = prepared(tiny_target_dir, data, run)
    assert [r.row_hash for r in after.rows] != [r.row_hash for r in before.rows]
    assert after.rows[5].row_hash != before.rows[5].row_hash and after.rows[4].row_hash == before.rows[4].row_hash
    shorter = prepared(tiny_target_dir, data, run, **{"data.max_length": 96})
    assert max(len(r.input_ids) for r in shorter.rows) == 96
    assert len(list((run / "cache").glob("tokens-*"))) == 1  # only the latest key is kept


def test_parallel_tokenizing_equals_serial(tiny_target_dir, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(40, seed=3))
    serial = prepared(tiny_target_dir, data, tmp_path / "serial", **{"data.tokenize_workers": 1})
    monkeypatch.setattr(tokens, "_PARALLEL_MIN_ROWS", 0)
    parallel = prepared(tiny_target_dir, data, tmp_path / "parallel", **{"data.tokenize_workers": 2})
    assert as_tuples(parallel) == as_tuples(serial)


def test_a_bad_row_in_a_worker_names_the_file_and_row_and_caches_nothing(tiny_target_dir, tmp_path, monkeypatch):
    rows = chat_rows(10)
    rows[7] = {"messages": [{"role": "user", "content": "a question"}, {"role": "user", "content": "no answer"}]}
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    monkeypatch.setattr(tokens, "_PARALLEL_MIN_ROWS", 0)
    with pytest.raises(ValueError, match=r"chat\.jsonl: row 7: no assistant tokens"):
        prepared(tiny_target_dir, data, tmp_path / "run", **{"data.tokenize_workers": 2})
    assert not list((tmp_path / "run").glob("cache/tokens-*"))


def test_tokenize_workers_is_validated(tiny_target_dir, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(2))
    with pytest.raises(ValueError, match="data.tokenize_workers"):
        prepared(tiny_target_dir, data, tmp_path / "run", **{"data.tokenize_workers": -1})


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01  # inside the array, past the .npy header: one token id becomes another
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[:-40])


@pytest.mark.parametrize("damage", [flip_a_byte, pytest.param(truncate, marks=pytest.mark.slow)], ids=["flipped byte", "truncated"])
def test_a_damaged_token_cache_is_named_rebuilt_and_never_reaches_the_store(tiny_target_dir, tmp_path, damage, caplog):
    """A flipped byte used to pass into the store as a token nobody wrote (and verify passed it); a
    truncated file ended in an mmap traceback. Both are now a warning naming the file, a rebuilt
    cache, and a store equal to the clean one, shard for shard."""
    from shared.store import StoreFiles, read_shard_arrays

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(12))
    clean_cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "clean"))
    commands.cmd_extract(clean_cfg, progress=False)
    cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "run"))
    prepare_run(cfg)  # builds the cache
    cache = next((tmp_path / "run" / "cache").glob("tokens-*"))
    damage(cache / "ids.npy")
    assert commands.cmd_status(cfg)["counts"]["missing"] > 0  # status reads the cache: no traceback
    assert f"token cache file {cache / 'ids.npy'}" in caplog.text and "rebuilding the cache" in caplog.text
    caplog.clear()
    damage(cache / "ids.npy")
    commands.cmd_extract(cfg, progress=False)
    assert f"token cache file {cache / 'ids.npy'}" in caplog.text
    clean = StoreFiles(clean_cfg.store.url(clean_cfg.run_dir)).read_json("manifest.json")
    rebuilt = StoreFiles(cfg.store.url(cfg.run_dir)).read_json("manifest.json")
    assert [s["name"] for s in rebuilt["shards"]] == [s["name"] for s in clean["shards"]]
    assert [s["checksum"] for s in rebuilt["shards"]] == [s["checksum"] for s in clean["shards"]]
    for record in clean["shards"]:
        a = read_shard_arrays(clean_cfg.store.url(clean_cfg.run_dir), record["name"])
        b = read_shard_arrays(cfg.store.url(cfg.run_dir), record["name"])
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert json.loads((cache / "meta.json").read_text())["inputs"]["version"] == token_cache.TOKENS_VERSION
    caplog.clear()
    prepare_run(cfg)  # the rebuilt cache verifies: no warning
    assert "token cache" not in caplog.text


def test_an_unwritable_cache_folder_only_costs_a_retokenize(tiny_target_dir, tmp_path, monkeypatch, caplog):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6))

    def full_disk(self, rows, stats):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(token_cache.TokenCache, "save", full_disk)
    first = prepared(tiny_target_dir, data, tmp_path / "run")
    assert len(first.rows) == 6 and "could not write the token cache" in caplog.text


def test_a_file_without_usable_rows_is_refused_by_name(tiny_target_dir, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", ["not json", "{also not json"])
    with pytest.raises(ValueError, match=r"chat\.jsonl: no usable rows"):
        prepared(tiny_target_dir, data, tmp_path / "run", **{"data.on_bad_row": "skip"})


def test_verify_deep_proves_a_store_matches_its_data(tiny_target_dir, tmp_path, monkeypatch):
    """A store made from tokens the data never held (what a silently damaged cache used to write)
    passes the shallow verify, since its checksums are its own; --deep tokenizes the data again,
    names the shard and the row, and --repair rebuilds the cache and the shard."""
    from shared.store import StoreFiles
    from stage1_extract.batching import content_hash

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(12))
    clean_cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "clean"))
    commands.cmd_extract(clean_cfg, progress=False)
    cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "run"))
    real = prepare.tokenized_rows

    def one_token_became_another(*args, **kwargs):
        rows, stats, sha = real(*args, **kwargs)
        rows[5].input_ids = rows[5].input_ids.copy()
        rows[5].input_ids[3] += 1
        rows[5].content_hash = content_hash(rows[5].input_ids, rows[5].loss_mask)  # the store agrees with itself
        return rows, stats, sha

    monkeypatch.setattr(prepare, "tokenized_rows", one_token_became_another)
    commands.cmd_extract(cfg, progress=False)
    monkeypatch.setattr(prepare, "tokenized_rows", real)
    assert commands.cmd_verify(cfg)["ok"]  # the shard agrees with itself
    deep = commands.cmd_verify(cfg, deep=True)
    assert not deep["ok"] and len(deep["bad_shards"]) == 1
    assert deep["bad_shards"][0]["error"] == "input row 5: stored input_ids differ from the data at token 3"
    repaired = commands.cmd_verify(cfg, repair=True, deep=True)
    assert repaired["ok"] and repaired["repaired"] == [deep["bad_shards"][0]["shard"]]
    clean = StoreFiles(clean_cfg.store.url(clean_cfg.run_dir)).read_json("manifest.json")["shards"]
    fixed = StoreFiles(cfg.store.url(cfg.run_dir)).read_json("manifest.json")["shards"]
    assert [s["checksum"] for s in fixed] == [s["checksum"] for s in clean]


def test_a_store_tokenized_at_a_version_with_the_same_tokens_is_not_doubted(tiny_target_dir, tmp_path):
    """Token cache version 11 added only each row's opening hash beside the tokens: every store made
    at 10, trained on without a cache of 11 (right after upgrading), was warned about as maybe holding
    other tokens. A version whose rows tokenize alike is taken as today's; an older one is still named."""
    from shared.freshness import store_staleness
    from shared.paths import RunPaths
    from shared.reader import StoreReader
    from shared.target import resolve_target

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6))
    cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "run"))
    commands.cmd_extract(cfg, progress=False)
    prepare.discard_token_cache(RunPaths.of(cfg).token_cache)
    manifest = StoreReader(cfg.store.url(cfg.run_dir)).manifest
    target = resolve_target(cfg.target)
    # 13 supervises turns a template opens otherwise as the last turn: a store made at 12 or before may hold other masks
    for version, doubted in ((token_cache.SAME_TOKENS_SINCE, False), (12, True), (9, True)):
        manifest["data"]["tokens_version"] = version
        report = store_staleness(cfg, target, manifest)
        assert report.current and report.rows_checked_by == "data sha256"
        assert any("tokenization version" in w for w in report.warnings) is doubted, (version, report.warnings)


# Mistral's and Llama 2's templates refuse a conversation whose roles do not alternate (ShareGPT data
# with two user turns in a row), through raise_exception: a jinja TemplateError, not a ValueError.
ALTERNATING = """{%- for m in messages -%}
{%- if not loop.first and m.role == messages[loop.index0 - 1].role -%}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
{%- endif -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"""


@pytest.mark.parametrize("workers", [1, 2], ids=["serial", "worker pool"])
def test_a_template_that_raises_is_a_bad_row_named_or_skipped(tiny_target_dir, tmp_path, monkeypatch, copy_tree, workers):
    target = copy_tree(tiny_target_dir, tmp_path / "target")
    (target / "chat_template.jinja").write_text(ALTERNATING)
    rows = chat_rows(10)
    rows[7]["messages"].insert(1, {"role": "user", "content": "and another thing"})
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    monkeypatch.setattr(tokens, "_PARALLEL_MIN_ROWS", 0)
    with pytest.raises(ValueError, match=r"chat\.jsonl: row 7: the chat template refused the row: Conversation roles must "
                                         r"alternate user/assistant/user/assistant/\.\.\. \(set data\.on_bad_row=skip"):
        prepared(target, data, tmp_path / "run", **{"data.tokenize_workers": workers})
    assert not list((tmp_path / "run").glob("cache/tokens-*"))
    skipped = prepared(target, data, tmp_path / "run", **{"data.tokenize_workers": workers, "data.on_bad_row": "skip"})
    assert [r.sample_id for r in skipped.rows] == [0, 1, 2, 3, 4, 5, 6, 8, 9]
    assert skipped.stats.bad_rows == 1
    assert skipped.stats.bad_examples == [f"{data}: row 7: the chat template refused the row: Conversation roles must "
                                          f"alternate user/assistant/user/assistant/..."]


def test_answers_cut_counts_the_rows_stored_only(tiny_target_dir, tmp_path):
    """answers_cut (and answers_cut_unknown) were counted as rows were read: a row then skipped as too long
    or dropped as bad still counted, so the manifest reported cut answers the store does not hold."""
    def row(i, words, **answer):
        return {"messages": [{"role": "user", "content": f"{i}: say it"},
                             {"role": "assistant", "content": " ".join(["fox"] * words), **answer}]}

    ids = [1, 2, 3]
    rows = [row(0, 3, token_ids=ids, answer_cut=True), row(1, 3, token_ids=ids * 40, answer_cut=True),  # too long
            row(2, 0, token_ids=[], answer_cut=True),  # nothing to supervise: a bad row
            row(3, 3, token_ids=ids), row(4, 3, token_ids=ids * 40), row(5, 3)]  # 3 and 4: cut or not unknown
    data = write_jsonl(tmp_path / "answers.jsonl", rows)
    prep = prepared(tiny_target_dir, data, tmp_path / "run", **{"data.max_length": 64, "data.on_long": "skip",
                                                                  "data.on_bad_row": "skip", "data.regenerate": False})
    assert [(r.sample_id, r.skipped) for r in prep.rows] == [(0, False), (1, True), (3, False), (4, True), (5, False)]
    assert (prep.stats.bad_rows, prep.stats.answers_cut, prep.stats.answers_cut_unknown) == (1, 1, 1)
