"""`plan` first (issue 33, item 5): the disk and the hours before anything runs, from the prompts and
estimated answers before `generate`, from the answers after it."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from shared.config import load_run_config
from shared.errors import ConfigError
from shared.target import TargetArch
from stage1_extract import __main__ as cli
from stage1_extract import commands, plan
from stage1_extract.resolve import prepare_run
from stage1_extract.template import tokenize_conversation
from tests.conftest import stage1_overrides, write_jsonl

QWEN3_8B = TargetArch("qwen3", 4096, 12288, 36, 32, 8, 128, 151936, 1e-6, 1e6, 40960, False)


def test_hours_follow_the_stated_rates_and_the_readmes_capacity_model():
    """800K samples of 1,000 tokens, bf16 (41,349 B/token): extraction is the 33 TB write at 2 GB/s
    (the forward alone would take ~1.1 h), training 6 epochs at the failed run's 26 Ktok/s."""
    tokens = 800_000_000
    sizes = {"tokens": tokens, "mean_tokens": 1000.0, "total_bytes": tokens * 41_349}
    params = 36 * (4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 12288) + 151936 * 4096
    assert plan.target_params(QWEN3_8B) == params  # 7.57 B: what a token passes through
    eight = plan.stage_hours(QWEN3_8B, sizes, 400_000_000, "h100", 8, epochs=6)
    assert eight["train"]["hours"] == pytest.approx(6 * tokens / 26_000 / 3600, rel=5e-3)  # 51.3 h
    assert eight["extract"]["hours"] == pytest.approx(tokens * 41_349 / 2e9 / 3600, rel=5e-3)  # 4.59 h, the write
    # generate runs bf16: MLPerf's FP8 H100 figure / 1.6 (hours keep 3 digits)
    assert eight["generate"]["hours"] == pytest.approx(4e8 / (5777 / 1.6 * 8e9 / params * 8) / 3600, rel=5e-3)
    assert eight["generate"]["basis"].startswith("400,000,000 answer tokens at 3,817 tok/s per GPU: 3,611 for a bf16 8B target")
    assert "5,777 tok/s on one H100 with FP8 weights" in eight["generate"]["basis"] and "/ 1.6 for bf16" in eight["generate"]["basis"]
    assert "26,000 tok/s on 8 GPUs" in eight["train"]["basis"]
    sixteen = plan.stage_hours(QWEN3_8B, sizes, 400_000_000, "h100", 16, epochs=6)
    assert [sixteen[s]["hours"] for s in ("generate", "extract", "train")] == pytest.approx(
        [eight[s]["hours"] / 2 for s in ("generate", "extract", "train")], rel=1e-2)  # two nodes write twice as fast
    a100 = plan.stage_hours(QWEN3_8B, sizes, None, "a100", 8, epochs=6)
    assert "generate" not in a100 and a100["train"]["hours"] == pytest.approx(eight["train"]["hours"] * 989 / 312, rel=1e-2)


def plan_config(tiny_target_dir, data, run_dir, **extra):
    settings = {"data.regenerate": True, "generate.max_new_tokens": 40, "generate.rows_per_part": 2, "extract.device": "cpu",
                **extra}
    return load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, run_dir, **settings))


def test_plan_before_generate_sizes_prompts_with_estimated_answers(tiny_target_dir, tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "How do I sort a list in Python?"}]},
        {"messages": [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A pear, or an apple."}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a dict?"}]},
    ]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    out = commands.cmd_plan(plan_config(tiny_target_dir, data, tmp_path / "run"), gpu="h200", gpus=4)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    empty = {"role": "assistant", "content": ""}
    emptied = [[*rows[0]["messages"], empty], [rows[1]["messages"][0], empty], [*rows[2]["messages"], empty]]
    prompts = [len(tokenize_conversation(tokenizer, messages, 10**6).input_ids) for messages in emptied]
    given = len(tokenizer("A pear, or an apple.", add_special_tokens=False)["input_ids"])
    assert out["answers"] == "estimated" and "2 at 0.5 x max_new_tokens" in out["answers_estimated"]
    assert out["tokens"] == sum(prompts) + 20 + given + 20 and out["samples"] == 3
    assert out["total_bytes"] == out["tokens"] * out["bytes_per_token"]
    assert out["total_bytes_at_most"] == (sum(prompts) + 3 * 40) * out["bytes_per_token"]
    assert set(out["time"]) == {"generate", "extract", "train"}
    assert all(t["gpu"] == "h200" and t["gpus"] == 4 and t["hours"] > 0 for t in out["time"].values())
    assert f"{20 + given + 20:,} answer tokens" in out["time"]["generate"]["basis"]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.parquet"))  # plan writes no data

    # After generate: the answers themselves, as extraction will tokenize them; nothing left to generate.
    commands.cmd_generate(plan_config(tiny_target_dir, data, tmp_path / "run", **{"generate.max_new_tokens": 8}), progress=False)
    cfg = plan_config(tiny_target_dir, data, tmp_path / "run", **{"generate.max_new_tokens": 8})
    after = commands.cmd_plan(cfg)
    assert after["answers"] == "generated" and "answers_estimated" not in after
    assert after["tokens"] == sum(len(r.input_ids) for r in prepare_run(cfg).rows)
    assert set(after["time"]) == {"extract", "train"} and after["time"]["train"]["gpu"] == "h100"


def test_plan_speaks_to_people_and_refuses_an_unknown_gpu(tiny_target_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "How do I sort a list?"}])
    overrides = stage1_overrides(tiny_target_dir, data, tmp_path / "run", **{"data.regenerate": True})
    assert cli.main(["plan", "--gpu", "l40s", "--gpus", "2", *overrides]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "0 bad row(s) skipped; 0 sample(s) truncated and 0 skipped at data.max_length (estimated)"  # --json's counts
    assert lines[2].startswith("answers not generated yet, estimated from 1 of 1 prompts tokenized")
    assert lines[3].startswith("GPU memory while extracting: ") and "of 45 GiB per l40s at extract.tensor_parallel_size=1" in lines[3]
    assert [line.split(":")[0] for line in lines[4:]] == ["generate", "extract", "train"]
    assert all(" on 2 x l40s (" in line for line in lines[4:])
    with pytest.raises(ConfigError, match=r"plan --gpu 'v100': known GPU kinds are h100, h200, a100, l40s"):
        commands.cmd_plan(load_run_config("configs/default.yaml", overrides), gpu="v100")
