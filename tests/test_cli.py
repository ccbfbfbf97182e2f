"""Every verb of both stages speaks to people by default and to scripts with --json (the same keys),
describes itself with --help, and the package names its version."""

from __future__ import annotations

import json

import pytest

from shared.config import load_run_config
from stage1_extract import __main__ as stage1_cli
from stage1_extract import commands as stage1
from stage2_train import __main__ as stage2_cli
from testkit.data import chat_rows, stage1_overrides, write_jsonl


@pytest.mark.parametrize("cli", [stage1_cli, stage2_cli], ids=["stage1", "stage2"])
def test_every_verb_has_its_own_help_and_the_list_names_them_all(cli, capsys):
    assert cli.main(["--help"]) == 0
    listing = capsys.readouterr().out
    for verb in cli.VERBS:
        assert f"  {verb.name} " in listing and verb.summary in listing
        with pytest.raises(SystemExit) as done:
            cli.main([verb.name, "--help"])
        assert done.value.code == 0
        text = capsys.readouterr().out
        assert f"{cli.PROG} {verb.name}" in text and "--json" in text and "--config" in text
        assert " ".join((verb.description or verb.summary).split()[:4]) in " ".join(text.split())
    assert cli.main(["no-such-verb"]) == 2 and "unknown command 'no-such-verb'" in capsys.readouterr().err


@pytest.mark.parametrize("verb", ["doctor", "report"])
def test_the_log_verbs_help_names_their_path_argument(verb, capsys):
    """doctor and report read the log given as a plain argument (docs/doctor.md: `doctor PATH`), which
    argparse lists only as `key=value`: their help says so, and what is read without one."""
    with pytest.raises(SystemExit):
        stage2_cli.main([verb, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "PATH, the first argument without '='" in text and "default: the config's run_dir" in text


def test_the_version_is_the_package_version(capsys):
    from shared.cli import version

    assert stage2_cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"python -m stage2_train {version()}" and version()[0].isdigit()


def test_status_for_people_and_for_scripts(tiny_target_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    overrides = stage1_overrides(tiny_target_dir, data, tmp_path / "run")
    stage1.cmd_extract(load_run_config("configs/default.yaml", overrides), progress=False)
    assert stage1_cli.main(["status", *overrides]) == 0
    text = capsys.readouterr().out
    assert "current, 0 stale, 0 missing, 0 orphaned" in text and text.strip().endswith("complete")
    assert stage1_cli.main(["status", "--json", *overrides]) == 0
    as_json = json.loads(capsys.readouterr().out)
    expected = stage1.cmd_status(load_run_config("configs/default.yaml", overrides))
    assert set(as_json) == set(expected) and as_json["counts"] == expected["counts"]


def test_report_for_people_and_for_scripts(tmp_path, capsys):
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 2.0 - s / 50, "elapsed_s": float(s)}) + "\n" for s in range(1, 30)))
    assert stage2_cli.main(["report", str(log)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("healthy: ") and "report.md" in text and "plots in" in text
    assert stage2_cli.main(["report", "--json", str(log)]) == 0
    assert set(json.loads(capsys.readouterr().out)) >= {"out_dir", "report", "plots", "healthy", "num_events"}


def test_a_fix_command_in_an_error_names_this_runs_config_and_overrides(tmp_path, capsys):
    """Without --config the printed fix would act on runs/default, not on the run that failed."""
    config = tmp_path / "my run.yaml"
    config.write_text(f"inherit: default\nrun_dir: {tmp_path / 'run'}\n")
    assert stage1_cli.main(["extract", "--config", str(config), "data.max_samples=4", "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'run'}/data/generated.parquet does not exist: run `python -m stage1_extract generate "
        f"--config '{config}' data.max_samples=4` first (or set data.regenerate=false to extract data.path as it is)\n"
    )


def test_every_suggested_command_gets_the_config_unless_it_names_one():
    from shared.cli import for_this_run

    message = (
        "run `python -m stage1_extract verify --repair` or `reprocess`; `python -m stage1_extract extract --config ...` "
        "builds it (`make extract`); `torchrun --nproc_per_node 8 -m stage2_train train train.resume_force=true`; "
        "`python -m stage2_train eval --config other.yaml`"
    )
    assert for_this_run(message, "my.yaml", ["run_dir=/r", "train.resume_force=false", "runs/x"]) == (
        "run `python -m stage1_extract verify --config my.yaml run_dir=/r train.resume_force=false --repair` or "
        "`reprocess`; `python -m stage1_extract extract --config my.yaml run_dir=/r train.resume_force=false` builds it "
        "(`make extract CONFIG=my.yaml ARGS='run_dir=/r train.resume_force=false'`); `torchrun --nproc_per_node 8 -m "
        "stage2_train train --config my.yaml run_dir=/r train.resume_force=true`; `python -m stage2_train eval --config "
        "other.yaml`"
    )


def my_config(tmp_path, name: str = "my run.yaml") -> str:
    config = tmp_path / name
    config.write_text(f"inherit: default\nrun_dir: {tmp_path / 'run'}\n")
    return str(config)


def test_next_steps_in_a_commands_summary_name_this_runs_config(tiny_target_dir, tmp_path, capsys):
    """`status` after an edited row said "not complete: `python -m stage1_extract reprocess`", which
    run as printed re-extracts runs/default: every command a summary suggests carries --config and the
    overrides, as errors' do."""
    import shlex

    rows = chat_rows(8)
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    overrides = stage1_overrides(tiny_target_dir, data, tmp_path / "run")
    config = my_config(tmp_path)
    stage1.cmd_extract(load_run_config(config, overrides), progress=False)
    rows[3]["messages"][1]["content"] = "an edited answer"
    write_jsonl(data, rows)
    assert stage1_cli.main(["status", "--config", config, *overrides]) == 0
    text = capsys.readouterr().out
    spelled = f"--config {shlex.quote(config)} {' '.join(shlex.quote(o) for o in overrides)}"
    assert text.strip().splitlines()[-1] == f"not complete: `python -m stage1_extract reprocess {spelled}` re-extracts what is not current"
    assert stage1_cli.main(["status", "--json", "--config", config, *overrides]) == 0
    assert json.loads(capsys.readouterr().out)["complete"] is False


def test_trains_next_steps_name_this_runs_config(tmp_path, monkeypatch, capsys):
    from stage2_train import commands as stage2

    summary = {"steps": 3, "elapsed_s": 6.0, "world_size": 1, "final_train": {"loss": 1.0, "accuracy": 0.5, "accept_len": 1.5},
               "final_eval": {}, "log": "train_log.jsonl", "rank": 0}
    monkeypatch.setattr(stage2, "cmd_train", lambda cfg, progress: summary)
    config = my_config(tmp_path, "mine.yaml")
    assert stage2_cli.main(["train", "--config", config, "train.max_steps=3"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"log train_log.jsonl; next: `python -m stage2_train eval --config {config} train.max_steps=3` and "
        f"`python -m stage2_train export --config {config} train.max_steps=3`"
    )


def test_what_check_prints_and_notes_name_this_runs_config(tmp_path, capsys):
    """Lines a verb prints while it runs (check's, notes, warnings) are spelled too: here the global
    batch's note (stage 2's rule; the tests import both stages)."""
    config = my_config(tmp_path, "mine.yaml")
    assert stage2_cli.main(["check", "--config", config, "seed=3"]) == 0
    assert f"`python -m stage2_train plan --config {config} seed=3` the GPU memory" in capsys.readouterr().err


def test_train_before_anything_names_both_steps_that_build_the_store(tmp_path, capsys):
    """`train` on a fresh run_dir named `extract`, which then said to run `generate` first."""
    config = my_config(tmp_path, "mine.yaml")
    assert stage2_cli.main(["train", "--config", config, "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'run'}/store: no manifest.json; no store was extracted here: build it with "
        f"`python -m stage1_extract generate --config {config}`, then `python -m stage1_extract extract --config {config}` "
        f"(`make extract CONFIG={config}` runs both; with data.regenerate=false, extract alone)\n"
    )


@pytest.mark.parametrize("cli, verb, runs, line", [
    (stage1_cli, "extract", "cmd_extract", "interrupted: the same command resumes (finished shards are kept)"),
    (stage1_cli, "generate", "cmd_generate", "interrupted: the same command resumes (finished parts are kept)"),
    (stage1_cli, "status", "cmd_status", "interrupted"),
    (stage2_cli, "train", "cmd_train", "interrupted: the same command resumes from the newest checkpoint "
                                       "(train.resume=auto; the steps after it are trained again)"),
    (stage2_cli, "eval", "cmd_eval", "interrupted"),
])
def test_ctrl_c_is_one_line_saying_whether_the_same_command_resumes(cli, verb, runs, line, monkeypatch, capsys):
    """Ctrl-C printed an 86-line KeyboardInterrupt traceback."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.commands, runs, interrupted)
    try:
        code = cli.main([verb])
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped the entry point (a traceback)")
    assert code == 130
    assert capsys.readouterr().err == line + "\n"


def test_no_message_suggests_a_bare_verb():
    """A bare "then `reprocess`" cannot be spelled for the run (which stage? which config?): every
    message of the library names whole commands (`python -m stage1_extract reprocess`), which the
    CLI then spells. Docstrings and comments may name verbs as they like."""
    import ast
    import re
    from pathlib import Path

    verbs = sorted({v.name for v in stage1_cli.VERBS} | {v.name for v in stage2_cli.VERBS})
    bare = re.compile(rf"`(?:(?:stage1_extract|stage2_train) )?({'|'.join(verbs)})(?: --[^`]*)?`")
    root = Path(__file__).resolve().parent.parent
    found = []
    for package in ("shared", "stage1_extract", "stage2_train"):
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                    found += [f"{path.relative_to(root)}:{node.lineno}: {m[0]}" for m in bare.finditer(node.value)]
    assert found == []
