"""data.chat_template_kwargs: the chat template's own variables (Qwen3's enable_thinking) reach every
render stage 1 makes (tokenizing, generation prompts), and are part of what a store, its token cache
and its generated answers were made from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from shared.config import load_run_config
from stage1_extract.template import prompt_ids, tokenize_conversation

from .conftest import chat_rows, stage1_overrides, write_jsonl

ROOT = Path(__file__).resolve().parents[1]

# Qwen3's switch in what matters here: the last assistant turn renders a think block (empty when its
# content has none), and the generation prompt closes an empty one when enable_thinking is false, so
# a no-think answer's block belongs to the prompt there and to the answer under the default.
THINKING_SWITCH = """{%- for m in messages -%}
{%- if m.role == 'assistant' and loop.last -%}{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}
{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}{%- endif -%}"""


def switch_target(tiny_target_dir: Path, root: Path) -> Path:
    """A copy of the tiny target whose chat template has the thinking switch."""
    target = Path(shutil.copytree(tiny_target_dir, root / "target"))
    (target / "chat_template.jinja").write_text(THINKING_SWITCH)
    return target


def test_the_template_variables_decide_what_is_prompt_and_what_is_answer(tiny_target_dir):
    """Under the default (thinking) the empty think block is the answer's, supervised; with
    enable_thinking=false the generation prompt holds it, as the target sees it when serving so."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    tokenizer.chat_template = THINKING_SWITCH
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]
    thinking = tokenize_conversation(tokenizer, messages, 256)
    off = tokenize_conversation(tokenizer, messages, 256, template_kwargs={"enable_thinking": False})
    assert thinking.input_ids.tolist() == off.input_ids.tolist()  # the same text either way
    assert tokenizer.decode(thinking.input_ids[thinking.loss_mask]) == "<think>\n\n</think>\n\n4.<|im_end|>\n"
    assert tokenizer.decode(off.input_ids[off.loss_mask]) == "4.<|im_end|>\n"
    prompt = prompt_ids(tokenizer, messages[:1], template_kwargs={"enable_thinking": False})
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    first = int(np.flatnonzero(off.loss_mask)[0])
    assert tokenizer.decode(off.input_ids[:first]) == tokenizer.decode(prompt)  # all of it unsupervised


def test_reserved_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match=r"data\.chat_template_kwargs sets add_generation_prompt, tools, which stage 1 passes itself"):
        load_run_config(ROOT / "configs/default.yaml", ['data.chat_template_kwargs={tools: x, add_generation_prompt: true}'])


@pytest.fixture(scope="module")
def no_think_store(tiny_target_dir, tmp_path_factory):
    """Rows extracted as given through a template with the switch, enable_thinking=false: (root, cfg)."""
    from stage1_extract import commands

    root = tmp_path_factory.mktemp("no_think")
    target = switch_target(tiny_target_dir, root)
    data = write_jsonl(root / "chat.jsonl", chat_rows(12))
    cfg = load_run_config(ROOT / "configs/default.yaml", stage1_overrides(
        target, data, root / "run", **{"data.chat_template_kwargs": {"enable_thinking": False}}))
    commands.cmd_extract(cfg, progress=False)
    return root, cfg


def test_a_store_records_its_template_variables_and_another_setting_makes_it_stale(no_think_store):
    """The manifest says what the prompts were rendered with; the same store under a config without
    them (the default: thinking) is stale naming the setting, on `status` and for `train`, and
    `reprocess` makes it the thinking one, whose stored answers begin with the think block."""
    from shared.freshness import store_staleness
    from shared.reader import StoreReader
    from shared.target import resolve_target
    from stage1_extract import commands

    root, cfg = no_think_store
    reader = StoreReader(cfg.store.url(cfg.run_dir))
    assert reader.manifest["chat_template_kwargs"] == {"enable_thinking": False}
    tokenizer_dir = cfg.target.path
    first = reader[0]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    answer = tokenizer.decode(first["input_ids_T"][first["loss_mask_T"].bool()])
    assert not answer.startswith("<think>")
    assert commands.cmd_status(cfg)["complete"]

    default = load_run_config(ROOT / "configs/default.yaml", stage1_overrides(
        Path(cfg.target.path), Path(cfg.data.path), Path(cfg.run_dir)))
    status = commands.cmd_status(default)
    assert not status["complete"] and len(status["shards"]) > 0
    assert {(s["state"], s["why"]) for s in status["shards"]} == {("stale", "settings changed: chat_template_kwargs.enable_thinking")}
    stale = store_staleness(default, resolve_target(default.target), reader.manifest).stale
    assert stale and all(why == "settings changed: chat_template_kwargs.enable_thinking" for _, why in stale)
    commands.cmd_reprocess(default, progress=False)
    again = StoreReader(default.store.url(default.run_dir))
    assert "chat_template_kwargs" not in again.manifest
    sample = again[int(np.flatnonzero(again.sample_ids == int(reader.sample_ids[0]))[0])]
    assert tokenizer.decode(sample["input_ids_T"][sample["loss_mask_T"].bool()]).startswith("<think>\n\n</think>\n\n")


def test_extract_without_the_variables_a_store_was_started_with_is_refused(tiny_target_dir, tmp_path):
    """plan.json compared only the fields today's header has: a config that dropped
    data.chat_template_kwargs passed it, and `extract` silently re-extracted every shard in the other
    mode (plan.json still naming the old one). It is refused as any other changed setting is."""
    from shared.errors import StoreError
    from stage1_extract import commands

    target = switch_target(tiny_target_dir, tmp_path)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6))
    off = load_run_config(ROOT / "configs/default.yaml", stage1_overrides(
        target, data, tmp_path / "run", **{"data.chat_template_kwargs": {"enable_thinking": False}}))
    commands.cmd_extract(off, progress=False)
    manifest = Path(off.store.url(off.run_dir)) / "manifest.json"
    before = manifest.read_text()
    default = load_run_config(ROOT / "configs/default.yaml", stage1_overrides(target, data, tmp_path / "run"))
    with pytest.raises(StoreError, match=r"started with data\.chat_template_kwargs\.enable_thinking=False .*set "
                                         r"data\.chat_template_kwargs\.enable_thinking=False to continue"):
        commands.cmd_extract(default, progress=False)
    assert manifest.read_text() == before


def test_generated_answers_carry_the_variables_their_prompts_were_rendered_with(tiny_target_dir, tmp_path):
    """generate renders each prompt with data.chat_template_kwargs (the no-think prompt ends with the
    closed think block, the target answers after it); answers made under other variables are refused
    by extract naming the setting, and generate makes them again."""
    from shared.errors import DataError, StoreError
    from shared.reader import StoreReader
    from stage1_extract import commands

    target = switch_target(tiny_target_dir, tmp_path)
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": r["messages"][:1]} for r in chat_rows(6)])
    settings = {"data.regenerate": True, "generate.max_new_tokens": 4, "generate.rows_per_part": 8, "extract.device": "cpu"}
    off = load_run_config(ROOT / "configs/default.yaml", stage1_overrides(
        target, data, tmp_path / "run", **settings, **{"data.chat_template_kwargs": {"enable_thinking": False}}))
    commands.cmd_generate(off, progress=False)
    made = json.loads((tmp_path / "run" / "data" / "generated.parts" / "settings.json").read_text())
    assert made["settings"]["chat_template_kwargs"] == {"enable_thinking": False}
    commands.cmd_extract(off, progress=False)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    reader = StoreReader(off.store.url(off.run_dir))
    for i in range(len(reader)):
        sample = reader[i]
        first = int(np.flatnonzero(sample["loss_mask_T"].numpy())[0])
        assert tokenizer.decode(sample["input_ids_T"][:first]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    thinking = load_run_config(ROOT / "configs/default.yaml", stage1_overrides(target, data, tmp_path / "run", **settings))
    with pytest.raises((DataError, StoreError), match="chat_template_kwargs"):
        commands.cmd_extract(thinking, progress=False)


def test_the_export_doctor_renders_a_store_with_the_variables_it_was_made_with(tiny_target_dir, tmp_path):
    """The export doctor rendered today's prompts without the store's data.chat_template_kwargs: a store
    made with enable_thinking=false under an unchanged template was an error ("trained in the other
    thinking mode"), and the acceptance check was skipped. Rendered as stage 1 rendered it, the prompts
    agree, and the mode they were made in is still named."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from shared.reader import StoreReader
    from stage1_extract import commands
    from stage2_train.serve.template_drift import compare_renders

    target = switch_target(tiny_target_dir, tmp_path)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6))
    cfg = load_run_config(ROOT / "configs/default.yaml", stage1_overrides(
        target, data, tmp_path / "run", **{"data.chat_template_kwargs": {"enable_thinking": False}}))
    commands.cmd_extract(cfg, progress=False)
    reader = StoreReader(cfg.store.url(cfg.run_dir))
    rendered = compare_renders(reader, SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(target)), None, 4)
    assert rendered["status"] == "compared" and rendered["num_samples"] == 4
    assert rendered["differ"] == []
    assert rendered["mode"].startswith("thinking mode: the stored prompts render as enable_thinking=False")


def test_a_drafter_carries_its_template_variables_to_the_export_doctors_prompts(tiny_target_dir, tmp_path):
    """An export records the variables its data was rendered with (dflash_pipeline.training), and the
    export doctor's built-in prompts are rendered with them: a no-think drafter decoded after thinking
    prompts scored another text than it was trained for."""
    from transformers import AutoTokenizer

    from stage2_train.serve.diagnose import builtin_prompts
    from stage2_train.serve.trained_on import TrainedOn, read_trained_on

    record = TrainedOn("run", 0.05, 0, "abc", {"enable_thinking": False})
    assert record.to_dict()["chat_template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_kwargs" not in TrainedOn("run", 0.05, 0, "abc").to_dict()  # older exports' records unchanged
    (tmp_path / "config.json").write_text(json.dumps({"dflash_pipeline": {"training": record.to_dict()}}))
    assert read_trained_on(tmp_path).chat_template_kwargs == {"enable_thinking": False}
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    tokenizer.chat_template = THINKING_SWITCH
    no_think, default = builtin_prompts(tokenizer, 1, {"enable_thinking": False}), builtin_prompts(tokenizer, 1)
    assert tokenizer.decode(no_think[0]).endswith("assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.decode(default[0]).endswith("<|im_start|>assistant\n")


def test_the_model_card_tells_servers_the_template_variables_the_drafter_was_trained_with(tmp_path):
    """The card's serving section names `chat_template_kwargs` from the drafter's own record; export
    never passed that record to the card, so a no-think drafter's card told nobody to serve no-think
    (thinking mode alone moves acceptance 25% -> 60%, z-lab #133)."""
    from types import SimpleNamespace

    from stage2_train.commands import _card_facts
    from stage2_train.model.config import DrafterConfig
    from stage2_train.model.description import describe_parts
    from stage2_train.serve.card import write_card
    from stage2_train.serve.trained_on import TrainedOn
    from tests.test_model import MASK_ID, tiny_arch

    cfg = load_run_config(ROOT / "configs/default.yaml", [f"run_dir={tmp_path / 'run'}"])
    description = describe_parts(DrafterConfig(num_layers=1, block_size=4), tiny_arch(), [1, 3], MASK_ID)
    out = tmp_path / "export"
    out.mkdir()
    for kwargs, said in (({"enable_thinking": False}, True), (None, False)):
        loaded = SimpleNamespace(weights_file=out / "model.safetensors", trained_on=TrainedOn("run", 0.05, 0, "abc", kwargs))
        card = write_card(out, description, _card_facts(cfg, {"name": "t"}, loaded)).read_text()
        sentence = 'The data was rendered with `chat_template_kwargs={"enable_thinking": false}` (`data.chat_template_kwargs`)'
        assert (sentence in card) is said


def test_a_variable_the_template_never_reads_is_refused_not_ignored(tiny_target_dir, tmp_path):
    """A misspelt enable_thinking (or one given to a template without the switch) rendered every row
    as without it: the store held the other mode's answers, and the manifest and model card still
    told users to serve with it. extract, plan and generate now refuse it, naming the template's own
    variables."""
    from shared.errors import ConfigError
    from stage1_extract import commands
    from stage1_extract.generate_command import cmd_generate
    from stage1_extract.plan import cmd_plan

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    target = switch_target(tiny_target_dir, tmp_path)
    typo = load_run_config(ROOT / "configs/default.yaml", stage1_overrides(
        target, data, tmp_path / "run", **{"data.chat_template_kwargs": {"enable_thinkng": False}}))
    expected = (r"data\.chat_template_kwargs\.enable_thinkng: the chat template of target\.path=.*target reads no variable "
                r"of that name, so the rows would render as without it; the variables it reads: enable_thinking\. Fix the name")
    regenerate = load_run_config(ROOT / "configs/default.yaml", stage1_overrides(
        target, data, tmp_path / "run", **{"data.regenerate": True, "generate.backend": "transformers", "extract.device": "cpu",
                                            "data.chat_template_kwargs": {"enable_thinkng": False}}))
    for command in (lambda: commands.cmd_extract(typo, progress=False), lambda: cmd_plan(typo),
                    lambda: cmd_plan(regenerate), lambda: cmd_generate(regenerate, progress=False)):
        with pytest.raises(ConfigError, match=expected):
            command()
    assert not list((tmp_path / "run").rglob("*.parquet"))
    assert not (tmp_path / "run" / "store" / "manifest.json").exists()
    plain = load_run_config(ROOT / "configs/default.yaml", stage1_overrides(
        tiny_target_dir, data, tmp_path / "plain", **{"data.chat_template_kwargs": {"enable_thinking": False}}))
    with pytest.raises(ConfigError, match=r"enable_thinking: .* reads no variable of that name.*; it reads no variable of its own"):
        commands.cmd_extract(plain, progress=False)


# Llama 3.1's date line, in what matters here: the day's date when the template can ask for it.
DATED = ("{%- if strftime_now is defined -%}{%- set date_string = strftime_now('%d %b %Y') -%}"
         "{%- else -%}{%- set date_string = '26 Jul 2024' -%}{%- endif -%}"
         "{{ '<|im_start|>system\\nToday Date: ' + date_string + '<|im_end|>\\n' }}") + THINKING_SWITCH


def test_a_template_that_prints_the_days_date_tokenizes_the_same_on_any_day(tiny_target_dir, tmp_path, monkeypatch):
    """Llama 3.1's template prints today's date (strftime_now): the same rows rendered into other tokens
    the next day, so once the token cache was rebuilt (another node, a cleaned run_dir) every shard of
    a good store read as stale ("tokens changed") and reprocess mixed dates. Every render now sees one date."""
    import datetime

    import transformers.utils.chat_template_utils as jinja_utils

    from shared.conversations import TEMPLATE_DATE
    from stage1_extract import commands

    class Day(datetime.datetime):  # the clock transformers' strftime_now reads
        today_is = datetime.datetime(2026, 12, 3)

        @classmethod
        def now(cls, tz=None):
            return cls.today_is

    monkeypatch.setattr(jinja_utils, "datetime", Day)
    target = Path(shutil.copytree(tiny_target_dir, tmp_path / "target"))
    (target / "chat_template.jinja").write_text(DATED)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(12))
    cfg = load_run_config(ROOT / "configs/default.yaml", stage1_overrides(target, data, tmp_path / "run"))
    commands.cmd_extract(cfg, progress=False)
    Day.today_is = datetime.datetime(2026, 12, 4)  # the next day, with the token cache gone
    shutil.rmtree(tmp_path / "run" / "cache")
    assert commands.cmd_status(cfg)["counts"] == {"current": 1, "stale": 0, "missing": 0, "orphaned": 0}
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(target).decode(prompt_ids(AutoTokenizer.from_pretrained(target), [
        {"role": "user", "content": "Hi"}]))
    assert prompt.startswith(f"<|im_start|>system\nToday Date: {TEMPLATE_DATE:%d %b %Y}<|im_end|>\n") and TEMPLATE_DATE.year == 2024
