"""Reading conversations, chat templates and loss masks, bad rows, the default corpus, generation."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from shared.conversation_files import read_conversations
from shared.conversations import ReadStats
from shared.embedded import default_target_dir
from shared.errors import DataError
from stage1_extract.corpus import default_conversations
from stage1_extract.data import write_conversations_parquet
from stage1_extract.resolve import prepare_run
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


@pytest.mark.parametrize("answer", ["\n\nHello", "  Hello", "\n\n\n"])
def test_an_answer_opening_with_whitespace_keeps_the_prompt_it_is_served_after(tokenizer, answer):
    """ChatML's prompt ends "assistant\\n"; an answer opening "\\n\\n" made one "\\n\\n" token of the two
    when the whole render was tokenized: a prompt the target never sees when serving, and the answer's
    first newline unsupervised. Each answer now follows its prompt's own tokens, as in generation."""
    from stage1_extract.template import prompt_ids

    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": answer},
                {"role": "user", "content": "Again"}, {"role": "assistant", "content": answer}]
    sample = tokenize_conversation(tokenizer, messages, max_length=512)
    prompt = prompt_ids(tokenizer, messages[:1])
    turn = tokenizer(answer + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
    between = tokenizer("<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert sample.input_ids.tolist() == prompt + turn + between + turn
    assert sample.loss_mask.tolist() == [False] * len(prompt) + [True] * len(turn) + [False] * len(between) + [True] * len(turn)


def test_prompt_completion_rows_become_chats(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "2+2?", "completion": "4"}])
    (conv,) = read_conversations(path)
    assert conv.messages == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    sample = tokenize_conversation(tokenizer, conv.messages, 512)
    assert decoded_supervised(tokenizer, sample) == "4<|im_end|>\n"


def test_trl_conversational_prompt_completion_rows_become_chats(tmp_path, tokenizer):
    """TRL's conversational format (lists of messages under prompt and completion, as SFTTrainer and
    many Hub datasets hold them) was refused ("must be strings") with no fix. It reads as one
    conversation, in JSON lines and in Parquet (lists of structs); TRL trains on the completion, so
    an assistant turn of the prompt is context (weight 0), the completion's answer is supervised."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}],
           "completion": [{"role": "assistant", "content": "4"}]}
    want = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", "weight": 0}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}]
    (conv,) = read_conversations(write_jsonl(tmp_path / "trl.jsonl", [row]))
    assert conv.messages == want
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "trl.parquet")
    (from_parquet,) = read_conversations(tmp_path / "trl.parquet")
    assert from_parquet.messages == want
    sample = tokenize_conversation(tokenizer, conv.messages, 512)
    assert decoded_supervised(tokenizer, sample) == "4<|im_end|>\n"


def test_truncation_is_reported(tokenizer):
    messages = [{"role": "user", "content": "x " * 200}, {"role": "assistant", "content": "y " * 200}]
    sample = tokenize_conversation(tokenizer, messages, max_length=64)
    assert sample.truncated and len(sample.input_ids) == 64 and len(sample.loss_mask) == 64


CHAT = json.dumps({"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "fine"}]})
PROMPT = json.dumps({"prompt": "ok"})


@pytest.mark.parametrize(
    "good, row, message",
    [
        (CHAT, '{"messages": [{"role": "robot", "content": "x"}]}', r"row 1: messages\[0\] has unknown role 'robot'"),
        (CHAT, '{"messages": []}', r"row 1: empty conversation"),
        (CHAT, '{"text": "x"}', r"row 1: expected OpenAI chat \(messages: \[\{role, content\}\]\) like the rows before it, found keys \['text'\]"),
        (CHAT, '{"messages": [{"role": "user"}]}', r"row 1: messages\[0\] must have 'role' and 'content'"),
        (CHAT, "{not json", r"row 1: not valid JSON"),
        (PROMPT, '{"prompt": 5}', r"row 1: 'prompt' is a number and 'completion' absent: give both as strings"),
        (PROMPT, '{"prompt": [{"role": "user", "content": "ok"}], "completion": "fine"}',
         r"row 1: 'prompt' is a list of messages and 'completion' a string: give both as strings \(a question and its answer\), "
         r"or both as lists of \{role, content\} messages \(TRL's conversational prompt/completion\)"),
        (PROMPT, '{"prompt": [{"role": "user", "content": "ok"}], "completion": [{"role": "robot", "content": "x"}]}',
         r"row 1: completion\[0\] has unknown role 'robot'"),
        (PROMPT, CHAT, r"row 1: expected prompt/completion \(prompt, completion\) like the rows before it, found keys \['messages'\]"),
    ],
)
def test_bad_rows_name_file_and_row(tmp_path, good, row, message):
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


def test_a_broken_json_row_says_its_problem_and_column_once(tmp_path):
    """json's messages end in " at" for some problems ("Invalid control character at"): it was
    printed "Invalid control character at at column 12"."""
    path = tmp_path / "ctrl.jsonl"
    path.write_text(CHAT + "\n" + '{"prompt": "a\tb"}' + "\n" + '{"prompt": "open')  # the last line unterminated
    stats = ReadStats()
    list(read_conversations(path, on_bad_row="skip", stats=stats))
    assert [e.split(": ", 1)[1] for e in stats.bad_examples] == [
        "row 1: not valid JSON (Invalid control character at column 14)",
        "row 2: not valid JSON (Unterminated string starting at column 12)",
    ]
    array = tmp_path / "ctrl.json"
    array.write_text('[{"prompt": "a\tb"}]')
    with pytest.raises(DataError, match=r"row 0: not valid JSON \(Invalid control character\); a JSON array"):
        list(read_conversations(array))


def test_a_relative_data_path_not_found_names_the_working_directory(tmp_path, monkeypatch):
    """data.path resolves against the working directory, not the config file: a run from another
    folder said only `data file not found: data/sharegpt.jsonl`."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        list(read_conversations("data/sharegpt.jsonl"))
    assert str(info.value) == (
        f"data file not found: data/sharegpt.jsonl (data.path=data/sharegpt.jsonl is relative: resolved against the "
        f"working directory {tmp_path}, not the config file's folder)"
    )
    with pytest.raises(FileNotFoundError) as info:
        list(read_conversations(tmp_path / "nope.jsonl"))
    assert str(info.value) == f"data file not found: {tmp_path / 'nope.jsonl'}"  # an absolute path is where it says


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
        {"messages": [{"role": "user", "content": "second"}]},
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
    # The random target never says EOS within 6 tokens: transformers' answers are all cut, and the
    # third row stops at its first answer (its later user turn dropped, no answer asked for it).
    assert (first["answers"], first["answers_cut"], first["turns_dropped_after_cut"]) == (3, 3, 1)
    assert all(c.messages[-1]["answer_cut"] and len(c.messages[-1]["token_ids"]) == 6 for c in out)
    roles = [[m["role"] for m in c.messages] for c in out]
    assert roles == [["user", "assistant"], ["user", "assistant"], ["user", "assistant"]]
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


# ---- what one row may bring: ids within the vocabulary, bounded work ------------------------------
def plan_config(tiny_target_dir, data, tmp_path, **extra):
    from shared.config import load_run_config

    from .conftest import stage1_overrides

    return load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "run", **extra))


def test_rows_past_the_targets_context_are_refused_not_extracted(tmp_path):
    """data.max_length past the target's max_position_embeddings stored features at positions the target
    never runs at when served (generate already counts a sample's context as the smaller of the two);
    a max_length within it cuts those rows, counted, as any other."""
    from shared.errors import ConfigError
    from testkit.target import build_tiny_target

    target = build_tiny_target(tmp_path / "short", max_positions=64)
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "fox " * (5 + 40 * i)}]}
            for i in range(3)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(ConfigError, match=r"max_length=256 is past the target's max_position_embeddings=64.* 2 row\(s\) "
                                          r".*row 1: \d+ tokens.*set data.max_length=64"):
        prepare_run(plan_config(target, data, tmp_path, **{"data.token_cache": False}))
    within = prepare_run(plan_config(target, data, tmp_path, **{"data.token_cache": False, "data.max_length": 64}))
    assert [len(r.input_ids) <= 64 for r in within.rows] == [True] * 3 and [r.truncated for r in within.rows] == [False, True, True]


def test_a_row_skipped_as_too_long_counts_none_of_its_turns(tiny_target_dir, tmp_path, copy_tree):
    """The manifest's num_empty_turns and context_turns count what the store holds: a row data.on_long=skip
    left out was counted (its empty turn warned about as supervised, its earlier turns as context)."""
    from stage1_extract import commands

    from .test_generate import QWEN3_LIKE

    target = copy_tree(tiny_target_dir, tmp_path / "qwen3-like")
    (target / "chat_template.jinja").write_text(QWEN3_LIKE)
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nr\n</think>\n\na"},
             {"role": "user", "content": "again"}, {"role": "assistant", "content": "b"}]
    long_turns = [{"role": "user", "content": "fox " * 300}, turns[1], {"role": "user", "content": "again"},
                  {"role": "assistant", "content": ""}]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": turns}, {"messages": long_turns}])
    cfg = plan_config(target, data, tmp_path, **{"data.on_long": "skip", "data.max_length": 128})
    out = commands.cmd_extract(cfg, progress=False)
    assert (out["num_samples"], out["num_skipped"]) == (1, 1)
    assert (out["num_empty_turns"], out["context_turns"]) == (0, 1)


def test_token_ids_beyond_the_vocabulary_are_a_named_bad_row(tiny_target_dir, tmp_path):
    """Regenerated answers carry token ids: one beyond the target's vocabulary would crash
    extraction (on a GPU, a device-side assert that kills the rank); it is named when read."""
    from shared.errors import DataError
    from stage1_extract import commands

    from .conftest import chat_rows

    rows = chat_rows(5)
    rows[2]["messages"][1]["token_ids"] = [31, 49152, 7]  # the tiny target has 49152 ids: 0..49151
    data = write_jsonl(tmp_path / "gen.jsonl", rows)
    with pytest.raises(DataError, match=r"gen\.jsonl: row 2: token id 49152 at token \d+ is beyond the target's vocabulary of 49152 ids: it came with the row's token_ids"):
        commands.cmd_plan(plan_config(tiny_target_dir, data, tmp_path))
    plan = commands.cmd_plan(plan_config(tiny_target_dir, data, tmp_path, **{"data.on_bad_row": "skip"}))
    assert plan["samples"] == 4 and plan["bad_rows_skipped"] == 1
    rows[2]["messages"][1]["token_ids"] = [31, 49151, 7]  # the last id is in
    write_jsonl(data, rows)
    assert commands.cmd_plan(plan_config(tiny_target_dir, data, tmp_path))["samples"] == 5


def test_a_tokenizer_larger_than_the_models_embedding_is_refused_by_name(tiny_target_dir, tmp_path):
    import shutil

    from shared.errors import ConfigError
    from stage1_extract import commands

    target = shutil.copytree(tiny_target_dir, tmp_path / "target")
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "zebra xylophone"}, {"role": "assistant", "content": "ok"}]}])
    cfg = plan_config(target, data, tmp_path, **{"data.on_bad_row": "skip"})  # not a bad row: the target is wrong
    assert commands.cmd_plan(cfg)["samples"] == 1  # the token cache is written now, keyed on the tokenizer
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    with pytest.raises(ConfigError, match=r"chat\.jsonl: row 0: token id \d+ at token \d+ \('.+'\) is beyond the target's embedding of 1000 ids .* \(49152 ids\) does not belong to its weights"):
        commands.cmd_plan(cfg)


def test_a_huge_row_is_cut_before_tokenizing_and_tokenizes_as_the_whole_row(tiny_target_dir, tmp_path, monkeypatch):
    """Each message is cut to 2 x max_length x the longest token's characters before the template
    or the tokenizer see it; what is stored (the first max_length tokens, the truncation flag, and
    so what data.on_long decides) is what the whole row gives."""
    from stage1_extract import prepare

    limits = prepare.row_limits(AutoTokenizer.from_pretrained(tiny_target_dir), 256)
    assert limits.max_chars == 2 * 256 * 81  # SmolLM2's longest entry: a newline and 80 spaces
    words = "the quick brown fox jumps over a lazy dog while python lists and dicts grow".split()
    long_text = " ".join(words[i * 7 % len(words)] for i in range(3 * limits.max_chars // 4))
    rows = [
        {"messages": [{"role": "user", "content": "a short question"}, {"role": "assistant", "content": "a short answer"}]},
        {"messages": [{"role": "user", "content": "tell me"}, {"role": "assistant", "content": long_text}]},
        {"messages": [{"role": "user", "content": long_text}, {"role": "assistant", "content": "fine"}]},
    ]
    assert len(long_text) > 2 * limits.max_chars
    data = write_jsonl(tmp_path / "big.jsonl", rows)
    seen = []
    real = prepare.tokenize_all
    monkeypatch.setattr(prepare, "tokenize_all", lambda tok, convs, *a: seen.extend(convs) or real(tok, convs, *a))
    cfg = plan_config(tiny_target_dir, data, tmp_path, **{"data.on_bad_row": "skip", "data.token_cache": False})
    prepared = prepare_run(cfg)
    assert max(len(m["content"]) for c in seen for m in c.messages) == limits.max_chars
    assert [c.cut for c in seen] == [False, True, True]
    whole = tokenize_conversation(AutoTokenizer.from_pretrained(tiny_target_dir), rows[1]["messages"], 256)
    (row,) = [r for r in prepared.rows if r.sample_id == 1]
    assert whole.truncated and row.truncated
    np.testing.assert_array_equal(row.input_ids, whole.input_ids)
    np.testing.assert_array_equal(row.loss_mask, whole.loss_mask)
    assert prepared.stats.bad_rows == 1  # row 2: its prompt alone fills max_length, as uncut
    skip = prepare_run(plan_config(tiny_target_dir, data, tmp_path / "skip", **{"data.on_long": "skip", "data.token_cache": False}))
    assert [(r.sample_id, r.skipped) for r in skip.rows] == [(0, False), (1, True), (2, True)]


PEAK_RSS = """
import resource, sys
import stage1_extract  # noqa: F401
from shared.config import load_run_config
from stage1_extract import commands
plan = commands.cmd_plan(load_run_config("configs/default.yaml", sys.argv[1:]))
print(plan["samples"], plan["samples_skipped"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""


@pytest.mark.slow
def test_a_200_mb_row_costs_plan_less_than_1_gb(tiny_target_dir, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from .conftest import stage1_overrides

    data = tmp_path / "huge.jsonl"
    with data.open("w") as fh:
        fh.write(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
        fh.write('{"messages": [{"role": "user", "content": "summarise"}, {"role": "assistant", "content": "')
        for _ in range(200):
            fh.write("lorem ipsum " * (2**20 // 12))
        fh.write('"}]}\n')
    assert data.stat().st_size > 200e6
    overrides = stage1_overrides(tiny_target_dir, data, tmp_path / "run", **{"data.on_long": "skip", "data.token_cache": False})
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", PEAK_RSS, *overrides], cwd=root, capture_output=True, text=True, check=True)
    samples, skipped, peak_mb = map(int, out.stdout.split())
    assert (samples, skipped) == (1, 1) and peak_mb < 1024, out.stdout  # data.on_long=skip: the row is left out


# ---- regenerated copies of a prompt: one split key, counted ---------------------------------------------
@pytest.fixture(scope="module")
def regenerated_copies(tiny_target_dir, tmp_path_factory):
    """A data file with exact duplicate rows (rows 16-19 copy rows 2, 5, 5 and 11), its answers
    regenerated by the tiny target (transformers, CPU) and extracted: (root, copies, config)."""
    from shared.config import load_run_config
    from stage1_extract import commands

    from .conftest import chat_rows, stage1_overrides

    root = tmp_path_factory.mktemp("copies")
    rows = chat_rows(16)
    copies = {16: 2, 17: 5, 18: 5, 19: 11}  # copy row -> the row it copies
    rows += [rows[i] for i in copies.values()]
    data = write_jsonl(root / "chat.jsonl", rows)
    cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, root / "run", **{
        "data.regenerate": True, "generate.max_new_tokens": 6, "generate.rows_per_part": 8, "extract.device": "cpu",
    }))
    commands.cmd_generate(cfg, progress=False)
    commands.cmd_extract(cfg, progress=False)
    return root, copies, cfg


def test_regenerated_copies_of_a_prompt_stay_on_one_side_of_the_split_and_are_counted(regenerated_copies):
    """Each copy gets its own sampled answer, so its tokens differ from the original's: the split
    keys them on their opening (the turns through the first user turn, as the data gives them) and
    counts them as duplicates by their prompt, as docs/faults.md promises."""
    from shared.reader import StoreReader
    from stage2_train.data.split import heldout_mask

    root, copies, cfg = regenerated_copies
    reader = StoreReader(cfg.store.url(cfg.run_dir))
    assert reader.manifest["num_duplicates"] == 4 and reader.manifest["split_key"] == "opening"
    at = {int(s): i for i, s in enumerate(reader.sample_ids)}
    for copy, original in copies.items():
        assert not np.array_equal(reader[at[copy]]["input_ids_T"], reader[at[original]]["input_ids_T"])  # other answers
        assert reader.split_keys[at[copy]] == reader.split_keys[at[original]]
    for seed in range(40):
        held = heldout_mask(reader.split_keys, 0.3, seed)
        assert all(held[at[copy]] == held[at[original]] for copy, original in copies.items())
    assert len(np.unique(reader.split_keys)) == len(reader) - 4


def reextracted_at_version(root, tiny_target_dir, tmp_path, version: int):
    """A copy of the regenerated store pinned at identity `version`, every shard extracted again: its reader."""
    import shutil

    from shared.config import load_run_config
    from shared.reader import StoreReader
    from stage1_extract import commands

    from .conftest import stage1_overrides

    copy = Path(shutil.copytree(root, tmp_path / "copy"))
    store = copy / "run" / "store"
    plan = json.loads((store / "plan.json").read_text())
    (store / "plan.json").write_text(json.dumps({**plan, "header": {**plan["header"], "identity_version": version}}))
    for path in (store / "manifest.json", *(store / "parts").glob("*.json"), *(store / "shards").iterdir()):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, copy / "chat.jsonl", copy / "run", **{
        "data.regenerate": True, "generate.max_new_tokens": 6, "generate.rows_per_part": 8, "extract.device": "cpu",
    }))
    commands.cmd_extract(cfg, progress=False)
    return StoreReader(str(store))


def test_a_store_made_at_identity_version_4_keeps_its_split_on_tokens(regenerated_copies, tiny_target_dir, tmp_path, caplog):
    """A store pinned before prompt keys (identity version 4) keeps the split it was trained with,
    even when every shard is extracted again: its part records get no prompt hashes (its split stays
    on tokens, the copies' own), and the log says why and how to get prompt keys."""

    from shared.reader import StoreReader


    root, _, made = regenerated_copies
    tokens_keys = StoreReader(made.store.url(made.run_dir)).manifest["shards"]
    tokens_keys = [int(h[:15], 16) for r in tokens_keys for h in r["content_hashes"]]
    reader = reextracted_at_version(root, tiny_target_dir, tmp_path, 4)
    assert reader.manifest["identity_version"] == 4 and reader.manifest["split_key"] == "tokens"
    assert not any("prompt_hashes" in r for r in reader.manifest["shards"])
    assert reader.split_keys.tolist() == tokens_keys and reader.manifest["num_duplicates"] == 0
    assert "made at identity version 4: its held-out split keys each sample on its tokens" in caplog.text


def test_rows_that_share_a_first_question_stay_on_one_side_of_the_split(tiny_target_dir, tmp_path):
    """Online eval decodes a held-out row from its opening (the turns through its first user turn): a
    row that asks the same first question and goes on otherwise, or answers it otherwise, must not be
    trained on while that row is held out. They are not copies (other tokens, not counted as
    duplicates), yet share one split key whatever the seed."""
    from shared.config import load_run_config
    from shared.reader import StoreReader
    from stage1_extract import commands
    from stage2_train.data.split import heldout_mask

    from .conftest import chat_rows, stage1_overrides

    rows = chat_rows(16)
    follow_up = {"messages": [*rows[3]["messages"], {"role": "user", "content": "and then?"}, {"role": "assistant", "content": "a lazy dog"}]}
    other_answer = {"messages": [rows[7]["messages"][0], {"role": "assistant", "content": "python lists grow"}]}
    other_system = {"messages": [{"role": "system", "content": "be brief"}, *rows[9]["messages"]]}
    data = write_jsonl(tmp_path / "chat.jsonl", [*rows, follow_up, other_answer, other_system])
    cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "run"))
    out = commands.cmd_extract(cfg, progress=False)
    assert (out["split_key"], out["num_duplicates"]) == ("opening", 0)
    reader = StoreReader(cfg.store.url(cfg.run_dir))
    at = {int(s): i for i, s in enumerate(reader.sample_ids)}
    together = [(3, 16), (7, 17)]  # the same opening; row 18 opens with a system turn row 9 lacks
    assert all(reader.split_keys[at[a]] == reader.split_keys[at[b]] for a, b in together)
    assert reader.split_keys[at[9]] != reader.split_keys[at[18]]
    for seed in range(40):
        held = heldout_mask(reader.split_keys, 0.3, seed)
        assert all(held[at[a]] == held[at[b]] for a, b in together)
    assert len(np.unique(reader.split_keys)) == len(reader) - 2


def test_a_generic_opening_does_not_put_the_whole_store_on_one_side_of_the_split():
    """Rows that all open alike (one fixed instruction: "Go on.") formed one split group: every sample
    held out or none (no eval at all, or no training sample). A group past GENERIC_OPENING_MIN rows is
    keyed on its rows' prompt or tokens; small groups (a question asked twice) stay together."""
    from shared.reader import content_keys
    from stage2_train.data.split import heldout_mask

    def record(openings, contents):
        return {"opening_hashes": openings, "content_hashes": contents}

    contents = [f"{i:016x}" for i in range(1, 41)]
    generic = [record(["a" * 16] * 20, contents[:20]), record(["a" * 16] * 18 + ["b" * 16] * 2, contents[20:])]
    keys = content_keys(generic, np.arange(40), 7)
    assert keys[:38].tolist() == [int(h[:15], 16) for h in contents[:38]]  # the generic group: its tokens
    assert keys[38] == keys[39] == int("b" * 15, 16)  # a pair that opens alike stays one key
    assert 0 < heldout_mask(keys, 0.25, 0).sum() < 40


def test_a_store_made_at_identity_version_5_keeps_its_split_on_prompts(regenerated_copies, tiny_target_dir, tmp_path, caplog):
    """A store pinned before opening keys (identity version 5) keeps the split it was trained with
    when every shard is extracted again: no opening hashes in its records, its regenerated rows keyed
    on their prompt, and the log says why and how to key on openings."""

    from shared.reader import StoreReader


    root, _, made = regenerated_copies
    prompt_keys = StoreReader(made.store.url(made.run_dir)).manifest["shards"]
    prompt_keys = [int(h[:15], 16) for r in prompt_keys for h in r["prompt_hashes"]]
    reader = reextracted_at_version(root, tiny_target_dir, tmp_path, 5)
    assert reader.manifest["identity_version"] == 5 and reader.manifest["split_key"] == "prompt"
    assert not any("opening_hashes" in r for r in reader.manifest["shards"])
    assert reader.split_keys.tolist() == prompt_keys and reader.manifest["num_duplicates"] == 4
    assert "made at identity version 5: its held-out split keeps rows that open with the same turns" in caplog.text


def test_answers_merged_before_prompt_hashes_are_refused_for_a_new_store_naming_the_fix(regenerated_copies, tiny_target_dir, tmp_path):
    """A new store keys regenerated rows on their prompt: a generated.parquet merged before it held
    them is refused by name, and rerunning generate (every part reused) writes them."""
    import shutil

    from shared.config import load_run_config
    from shared.errors import DataError
    from stage1_extract import commands
    from stage1_extract.data import part_counts

    from .conftest import stage1_overrides

    root, _, _ = regenerated_copies
    copy = Path(shutil.copytree(root, tmp_path / "copy"))
    shutil.rmtree(copy / "run" / "store")
    generated = copy / "run" / "data" / "generated.parquet"
    older = [replace(c, prompt_hash=None, source_row=None) for c in read_conversations(generated)]
    write_conversations_parquet(older, generated, part_counts(generated))
    cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, copy / "chat.jsonl", copy / "run", **{
        "data.regenerate": True, "generate.max_new_tokens": 6, "generate.rows_per_part": 8, "extract.device": "cpu",
    }))
    with pytest.raises(DataError, match=r"generated\.parquet was merged before generate recorded each row's prompt .*rerun "
                                        r"`python -m stage1_extract generate` \(it reuses every finished part"):
        commands.cmd_extract(cfg, progress=False)
    assert commands.cmd_generate(cfg, progress=False)["parts_reused"] == 3
    assert commands.cmd_extract(cfg, progress=False)["split_key"] == "opening"


def copied_copies(regenerated_copies, tiny_target_dir, tmp_path):
    """A copy of the regenerated store's root, and its config."""
    import shutil

    from shared.config import load_run_config

    from .conftest import stage1_overrides

    root, _, _ = regenerated_copies
    copy = Path(shutil.copytree(root, tmp_path / "copy"))
    cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, copy / "chat.jsonl", copy / "run", **{
        "data.regenerate": True, "generate.max_new_tokens": 6, "generate.rows_per_part": 8, "extract.device": "cpu",
    }))
    return copy / "run" / "store", cfg


def test_verify_deep_finds_split_keys_the_data_does_not_give_and_repair_extracts_them_again(
    regenerated_copies, tiny_target_dir, tmp_path, monkeypatch
):
    """A store whose rows reached it with another prompt hash than generated.parquet gives them (what
    a damaged token cache would write): row 17, a copy of row 5, keyed apart from it, so the held-out
    split may separate them. Nothing in the shard can recount a prompt hash, so the shallow verify
    passes; --deep names the shard, the sample and both hashes, and --deep --repair extracts it again."""
    import shutil

    from shared.reader import StoreReader
    from stage1_extract import commands, prepare
    from stage1_extract.__main__ import show_verify

    store, cfg = copied_copies(regenerated_copies, tiny_target_dir, tmp_path)
    clean = json.loads((store / "manifest.json").read_text())["shards"]
    shutil.rmtree(store)
    real = prepare.tokenized_rows

    def row_17_keyed_apart(*args, **kwargs):
        rows, stats, sha = real(*args, **kwargs)
        at = next(i for i, r in enumerate(rows) if r.sample_id == 17)
        rows[at] = replace(rows[at], prompt_hash="0123456789abcdef" * 2)
        return rows, stats, sha

    monkeypatch.setattr(prepare, "tokenized_rows", row_17_keyed_apart)
    commands.cmd_extract(cfg, progress=False)
    monkeypatch.setattr(prepare, "tokenized_rows", real)
    assert commands.cmd_verify(cfg)["ok"]  # the shard agrees with its record
    (record,) = [r for r in clean if 17 in r["sample_ids"]]
    s = record["sample_ids"].index(17)
    deep = commands.cmd_verify(cfg, deep=True)
    assert [(b["shard"], b["fields"], b["fix"]) for b in deep["bad_shards"]] == [(record["name"], ["prompt_hashes"], "extract again")]
    assert deep["bad_shards"][0]["error"] == (
        f"prompt_hashes: 1 of {record['num_samples']} samples' split keys are not their row's in generated.parquet, "
        f"first sample {s} (input row 17): 0123456789abcdef in the record, {record['prompt_hashes'][s]} in generated.parquet"
    )
    # A check without --deep would find nothing to repair: the advice says --deep.
    assert show_verify(deep).endswith("\n1 bad shard(s): `python -m stage1_extract verify --deep --repair` repairs them")
    repaired = commands.cmd_verify(cfg, repair=True, deep=True, progress=False)
    assert repaired["ok"] and repaired["reextracted"] == [record["name"]]
    assert [r["prompt_hashes"] for r in json.loads((store / "manifest.json").read_text())["shards"]] == [r["prompt_hashes"] for r in clean]
    reader = StoreReader(str(store))
    at = {int(i): n for n, i in enumerate(reader.sample_ids)}
    assert reader.split_keys[at[17]] == reader.split_keys[at[5]]


def test_verify_deep_finds_a_record_without_opening_hashes_and_repair_rebuilds_it(regenerated_copies, tiny_target_dir, tmp_path):
    """One manifest record without opening hashes moves the whole store's split onto prompts (rows
    that share a first question apart), and the shallow verify cannot see it; --deep names it and,
    the part record being sound, --deep --repair rebuilds the record without extracting anything."""
    from shared.reader import StoreReader
    from stage1_extract import commands

    store, cfg = copied_copies(regenerated_copies, tiny_target_dir, tmp_path)
    manifest = json.loads((store / "manifest.json").read_text())
    clean = manifest["shards"]
    damaged = json.loads(json.dumps(manifest))
    del damaged["shards"][0]["opening_hashes"]
    (store / "manifest.json").write_text(json.dumps(damaged))
    assert StoreReader(str(store)).split_keys.tolist() == [int(h[:15], 16) for r in clean for h in r["prompt_hashes"]]
    assert commands.cmd_verify(cfg)["ok"]
    deep = commands.cmd_verify(cfg, deep=True)
    name = clean[0]["name"]
    assert [(b["shard"], b["fields"], b["fix"], b["error"]) for b in deep["bad_shards"]] == [(
        name, ["opening_hashes"], "rebuild the record",
        f"opening_hashes: none in the record, generated.parquet gives each of its {clean[0]['num_samples']} rows one "
        f"(without them the held-out split of the whole store keys on another hash)",
    )]
    repaired = commands.cmd_verify(cfg, repair=True, deep=True, progress=False)
    assert repaired["ok"] and (repaired["records_rebuilt"], repaired["reextracted"]) == ([name], [])
    assert json.loads((store / "manifest.json").read_text())["shards"] == clean
