"""Reading conversations, chat templates and loss masks, bad rows, the default corpus, generation."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from shared.embedded import default_target_dir
from stage1_extract.corpus import default_conversations
from stage1_extract.data import ReadStats, read_conversations, write_conversations_parquet
from stage1_extract.template import tokenize_conversation

from .conftest import write_jsonl


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_target_dir())


def decoded_supervised(tokenizer, sample) -> str:
    return tokenizer.decode(sample.input_ids[sample.loss_mask])


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "Hi again"},
    ]
    sample = tokenize_conversation(tokenizer, messages, max_length=512)
    text = tokenizer.decode(sample.input_ids)
    assert text == tokenizer.apply_chat_template(messages, tokenize=False)
    # Each answer and its end-of-turn marker are supervised; nothing of the prompt is.
    assert decoded_supervised(tokenizer, sample) == "Hello there<|im_end|>\nHi again<|im_end|>\n"
    assert not sample.truncated
    assert sample.input_ids.dtype == np.int32 and sample.loss_mask.dtype == bool


def test_prompt_completion_rows_become_chats(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "2+2?", "completion": "4"}])
    (conv,) = read_conversations(path)
    assert conv.messages == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    sample = tokenize_conversation(tokenizer, conv.messages, 512)
    assert decoded_supervised(tokenizer, sample) == "4<|im_end|>\n"


def test_truncation_is_reported(tokenizer):
    messages = [{"role": "user", "content": "x " * 200}, {"role": "assistant", "content": "y " * 200}]
    sample = tokenize_conversation(tokenizer, messages, max_length=64)
    assert sample.truncated and len(sample.input_ids) == 64 and len(sample.loss_mask) == 64


@pytest.mark.parametrize(
    "row, message",
    [
        ('{"messages": [{"role": "robot", "content": "x"}]}', r"row 1: messages\[0\] has unknown role 'robot'"),
        ('{"messages": []}', r"row 1: empty conversation"),
        ('{"text": "x"}', r"row 1: row has neither 'messages' nor 'prompt'"),
        ('{"messages": [{"role": "user"}]}', r"row 1: messages\[0\] must have 'role' and 'content'"),
        ("{not json", r"row 1: not valid JSON"),
        ('{"prompt": 5}', r"row 1: 'prompt' and 'completion' must be strings"),
    ],
)
def test_bad_rows_name_file_and_row(tmp_path, row, message):
    good = json.dumps({"prompt": "ok"})
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + row + "\n" + good + "\n")
    with pytest.raises(ValueError, match=message) as info:
        list(read_conversations(path))
    assert str(path) in str(info.value)
    stats = ReadStats()
    kept = list(read_conversations(path, on_bad_row="skip", stats=stats))
    assert [c.row for c in kept] == [0, 2]
    assert stats.bad_rows == 1 and stats.rows == 3 and "row 1" in stats.bad_examples[0]


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        list(read_conversations(tmp_path / "nope.jsonl"))


def test_a_jsonl_file_with_a_byte_order_mark_reads_its_first_row(tmp_path):
    """Windows tools often start UTF-8 files with a BOM; it used to make row 0 "not valid JSON"."""
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(row) + "\n").encode() * 2)
    assert [c.messages for c in read_conversations(path)] == [row["messages"]] * 2


def test_an_empty_assistant_turn_is_counted(tokenizer):
    """Only its end-of-turn marker is supervised: counted (the manifest sums it), never silent."""
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "r"},
                {"role": "assistant", "content": "an answer"}]
    sample = tokenize_conversation(tokenizer, messages, 256)
    assert sample.empty_turns == 1 and sample.loss_mask.any()


def test_parquet_round_trip_and_max_samples(tmp_path):
    convs = default_conversations(10)
    write_conversations_parquet(convs, tmp_path / "c.parquet")
    assert pq.read_table(tmp_path / "c.parquet").num_rows == 10
    back = list(read_conversations(tmp_path / "c.parquet", max_samples=4))
    assert [c.messages for c in back] == [c.messages for c in convs[:4]]


def test_default_corpus_is_deterministic_and_varied():
    a, b = default_conversations(64), default_conversations(64)
    assert [c.messages for c in a] == [c.messages for c in b]
    lengths = [len(c.messages[0]["content"]) for c in a]
    assert min(lengths) < 100 < 600 < max(lengths)
    assert len({c.messages[0]["content"] for c in a}) == 64


def test_the_question_share_spreads_short_questions_evenly():
    from stage1_extract.corpus import is_question

    assert [i for i in range(400) if is_question(i, 0.25)] == [i for i in range(400) if i % 4 == 3]  # the old default
    for share in (0.0, 0.5, 0.75, 1.0):
        flags = [is_question(i, share) for i in range(400)]
        assert sum(flags) == 400 * share and sum(flags[:40]) == 40 * share
    questions = default_conversations(64, question_share=1.0)
    assert all(len(c.messages[0]["content"]) < 100 for c in questions)
    assert [c.messages for c in default_conversations(64, question_share=0.25)] == [c.messages for c in default_conversations(64)]


def test_generate_regenerates_assistant_turns_and_resumes(tiny_target_dir, tmp_path):
    from shared.config import load_run_config
    from stage1_extract import commands

    rows = [
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "OLD ANSWER"}]},
        {"prompt": "second"},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "OLD"}, {"role": "user", "content": "b"}]},
    ]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    overrides = [
        f"run_dir={tmp_path / 'run'}", f"target.path={tiny_target_dir}", "target.dtype=fp32",
        f"data.path={data}", "generate.max_new_tokens=6", "generate.rows_per_part=2", "extract.device=cpu",
    ]
    cfg = load_run_config("configs/default.yaml", overrides)
    first = commands.cmd_generate(cfg, progress=False)
    assert first["conversations"] == 3 and first["parts_reused"] == 0
    out = list(read_conversations(first["output"]))
    roles = [[m["role"] for m in c.messages] for c in out]
    assert roles == [["user", "assistant"], ["user", "assistant"], ["user", "assistant", "user", "assistant"]]
    assert all(m["content"] not in ("OLD ANSWER", "OLD") for c in out for m in c.messages)
    # A rerun (as after a kill) reuses every finished part and changes nothing.
    second = commands.cmd_generate(cfg, progress=False)
    assert second["parts_reused"] == 2
    assert [c.messages for c in read_conversations(second["output"])] == [c.messages for c in out]
    # Other settings must not silently mix with old parts.
    changed = load_run_config("configs/default.yaml", overrides + ["generate.temperature=0.2"])
    with pytest.raises(ValueError, match=r"other settings than the config gives: generate.temperature \(0.7 -> 0.2\)"):
        commands.cmd_generate(changed, progress=False)


def test_appending_rows_regenerates_only_the_new_parts(tiny_target_dir, tmp_path):
    """Parts are keyed by their own rows: appended prompts cost only their answers; an edited row
    regenerates only its part, and the merged output keeps every other answer as it was."""
    from shared.config import load_run_config
    from stage1_extract import commands

    rows = [{"prompt": f"question {i}"} for i in range(4)]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    overrides = [
        f"run_dir={tmp_path / 'run'}", f"target.path={tiny_target_dir}", "target.dtype=fp32",
        f"data.path={data}", "generate.max_new_tokens=4", "generate.rows_per_part=2", "extract.device=cpu",
    ]
    cfg = load_run_config("configs/default.yaml", overrides)
    first = [c.messages for c in read_conversations(commands.cmd_generate(cfg, progress=False)["output"])]
    write_jsonl(data, rows + [{"prompt": "question 4"}, {"prompt": "question 5"}])
    grown = commands.cmd_generate(cfg, progress=False)
    assert grown["parts_reused"] == 2 and grown["conversations"] == 6
    after = [c.messages for c in read_conversations(grown["output"])]
    assert after[:4] == first
    rows[1] = {"prompt": "an edited question"}
    write_jsonl(data, rows + [{"prompt": "question 4"}, {"prompt": "question 5"}])
    edited = commands.cmd_generate(cfg, progress=False)
    assert edited["parts_reused"] == 2  # parts 1 and 2 kept, part 0 (rows 0-1) regenerated
    again = [c.messages for c in read_conversations(edited["output"])]
    assert again[2:] == after[2:] and again[1][0]["content"] == "an edited question"


def test_generate_does_nothing_when_the_answers_are_given(tmp_path):
    from shared.config import load_run_config
    from stage1_extract import commands

    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "completion": "a"}])
    cfg = load_run_config("configs/default.yaml", [f"run_dir={tmp_path / 'run'}", f"data.path={data}", "data.regenerate=false"])
    assert "skipped" in commands.cmd_generate(cfg, progress=False)
    assert not (tmp_path / "run").exists()  # no model loaded, nothing written
