"""Regeneration on a GPU node, as far as CPU can show it: vLLM (a stand-in module with its API)
per rank on its own GPU, a seed per request from its row, the target's own token ids kept and
stored by extraction as they are.

    .venv/bin/python -m pytest tests/test_generate.py -q
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import types
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from shared.config import load_run_config
from shared.conversation_files import read_conversations
from shared.conversations import Conversation
from shared.errors import DataError
from shared.reader import StoreReader
from shared.target import load_tokenizer
from stage1_extract import backends, commands, generate, generate_command
from stage1_extract.backends import engine_seed
from stage1_extract.data import write_conversations_parquet
from stage1_extract.template import prompt_ids, tokenize_conversation
from testkit.data import write_jsonl

EOS = 2  # SmolLM2's <|im_end|>


class FakeSamplingParams:
    def __init__(self, seed=None, **kwargs):
        self.seed = seed
        self.__dict__.update(kwargs)


class FakeEngine:
    """vLLM's engine API (add_request / step / has_unfinished_requests), decoding one token per
    step for at most `max_num_seqs` requests at a time, first come first served. An answer is drawn
    from its request's own seed when it has one, else from the engine's seeded stream in the order
    requests start (so, as on vLLM, it depends on what ran before it). A request `cuts` picks runs to
    max_tokens without a stop token and finishes with vLLM's finish_reason "length"; the others end on
    EOS ("stop")."""

    max_num_seqs = 4
    max_model_len = 2048
    cuts = staticmethod(lambda prompt_ids: False)

    @property
    def vllm_config(self):  # where vLLM's LLMEngine holds its scheduler and model settings
        return types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=self.max_num_seqs),
                                     model_config=types.SimpleNamespace(max_model_len=self.max_model_len))

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.waiting, self.running = [], {}
        self.added = []  # (request id, prompt ids) in order
        self.steps = []  # request ids decoding at each step
        self.added_by_step = []  # requests added before each step
        self.fail_after_steps = None

    def add_request(self, request_id, prompt, params):
        assert isinstance(request_id, str) and set(prompt) == {"prompt_token_ids"}
        if len(prompt["prompt_token_ids"]) > self.max_model_len:  # as vLLM validates a request
            raise ValueError(f"The decoder prompt (length {len(prompt['prompt_token_ids'])}) is longer than the maximum "
                             f"model length of {self.max_model_len}.")
        self.added.append((request_id, prompt["prompt_token_ids"]))
        self.waiting.append((request_id, params, prompt["prompt_token_ids"]))

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)

    def step(self):
        if self.fail_after_steps is not None and len(self.steps) >= self.fail_after_steps:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        while self.waiting and len(self.running) < self.max_num_seqs:
            request_id, params, prompt_ids = self.waiting.pop(0)
            rng = random.Random(params.seed) if params.seed is not None else self.rng
            if self.cuts(prompt_ids):
                ids, reason = [rng.randrange(300, 5000) for _ in range(params.max_tokens)], "length"
            else:
                ids, reason = [rng.randrange(300, 5000) for _ in range(rng.randint(3, params.max_tokens - 1))] + [EOS], "stop"
            self.running[request_id] = [ids, 0, reason]
        self.steps.append(sorted(self.running))
        self.added_by_step.append(len(self.added))
        outputs = []
        for request_id in list(self.running):
            ids, done, reason = self.running[request_id]
            self.running[request_id][1] = done + 1
            finished = done + 1 == len(ids)
            if finished:
                del self.running[request_id]
            outputs.append(types.SimpleNamespace(request_id=request_id, finished=finished, outputs=[
                types.SimpleNamespace(token_ids=ids[: done + 1], finish_reason=reason if finished else None)
            ]))
        return outputs


class FakeLLM:
    """vLLM's offline entry point: it builds the engine the backend feeds."""

    made: list[dict] = []

    def __init__(self, model, dtype, seed, tensor_parallel_size):
        FakeLLM.made.append(
            {"tp": tensor_parallel_size, "seed": seed, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "rank_env": "RANK" in os.environ,
             "start_method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")}
        )
        self.llm_engine = FakeEngine(seed)
        FakeLLM.engines.append(self.llm_engine)


@pytest.fixture
def fake_vllm(monkeypatch):
    FakeLLM.made, FakeLLM.engines = [], []
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


def test_vllm_answers_keep_their_token_ids_and_sample_on_the_fast_path(tiny_target_dir, tmp_path, fake_vllm):
    """By default no request carries a seed (vLLM's fast sampler; one engine seed per rank); with
    generate.per_request_seeds each request is seeded from its row and turn, so another part size
    gives the same answers."""
    data = prompts_file(tmp_path)
    out = commands.cmd_generate(generate_config(tiny_target_dir, data, tmp_path / "a", **{"generate.tensor_parallel_size": 2}), progress=False)
    got = answers(out["output"])
    assert all(len(a) == 1 and a[0] and EOS not in a[0] for a in got)  # ids kept, stop token left to the template
    assert fake_vllm.made[0]["tp"] == 2 and fake_vllm.made[0]["seed"] == engine_seed(0, 0)
    engine = fake_vllm.engines[0]
    assert len(engine.added) == 10 and len({tuple(a[0]) for a in got}) == len(got)
    tokenizer = load_tokenizer(generate_config(tiny_target_dir, data, tmp_path / "a").target)
    texts = [c.messages[-1]["content"] for c in read_conversations(out["output"])]
    assert texts[0] == tokenizer.decode(got[0][0], skip_special_tokens=True)  # the text is for people
    seeded = {"generate.per_request_seeds": "true"}
    three = commands.cmd_generate(generate_config(tiny_target_dir, data, tmp_path / "b", **seeded), progress=False)
    four = commands.cmd_generate(generate_config(tiny_target_dir, data, tmp_path / "c", **seeded, **{"generate.rows_per_part": 4}), progress=False)
    assert answers(three["output"]) == answers(four["output"])  # the seed belongs to the row, not to the call
    assert answers(three["output"]) != got


def test_the_engine_start_is_timed_apart_from_generating(tiny_target_dir, tmp_path, fake_vllm, monkeypatch):
    """A few dozen prompts on a GPU take seconds; an engine's start can take a minute: the summary
    says which was which."""
    import time

    made, step = FakeLLM.__init__, FakeEngine.step
    monkeypatch.setattr(FakeLLM, "__init__", lambda self, *a, **k: (time.sleep(0.3), made(self, *a, **k))[1])
    monkeypatch.setattr(FakeEngine, "step", lambda self: (time.sleep(0.02), step(self))[1])
    out = commands.cmd_generate(generate_config(tiny_target_dir, prompts_file(tmp_path), tmp_path / "a"), progress=False)
    steps = len(FakeLLM.engines[0].steps)
    assert 0.3 <= out["backend_start_seconds"] < 0.6  # one engine started once, none of the engine's steps
    assert steps > 4 and out["generate_call_seconds"] >= 0.02 * steps
    assert out["backend_start_seconds"] + out["generate_call_seconds"] <= out["seconds"] + 0.05


def test_the_engine_starts_from_a_process_that_never_initialised_cuda(tiny_target_dir, tmp_path, fake_vllm, monkeypatch):
    """vLLM forks its engine unless it sees CUDA initialised, and a fork of a process whose CUDA driver
    started (torch's plain is_available() runs cuInit) cannot use CUDA: with `extract.device=auto` the
    device is asked through NVML, and the engine's workers are spawned."""
    asked = []
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")) or False)
    commands.cmd_generate(generate_config(tiny_target_dir, prompts_file(tmp_path, n=3), tmp_path / "run", **{"extract.device": "auto"}),
                          progress=False)
    assert asked and set(asked) == {"1"}
    assert fake_vllm.made[-1]["start_method"] == "spawn" and "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ


def test_ranks_each_run_an_engine_on_their_own_gpu_and_share_the_parts(tiny_target_dir, tmp_path, fake_vllm, monkeypatch):
    """Under torchrun rank r runs one engine on its GPU with its own seed, sees no torchrun variables
    while it starts, writes parts r, r + W, ...; rank 0 merges: with per-request seeds the file
    equals a single-process run's."""
    data = prompts_file(tmp_path, n=11)
    seeded = {"generate.per_request_seeds": "true"}
    single = commands.cmd_generate(generate_config(tiny_target_dir, data, tmp_path / "one", **seeded), progress=False)
    cfg = generate_config(tiny_target_dir, data, tmp_path / "two", **seeded)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    for rank in (1, 0):  # rank 1 first: rank 0 then finds its parts and merges
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        result = commands.cmd_generate(cfg, progress=False)
        assert result["rank"] == rank and os.environ["RANK"] == str(rank)  # restored after the engine started
    assert [m["visible"] for m in fake_vllm.made[-2:]] == ["5", "4"] and not any(m["rank_env"] for m in fake_vllm.made)
    assert [m["seed"] for m in fake_vllm.made[-2:]] == [engine_seed(0, 1), engine_seed(0, 0)] and engine_seed(0, 1) != engine_seed(0, 0)
    assert answers(result["output"]) == answers(single["output"])
    parts = sorted(p.name for p in (tmp_path / "two" / "data" / "generated.parts").glob("part-*.parquet"))
    assert len(parts) == 4


def part_of(tokenizer, prompt_ids, rows_per_part):
    row = int(re.search(r"question number (\d+)", tokenizer.decode(prompt_ids)).group(1))
    return row // rows_per_part


def test_the_engine_decodes_several_parts_at_once_and_each_part_is_written_as_it_completes(tiny_target_dir, tmp_path, fake_vllm, monkeypatch):
    """A part waits for its longest answer; the engine does not: the next part's requests are in
    before the current part is written, several parts decode in one step, and a part is written the
    moment its last answer lands, while the engine is still busy with the others."""
    data = prompts_file(tmp_path, n=10)
    cfg = generate_config(tiny_target_dir, data, tmp_path / "run")  # 4 parts of 3, 3, 3, 1 rows
    tokenizer = load_tokenizer(cfg.target)
    real_write = generate.write_conversations_parquet
    written = []  # (part number, parts the engine had received by then, engine still busy)

    def write_part(conversations, path, counts=None):
        if not path.name.startswith("part-"):  # the merged file
            return real_write(conversations, path)
        engine = fake_vllm.engines[0]
        received = {part_of(tokenizer, ids, 3) for _, ids in engine.added}
        written.append((int(path.name.split("-")[1]), received, engine.has_unfinished_requests()))
        real_write(conversations, path, counts)

    monkeypatch.setattr(generate, "write_conversations_parquet", write_part)
    out = commands.cmd_generate(cfg, progress=False)
    assert out["conversations"] == 10
    assert sorted(p for p, _, _ in written) == [0, 1, 2, 3]
    first, received, busy = written[0]
    assert busy and received - {first}  # written while the engine still decodes another part's requests
    engine = fake_vllm.engines[0]
    part_by_id = {request_id: part_of(tokenizer, ids, 3) for request_id, ids in engine.added}
    together = max(len({part_by_id[r] for r in step}) for step in engine.steps)
    assert together >= 2


def test_the_engine_is_fed_up_to_its_own_batch_not_to_a_part(tiny_target_dir, tmp_path, fake_vllm, monkeypatch):
    """vLLM decodes max_num_seqs sequences a step (hundreds on an H100): parts of 3 rows go in until
    8 requests are in flight, so its first step is full and it never runs below its batch while
    rows are left, and each part is still written the moment it completes."""
    monkeypatch.setattr(FakeEngine, "max_num_seqs", 8)
    data = prompts_file(tmp_path, n=24)
    cfg = generate_config(tiny_target_dir, data, tmp_path / "run")  # 8 parts of 3
    tokenizer = load_tokenizer(cfg.target)
    out = commands.cmd_generate(cfg, progress=False)
    assert out["conversations"] == 24 and out["in_flight_limit"] == 8
    engine = fake_vllm.engines[0]
    assert len(engine.steps[0]) == 8 and max(len(step) for step in engine.steps) == 8
    assert all(len(step) == 8 for step, added in zip(engine.steps, engine.added_by_step) if added < 24)  # rows left
    part_by_id = {request_id: part_of(tokenizer, ids, 3) for request_id, ids in engine.added}
    assert max(len({part_by_id[r] for r in step}) for step in engine.steps) >= 3
    assert len(list((tmp_path / "run" / "data" / "generated.parts").glob("part-*.parquet"))) == 8


def test_a_prompt_past_the_engines_context_keeps_its_turns_and_is_counted(tiny_target_dir, tmp_path, fake_vllm, monkeypatch):
    """vLLM refuses a prompt longer than max_model_len: that turn and the row's later ones are kept
    as the data has them and counted, the other rows and the row's earlier turns are answered."""
    monkeypatch.setattr(FakeEngine, "max_model_len", 160)
    long = "please read this long question carefully " * 30
    rows = [{"messages": [{"role": "user", "content": f"question number {i}: how does one sort a list?"}]} for i in range(4)]
    rows[1]["messages"] = [{"role": "user", "content": long}]
    rows[2]["messages"] += [{"role": "assistant", "content": "sort it."}, {"role": "user", "content": long},
                            {"role": "assistant", "content": "the data's own answer"}]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    out = commands.cmd_generate(generate_config(tiny_target_dir, data, tmp_path / "run"), progress=False)
    assert out["conversations"] == 4 and out["long_prompt_turns_kept"] == 2
    generated = list(read_conversations(tmp_path / "run" / "data" / "generated.parquet"))
    assert generated[1].messages == rows[1]["messages"]  # no answer: extraction judges the row as the data gives it
    first, kept = [m for m in generated[2].messages if m["role"] == "assistant"]
    assert first.get("token_ids") and not kept.get("token_ids") and kept["content"] == "the data's own answer"
    assert all(m[-1].get("token_ids") for m in (generated[0].messages, generated[3].messages))


def test_turns_kept_past_the_context_are_counted_over_every_ranks_parts_and_resumed_ones(tiny_target_dir, tmp_path, fake_vllm, monkeypatch):
    """Each part carries its own count, so rank 0's summary counts the other ranks' parts and the
    parts a resumed run reused, not only what it answered itself."""
    monkeypatch.setattr(FakeEngine, "max_model_len", 160)
    long = "please read this long question carefully " * 30
    rows = [{"messages": [{"role": "user", "content": long if i in (1, 4, 5) else f"question number {i}: how?"}]} for i in range(6)]
    cfg = generate_config(tiny_target_dir, write_jsonl(tmp_path / "prompts.jsonl", rows), tmp_path / "run")  # parts 0-2, 3-5
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    for rank in (1, 0):  # rank 1 answers part 1 (rows 4 and 5 past the context), rank 0 part 0 and merges
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        out = commands.cmd_generate(cfg, progress=False)
    assert out["long_prompt_turns_kept"] == 3
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name)
    again = commands.cmd_generate(cfg, progress=False)  # every part reused, none answered
    assert again["parts_reused"] == 2 and again["long_prompt_turns_kept"] == 3


def test_a_request_the_engine_refuses_names_the_row_and_its_part(tiny_target_dir, tmp_path, fake_vllm, monkeypatch):
    tokenizer = load_tokenizer(generate_config(tiny_target_dir, prompts_file(tmp_path), tmp_path / "run").target)
    add = FakeEngine.add_request

    def refuses_row_4(self, request_id, prompt, params):
        if part_of(tokenizer, prompt["prompt_token_ids"], 1) == 4:
            raise ValueError("Token id 99999 is out of vocabulary")
        return add(self, request_id, prompt, params)

    monkeypatch.setattr(FakeEngine, "add_request", refuses_row_4)
    cfg = generate_config(tiny_target_dir, tmp_path / "prompts.jsonl", tmp_path / "run")
    with pytest.raises(DataError, match=r"prompts.jsonl: row 4: the engine refused its assistant turn 0 \(Token id 99999 is out "
                                        r"of vocabulary\) while writing part-000001-\w+.parquet; fix or drop that row, then "
                                        r"rerun `python -m stage1_extract generate` \(finished parts are kept\)$"):
        commands.cmd_generate(cfg, progress=False)


def test_a_killed_run_resumes_from_its_finished_parts_and_never_regenerates_them(tiny_target_dir, tmp_path, fake_vllm, monkeypatch):
    """The engine dies mid-run: the parts finished by then are kept as they are, and the rerun asks
    the engine only for the rows of the parts that are missing."""
    data = prompts_file(tmp_path, n=12)
    cfg = generate_config(tiny_target_dir, data, tmp_path / "run")  # 4 parts of 3
    tokenizer = load_tokenizer(cfg.target)
    real_init = FakeEngine.__init__

    def dies(self, seed):
        real_init(self, seed)
        self.fail_after_steps = 16

    monkeypatch.setattr(FakeEngine, "__init__", dies)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        commands.cmd_generate(cfg, progress=False)
    parts_dir = tmp_path / "run" / "data" / "generated.parts"
    kept = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in parts_dir.glob("part-*.parquet")}
    assert 1 <= len(kept) < 4
    monkeypatch.setattr(FakeEngine, "__init__", real_init)
    out = commands.cmd_generate(cfg, progress=False)
    assert out["parts_reused"] == len(kept) and out["conversations"] == 12
    for name, (data_bytes, mtime) in kept.items():
        assert (parts_dir / name).read_bytes() == data_bytes and (parts_dir / name).stat().st_mtime_ns == mtime
    asked = {part_of(tokenizer, ids, 3) for _, ids in fake_vllm.engines[-1].added}
    assert asked == {int(p.name.split("-")[1]) for p in parts_dir.glob("part-*.parquet")} - {int(n.split("-")[1]) for n in kept}


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

    def part_writer(conversations, path, counts=None):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        written.append(path)
        real_part(conversations, path, counts)

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


# ---- answers cut at generate.max_new_tokens ------------------------------------------------------------
AT_LENGTH = "write at length"


def cut_when_asked_at_length(monkeypatch, tokenizer):
    """The stand-in vLLM cuts (finish_reason "length") every answer to a user turn opening with AT_LENGTH."""
    def cuts(prompt_ids):
        return tokenizer.decode(prompt_ids).rsplit("<|im_start|>user\n", 1)[1].startswith(AT_LENGTH)

    monkeypatch.setattr(FakeEngine, "cuts", staticmethod(cuts))


CUT_ROWS = [
    {"messages": [{"role": "user", "content": "question 0: how are you?"}]},
    {"messages": [{"role": "user", "content": f"{AT_LENGTH} about lists"}]},
    {"messages": [{"role": "user", "content": f"{AT_LENGTH} about dicts"}, {"role": "assistant", "content": "OLD"},
                  {"role": "user", "content": "and sets?"}, {"role": "assistant", "content": "OLD"}]},
    {"messages": [{"role": "user", "content": "question 3"}, {"role": "assistant", "content": "OLD"},
                  {"role": "user", "content": "more?"}, {"role": "assistant", "content": "OLD"}]},
]


def cut_flags(path):
    return [[m.get("answer_cut") for m in c.messages if m["role"] == "assistant"] for c in read_conversations(path)]


def test_answers_cut_at_max_new_tokens_are_marked_counted_and_end_their_row(tiny_target_dir, tmp_path, fake_vllm, monkeypatch):
    """vLLM says an answer hit max_tokens (finish_reason "length"): the answer is kept and marked, its
    row's later turns are dropped (never asked of the engine), and the summary counts both, over
    every part, reused ones too, with a warning naming the setting."""
    from stage1_extract.__main__ import show_generate

    cfg = generate_config(tiny_target_dir, write_jsonl(tmp_path / "prompts.jsonl", CUT_ROWS), tmp_path / "run")
    cut_when_asked_at_length(monkeypatch, load_tokenizer(cfg.target))
    out = commands.cmd_generate(cfg, progress=False)
    assert (out["answers"], out["answers_cut"], out["answers_cut_share"], out["turns_dropped_after_cut"]) == (5, 2, 0.4, 2)
    assert out["answers_cut_unknown"] == 0 and len(fake_vllm.engines[0].added) == 5
    assert cut_flags(out["output"]) == [[False], [True], [True], [False, False]]
    assert [f.name for f in pq.read_schema(out["output"]).field("messages").type.value_type][-2:] == ["answer_cut", "stop_id"]
    generated = list(read_conversations(out["output"]))
    assert [m["role"] for m in generated[2].messages] == ["user", "assistant"]  # stopped at its cut answer
    assert all(len(c.messages[1]["token_ids"]) == 12 and EOS not in c.messages[1]["token_ids"] for c in generated[1:3])
    assert "\nwarning: 2 of 5 answers (40.0%) were cut at generate.max_new_tokens=12 before the target ended them: kept " \
           "with their end-of-turn marker unsupervised, the 2 later turn(s) of their rows dropped; raise " \
           "generate.max_new_tokens to let them finish" in show_generate(out)
    again = commands.cmd_generate(cfg, progress=False)
    assert again["parts_reused"] == 2 and (again["answers_cut"], again["turns_dropped_after_cut"]) == (2, 2)


def test_parts_written_before_cuts_were_recorded_are_read_as_ended_and_said_so(tiny_target_dir, tmp_path, fake_vllm, monkeypatch):
    """A part without the answer_cut column (an older generate) is reused as it is: its answers load,
    count as ended, and the summary says how many could not be told apart."""
    from stage1_extract.__main__ import show_generate
    from stage1_extract.data import part_counts

    cfg = generate_config(tiny_target_dir, write_jsonl(tmp_path / "prompts.jsonl", CUT_ROWS), tmp_path / "run")
    cut_when_asked_at_length(monkeypatch, load_tokenizer(cfg.target))
    commands.cmd_generate(cfg, progress=False)
    parts = tmp_path / "run" / "data" / "generated.parts"
    first = sorted(parts.glob("part-*.parquet"))[0]  # rows 0-2: one finished answer, two cut
    old = [Conversation(c.row, [{k: v for k, v in m.items() if k not in ("answer_cut", "stop_id")} for m in c.messages], tools=c.tools)
           for c in read_conversations(first)]
    write_conversations_parquet(old, first, {"long_prompt_turns_kept": part_counts(first)["long_prompt_turns_kept"]})
    assert [f.name for f in pq.read_schema(first).field("messages").type.value_type] == ["role", "content", "token_ids"]
    out = commands.cmd_generate(cfg, progress=False)
    assert out["parts_reused"] == 2 and (out["answers"], out["answers_cut"], out["answers_cut_unknown"]) == (5, 0, 3)
    assert cut_flags(out["output"]) == [[None], [None], [None], [False, False]]
    assert f"\n3 answer(s) come from parts written before cut answers were recorded: read as ended (delete {parts} to " \
           "regenerate them)" in show_generate(out)
    tokenizer = load_tokenizer(cfg.target)
    sample = tokenize_conversation(tokenizer, list(read_conversations(out["output"]))[1].messages, 256)
    assert tokenizer.decode(sample.input_ids[sample.loss_mask]).endswith("<|im_end|>\n")  # supervised, as before


def test_a_cut_answers_end_of_turn_marker_is_not_supervised_and_its_content_is(tiny_target_dir, tmp_path):
    """The template closes a cut answer with its end-of-turn marker like any other: those tokens are left out of
    the loss (the target did not end there), the answer's own ids stay in; a finished answer, later
    in the same row or in another, keeps its marker. Extraction stores that mask, the manifest counts
    the cut answer and status and verify say so."""
    from stage1_extract.__main__ import show_status

    tokenizer = load_tokenizer(generate_config(tiny_target_dir, tmp_path, tmp_path).target)
    word = "extraordinarily"
    per_char = [tokenizer.convert_tokens_to_ids(c) for c in word]

    def reply(cut):
        return {"role": "assistant", "content": word, "token_ids": per_char, "answer_cut": cut}

    convs = [Conversation(row=0, messages=[{"role": "user", "content": "say it"}, reply(True),
                                           {"role": "user", "content": "again"}, reply(False)])]
    convs += [Conversation(row=i, messages=[{"role": "user", "content": f"say it {i}"}, reply(False)]) for i in (1, 2, 3)]
    path = tmp_path / "answers.parquet"
    write_conversations_parquet(convs, path)
    back = list(read_conversations(path))
    cut_row, finished_row = (tokenize_conversation(tokenizer, c.messages, 256) for c in back[:2])
    for sample, supervised in ((cut_row, f"{word}{word}<|im_end|>\n"), (finished_row, f"{word}<|im_end|>\n")):
        assert tokenizer.decode(sample.input_ids[sample.loss_mask]) == supervised and sample.ids_fallbacks == 0
    ids = cut_row.input_ids.tolist()
    end = next(i for i in range(len(ids)) if ids[i : i + len(per_char)] == per_char) + len(per_char)
    assert cut_row.loss_mask[end - len(per_char) : end].all() and ids[end] == EOS and not cut_row.loss_mask[end : end + 2].any()
    cfg = load_run_config("configs/default.yaml", [
        f"run_dir={tmp_path / 'run'}", f"target.path={tiny_target_dir}", "target.dtype=fp32", "target.num_feature_layers=3",
        f"data.path={path}", "data.regenerate=false", "extract.top_k=8", "store.shard_mb=1",
    ])
    assert commands.cmd_extract(cfg, progress=False)["answers_cut"] == 1
    stored = StoreReader(cfg.store.url(cfg.run_dir))
    assert np.array_equal(stored[0]["loss_mask_T"].numpy(), cut_row.loss_mask)
    assert stored.manifest["data"]["answers_cut"] == 1 and stored.manifest["data"]["answers_cut_unknown"] == 0
    status = commands.cmd_status(cfg)
    assert status["answers_cut"] == 1 and "\n1 answer(s) cut at generate.max_new_tokens: their end-of-turn marker is " \
                                           "not supervised\n" in show_status(status)
    assert commands.cmd_verify(cfg)["answers_cut"] == 1


def test_ids_follow_their_generation_prompt_whatever_the_template_writes_around_the_answer(tiny_target_dir):
    """The target's ids go right after the prompt it answered and the end marker after them: a
    template that trims the answer's text, or drops it, changes nothing of what the target produced
    (a template that drops the text cannot be located: its text is tokenized, counted)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    original = tokenizer.chat_template
    tokenizer.chat_template = original.replace("message['content']", "(message['content'] | trim)")
    text = "hello there  "
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for cut, supervised in ((True, text), (False, text + "<|im_end|>\n")):
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text, "token_ids": ids, "answer_cut": cut}]
        sample = tokenize_conversation(tokenizer, messages, 256)
        assert sample.ids_fallbacks == 0 and tokenizer.decode(sample.input_ids[sample.loss_mask]) == supervised
    tokenizer.chat_template = original.replace("message['content']", "''")  # the answer is not rendered at all
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text, "token_ids": ids, "answer_cut": True}]
    sample = tokenize_conversation(tokenizer, messages, 256)
    assert sample.ids_fallbacks == 1 and not sample.loss_mask.any()  # cut, and no end marker to tell apart


def test_an_answer_closes_with_the_stop_token_the_target_ended_it_with(tiny_target_dir, tmp_path):
    """The target's stop token was dropped and the template's end marker written and supervised in its
    place: a target ending with <|endoftext|> (Qwen3's other stop; Llama 3.1's <|eom_id|>) taught the
    drafter <|im_end|>. The stop it produced is kept through generated.parquet and stored, supervised; in a
    turn later turns follow, the marker they were generated after stays, unsupervised."""
    from transformers import AutoTokenizer

    from shared.row_formats import parse_row
    from stage1_extract.backends import Answer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    im_end, eos = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    rewrite = generate.PartRewrite(0, [Conversation(0, [{"role": "user", "content": "hi"}])], tokenizer, seed=0)
    rewrite.next_round()
    ids = tokenizer("hello there", add_special_tokens=False)["input_ids"]
    rewrite.answer(0, Answer(ids, cut=False, stop=eos))
    write_conversations_parquet(rewrite.conversations(), tmp_path / "generated.parquet")
    (row,) = read_conversations(tmp_path / "generated.parquet")
    assert row.messages[1] == {"role": "assistant", "content": "hello there", "token_ids": ids, "answer_cut": False, "stop_id": eos}

    prompt = prompt_ids(tokenizer, row.messages[:1])
    sample = tokenize_conversation(tokenizer, row.messages, 256)
    assert sample.input_ids.tolist() == prompt + ids + [eos, *newline]
    assert sample.loss_mask.tolist() == [False] * len(prompt) + [True] * (len(ids) + 1 + len(newline))

    again = [*row.messages, {"role": "user", "content": "more"}, {**row.messages[1], "stop_id": im_end}]
    sample = tokenize_conversation(tokenizer, again, 256)
    first = prompt + ids + [im_end, *newline]
    second = prompt_ids(tokenizer, again[:3])[len(first):]
    assert sample.input_ids.tolist() == first + second + ids + [im_end, *newline]
    assert sample.loss_mask.tolist() == ([False] * len(prompt) + [True] * len(ids) + [False] + [True] * len(newline)
                                         + [False] * len(second) + [True] * (len(ids) + 1 + len(newline)))
    with pytest.raises(ValueError, match=r"messages\[1\]\.stop_id must be a token id, beside token_ids of an answer not cut"):
        parse_row({"messages": [row.messages[0], {**row.messages[1], "answer_cut": True}]}, "openai")


# Qwen3's chat template in what matters here: an assistant turn after the last user query renders its
# reasoning (an empty think block when the content has no </think>, as a cut answer's has not), one
# before it renders without: a turn is rendered otherwise once a user turn follows it.
QWEN3_LIKE = """{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- set c = m.content -%}{%- set r = '' -%}
{%- if '</think>' in c -%}{%- set r = c.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}
{%- if loop.index0 > ns.last_query -%}{{ '<|im_start|>assistant\\n<think>\\n' + r + '\\n</think>\\n\\n' + c + '<|im_end|>\\n' }}
{%- else -%}{{ '<|im_start|>assistant\\n' + c + '<|im_end|>\\n' }}{%- endif -%}
{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"""


def test_a_thinking_answer_is_stored_as_the_target_wrote_it_after_its_prompt(tiny_target_dir):
    """Qwen3's template writes `<think>\n\n</think>\n\n` ahead of an answer without `</think>` (a cut
    thinking answer): that text was stored before the target's ids, supervised, a context the target
    never saw; a finished thinking answer was re-tokenized from its re-rendered text (a fallback)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    tokenizer.chat_template = QWEN3_LIKE
    user = {"role": "user", "content": "2+2?"}
    prompt = prompt_ids(tokenizer, [user])
    for content, cut in (("<think>\nThe user asks for 2+2. Let me", True), ("<think>\nAdd them.\n</think>\n\nIt is 4.", False)):
        ids = tokenizer(content, add_special_tokens=False)["input_ids"]
        sample = tokenize_conversation(tokenizer, [user, {"role": "assistant", "content": content, "token_ids": ids, "answer_cut": cut}], 512)
        end = tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]
        assert sample.input_ids.tolist() == prompt + ids + end and sample.ids_fallbacks == 0
        assert sample.loss_mask.tolist() == [False] * len(prompt) + [True] * len(ids) + [not cut] * len(end)


def test_turns_a_template_renders_otherwise_once_a_user_turn_follows_are_context(tiny_target_dir):
    """Qwen3 drops the reasoning of every turn before the last user query: every multi-turn row was
    refused as "not prefix-stable". The whole conversation is stored as the template renders it (as
    the target sees it when serving the last turn), the earlier turns as context, counted."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    tokenizer.chat_template = QWEN3_LIKE
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n4."},
                {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "<think>\nAlso easy.\n</think>\n\n6."}]
    sample = tokenize_conversation(tokenizer, messages, 512)
    assert sample.context_turns == 1
    assert tokenizer.decode(sample.input_ids) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAlso easy.\n</think>\n\n6.<|im_end|>\n")
    assert tokenizer.decode(sample.input_ids[sample.loss_mask]) == "<think>\nAlso easy.\n</think>\n\n6.<|im_end|>\n"
    with pytest.raises(ValueError, match="not prefix-stable at assistant turn 1"):  # no later user turn: refused as before
        tokenizer.chat_template = QWEN3_LIKE.replace("loop.index0 > ns.last_query", "loop.last")
        tokenize_conversation(tokenizer, messages[:2] + [{"role": "tool", "content": "x"}], 512)


def test_history_the_later_turns_saw_and_templates_that_cannot_be_read(tiny_target_dir):
    """An earlier answer whose text the template rewrites in the history (trims it) is stored as the
    later turns saw it, its text (counted); a generation prompt that opens a think block (Qwen3
    Thinking-2507) still keeps earlier turns as context; a template that departs elsewhere (Phi-3
    appends end-of-text to a conversation's end only) is refused, not made context."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    tokenizer.chat_template = tokenizer.chat_template.replace("message['content']", "(message['content'] | trim)")
    text = "hello there  "
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    reply = {"role": "assistant", "content": text, "token_ids": ids}
    sample = tokenize_conversation(tokenizer, [{"role": "user", "content": "hi"}, reply, {"role": "user", "content": "again"}, reply], 256)
    assert sample.ids_fallbacks == 1 and tokenizer.decode(sample.input_ids).count("hello there<|im_end|>") == 1
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n4."},
                {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "<think>\nAlso easy.\n</think>\n\n6."}]
    tokenizer.chat_template = QWEN3_LIKE.rsplit("{%- if add_generation_prompt", 1)[0] + (
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif -%}")
    assert tokenize_conversation(tokenizer, messages, 512).context_turns == 1
    tokenizer.chat_template = ("{%- for m in messages -%}{{ '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' }}{%- endfor -%}"
                               "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- else -%}{{ '<|endoftext|>' }}{%- endif -%}")
    with pytest.raises(ValueError, match="not prefix-stable at assistant turn 1"):
        tokenize_conversation(tokenizer, messages, 512)


def test_the_cpu_backend_samples_with_the_settings_given_only(tiny_target_dir):
    """transformers' generate filled what it was not told from the target's generation_config.json
    (Qwen2.5-Instruct ships a repetition_penalty): the CPU answers were other samples than vLLM's,
    which takes only the settings given. A generation config full of sampling settings changes nothing."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stage1_extract.backends import Request, transformers_backend

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    ids = tokenizer("hello there", add_special_tokens=False)["input_ids"]
    answers = []
    for extra in ({}, {"repetition_penalty": 5.0, "top_k": 1, "min_new_tokens": 6, "no_repeat_ngram_size": 1}):
        model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
        for key, value in extra.items():
            setattr(model.generation_config, key, value)
        for temperature in (0.7, 0.0):
            cfg = SimpleNamespace(batch_size=4, temperature=temperature, top_p=0.8, max_new_tokens=6)
            answers.append(transformers_backend(model, tokenizer, cfg, seed=0)([Request(ids, 1), Request(ids[:1], 2)]))
    assert answers[:2] == answers[2:]


def test_an_answer_is_cut_when_no_stop_token_ends_it():
    """The transformers backend's reading of a generated row: a stop token ends the answer (the
    padding after it dropped); none within max_new_tokens means the limit cut it."""
    from stage1_extract.backends import Answer, until_stop

    assert until_stop([7, 8, EOS, EOS, EOS], [EOS]) == Answer([7, 8], cut=False, stop=EOS)
    assert until_stop([7, 8, 9, EOS], [EOS]) == Answer([7, 8, 9], cut=False, stop=EOS)  # ended on its last allowed token
    assert until_stop([7, 8, 5, EOS], [EOS, 5]) == Answer([7, 8], cut=False, stop=5)  # the stop token it ended with
    assert until_stop([7, 8, 9, 10], [EOS]) == Answer([7, 8, 9, 10], cut=True)


def test_every_8b_sequence_generates_on_every_gpu():
    """Wherever the 8B path is shown, `generate` runs under torchrun (one vLLM engine per GPU), not
    as one process driving one engine while seven GPUs idle."""
    repo = Path(__file__).resolve().parents[1]
    shown = []
    for path in [repo / "README.md", *sorted((repo / "docs").glob("*.md")), *sorted((repo / "configs").glob("*.yaml"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "stage1_extract generate" in line and re.search(r"8b|my-qwen3|my-llama", line):
                shown.append((path.name, number, line))
    assert {name for name, _, _ in shown} >= {"README.md", "gpu.md", "qwen3-8b.yaml", "llama-3.1-8b.yaml"}
    assert [s for s in shown if "torchrun --nproc_per_node 8 -m stage1_extract generate" not in s[2]] == []


# ---- the user's rows on their way to the store: numbered as the user's file numbers them, counted ----
def traced_rows(tmp_path):
    """Seven rows of a user's file: 1 (not JSON) and 6 (no user turn) are bad, 3 opens with an
    assistant turn, 4's prompt is longer than data.max_length (extraction has nothing left to supervise)."""
    rows = [{"messages": [{"role": "user", "content": f"question number {i}: how does one sort a list?"}]} for i in range(7)]
    rows[1] = '{"messages": [not json'
    rows[3]["messages"] = [{"role": "assistant", "content": "an answer to nothing"}, *rows[3]["messages"]]
    rows[4]["messages"] = [{"role": "user", "content": "please read this long question carefully " * 30}]
    rows[6] = {"messages": [{"role": "system", "content": "be brief"}]}
    return write_jsonl(tmp_path / "prompts.jsonl", rows)


def test_generated_rows_keep_the_users_row_and_extract_names_it(tiny_target_dir, tmp_path, fake_vllm, caplog):
    """generated.parquet's source_row is the row of the user's file (0-based), not its own position,
    and extraction's warning about a generated row names the user's file and row too."""
    data = traced_rows(tmp_path)
    cfg = generate_config(tiny_target_dir, data, tmp_path / "run", **{
        "data.on_bad_row": "skip", "data.max_length": 96, "target.num_feature_layers": 3, "extract.top_k": 8,
    })
    out = commands.cmd_generate(cfg, progress=False)
    assert pq.read_table(out["output"]).column("source_row").to_pylist() == [0, 2, 3, 4, 5]
    commands.cmd_extract(cfg, progress=False)
    assert re.search(rf"skipping {re.escape(out['output'])}: row 3 \(row 4 of {re.escape(str(data))}\): no assistant tokens",
                     caplog.text)


def test_rows_dropped_on_the_way_to_the_store_are_counted_at_each_stage(tiny_target_dir, tmp_path, fake_vllm):
    """generate's counts (bad rows, leading turns) reach the manifest's data block; extract, status
    and plan say in one line how many of the user's rows each stage dropped; generate's and plan's
    summaries print the bad rows their --json counts."""
    from stage1_extract.__main__ import show_extract, show_generate, show_plan, show_status
    from stage1_extract.data import generate_record

    data = traced_rows(tmp_path)
    cfg = generate_config(tiny_target_dir, data, tmp_path / "run", **{
        "data.on_bad_row": "skip", "data.max_length": 96, "target.num_feature_layers": 3, "extract.top_k": 8,
    })
    generated = commands.cmd_generate(cfg, progress=False)
    assert (generated["rows_read"], generated["bad_rows_skipped"], generated["leading_turns_dropped"]) == (7, 2, 1)
    assert f"\n2 bad row(s) of the 7 read from {data} skipped (data.on_bad_row=skip; the log names them)" in show_generate(generated)
    record = generate_record(Path(generated["output"]))
    assert {k: record[k] for k in ("prompts", "rows_read", "bad_rows_skipped", "leading_turns_dropped", "conversations")} == {
        "prompts": str(data), "rows_read": 7, "bad_rows_skipped": 2, "leading_turns_dropped": 1, "conversations": 5}
    out = commands.cmd_extract(cfg, progress=False)
    rows = {"data": str(data), "rows": 7, "dropped_by_generate": 2, "dropped_by_extract": 1, "bad_rows_skipped_by_extract": 1,
            "skipped_too_long": 0, "stored": 4, "leading_turns_dropped": 1, "generated": generated["output"], "generated_rows": 5}
    assert out["rows"] == rows and out["bad_rows_skipped"] == 1 and out["num_samples"] == 4
    line = (f"\nrows: 7 read from {data} -> 2 dropped by generate (bad rows) -> 1 dropped by extract (1 bad, 0 too long with "
            f"data.on_long=skip) -> 4 stored; 1 turn(s) before a row's first user turn dropped")
    assert line in show_extract(out) and ", 1 bad row(s) skipped" in show_extract(out)
    manifest = json.loads((tmp_path / "run" / "store" / "manifest.json").read_text())
    assert manifest["data"]["generate"] == record and manifest["data"]["bad_rows_skipped"] == 1
    status = commands.cmd_status(cfg)
    assert status["rows"] == rows and line in "\n" + show_status(status)
    plan = commands.cmd_plan(cfg)
    assert plan["rows"] == rows and line in "\n" + show_plan(plan)
    assert "\n1 bad row(s) skipped; 0 sample(s) truncated and 0 skipped at data.max_length" in "\n" + show_plan(plan)


# ---- a prompt past what a sample can hold is never sent, on every backend ------------------------------
def test_a_prompt_past_the_samples_context_is_not_sent_on_the_cpu_backend(tiny_target_dir, tmp_path, monkeypatch):
    """transformers pads a batch to its longest prompt: a prompt past min(data.max_length, the target's
    max_position_embeddings) is kept as the data has it and counted, as vLLM's max_model_len guard does.
    When data.max_length is raised past it, the part that kept it is generated again."""
    from stage1_extract import backends

    sent = []
    real = backends.transformers_backend

    def recording(model, tokenizer, cfg, seed):
        run = real(model, tokenizer, cfg, seed)

        def answer(requests):
            sent.extend(len(r.prompt_ids) for r in requests)
            return run(requests)
        return answer

    monkeypatch.setattr(generate_command, "transformers_backend", recording)
    rows = [{"messages": [{"role": "user", "content": f"question number {i}: how?"}]} for i in range(3)]
    rows[1]["messages"] = [{"role": "user", "content": "please read this long question carefully " * 30}]  # ~250 tokens
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    cfg = generate_config(tiny_target_dir, data, tmp_path / "run", **{"generate.backend": "transformers", "data.max_length": 96})
    out = commands.cmd_generate(cfg, progress=False)
    assert (out["long_prompt_turns_kept"], out["prompt_limit"]) == (1, 95) and "data.max_length=96" in out["prompt_limit_why"]
    assert len(sent) == 2 and max(sent) <= 95
    assert list(read_conversations(out["output"]))[1].messages == rows[1]["messages"]
    raised = generate_config(tiny_target_dir, data, tmp_path / "run", **{"generate.backend": "transformers", "data.max_length": 512})
    again = commands.cmd_generate(raised, progress=False)
    assert again["parts_reused"] == 0 and again["long_prompt_turns_kept"] == 0  # its part now answers it
    assert list(read_conversations(again["output"]))[1].messages[-1].get("token_ids")
    sent.clear()
    huge = generate_config(tiny_target_dir, data, tmp_path / "huge", **{"generate.backend": "transformers", "data.max_length": 4096})
    rows[1]["messages"] = [{"role": "user", "content": "please read this long question carefully " * 400}]  # ~2,400 tokens
    write_jsonl(data, rows)
    wide = commands.cmd_generate(huge, progress=False)
    assert wide["long_prompt_turns_kept"] == 1 and wide["prompt_limit"] == 2047 and max(sent) <= 2047
    assert "the target's max_position_embeddings=2048" in wide["prompt_limit_why"]


def test_generate_with_vllm_not_installed_is_one_line_before_any_data_is_read(tiny_target_dir, tmp_path, monkeypatch, capsys):
    """The 8B presets set generate.backend: vllm; on a node without it `generate` read the data, then
    died with a 28-line ModuleNotFoundError (exit 1)."""
    from stage1_extract import __main__ as stage1_cli

    monkeypatch.setattr(backends, "vllm_installed", lambda: False)
    missing = tmp_path / "not-read-yet.jsonl"  # read first, it would be the error
    args = [f"run_dir={tmp_path / 'run'}", f"target.path={tiny_target_dir}", f"data.path={missing}", "generate.backend=vllm"]
    assert stage1_cli.main(["generate", "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: generate.backend=vllm, but vllm is not installed here: install it with `pip install -e '.[gpu]'` (on a "
        "GPU node), or set generate.backend=transformers (runs anywhere, CPU included, but slowly: fine for a small "
        "test, weeks for an 8B target)\n"
    )
    assert not (tmp_path / "run").exists()
    monkeypatch.setattr(backends, "vllm_installed", lambda: True)  # installed: on to the data
    assert stage1_cli.main(["generate", "--no-progress", *args]) == 2
    assert "data file not found" in capsys.readouterr().err


def test_rank_0_waits_for_a_part_another_rank_is_making_again(tmp_path):
    """data.max_length raised: a part that kept turns under the smaller context is generated again by
    its rank, its old file on disk until then. Rank 0, done with its own parts, must not merge that
    old file (the data's answers where the target's belong): it waits until the part is current."""
    import threading
    import time

    from stage1_extract.data import write_conversations_parquet

    parts = tmp_path / "parts"
    parts.mkdir()
    chat = [Conversation(row=0, messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])]
    write_conversations_parquet(chat, parts / "part-0.parquet", counts={"long_prompt_turns_kept": 1, "context": 60})
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (generate.wait_for_parts(parts, ["part-0.parquet"], 2, (4096, "x"), poll_s=0.02), done.set()))
    waiter.start()
    time.sleep(0.3)
    assert not done.is_set()  # the old part is there, and is not taken
    write_conversations_parquet(chat, parts / "part-0.parquet", counts={"long_prompt_turns_kept": 0, "context": 4096})
    waiter.join(timeout=10)
    assert done.is_set()


def test_generate_asks_for_vllm_only_when_a_part_is_left_to_make(tiny_target_dir, tmp_path, fake_vllm, monkeypatch, capsys):
    """`make extract` always runs `generate`: with every part made it reuses them on a node without
    vllm (a CPU box extracting a GPU node's answers); a missing part needs the engine, and is one line."""
    from stage1_extract import __main__ as stage1_cli

    data = prompts_file(tmp_path, n=6)
    args = [f"run_dir={tmp_path / 'run'}", f"target.path={tiny_target_dir}", "target.dtype=fp32", f"data.path={data}",
            "generate.backend=vllm", "generate.max_new_tokens=12", "generate.rows_per_part=3", "extract.device=cpu"]
    assert stage1_cli.main(["generate", "--no-progress", *args]) == 0  # made with (the stand-in) vllm
    parts = sorted((tmp_path / "run" / "data" / "generated.parts").glob("part-*.parquet"))
    made = {p.name: p.read_bytes() for p in parts}
    assert len(made) == 2 and len(fake_vllm.made) == 1
    monkeypatch.delitem(sys.modules, "vllm")
    monkeypatch.setattr(backends, "vllm_installed", lambda: False)
    capsys.readouterr()
    assert stage1_cli.main(["generate", "--no-progress", "--json", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parts_reused"] == 2 and out["conversations"] == 6 and len(fake_vllm.made) == 1
    parts[1].unlink()
    assert stage1_cli.main(["generate", "--no-progress", *args]) == 2
    assert capsys.readouterr().err == (
        "error: generate.backend=vllm, but vllm is not installed here: install it with `pip install -e '.[gpu]'` (on a "
        "GPU node), or set generate.backend=transformers (runs anywhere, CPU included, but slowly: fine for a small "
        "test, weeks for an 8B target)\n"
    )
    assert parts[0].read_bytes() == made[parts[0].name] and not parts[1].exists() and len(fake_vllm.made) == 1


def test_answers_generated_under_another_chat_template_are_not_reused(tiny_target_dir, tmp_path, fake_vllm, caplog):
    """Each answer was sampled after its prompt as the chat template rendered it. Under another
    template with the same weights (an edited one, or a Hub revision that changed only the template),
    extraction would store the old answers after prompts the target never answered: generate refuses
    the parts and extraction calls the generated data stale, naming the template. Answers generated
    before the template was recorded are used with a warning."""
    import shutil

    from shared.identity import generated_problem, prompt_template
    from shared.target import resolve_target

    data = prompts_file(tmp_path, n=6)
    target_dir = shutil.copytree(tiny_target_dir, tmp_path / "target")
    cfg = generate_config(target_dir, data, tmp_path / "run")
    commands.cmd_generate(cfg, progress=False)

    def problem():
        target = resolve_target(cfg.target)
        return generated_problem(cfg, target.weights_sha256, prompt_template(target.tokenizer_hashes()), target.config_sha256)

    assert problem() is None
    parts = tmp_path / "run" / "data" / "generated.parts"
    old = json.loads((parts / "settings.json").read_text())
    provenance = tmp_path / "run" / "data" / "generated.provenance.json"
    written = json.loads(provenance.read_text())
    template = target_dir / "chat_template.jinja"
    template.write_text(template.read_text().replace("You are a helpful AI assistant", "You are an AI assistant"))
    assert "the chat template" in (problem() or "")
    with pytest.raises(DataError, match="template.chat_template_sha256"):
        commands.cmd_generate(cfg, progress=False)
    # Answers from before the template was recorded: used as they are, said so.
    old["settings"].pop("template")
    (parts / "settings.json").write_text(json.dumps(old))
    written["inputs"]["settings"].pop("template")
    provenance.write_text(json.dumps(written))
    assert problem() is None and "before generate recorded the chat template" in caplog.text
    assert commands.cmd_generate(cfg, progress=False)["parts_reused"] == 2


def _scale_rms_norm_eps(target_dir):
    config = json.loads((target_dir / "config.json").read_text())
    (target_dir / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 10 * config["rms_norm_eps"]}))


def _drop_first_merge(target_dir):
    tokenizer = json.loads((target_dir / "tokenizer.json").read_text())
    tokenizer["model"]["merges"] = tokenizer["model"]["merges"][1:]  # "Ġ t" no longer merged; the vocabulary unchanged
    (target_dir / "tokenizer.json").write_text(json.dumps(tokenizer))


@pytest.mark.parametrize("edit, named, key, recorded", [
    # The same weights under another config.json (a Hub revision that changed rope_theta, a window, a norm epsilon).
    (_scale_rms_norm_eps, "the target's config.json (", ("target_config",), "the target's config.json"),
    # A tokenizer whose merges changed with its vocabulary unchanged tokenizes the same prompts into other ids.
    # (test_identity.py's stale-store test runs the same edit in the default run; this one in test-all)
    pytest.param(_drop_first_merge, "the tokenizer's behaviour (", ("template", "tokenizer_probe_sha256"),
                 "the tokenizer's behaviour", marks=pytest.mark.slow),
], ids=["config", "tokenizer"])
def test_answers_of_a_target_that_changed_since_are_not_reused(tiny_target_dir, tmp_path, fake_vllm, caplog, edit, named, key, recorded):
    """Another target config.json or tokenizer behaviour computes another model or other prompt ids: its
    store is stale, but the answers sampled before were kept by generate and called current by status,
    so `reprocess` paired the new target's features with the old one's answers. Both are now part of
    what made an answer; answers generated before they were recorded are used with a warning."""
    import shutil

    from shared.identity import generated_problem, prompt_template
    from shared.target import resolve_target

    data = prompts_file(tmp_path, n=6)
    target_dir = shutil.copytree(tiny_target_dir, tmp_path / "target")
    cfg = generate_config(target_dir, data, tmp_path / "run")
    commands.cmd_generate(cfg, progress=False)

    def problem():
        target = resolve_target(cfg.target)
        return generated_problem(cfg, target.weights_sha256, prompt_template(target.tokenizer_hashes()), target.config_sha256)

    def forget(settings):  # the key as generate wrote it before it was recorded
        node = settings
        for part in key[:-1]:
            node = node[part]
        node.pop(key[-1])

    assert problem() is None
    parts = tmp_path / "run" / "data" / "generated.parts"
    old = json.loads((parts / "settings.json").read_text())
    provenance = tmp_path / "run" / "data" / "generated.provenance.json"
    written = json.loads(provenance.read_text())
    edit(target_dir)
    assert named in (problem() or "")
    with pytest.raises(DataError, match=".".join(key)):
        commands.cmd_generate(cfg, progress=False)
    forget(old["settings"])
    (parts / "settings.json").write_text(json.dumps(old))
    forget(written["inputs"]["settings"])
    provenance.write_text(json.dumps(written))
    assert problem() is None and f"before generate recorded {recorded}" in caplog.text
    assert commands.cmd_generate(cfg, progress=False)["parts_reused"] == 2


def test_rank_0_merges_the_parts_it_waited_for_even_when_its_listing_lacks_them(tiny_target_dir, tmp_path, fake_vllm, monkeypatch):
    """Rank 0 waited for every part by name, then read the folder through a listing: on NFS another
    node's newest parts can be missing from it for up to a minute, and generate failed at its very end
    ('its parts hold other rows than the data'). It reads the parts it waited for by name."""
    data = prompts_file(tmp_path, n=11)
    cfg = generate_config(tiny_target_dir, data, tmp_path / "two")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    real_glob = Path.glob
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        if rank == 0:  # rank 1's parts (1 and 3), written on another node moments ago
            monkeypatch.setattr(Path, "glob", lambda self, pattern: (
                p for p in real_glob(self, pattern) if not p.name.startswith(("part-000001-", "part-000003-"))))
        result = commands.cmd_generate(cfg, progress=False)
    monkeypatch.setattr(Path, "glob", real_glob)
    assert result["conversations"] == 11
    assert [c.row for c in read_conversations(result["output"])] == list(range(11))


def test_a_row_the_chat_template_refuses_is_named_or_skipped_before_generating(tiny_target_dir, tmp_path, fake_vllm, copy_tree):
    """A template's raise_exception (Mistral's "roles must alternate", two user turns in a row in ShareGPT
    data) stopped generate mid-run with a jinja traceback naming no row, whatever data.on_bad_row said."""
    from .test_tokens import ALTERNATING

    target = copy_tree(tiny_target_dir, tmp_path / "target")
    (target / "chat_template.jinja").write_text(ALTERNATING)
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(4)]
    rows[2]["messages"].append({"role": "user", "content": "and another"})
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    with pytest.raises(DataError, match=rf"^{re.escape(str(data))}: row 2: the chat template refused the row: Conversation "
                                        r"roles must alternate user/assistant/user/assistant/\.\.\. \(set data\.on_bad_row=skip"):
        commands.cmd_generate(generate_config(target, data, tmp_path / "run"), progress=False)
    out = commands.cmd_generate(generate_config(target, data, tmp_path / "run", **{"data.on_bad_row": "skip"}), progress=False)
    assert (out["rows_read"], out["bad_rows_skipped"], out["conversations"]) == (4, 1, 3)
    assert [c.source_row for c in read_conversations(out["output"])] == [0, 1, 3]
