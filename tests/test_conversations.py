"""The data people have (issue 33, item 3): ShareGPT, OpenAI chat with tool calls, prompt/completion;
JSONL, JSON arrays, Parquet, Arrow and `datasets` folders; each file's format found or given; tool
calls and multi-turn supervised exactly where the assistant speaks (the tiny target's real SmolLM2
template, and a template that takes tool calls as structured fields)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shlex
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from shared import conversation_files
from shared.conversation_files import read_conversations, read_rows
from shared.conversations import Conversation, ReadStats
from shared.embedded import default_target_dir
from shared.errors import DataError, InputFileError
from stage1_extract.data import write_conversations_parquet
from stage1_extract.template import tokenize_conversation
from tests.conftest import write_jsonl

WEATHER_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
OPENAI_TOOL_ROW = {
    "messages": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome."},
    ],
    "tools": TOOLS,
}
# The same conversation as LLaMA-Factory writes ShareGPT: function_call / observation turns, tools as JSON text.
SHAREGPT_TOOL_ROW = {
    "system": "Use tools.",
    "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": '{"sky": "sunny"}'},
        {"from": "gpt", "value": "It is sunny."},
        {"from": "user", "content": "Thanks!"},
        {"from": "assistant", "content": "You're welcome."},
    ],
    "tools": json.dumps(TOOLS),
}
CHAT = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_target_dir())


def supervised(tokenizer, sample) -> str:
    return tokenizer.decode(sample.input_ids[sample.loss_mask])


def read_one(path, **kwargs) -> Conversation:
    (conv,) = read_conversations(path, **kwargs)
    return conv


# ---- formats ------------------------------------------------------------------------------------------
def test_sharegpt_and_openai_rows_of_one_chat_read_alike(tmp_path):
    sharegpt = read_one(write_jsonl(tmp_path / "s.jsonl", [{"conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}]))
    openai = read_one(write_jsonl(tmp_path / "o.jsonl", [{"messages": [{"role": "system", "content": "Be brief."}, *CHAT]}]))
    completion = read_one(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2?", "completion": "4"}]))
    assert sharegpt.messages == openai.messages == [{"role": "system", "content": "Be brief."}, *CHAT]
    assert sharegpt.row_hash() == openai.row_hash()
    assert completion.messages == CHAT


def test_the_row_hash_of_messages_data_is_what_it_always_was(tmp_path):
    """Staleness is decided by it: existing stores stay current."""
    row = {"messages": [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi", "weight": 1}]}
    conv = read_one(write_jsonl(tmp_path / "o.jsonl", [row]))
    plain = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi"}]
    expected = hashlib.sha256(json.dumps(plain, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:32]
    assert conv.messages == plain and conv.row_hash() == expected


def test_tool_calls_read_alike_from_openai_and_sharegpt(tmp_path):
    openai = read_one(write_jsonl(tmp_path / "o.jsonl", [OPENAI_TOOL_ROW]))
    sharegpt = read_one(write_jsonl(tmp_path / "s.jsonl", [SHAREGPT_TOOL_ROW]))
    assert openai.messages[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"name": "get_weather", "arguments": '{"city": "Paris"}', "id": "call_1"}]}
    assert openai.messages[3] == {"role": "tool", "content": '{"sky": "sunny"}', "tool_call_id": "call_1"}
    assert openai.tools == sharegpt.tools == json.dumps(TOOLS)
    # ShareGPT carries no call id: otherwise the same conversation.
    without_ids = [{k: v for k, v in m.items() if k != "tool_call_id"} for m in openai.messages]
    without_ids[2] = {**without_ids[2], "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]}
    assert sharegpt.messages == without_ids


def test_openai_content_parts_and_developer_role(tmp_path):
    row = {"messages": [{"role": "developer", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "2+2?"}, {"type": "text", "text": "Quick."}]},
                        {"role": "assistant", "content": "4"}]}
    assert read_one(write_jsonl(tmp_path / "o.jsonl", [row])).messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?\nQuick."}, {"role": "assistant", "content": "4"}]
    row["messages"][1]["content"].append({"type": "image_url", "image_url": {"url": "x"}})
    with pytest.raises(DataError, match=r"row 0: messages\[1\]\.content has parts of type \['image_url'\]: only text is read"):
        list(read_conversations(write_jsonl(tmp_path / "o.jsonl", [row])))


def test_a_row_in_another_format_than_its_file_is_named(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}] * 3
    rows[2] = {"messages": CHAT}
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(DataError, match=r"mixed\.jsonl: row 2: expected ShareGPT \(conversations: \[\{from, value\}\]\) like the rows "
                                        r"before it, found keys \['messages'\]"):
        list(read_conversations(path))
    with pytest.raises(DataError, match=r"row 0: expected OpenAI chat \(messages: \[\{role, content\}\]\) \(data.format=openai\), "
                                        r"found keys \['conversations'\]"):
        list(read_conversations(path, data_format="openai"))
    with pytest.raises(DataError, match=r"row 0: fits no known format \(expected ShareGPT .*, OpenAI chat .* or prompt/completion "
                                        r"\(prompt, completion\)\), found keys \['question'\]; data.format names one"):
        list(read_conversations(write_jsonl(tmp_path / "q.jsonl", [{"question": "q"}])))
    stats = ReadStats()
    assert [c.row for c in read_conversations(path, on_bad_row="skip", stats=stats)] == [0, 1]
    assert stats.bad_rows == 1


def test_unknown_sharegpt_speaker_and_a_broken_function_call_are_named(tmp_path):
    bad = [{"conversations": [{"from": "robot", "value": "x"}]},
           {"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "get_weather(Paris)"}]}]
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": [{"from": "human", "value": "q"}]}, *bad])
    stats = ReadStats()
    assert [c.row for c in read_conversations(path, on_bad_row="skip", stats=stats)] == [0]
    assert "row 1: conversations[0] has unknown speaker 'from': 'robot'" in stats.bad_examples[0]
    assert "row 2: conversations[1]: a function_call turn's value must be JSON {name, arguments}" in stats.bad_examples[1]


def test_a_rows_system_opens_the_conversation_in_every_format(tmp_path):
    """OpenAI and prompt/completion rows carry a top-level `system` as ShareGPT rows do; it was read
    for ShareGPT only, and the other two lost it without a count."""
    rows = [{"system": "Be brief.", "messages": CHAT}, {"system": "Be brief.", "prompt": "2+2?", "completion": "4"},
            {"system": "Be brief.", "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}]
    expected = [{"role": "system", "content": "Be brief."}, *CHAT]
    convs = [read_one(write_jsonl(tmp_path / f"{i}.jsonl", [row])) for i, row in enumerate(rows)]
    assert [c.messages for c in convs] == [expected] * 3
    as_a_turn = read_one(write_jsonl(tmp_path / "turn.jsonl", [{"messages": expected}]))
    assert {c.row_hash() for c in convs} == {as_a_turn.row_hash()}
    with pytest.raises(DataError, match=r"row 0: 'system' must be a string"):
        list(read_conversations(write_jsonl(tmp_path / "bad.jsonl", [{"system": ["x"], "messages": CHAT}])))


def test_a_row_with_both_messages_and_conversations_is_refused_unless_data_format_chooses(tmp_path):
    """They may be two different chats: auto-detection read `messages` and dropped `conversations`."""
    row = {"messages": CHAT, "conversations": [{"from": "human", "value": "B?"}, {"from": "gpt", "value": "b"}]}
    path = write_jsonl(tmp_path / "both.jsonl", [{"messages": CHAT}, row])
    with pytest.raises(DataError, match=r"both\.jsonl: row 1: holds both 'messages' \(OpenAI chat\) and 'conversations' "
                                        r"\(ShareGPT\), and only one is read: remove one, or set data.format=openai"):
        list(read_conversations(path))
    stats = ReadStats()
    assert [c.row for c in read_conversations(path, on_bad_row="skip", stats=stats, log_skips=False)] == [0]
    assert stats.bad_rows == 1
    assert [c.messages for c in read_conversations(path, data_format="openai")] == [CHAT, CHAT]
    assert next(read_conversations(path, data_format="sharegpt", on_bad_row="skip")).messages == [
        {"role": "user", "content": "B?"}, {"role": "assistant", "content": "b"}]


def test_a_sharegpt_turn_whose_value_and_content_differ_is_refused_by_row_and_turn(tmp_path):
    """`value` was read and a different `content` dropped unread. The same text twice, or one of them
    null (a Parquet table holding both spellings has both columns), reads as one turn."""
    rows = [
        {"conversations": [{"from": "human", "value": "2+2?", "content": "2+2?"}, {"from": "gpt", "value": "4"}]},
        {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4", "content": "Four."}]},
        {"conversations": [{"from": "human", "value": None, "content": "2+2?"}, {"from": "gpt", "value": "4", "content": None}]},
    ]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    with pytest.raises(DataError, match=r"s\.jsonl: row 1: conversations\[1\] holds both 'value' and 'content', with different "
                                        r"text: only one would be read and the other dropped; keep the one that is the "
                                        r"turn's text \(set data\.on_bad_row=skip to skip and count bad rows\)$"):
        list(read_conversations(path))
    stats = ReadStats()
    kept = list(read_conversations(path, on_bad_row="skip", stats=stats, log_skips=False))
    assert [(c.row, c.messages) for c in kept] == [(0, CHAT), (2, CHAT)]
    assert stats.bad_rows == 1 and "row 1: conversations[1] holds both 'value' and 'content'" in stats.bad_examples[0]
    # One text written twice: as a string and as text parts, or beside an empty string.
    same = [{"conversations": [{"from": "human", "value": "2+2?", "content": [{"type": "text", "text": "2+2?"}]},
                               {"from": "gpt", "value": "", "content": "4"}]}]
    assert [c.messages for c in read_conversations(write_jsonl(tmp_path / "same.jsonl", same))] == [CHAT]
    # The speaker alike: `from` and `role` that disagree are refused, one null is the other, synonyms agree.
    speakers = [
        {"conversations": [{"from": None, "role": "user", "value": "2+2?"}, {"from": "gpt", "role": "assistant", "value": "4"}]},
        {"conversations": [{"from": "human", "role": "assistant", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
    ]
    path = write_jsonl(tmp_path / "speakers.jsonl", speakers)
    with pytest.raises(DataError, match=r"speakers\.jsonl: row 1: conversations\[0\] holds both 'from' \('human'\) and 'role' "
                                        r"\('assistant'\): only one would be read; keep the one that names the speaker"):
        list(read_conversations(path))
    assert [c.messages for c in read_conversations(path, on_bad_row="skip", log_skips=False)] == [CHAT]


# ---- files --------------------------------------------------------------------------------------------
def test_a_json_array_reads_element_by_element(tmp_path, monkeypatch):
    """Numbered by element; read in chunks smaller than a row, a BOM first, white space anywhere."""
    monkeypatch.setattr(conversation_files, "ARRAY_CHUNK", 7)
    rows = [{"conversations": [{"from": "human", "value": f"question {i} " + "é" * i}, {"from": "gpt", "value": "a"}]}
            for i in range(5)]
    path = tmp_path / "sharegpt.json"
    path.write_bytes(b"\xef\xbb\xbf \n[\n" + ",\n  ".join(json.dumps(r, ensure_ascii=False) for r in rows).encode() + b"\n]\n")
    convs = list(read_conversations(path))
    assert [c.row for c in convs] == [0, 1, 2, 3, 4]
    assert [c.messages[0]["content"] for c in convs] == [r["conversations"][0]["value"] for r in rows]
    assert list(read_conversations(path, max_samples=2)) == convs[:2]
    (tmp_path / "empty.json").write_text("[ ]")
    assert list(read_conversations(tmp_path / "empty.json")) == []


def test_a_broken_element_ends_a_json_array_by_name_even_when_skipping(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("[" + json.dumps({"messages": CHAT}) + ', {"messages": [}, ' + json.dumps({"messages": CHAT}) + "]")
    with pytest.raises(DataError, match=r"broken\.json: row 1: not valid JSON .* a JSON array cannot be read past a broken element"):
        list(read_conversations(path, on_bad_row="skip"))
    raw = b'\xef\xbb\xbf[{"messages": [{"role": "user", "content": "caf\xe9"}]}]'
    path.write_bytes(raw)
    at = raw.index(b"\xe9")  # the BOM counted: a byte offset in the file as it is
    with pytest.raises(DataError, match=rf"row 0: not UTF-8 \(byte 0xe9 at byte {at} of the file\)"):
        list(read_conversations(path))


def write_arrow_stream(path, table):
    with pa.ipc.new_stream(path, table.schema) as writer:
        writer.write_table(table, max_chunksize=2)


def save_to_disk(folder, rows, shards):
    """What `datasets` 5.2 `Dataset.save_to_disk(folder, num_shards=shards)` writes (checked against
    it): Arrow IPC stream files, state.json listing them in order, dataset_info.json."""
    folder.mkdir()
    per = -(-len(rows) // shards)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    for i, name in enumerate(names):
        write_arrow_stream(folder / name, pa.Table.from_pylist(rows[i * per : (i + 1) * per]))
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names], "_split": None}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return folder


def test_datasets_folders_parquet_and_arrow_files_number_rows_across_files(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]} for i in range(7)]
    expected = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(7)]
    saved = save_to_disk(tmp_path / "saved", rows, shards=3)
    assert [(c.row, c.messages) for c in read_conversations(saved)] == list(enumerate(expected))
    parquet = tmp_path / "parquet"
    parquet.mkdir()
    for i in range(0, 7, 3):
        pq.write_table(pa.Table.from_pylist(rows[i : i + 3]), parquet / f"train-{i:05d}.parquet")
    assert [(c.row, c.messages) for c in read_conversations(parquet)] == list(enumerate(expected))
    arrow_file = tmp_path / "one.arrow"  # the random-access file format too
    with pa.ipc.new_file(arrow_file, pa.Table.from_pylist(rows).schema) as writer:
        writer.write_table(pa.Table.from_pylist(rows))
    assert [c.messages for c in read_conversations(arrow_file)] == expected
    # A DatasetDict holds splits: which one is the data is the user's to say.
    splits = tmp_path / "dict"
    splits.mkdir()
    save_to_disk(splits / "train", rows, 1)
    (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(InputFileError, match=r"DatasetDict saved by `datasets` with splits train, test: set data.path to one split's "
                                             r"folder \(.*dict/train\)"):
        list(read_conversations(splits))


def hub_dataset(root, rows, suffix=".parquet", prefix=""):
    """A Hub dataset's layout (HuggingFaceH4/ultrachat_200k): data/<split>-NNNNN-of-NNNNN.parquet, or
    with `prefix` the `datasets` cache's <name>-<split>-NNNNN-of-NNNNN.arrow; rows 0-4 train (two
    files), 5-6 test."""
    data = root / "data"
    data.mkdir(parents=True)
    for name, part in (("train_sft-00000-of-00002", rows[:3]), ("train_sft-00001-of-00002", rows[3:5]),
                       ("test_sft-00000-of-00001", rows[5:])):
        if suffix == ".parquet":
            pq.write_table(pa.Table.from_pylist(part), data / f"{name}{suffix}")
        else:
            write_arrow_stream(data / f"{prefix}{name}{suffix}", pa.Table.from_pylist(part))
    return data


def test_a_folder_of_several_splits_is_refused_naming_the_data_path_of_each(tmp_path):
    """data.path=<dataset>/data read the train and test splits as one data set. The refusal names each
    split's glob, and that data.path reads exactly the split's rows, numbered across its files."""
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(7)]
    for suffix, prefix in ((".parquet", ""), (".arrow", "ultrachat_200k-")):
        data = hub_dataset(tmp_path / suffix[1:], rows, suffix, prefix)
        for given in (data.parent, data):  # the dataset folder's hint says what the data/ folder's refusal says
            with pytest.raises(InputFileError) as refused:
                list(read_conversations(given))
            message = str(refused.value)
            assert f"train_sft (2 files): 'data.path={data}/{prefix}train_sft-*{suffix}'" in message
            assert f"test_sft (1 file): 'data.path={data}/{prefix}test_sft-*{suffix}'" in message
        assert "holds the files of several splits" in message
        train = shlex.split(re.search(r"train_sft \(2 files\): ('[^']+')", message)[1])[0].removeprefix("data.path=")
        assert [(c.row, c.messages[0]["content"]) for c in read_conversations(train)] == [(i, f"q{i}") for i in range(5)]
        assert [c.row for c in read_conversations(f"{data}/{prefix}test_sft-*{suffix}")] == [0, 1]
    with pytest.raises(InputFileError, match=r"data.path=.*/data/valid-\*\.parquet matches no file"):
        list(read_conversations(tmp_path / "parquet" / "data" / "valid-*.parquet"))
    one = tmp_path / "one"  # one split's files, or files that name no split, read as before
    one.mkdir()
    for name in ("train-00000-of-00002.parquet", "train-00001-of-00002.parquet"):
        pq.write_table(pa.Table.from_pylist(rows[:2]), one / name)
    assert [c.row for c in read_conversations(one)] == [0, 1, 2, 3]
    pq.write_table(pa.Table.from_pylist(rows[:1]), one / "extra.parquet")
    with pytest.raises(InputFileError, match=r"train \(2 files\): 'data.path=.*/one/train-\*\.parquet'; 1 other file, of no "
                                             r"split \(extra.parquet\)"):
        list(read_conversations(one))
    plain = tmp_path / "plain"  # the Hub's one-file splits: data/train.parquet beside data/test.parquet
    plain.mkdir()
    for name in ("chunk1", "chunk2", "train"):
        pq.write_table(pa.Table.from_pylist(rows[:1]), plain / f"{name}.parquet")
    with pytest.raises(InputFileError, match=r"train \(1 file\): data.path=.*/plain/train\.parquet; 2 other files, of no split \(chunk1"):
        list(read_conversations(plain))
    (plain / "train.parquet").unlink()
    assert [c.row for c in read_conversations(plain)] == [0, 1]


def test_a_glob_is_a_data_path_for_every_command(tiny_target_dir, tmp_path):
    """Extraction reads the glob's files, and the store's source fingerprint is theirs: editing the
    test split leaves it current, editing a train file does not."""
    from shared.config import load_run_config
    from shared.store import read_manifest
    from shared.token_cache import source_fingerprint
    from stage1_extract import commands
    from testkit.data import stage1_overrides

    data = hub_dataset(tmp_path / "ds", [{"messages": CHAT}] * 7)
    train = data / "train_sft-*.parquet"
    extracted = commands.cmd_extract(load_run_config("configs/default.yaml", stage1_overrides(
        tiny_target_dir, train, tmp_path / "run")), progress=False)
    assert extracted["num_samples"] == 5
    made = read_manifest(str(tmp_path / "run" / "store"))["data"]
    assert (made["source"], made["num_rows"]) == (str(train), 5)
    assert made["source_sha256"] == source_fingerprint(train)
    pq.write_table(pa.Table.from_pylist([{"messages": CHAT}]), data / "test_sft-00000-of-00001.parquet")
    assert source_fingerprint(train) == made["source_sha256"]
    pq.write_table(pa.Table.from_pylist([{"messages": CHAT}]), data / "train_sft-00001-of-00002.parquet")
    assert source_fingerprint(train) != made["source_sha256"]


def test_a_table_is_read_in_the_format_its_columns_say(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "2+2?", "completion": "4"}]), path)
    assert read_one(path).messages == CHAT
    with pytest.raises(DataError, match=r"t\.parquet: data.format=sharegpt reads ShareGPT .*, but the file's columns are \['prompt', 'completion'\]"):
        list(read_conversations(path, data_format="sharegpt"))


def test_tool_calls_survive_the_parquet_stage_1_writes_and_plain_chats_keep_their_schema(tmp_path):
    tool = read_one(write_jsonl(tmp_path / "o.jsonl", [OPENAI_TOOL_ROW]))
    plain = Conversation(row=1, messages=CHAT)
    write_conversations_parquet([tool, plain], tmp_path / "both.parquet")
    back = list(read_conversations(tmp_path / "both.parquet"))
    assert [(c.messages, c.tools, c.row_hash()) for c in back] == [
        (tool.messages, tool.tools, tool.row_hash()), (plain.messages, None, plain.row_hash())]
    write_conversations_parquet([plain], tmp_path / "plain.parquet")
    assert pq.read_schema(tmp_path / "plain.parquet").names == ["messages", "source_row"]
    assert [f.name for f in pq.read_schema(tmp_path / "plain.parquet").field("messages").type.value_type] == [
        "role", "content", "token_ids"]


def test_reasoning_and_weight_survive_the_parquet_stage_1_writes(tmp_path):
    """`generate` writes what it read into Parquet and extraction reads that back: the keys must live."""
    conv = read_one(write_jsonl(tmp_path / "o.jsonl", [WEIGHTED]))
    plain = Conversation(row=1, messages=CHAT)
    write_conversations_parquet([conv, plain], tmp_path / "both.parquet")
    back = list(read_conversations(tmp_path / "both.parquet"))
    assert [(c.messages, c.row_hash()) for c in back] == [(conv.messages, conv.row_hash()), (CHAT, plain.row_hash())]
    assert conv.messages[1] == {"role": "assistant", "content": "Context.", "weight": 0}
    assert conv.messages[3]["reasoning_content"] == "Add them."


def test_read_rows_numbers_rows_as_stage_1_does(tmp_path):
    """The export doctor reads a few rows by number: blank lines count, bad rows are left out."""
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n\n{not json\n" + json.dumps({"messages": [*CHAT, *CHAT]}) + "\n")
    found = read_rows(path, {0, 2, 3})
    assert sorted(found) == [0, 3] and found[3].messages == [*CHAT, *CHAT]
    assert [c.row for c in read_conversations(path, on_bad_row="skip")] == [0, 3]


# A ShareGPT chunk cut from a longer chat: it opens with the assistant (and a tool call and its result).
OPENS_WITH_ASSISTANT = [
    {"system": "Be brief.", "conversations": [
        {"from": "gpt", "value": "As I said, it is 4."}, {"from": "human", "value": "Why?"}, {"from": "gpt", "value": "2+2."}]},
    {"conversations": [
        {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 2}}'}, {"from": "observation", "value": "4"},
        {"from": "gpt", "value": "It is 4."}, {"from": "human", "value": "And 3+3?"}, {"from": "gpt", "value": "6."}]},
    {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
]


def test_turns_before_the_first_user_turn_are_dropped_and_counted(tmp_path, tokenizer):
    """Regenerating them would answer an empty prompt; supervising them, text conditioned on nothing."""
    from stage1_extract.generate import assistant_slots

    stats = ReadStats()
    convs = list(read_conversations(write_jsonl(tmp_path / "s.jsonl", OPENS_WITH_ASSISTANT), stats=stats))
    assert [c.messages for c in convs] == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "2+2."}],
        [{"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6."}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    ]
    assert stats.leading_turns_dropped == 4 and stats.bad_rows == 0
    for conv in convs:  # every turn generate rewrites answers a user turn
        assert all(any(m["role"] == "user" for m in conv.messages[:slot]) for slot in assistant_slots(conv.messages))
    sample = tokenize_conversation(tokenizer, convs[0].messages, 256)
    assert supervised(tokenizer, sample) == "2+2.<|im_end|>\n"
    assert "As I said" not in tokenizer.decode(sample.input_ids)
    openai = [{"messages": [{"role": "assistant", "content": "Hi!"}, *CHAT]}]
    stats = ReadStats()
    assert [c.messages for c in read_conversations(write_jsonl(tmp_path / "o.jsonl", openai), stats=stats)] == [CHAT]
    assert stats.leading_turns_dropped == 1


def test_generate_and_extract_count_the_dropped_turns(tiny_target_dir, tmp_path):
    from shared.config import load_run_config
    from shared.store import read_manifest
    from stage1_extract import commands
    from testkit.data import stage1_overrides

    data = write_jsonl(tmp_path / "s.jsonl", OPENS_WITH_ASSISTANT)
    overrides = stage1_overrides(tiny_target_dir, data, tmp_path / "run")
    extracted = commands.cmd_extract(load_run_config("configs/default.yaml", overrides), progress=False)
    assert extracted["leading_turns_dropped"] == 4
    assert read_manifest(str(tmp_path / "run" / "store"))["data"]["leading_turns_dropped"] == 4
    generated = commands.cmd_generate(load_run_config("configs/default.yaml", [
        *overrides, "data.regenerate=true", "generate.max_new_tokens=3", "extract.device=cpu"]), progress=False)
    assert generated["leading_turns_dropped"] == 4
    from stage1_extract.__main__ import show_extract, show_generate

    assert "\n4 turn(s) before a row's first user turn dropped (they answer nothing)\n" in show_generate(generated)
    assert show_extract(extracted).endswith("; 4 turn(s) before a row's first user turn dropped")
    roles = [[m["role"] for m in c.messages] for c in read_conversations(generated["output"])]
    assert roles == [["system", "user", "assistant"], ["user", "assistant"], ["user", "assistant"]]


# ---- loss masks ---------------------------------------------------------------------------------------
def test_tool_calls_and_answers_are_supervised_tool_results_and_user_turns_are_not(tmp_path, tokenizer):
    """SmolLM2's template knows no tool calls: they are written into the assistant's turn as Hermes text."""
    conv = read_one(write_jsonl(tmp_path / "o.jsonl", [OPENAI_TOOL_ROW]))
    sample = tokenize_conversation(tokenizer, conv.messages, 1024, conv.tools)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert tokenizer.decode(sample.input_ids) == (
        "<|im_start|>system\nUse tools.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        f"<|im_start|>assistant\n{call}<|im_end|>\n<|im_start|>tool\n{{\"sky\": \"sunny\"}}<|im_end|>\n"
        "<|im_start|>assistant\nIt is sunny.<|im_end|>\n<|im_start|>user\nThanks!<|im_end|>\n"
        "<|im_start|>assistant\nYou're welcome.<|im_end|>\n"
    )
    assert supervised(tokenizer, sample) == f"{call}<|im_end|>\nIt is sunny.<|im_end|>\nYou're welcome.<|im_end|>\n"
    assert sample.empty_turns == 0  # a turn that only calls a tool is not empty
    sharegpt = read_one(write_jsonl(tmp_path / "s.jsonl", [SHAREGPT_TOOL_ROW]))
    again = tokenize_conversation(tokenizer, sharegpt.messages, 1024, sharegpt.tools)
    np.testing.assert_array_equal(again.input_ids, sample.input_ids)
    np.testing.assert_array_equal(again.loss_mask, sample.loss_mask)


STRUCTURED = (  # a template that takes tools and tool calls as fields, as Qwen3's and Llama 3.1's do
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools' }}{%- for t in tools %}{{ '\\n' + (t | tojson) }}{%- endfor %}"
    "{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response id=' + m.tool_call_id + '>\\n' + m.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content }}"
    "{%- for c in m.tool_calls or [] %}{{ '<call ' + c.function.name + '>' + (c.function.arguments | tojson) + '</call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_template_that_knows_tool_calls_gets_them_as_fields(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(default_target_dir())
    tokenizer.chat_template = STRUCTURED
    conv = read_one(write_jsonl(tmp_path / "o.jsonl", [OPENAI_TOOL_ROW]))
    sample = tokenize_conversation(tokenizer, conv.messages, 1024, conv.tools)
    text = tokenizer.decode(sample.input_ids)
    assert text.startswith('<|im_start|>system\n# Tools\n{"type": "function", "function": {"name": "get_weather"')
    assert '<tool_response id=call_1>\n{"sky": "sunny"}\n</tool_response>' in text
    call = '<call get_weather>{"city": "Paris"}</call>'  # the template's own rendering: the fields reached it
    assert supervised(tokenizer, sample) == f"{call}<|im_end|>\nIt is sunny.<|im_end|>\nYou're welcome.<|im_end|>\n"


# axolotl's per-turn weight (0: context only) beside reasoning; the same chat in ShareGPT.
WEIGHTED = {"messages": [
    {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Context.", "weight": 0},
    {"role": "user", "content": "2+2?", "weight": 0},
    {"role": "assistant", "content": "4", "reasoning_content": "Add them.", "weight": 1}]}
WEIGHTED_SHAREGPT = {"conversations": [
    {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Context.", "weight": 0},
    {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4", "reasoning_content": "Add them."}]}


def test_a_weight_0_turn_is_context_neither_supervised_nor_regenerated(tmp_path, tokenizer):
    """axolotl's `weight: 0` was read as any turn and supervised."""
    from stage1_extract.generate import assistant_slots

    conv = read_one(write_jsonl(tmp_path / "o.jsonl", [WEIGHTED]))
    assert read_one(write_jsonl(tmp_path / "s.jsonl", [WEIGHTED_SHAREGPT])).messages == conv.messages
    sample = tokenize_conversation(tokenizer, conv.messages, 512)
    assert "Context." in tokenizer.decode(sample.input_ids)
    assert supervised(tokenizer, sample) == "<think>\nAdd them.\n</think>\n\n4<|im_end|>\n"
    assert assistant_slots(conv.messages) == [3]  # `generate` keeps the context turn as the data has it
    # The target's own ids of a regenerated answer beside it: the weight-0 turn is still not supervised.
    answer = tokenizer("Four", add_special_tokens=False)["input_ids"]
    regenerated = [*conv.messages[:3], {"role": "assistant", "content": "Four", "token_ids": answer}]
    sample = tokenize_conversation(tokenizer, regenerated, 512)
    assert supervised(tokenizer, sample) == "Four<|im_end|>\n" and sample.ids_fallbacks == 0
    only_context = conv.messages[:2]
    assert not tokenize_conversation(tokenizer, only_context, 512).loss_mask.any()  # then a bad row, named
    assert tokenize_conversation(tokenizer, only_context, 512).empty_turns == 0


def test_generate_keeps_a_weight_0_turn_and_its_mark(tiny_target_dir, tmp_path):
    """The answers `generate` writes are what extraction reads: the context turn is there as the data
    has it, still marked, and only the supervised turn is the target's."""
    from shared.config import load_run_config
    from stage1_extract import commands
    from testkit.data import stage1_overrides

    overrides = stage1_overrides(tiny_target_dir, write_jsonl(tmp_path / "o.jsonl", [WEIGHTED]), tmp_path / "run")
    generated = commands.cmd_generate(load_run_config("configs/default.yaml", [
        *overrides, "data.regenerate=true", "generate.max_new_tokens=3", "extract.device=cpu"]), progress=False)
    (conv,) = read_conversations(generated["output"])
    assert conv.messages[1] == {"role": "assistant", "content": "Context.", "weight": 0}
    assert len(conv.messages[3]["token_ids"]) <= 3 and "reasoning_content" not in conv.messages[3]


@pytest.mark.parametrize("turn, message", [
    ({"role": "assistant", "content": "a", "weight": 0.5}, r"messages\[1\]\.weight must be 0 \(not supervised\) or 1, got 0\.5"),
    ({"role": "tool", "content": "a", "weight": 1}, r"messages\[1\] has weight=1 but role 'tool': only assistant turns"),
    ({"role": "user", "content": "a", "reasoning_content": "r"}, r"messages\[1\] has reasoning_content but role 'user'"),
    ({"role": "assistant", "content": "a", "reasoning_content": ["r"]}, r"messages\[1\]\.reasoning_content must be a string"),
], ids=["weight-0.5", "weight-1-on-a-tool-turn", "reasoning-on-a-user-turn", "reasoning-not-text"])
def test_weight_and_reasoning_that_cannot_be_honoured_are_refused_by_row_and_key(tmp_path, turn, message):
    path = write_jsonl(tmp_path / "o.jsonl", [{"messages": [{"role": "user", "content": "q"}, turn]}])
    with pytest.raises(DataError, match=r"o\.jsonl: row 0: " + message):
        list(read_conversations(path))


THINKING = (  # a template that reads reasoning_content, as Qwen3's does
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.reasoning_content %}{{ '<reasoning>' + m.reasoning_content + '</reasoning>' }}{%- endif %}"
    "{{ m.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_reasoning_reaches_the_template_as_a_field_or_as_think_text(tmp_path, tokenizer):
    """`reasoning_content` was dropped: a template that reads it gets the field, one that does not
    (SmolLM2) gets it as <think> text before the answer; either way it is the assistant's, supervised."""
    row = {"messages": [*CHAT[:1], {"role": "assistant", "content": "4", "reasoning_content": "Add them."}]}
    conv = read_one(write_jsonl(tmp_path / "o.jsonl", [row]))
    sample = tokenize_conversation(tokenizer, conv.messages, 512)
    assert supervised(tokenizer, sample) == "<think>\nAdd them.\n</think>\n\n4<|im_end|>\n"
    thinking = AutoTokenizer.from_pretrained(default_target_dir())
    thinking.chat_template = THINKING
    sample = tokenize_conversation(thinking, conv.messages, 512)
    assert tokenizer.decode(sample.input_ids) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<reasoning>Add them.</reasoning>4<|im_end|>\n")
    assert supervised(tokenizer, sample) == "<reasoning>Add them.</reasoning>4<|im_end|>\n"


NAMED = (  # a template that shows a turn's name, as some multi-participant templates do
    "{%- for m in messages %}{{ '<|im_start|>' + m.role }}{%- if m.name %}{{ ' (' + m.name + ')' }}{%- endif %}"
    "{{ '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
NAMED_ROW = {"messages": [{"role": "system", "content": "Be brief.", "name": "rules"},
                          {"role": "user", "content": "2+2?", "name": "ada"}, {"role": "assistant", "content": "4"}]}


def test_a_turns_name_reaches_a_template_that_reads_it_in_every_format(tmp_path):
    """`name` was kept on tool turns only: a user's or a system turn's was dropped unread, so the
    rendered prompt differed from what a server renders from the same messages."""
    conv = read_one(write_jsonl(tmp_path / "o.jsonl", [NAMED_ROW]))
    sharegpt = read_one(write_jsonl(tmp_path / "s.jsonl", [{"conversations": [
        {"from": "system", "value": "Be brief.", "name": "rules"}, {"from": "human", "value": "2+2?", "name": "ada"},
        {"from": "gpt", "value": "4"}]}]))
    assert conv.messages == sharegpt.messages == NAMED_ROW["messages"]
    assert conv.row_hash() != Conversation(row=0, messages=[{"role": "system", "content": "Be brief."}, *CHAT]).row_hash()
    write_conversations_parquet([conv, Conversation(row=1, messages=CHAT)], tmp_path / "named.parquet")  # what generate writes
    assert [c.messages for c in read_conversations(tmp_path / "named.parquet")] == [conv.messages, CHAT]
    named = AutoTokenizer.from_pretrained(default_target_dir())
    named.chat_template = NAMED
    sample = tokenize_conversation(named, conv.messages, 512)
    assert named.decode(sample.input_ids) == ("<|im_start|>system (rules)\nBe brief.<|im_end|>\n"
                                              "<|im_start|>user (ada)\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n")
    assert supervised(named, sample) == "4<|im_end|>\n"


def test_a_template_that_reads_no_name_is_warned_about_once(tmp_path, tokenizer, monkeypatch, caplog):
    """SmolLM2's template ("...named SmolLM") never reads a message's name: the name is passed, as a
    server passes it, renders nothing, and one warning says so."""
    from shared import conversations
    from shared.conversations import reads_message_name, render

    monkeypatch.setattr(conversations, "_WARNED", set())
    conv = read_one(write_jsonl(tmp_path / "o.jsonl", [NAMED_ROW]))
    unnamed = [{k: v for k, v in m.items() if k != "name"} for m in conv.messages]
    with caplog.at_level(logging.WARNING, logger="shared.conversations"):
        render(tokenizer, unnamed, add_generation_prompt=False)
        assert not caplog.records  # no name, nothing to say
        texts = [render(tokenizer, conv.messages, add_generation_prompt=False) for _ in range(2)]
        named = AutoTokenizer.from_pretrained(default_target_dir())
        named.chat_template = NAMED
        render(named, conv.messages, add_generation_prompt=False)
    assert texts == [render(tokenizer, unnamed, add_generation_prompt=False)] * 2
    assert [r.getMessage() for r in caplog.records] == [
        "the target's chat template reads no message's `name`: the rows' turn names are passed to it, as a server "
        "passes them, and not rendered"]
    assert not reads_message_name(tokenizer.chat_template) and reads_message_name(NAMED)
    assert reads_message_name("{% for msg in loop_messages %}{{ msg['name'] }}{% endfor %}")
    assert not reads_message_name("{% for message in messages %}{% for c in message.tool_calls %}{{ c.function.name }}"
                                  "{% endfor %}{% endfor %}")  # a tool's name is not the turn's


@pytest.mark.parametrize("row, where", [
    ({"messages": [{"role": "user", "content": "q", "name": 7}]}, r"messages\[0\]"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "name": ["bot"]}]}, r"conversations\[1\]"),
], ids=["openai-user", "sharegpt-assistant"])
def test_a_name_that_is_not_a_string_is_refused_naming_the_turn(tmp_path, row, where):
    path = write_jsonl(tmp_path / "n.jsonl", [row])
    with pytest.raises(DataError, match=r"n\.jsonl: row 0: " + where + r"\.name must be a string \(the participant's name\), got a"):
        list(read_conversations(path))


def test_a_json_file_holding_one_object_names_the_list_of_rows_and_the_command_that_writes_them(tmp_path):
    """`{"train": [rows]}` written with indent (as json.dump(..., indent=2) writes it) was read as
    JSON lines: "row 0: not valid JSON" for a valid file, with data.on_bad_row=skip as the fix (which
    skips every line). It is now refused whatever on_bad_row says, naming the key that holds the rows
    and a command that writes them one per line, which then reads as they are."""
    import subprocess
    import sys

    rows = [{"conversations": [{"from": "human", "value": f"Q{i}"}, {"from": "gpt", "value": f"A{i}"}]} for i in range(3)]
    nested = tmp_path / "data.json"
    nested.write_text(json.dumps({"version": 1, "train": rows}, indent=2))
    with pytest.raises(DataError) as refused:
        list(read_conversations(nested, on_bad_row="skip"))
    message = str(refused.value)
    assert message.startswith(f"{nested}: holds one JSON object (keys ['train', 'version']), not rows (a JSON array, or "
                              f"JSONL: one row a line); its rows are the list under 'train': write them one per line with `")
    command = re.search(r"`(python -c .*)` and set data\.path=(\S+)$", message)
    subprocess.run(command[1], shell=True, check=True, cwd=tmp_path, executable="/bin/bash", env={"PATH": f"{Path(sys.executable).parent}"})
    assert [[m["content"] for m in c.messages] for c in read_conversations(command[2])] == [[f"Q{i}", f"A{i}"] for i in range(3)]

    one = tmp_path / "one.json"
    one.write_text(json.dumps(rows[0], indent=2))
    with pytest.raises(DataError, match=r"one\.json: holds one JSON object \(keys \['conversations'\]\), .*; it is one "
                                        r"conversation: put it in a JSON array \(\[\.\.\.\]\) or on one line \(JSONL\)$"):
        list(read_conversations(one))
    flat = write_jsonl(tmp_path / "flat.jsonl", [{"train": rows}])
    with pytest.raises(DataError, match=r"flat\.jsonl: row 0: fits no known format .* found keys \['train'\]; its rows are the "
                                        r"list under 'train': write them one per line with `python -c"):
        list(read_conversations(flat))
    broken = write_jsonl(tmp_path / "broken.jsonl", ['{"messages": [', *map(json.dumps, rows)])
    assert [c.row for c in read_conversations(broken, on_bad_row="skip")] == [1, 2, 3]  # a broken first line stays one bad row


def test_a_utf16_file_is_named_as_such_with_the_command_that_converts_it(tmp_path):
    """PowerShell's `>` writes UTF-16 with a byte-order mark: every line was "row N: not UTF-8 (byte 0xff
    ...)" with data.on_bad_row=skip as the fix, which skipped them all. It is refused whatever on_bad_row
    says, naming the encoding and an iconv command, which then gives the rows."""
    import subprocess

    rows = [{"messages": [{"role": "user", "content": f"Q{i} é"}, {"role": "assistant", "content": "A"}]} for i in range(3)]
    path = tmp_path / "win.jsonl"
    path.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows).encode("utf-16"))
    with pytest.raises(DataError) as refused:
        list(read_conversations(path, on_bad_row="skip"))
    out = tmp_path / "win.utf8.jsonl"
    assert str(refused.value) == (f"{path}: is UTF-16 (it starts with its byte-order mark), not UTF-8: convert it with "
                                  f"`iconv -f UTF-16 -t UTF-8 {path} > {out}` and set data.path={out}")
    subprocess.run(re.search(r"`(iconv .*)`", str(refused.value))[1], shell=True, check=True)
    assert [c.messages[0]["content"] for c in read_conversations(out)] == ["Q0 é", "Q1 é", "Q2 é"]


def test_a_folder_of_jsonl_files_names_the_glob_that_reads_them(tmp_path):
    """data.path at a folder of JSONL shards was refused as "folder holds no .parquet or .arrow files",
    with no word of the .jsonl files in it nor of the glob that reads them; the refusal now names both,
    and the glob it names reads every shard in name order."""
    folder = tmp_path / "shards"
    folder.mkdir()
    for k in range(2):
        write_jsonl(folder / f"part-{k}.jsonl", [{"prompt": f"p{k}{i}", "completion": "c"} for i in range(2)])
    with pytest.raises(InputFileError) as refused:
        list(read_conversations(folder))
    assert str(refused.value) == (f"{folder}: folder holds no .parquet or .arrow files (it holds 2 .jsonl file(s): part-0.jsonl, "
                                  f"part-1.jsonl; set data.path to one, or to a glob of one split's: "
                                  f"{shlex.quote(f'data.path={folder}/*.jsonl')} reads all)")
    glob = shlex.split(re.search(r"glob of one split's: (.*) reads all\)$", str(refused.value))[1])[0].removeprefix("data.path=")
    assert [c.messages[0]["content"] for c in read_conversations(glob)] == ["p00", "p01", "p10", "p11"]


def test_jsonl_written_over_several_lines_per_row_names_the_command_that_writes_one_per_line(tmp_path):
    """`jq '.[]' data.json > data.jsonl` (no -c) writes each row over several lines: read as JSON lines
    every line was a bad row ("row 0: not valid JSON", data.on_bad_row=skip as the fix, which skipped
    them all). It is now refused naming `jq -c`, whose output then reads row by row."""
    import shutil
    import subprocess

    rows = [{"conversations": [{"from": "human", "value": f"Q{i}"}, {"from": "gpt", "value": "A"}]} for i in range(3)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r, indent=2) + "\n" for r in rows))
    with pytest.raises(DataError) as refused:
        list(read_conversations(path, on_bad_row="skip"))
    out = tmp_path / "rows.lines.jsonl"
    assert str(refused.value) == (f"{path}: holds JSON objects written over several lines each (`jq` without -c?), not one per "
                                  f"line: write them one per line with `jq -c . {path} > {out}` and set data.path={out}")
    if shutil.which("jq"):
        subprocess.run(re.search(r"`(jq .*)`", str(refused.value))[1], shell=True, check=True)
        assert [c.messages[0]["content"] for c in read_conversations(out)] == ["Q0", "Q1", "Q2"]


def test_integer_tool_call_ids_read_as_the_calls_own_ids(tmp_path):
    """A call's `id` given as an integer was read (as text), while the tool result's `tool_call_id`
    naming that same integer refused the row ("must be a string"). Both now read as the same text,
    and the row is the one its string-id copy is."""
    def row(call_id):
        return {"messages": [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function",
                                                                   "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "res"}, {"role": "assistant", "content": "done"}]}
    path = write_jsonl(tmp_path / "ids.jsonl", [row(1), row("1"), {**row(True)}])
    stats = ReadStats()
    convs = list(read_conversations(path, on_bad_row="skip", stats=stats, log_skips=False))
    assert [c.row for c in convs] == [0, 1] and convs[0].messages == convs[1].messages
    assert convs[0].messages[1]["tool_calls"] == [{"name": "f", "arguments": "{}", "id": "1"}]
    assert convs[0].messages[2] == {"role": "tool", "content": "res", "tool_call_id": "1"}
    assert convs[0].row_hash() == convs[1].row_hash()
    assert stats.bad_examples == [f"{path}: row 2: messages[2].tool_call_id must be a string (the id of the call it answers)"]
