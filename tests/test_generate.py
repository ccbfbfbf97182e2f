"""Regeneration on a GPU node, as far as CPU can show it: vLLM (a stand-in module with its API)
per rank on its own GPU, a seed per request from its row, the target's own token ids kept and
stored by extraction as they are.

    .venv/bin/python -m pytest tests/test_generate.py -q
"""

from __future__ import annotations

import os
import random
import sys
import types

import numpy as np
import pytest

from shared.config import load_run_config
from shared.conversation_files import read_conversations
from shared.conversations import Conversation
from shared.reader import StoreReader
from shared.target import load_tokenizer
from stage1_extract import commands, generate
from stage1_extract.data import write_conversations_parquet
from stage1_extract.template import tokenize_conversation
from testkit.data import write_jsonl

EOS = 2  # SmolLM2's <|im_end|>


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class FakeLLM:
    """vLLM's offline API: answers drawn from each request's own seed, ending in EOS."""

    made: list[dict] = []

    def __init__(self, model, dtype, seed, tensor_parallel_size):
        FakeLLM.made.append(
            {"tp": tensor_parallel_size, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "rank_env": "RANK" in os.environ}
        )

    def generate(self, prompts, params, use_tqdm=False):
        assert len(prompts) == len(params)
        outs = []
        for _, p in zip(prompts, params):
            rng = random.Random(p.seed)
            ids = [rng.randrange(300, 5000) for _ in range(rng.randint(3, p.max_tokens - 1))] + [EOS]
            outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids, text="not used")]))
        return outs


@pytest.fixture
def fake_vllm(monkeypatch):
    FakeLLM.made = []
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM, SamplingParams=FakeSamplingParams))
    return FakeLLM


def prompts_file(tmp_path, n=10):
    rows = [{"messages": [{"role": "user", "content": f"question number {i}: how does one sort a list?"}]} for i in range(n)]
    return write_jsonl(tmp_path / "prompts.jsonl", rows)


def generate_config(tiny_target_dir, data, run_dir, **extra):
    overrides = {
        "run_dir": str(run_dir), "target.path": str(tiny_target_dir), "target.dtype": "fp32", "data.path": str(data),
        "generate.backend": "vllm", "generate.max_new_tokens": 12, "generate.rows_per_part": 3, "extract.device": "cpu",
        **extra,
    }
    return load_run_config("configs/default.yaml", [f"{k}={v}" for k, v in overrides.items()])


def answers(path):
    return [[m.get("token_ids") for m in c.messages if m["role"] == "assistant"] for c in read_conversations(path)]


def test_vllm_answers_keep_their_token_ids_and_a_seed_per_row(tiny_target_dir, tmp_path, fake_vllm, monkeypatch):
    data = prompts_file(tmp_path)
    out = commands.cmd_generate(generate_config(tiny_target_dir, data, tmp_path / "a", **{"generate.tensor_parallel_size": 2}), progress=False)
    got = answers(out["output"])
    assert all(len(a) == 1 and a[0] and EOS not in a[0] for a in got)  # ids kept, stop token left to the template
    assert len({tuple(a[0]) for a in got}) == len(got)  # a seed per request, not one per call
    assert fake_vllm.made[0]["tp"] == 2
    tokenizer = load_tokenizer(generate_config(tiny_target_dir, data, tmp_path / "a").target)
    texts = [c.messages[-1]["content"] for c in read_conversations(out["output"])]
    assert texts[0] == tokenizer.decode(got[0][0], skip_special_tokens=True)  # the text is for people
    # Another part size: the same answers (the seed belongs to the row, not to the call).
    other = commands.cmd_generate(generate_config(tiny_target_dir, data, tmp_path / "b", **{"generate.rows_per_part": 4}), progress=False)
    assert answers(other["output"]) == got


def test_the_engine_start_is_timed_apart_from_generating(tiny_target_dir, tmp_path, fake_vllm, monkeypatch):
    """A few dozen prompts on a GPU take seconds; an engine's start can take a minute: the summary
    says which was which."""
    import time

    made, answer = FakeLLM.__init__, FakeLLM.generate
    monkeypatch.setattr(FakeLLM, "__init__", lambda self, *a, **k: (time.sleep(0.3), made(self, *a, **k))[1])
    monkeypatch.setattr(FakeLLM, "generate", lambda self, *a, **k: (time.sleep(0.1), answer(self, *a, **k))[1])
    out = commands.cmd_generate(generate_config(tiny_target_dir, prompts_file(tmp_path), tmp_path / "a"), progress=False)
    assert 0.3 <= out["backend_start_seconds"] < 0.6  # one engine started once, none of the generate calls
    assert out["generate_call_seconds"] >= 0.1 * 4  # 10 rows in parts of 3: four calls
    assert out["backend_start_seconds"] + out["generate_call_seconds"] <= out["seconds"] + 0.05


def test_ranks_each_run_an_engine_on_their_own_gpu_and_share_the_parts(tiny_target_dir, tmp_path, fake_vllm, monkeypatch):
    """Under torchrun rank r runs one engine on its GPU, sees no torchrun variables while it
    starts, writes parts r, r + W, ...; rank 0 merges: the file equals a single-process run's."""
    data = prompts_file(tmp_path, n=11)
    single = commands.cmd_generate(generate_config(tiny_target_dir, data, tmp_path / "one"), progress=False)
    cfg = generate_config(tiny_target_dir, data, tmp_path / "two")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    for rank in (1, 0):  # rank 1 first: rank 0 then finds its parts and merges
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        result = commands.cmd_generate(cfg, progress=False)
        assert result["rank"] == rank and os.environ["RANK"] == str(rank)  # restored after the engine started
    assert [m["visible"] for m in fake_vllm.made[-2:]] == ["5", "4"] and not any(m["rank_env"] for m in fake_vllm.made)
    assert answers(result["output"]) == answers(single["output"])
    parts = sorted(p.name for p in (tmp_path / "two" / "data" / "generated.parts").glob("part-*.parquet"))
    assert len(parts) == 4


def test_a_failed_rank_stops_rank_0_naming_it(tiny_target_dir, tmp_path, fake_vllm, monkeypatch):
    data = prompts_file(tmp_path, n=6)
    cfg = generate_config(tiny_target_dir, data, tmp_path / "run")
    parts = tmp_path / "run" / "data" / "generated.parts"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    real_wait = generate.wait_for_parts

    def rank_1_fails_meanwhile(parts_dir, wanted, world, poll_s=2.0):
        (parts / ".failed-rank-1").write_text("CUDA error: out of memory")
        return real_wait(parts_dir, wanted, world, poll_s=0.01)

    monkeypatch.setattr(generate, "wait_for_parts", rank_1_fails_meanwhile)
    with pytest.raises(ValueError, match="generate failed on rank-1: CUDA error: out of memory"):
        commands.cmd_generate(cfg, progress=False)


def test_extraction_stores_the_targets_own_token_ids(tiny_target_dir, tmp_path):
    """Ids whose decoded text re-tokenizes differently (here one character per token) are stored
    as generated, supervised, between the template's own tokens."""
    tokenizer = load_tokenizer(generate_config(tiny_target_dir, tmp_path, tmp_path).target)
    word = "extraordinarily"
    per_char = [tokenizer.convert_tokens_to_ids(c) for c in word]
    assert tokenizer(word, add_special_tokens=False)["input_ids"] != per_char  # re-tokenizing would merge them
    convs = [
        Conversation(row=i, messages=[{"role": "user", "content": f"say it {i}"}, {"role": "assistant", "content": word, "token_ids": per_char}])
        for i in range(4)
    ]
    path = tmp_path / "answers.parquet"
    write_conversations_parquet(convs, path)
    sample = tokenize_conversation(tokenizer, read_conversations(path).__next__().messages, 256)
    ids = sample.input_ids.tolist()
    start = next(i for i in range(len(ids)) if ids[i : i + len(per_char)] == per_char)
    assert sample.loss_mask[start : start + len(per_char)].all() and not sample.loss_mask[:start].any()
    assert sample.loss_mask[start + len(per_char)]  # the template's end-of-turn token is supervised too
    assert ids[start + len(per_char)] == EOS and sample.ids_fallbacks == 0
    cfg = load_run_config("configs/default.yaml", [
        f"run_dir={tmp_path / 'run'}", f"target.path={tiny_target_dir}", "target.dtype=fp32", "target.num_feature_layers=3",
        f"data.path={path}", "data.regenerate=false", "extract.top_k=8", "store.shard_mb=1",
    ])
    commands.cmd_extract(cfg, progress=False)
    stored = StoreReader(cfg.store.url(cfg.run_dir))[0]["input_ids_T"].numpy()
    assert np.array_equal(stored, sample.input_ids)


def test_a_full_disk_is_one_line_naming_the_folder_and_its_free_space(tiny_target_dir, tmp_path, fake_vllm, monkeypatch, capsys):
    """The disk fills while a part is written: the failure marker's own write then fails too. The
    user gets one line (exit 2) naming the folder and its free space; the parts written stay."""
    import errno

    from stage1_extract import __main__ as cli

    data = prompts_file(tmp_path, n=9)
    real_part, real_atomic = generate.write_conversations_parquet, generate.write_atomic
    written = []

    def part_writer(conversations, path):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        written.append(path)
        real_part(conversations, path)

    def atomic(path, data):
        if written and ".failed-rank" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_atomic(path, data)

    monkeypatch.setattr(generate, "write_conversations_parquet", part_writer)
    monkeypatch.setattr(generate, "write_atomic", atomic)
    overrides = [
        f"run_dir={tmp_path / 'run'}", f"target.path={tiny_target_dir}", "target.dtype=fp32", f"data.path={data}",
        "generate.backend=vllm", "generate.max_new_tokens=12", "generate.rows_per_part=3", "extract.device=cpu",
    ]
    assert cli.main(["generate", "--no-progress", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    parts = tmp_path / "run" / "data" / "generated.parts"
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith(f"error: {parts}: no space left on the device (") and " free) writing part-000001-" in err
    # The rerun command carries the run's own overrides (shared/cli.py names the config it came with).
    assert "1 of 3 parts written so far are kept; free space and rerun `python -m stage1_extract generate " in err
    assert "generate.rows_per_part=3 extract.device=cpu`, which resumes from them" in err
    assert [p.name for p in parts.glob("part-*.parquet")] == [written[0].name]


def test_a_turn_that_calls_tools_is_kept_and_the_answer_after_its_result_regenerated(tiny_target_dir, tmp_path, fake_vllm):
    """The tool's result answers the call the data made: that call stays; the turns around it are the target's."""
    row = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "OLD", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "OLD ANSWER"},
            {"role": "user", "content": "Thanks"},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
    }
    data = write_jsonl(tmp_path / "tools.jsonl", [row])
    out = commands.cmd_generate(generate_config(tiny_target_dir, data, tmp_path / "run"), progress=False)
    assert out["tool_call_turns_kept"] == 1
    (conv,) = read_conversations(out["output"])
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert conv.messages[1] == {"role": "assistant", "content": "OLD", "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]}
    assert [m.get("token_ids") is not None for m in conv.messages] == [False, False, False, True, False, True]
    assert conv.messages[3]["content"] != "OLD ANSWER" and conv.tools == '[{"type": "function", "function": {"name": "get_weather"}}]'
