"""A saved drafter is used as it was trained: its held-out split, its store, its target, its mask
token, its description on resume, and a checkpoint from before the block budget.

    .venv/bin/python -m pytest tests/test_trained_on.py -q

Each test reproduces a case the hostile review found (review1 items 1, 5, 7, 8): eval scoring samples
the checkpoint trained on, a resume with another mask token accepted silently, an export naming a
same-shape target it was not trained on, and old checkpoints that could not be resumed at all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from shared.config import load_run_config
from shared.errors import CheckpointError, ConfigError, StoreError
from shared.files import file_sha256
from stage1_extract import commands as stage1
from stage2_train.commands import cmd_eval, cmd_export, cmd_train
from testkit.data import chat_rows, stage1_overrides, train_overrides_for, write_jsonl
from testkit.target import build_tiny_target

TRAINED = {
    "sampler.micro_batch_tokens": 256, "sampler.max_anchors_per_seq": 4, "model.block_size": 8, "loss.gamma": 4.0,
    "train.max_steps": 2, "train.num_data_threads": 1, "checkpoint.every_steps": 2, "log.every_steps": 1,
    "eval.holdout_fraction": 0.2, "eval.split_seed": 0, "eval.offline_max_samples": 2, "eval.online_num_prompts": 1,
    "eval.online_max_new_tokens": 4, "log.wandb": "disabled",
}


def extract(target_dir: Path, root: Path, rows: list) -> Path:
    data = write_jsonl(root / "chat.jsonl", rows)
    cfg = load_run_config("configs/default.yaml", stage1_overrides(target_dir, data, root / "run"))
    stage1.cmd_extract(cfg, progress=False)
    return Path(cfg.store.url(cfg.run_dir))


@pytest.fixture(scope="module")
def stores(tiny_target_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(the store trained on, another store of other conversations), both from the tiny target."""
    return (
        extract(tiny_target_dir, tmp_path_factory.mktemp("trained_on"), chat_rows(24)),
        extract(tiny_target_dir, tmp_path_factory.mktemp("other_store"), chat_rows(12, seed=1)),
    )


def overrides(target_dir: Path, store: Path, run_dir: Path, **extra) -> list[str]:
    return train_overrides_for(target_dir, store, run_dir, {**TRAINED, **extra})


@pytest.fixture(scope="module")
def trained(tiny_target_dir, stores, tmp_path_factory) -> Path:
    """A run dir holding step_000002, trained with eval.holdout_fraction=0.2, split_seed=0."""
    run_dir = tmp_path_factory.mktemp("trained_run")
    cmd_train(load_run_config("configs/default.yaml", overrides(tiny_target_dir, stores[0], run_dir)), progress=False)
    return run_dir


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    return Path(shutil.copytree(trained, tmp_path / "run"))


def log_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]


# ---- eval: the drafter's own split, on its own store (item 1) --------------------------------------
def test_eval_scores_the_split_the_checkpoint_was_trained_with(tiny_target_dir, stores, trained, tmp_path, capsys):
    from shared.reader import StoreReader
    from stage2_train.data.view import split_indices
    from stage2_train.train.state import store_digest

    base = overrides(tiny_target_dir, stores[0], trained)
    with pytest.raises(ConfigError, match=r"eval\.split_seed: the drafter was trained with 0, the command line gives 3\. "
                                          r"Another split would score samples it trained on"):
        cmd_eval(load_run_config("configs/default.yaml", base + ["eval.split_seed=3"]))
    # The same values in a config file: ignored with a note, the checkpoint's split used.
    in_file = [o for o in base if not o.startswith(("eval.holdout_fraction=", "eval.split_seed="))]
    config = tmp_path / "eval.yaml"
    config.write_text("inherit: default\neval:\n  holdout_fraction: 0.5\n  split_seed: 3\n")
    result = cmd_eval(load_run_config(config, in_file))
    reader = StoreReader(str(stores[0]))
    held = split_indices(reader, 0.2, 0)[1]
    assert result["num_heldout"] == len(held) != len(split_indices(reader, 0.5, 3)[1])
    assert result["split"] == {
        "holdout_fraction": 0.2, "split_seed": 0, "from": str(trained / "checkpoints" / "step_000002"),
        "store_digest": store_digest(reader.manifest), "data_source": "chat.jsonl", "trained_on_store": True,
    }
    err = capsys.readouterr().err
    assert "note: eval.holdout_fraction: the drafter was trained with 0.2, the config gives (ignored) 0.5" in err
    assert "note: eval.split_seed: the drafter was trained with 0, the config gives (ignored) 3" in err


def test_eval_refuses_another_store_unless_allowed(tiny_target_dir, stores, trained):
    other = overrides(tiny_target_dir, stores[1], trained)
    with pytest.raises(StoreError, match=r"is not the store .*step_000002 was trained on \(store digest \w+, the drafter was "
                                         r"trained on \w+ .*set store\.path to the store it was trained on, or "
                                         r"eval\.allow_other_store=true"):
        cmd_eval(load_run_config("configs/default.yaml", other))
    result = cmd_eval(load_run_config("configs/default.yaml", other + ["eval.allow_other_store=true"]))
    assert result["split"]["trained_on_store"] is False and result["split"]["holdout_fraction"] == 0.2


def test_eval_refuses_a_drafter_trained_on_other_target_layers(tiny_target_dir, stores, trained):
    """The store's features are of the config's layers: a drafter trained on others would be scored
    on the wrong features with decoding still exact, so nothing else would show it."""
    import dataclasses

    from stage2_train.serve.evaluation import HeldoutSet

    cfg = load_run_config("configs/default.yaml", overrides(tiny_target_dir, stores[0], trained))
    heldout = HeldoutSet.open(cfg)
    step = trained / "checkpoints" / "step_000002"
    assert heldout.load(step).description.target_layer_ids == tuple(heldout.target.layer_ids)
    heldout.target = dataclasses.replace(heldout.target, layer_ids=[i + 1 for i in heldout.target.layer_ids])
    with pytest.raises(CheckpointError, match=r"the drafter reads target layers \[.*\], the store and the config give .*"
                                              r"target\.layer_ids="):
        heldout.load(step)


def test_a_heldout_set_cut_with_another_split_refuses_a_drafter_trained_with_its_own(tiny_target_dir, stores, trained):
    """bench/compare.py and bench/learning.py open one held-out set from the config (`HeldoutSet.open(cfg)`)
    and load each drafter into it: a drafter trained with eval.holdout_fraction=0.2 was scored on a set cut
    at 0.5, which holds samples it trained on, and its online tau counted them as held-out, without a word."""
    from stage2_train.serve.evaluation import HeldoutSet

    step = trained / "checkpoints" / "step_000002"
    own = HeldoutSet.open(load_run_config("configs/default.yaml", overrides(tiny_target_dir, stores[0], trained)))
    assert own.load(step).trained_on.holdout_fraction == 0.2
    for change, named in (({"eval.holdout_fraction": 0.5}, "eval.holdout_fraction=0.2, this held-out set 0.5"),
                          ({"eval.split_seed": 3}, "eval.split_seed=0, this held-out set 3")):
        other = HeldoutSet.open(load_run_config("configs/default.yaml", overrides(tiny_target_dir, stores[0], trained, **change)))
        with pytest.raises(ConfigError, match=rf"{re.escape(str(step))} was trained with {re.escape(named)}: .*samples it trained "
                                              rf"on.*eval\.holdout_fraction=0\.2 eval\.split_seed=0"):
            other.load(step)


def test_eval_refuses_a_confidence_stop_for_a_drafter_without_a_confidence_head(tiny_target_dir, stores, trained):
    """eval.confidence_stop=0.5 on the command line for a DFlash drafter (only DSpark's confidence head
    can stop a block early) decoded whole blocks and reported confidence_stop null: the figure asked
    for was never measured, without a word."""
    with pytest.raises(ConfigError, match=r"eval\.confidence_stop: the drafter .*step_000002 has no confidence head \(a dflash "
                                          r"drafter\), the command line gives 0\.5.*drop eval\.confidence_stop"):
        cmd_eval(load_run_config("configs/default.yaml", overrides(tiny_target_dir, stores[0], trained) + ["eval.confidence_stop=0.5"]))


def test_eval_with_no_online_prompts_reports_offline_only_without_loading_the_target(tiny_target_dir, stores, trained, monkeypatch):
    """eval.online_num_prompts=0 asks for the offline numbers: the (at 8B 32 GB fp32) target never loads."""
    import stage2_train.serve.evaluation as evaluation

    def no_target(*args, **kwargs):
        raise AssertionError("the online target was loaded")

    monkeypatch.setattr(evaluation, "load_online_target", no_target)
    result = cmd_eval(load_run_config("configs/default.yaml", overrides(tiny_target_dir, stores[0], trained) + ["eval.online_num_prompts=0"]))
    assert result["online"] is None and result["offline"]["accept_len"] >= 1.0
    assert "offline only (eval.online_num_prompts=0)" in result["summary"]


def test_eval_weights_the_heldout_ce_with_the_gamma_the_drafter_trained_with(tiny_target_dir, stores, trained, tmp_path, capsys):
    """The offline ce is weighted by exp(-(k-1)/gamma): eval took the config's loss.gamma, so the same
    checkpoint on the same held-out samples scored another ce under a config without the run's
    loss.gamma=4 than in its own evals. It now takes the drafter's own (its saved run config; an
    export records it), with a note naming the config's value it ignored."""
    from stage2_train.serve.trained_on import read_trained_on

    base = overrides(tiny_target_dir, stores[0], trained, **{"eval.online_num_prompts": 0})
    own = cmd_eval(load_run_config("configs/default.yaml", base))["offline"]
    capsys.readouterr()
    other = cmd_eval(load_run_config("configs/default.yaml", [o for o in base if not o.startswith("loss.gamma=")] + ["loss.gamma=9"]))["offline"]
    assert other["ce"] == own["ce"] and own["accept_len"] == other["accept_len"]
    assert own["gamma"] == other["gamma"] == 4.0
    assert ("note: loss.gamma: the held-out ce is weighted with the drafter's own: the drafter was trained with 4 "
            f"({trained / 'checkpoints' / 'step_000002'}); the config gives (ignored) 9") in capsys.readouterr().err
    cmd_export(load_run_config("configs/default.yaml", base), out=str(tmp_path / "export"))
    assert read_trained_on(tmp_path / "export").loss_gamma == 4.0


# ---- export: the target, the mask token and the store it was trained on (items 1, 7) ---------------
def test_export_records_the_split_and_states_the_store_only_when_it_was_trained_on(tiny_target_dir, stores, trained, tmp_path):
    from shared.reader import StoreReader
    from stage2_train.train.state import store_digest

    digest = store_digest(StoreReader(str(stores[0])).manifest)
    cmd_export(load_run_config("configs/default.yaml", overrides(tiny_target_dir, stores[0], trained)), out=str(tmp_path / "a"))
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["dflash_pipeline"]["training"] == {"holdout_fraction": 0.2, "split_seed": 0, "store_digest": digest, "loss_gamma": 4.0}
    assert "| data | chat.jsonl: 24 samples" in (tmp_path / "a" / "README.md").read_text()
    cmd_export(load_run_config("configs/default.yaml", overrides(tiny_target_dir, stores[1], trained)), out=str(tmp_path / "b"))
    card = (tmp_path / "b" / "README.md").read_text()
    assert "| data | not stated: the configured store is not the one trained on (store digest" in card
    assert "12 samples" not in card


def test_the_card_calls_an_eval_held_out_only_on_the_drafters_own_split_of_its_store(tiny_target_dir, stores, run_copy, tmp_path):
    """An eval made on another store (eval.allow_other_store) was stated on the card as "Held-out
    speculative decoding" (review, probe6): the card now says which data the eval used."""
    from shared.reader import StoreReader
    from stage2_train.train.state import store_digest

    own = load_run_config("configs/default.yaml", overrides(tiny_target_dir, stores[0], run_copy))
    other = load_run_config("configs/default.yaml", overrides(tiny_target_dir, stores[1], run_copy) + ["eval.allow_other_store=true"])
    assert cmd_eval(other)["split"]["trained_on_store"] is False
    cmd_export(own, out=str(tmp_path / "other"))
    card = (tmp_path / "other" / "README.md").read_text()
    other_digest = store_digest(StoreReader(str(stores[1])).manifest)
    assert "Held-out" not in card and "held-out split" not in card
    assert (f"Speculative decoding on another store than the one trained on, on prompts of chat.jsonl (store digest "
            f"{other_digest}, evaluated with eval.allow_other_store), so these are not held-out figures of this training. "
            f"1 prompt x 4 new tokens") in card
    # One prompt: its tau is stated with no interval.
    assert "(1 prompt: too few for an interval)**" in card and "95% bootstrap interval" not in card
    cmd_eval(own)
    cmd_export(own, out=str(tmp_path / "own"))
    card = (tmp_path / "own" / "README.md").read_text()
    assert ("Held-out speculative decoding, on the drafter's own held-out split (eval.holdout_fraction 0.2, "
            "eval.split_seed 0) of the store it was trained on, chat.jsonl. 1 prompt x 4 new tokens") in card


def test_the_card_states_no_eval_of_another_checkpoint_of_the_same_step(tiny_target_dir, stores, run_copy, tmp_path):
    """run_dir/eval/<step>.json is named by the step alone: `eval --checkpoint` of another run's
    checkpoint of that step writes there too, and the card must not state its tau as this drafter's."""
    import shutil

    cfg = load_run_config("configs/default.yaml", overrides(tiny_target_dir, stores[0], run_copy))
    step = sorted((run_copy / "checkpoints").glob("step_*"))[-1]
    other = shutil.copytree(step, tmp_path / "other-run" / "checkpoints" / step.name)
    assert cmd_eval(cfg, checkpoint=str(other))["checkpoint"] == str(other / "model.safetensors")
    cmd_export(cfg, out=str(tmp_path / "export"))
    card = (tmp_path / "export" / "README.md").read_text()
    assert "No held-out evaluation was recorded for this checkpoint" in card and "tau **" not in card
    evaluated = cmd_eval(cfg)
    cmd_export(cfg, out=str(tmp_path / "export"))
    assert "Held-out speculative decoding" in (tmp_path / "export" / "README.md").read_text()
    # A run trained again from scratch in this run_dir saves its own step_N at the same path: the eval
    # recorded the weights it scored (their sha256 in the checkpoint's meta.json), which are not these.
    written = Path(evaluated["written_to"])
    assert len(evaluated["weights_sha256"]) == 64
    written.write_text(json.dumps({**json.loads(written.read_text()), "weights_sha256": "0" * 64}))
    cmd_export(cfg, out=str(tmp_path / "export"))
    assert "No held-out evaluation was recorded for this checkpoint" in (tmp_path / "export" / "README.md").read_text()


def test_the_card_still_states_an_eval_written_before_evals_recorded_their_weights(tiny_target_dir, stores, run_copy, tmp_path):
    """Evals written before `eval` recorded the weights' sha256 have none: the card dropped every such
    eval, so each existing run had to rerun its (online, target-sized) eval to state tau again. One
    written after the weights is theirs; one older than them (a run trained again since) is not."""
    cfg = load_run_config("configs/default.yaml", overrides(tiny_target_dir, stores[0], run_copy))
    written = Path(cmd_eval(cfg)["written_to"])
    record = json.loads(written.read_text())
    del record["weights_sha256"]
    written.write_text(json.dumps(record))
    cmd_export(cfg, out=str(tmp_path / "export"))
    assert "Held-out speculative decoding" in (tmp_path / "export" / "README.md").read_text()
    weights = sorted((run_copy / "checkpoints").glob("step_*"))[-1] / "model.safetensors"
    os.utime(written, (weights.stat().st_mtime - 60,) * 2)
    cmd_export(cfg, out=str(tmp_path / "export"))
    assert "No held-out evaluation was recorded for this checkpoint" in (tmp_path / "export" / "README.md").read_text()


def test_export_and_init_from_refuse_a_same_shape_target_with_other_weights(tiny_target_dir, stores, trained, tmp_path):
    other_target = build_tiny_target(tmp_path / "other_target", seed=1)  # the same shape, other weights
    step = trained / "checkpoints" / "step_000002"
    base = overrides(other_target, stores[0], trained)
    refusal = r"the drafter was trained against target weights \w{12}, target\.path=.*other_target.* has \w{12} .*" \
              r"model\.allow_other_target=true to use it with this one"
    with pytest.raises(CheckpointError, match=refusal):
        cmd_export(load_run_config("configs/default.yaml", base), out=str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
    cmd_export(load_run_config("configs/default.yaml", base + ["model.allow_other_target=true"]), out=str(tmp_path / "y"))
    recorded = json.loads((tmp_path / "y" / "config.json").read_text())["dflash_pipeline"]
    assert recorded["drafter"]["target_weights_sha256"] != recorded["target"]["weights_sha256"]  # both said
    new_run = overrides(other_target, stores[0], tmp_path / "new", **{"model.init_from": str(step)})
    with pytest.raises(CheckpointError, match=r"model\.init_from=.*step_000002.*: " + refusal):
        cmd_train(load_run_config("configs/default.yaml", new_run), progress=False)


def test_the_exported_mask_token_is_the_drafters_not_the_configs(tiny_target_dir, tmp_path):
    """A drafter trained with mask 16 exported by a config whose target.mask_token_id is 17: config.json
    and its mask_token string both say 16."""
    import torch

    from shared.config import build_run_config
    from shared.target import TargetArch, cached_tokenizer
    from stage2_train.model.config import DrafterConfig
    from stage2_train.model.description import describe_parts
    from stage2_train.model.drafter import DFlashDrafter
    from stage2_train.train.checkpoint.saver import Checkpointer
    from stage2_train.train.config import CheckpointConfig

    arch = TargetArch.from_dir(tiny_target_dir)
    model = DrafterConfig(num_layers=1, block_size=4)
    torch.manual_seed(0)
    drafter = DFlashDrafter(model, arch, 3, 16)
    description = describe_parts(model, arch, [1, 2, 3], 16)
    Checkpointer(CheckpointConfig(), tmp_path / "run" / "checkpoints").save(
        3, lambda: {"model": drafter.state_dict(), "drafter": description.to_dict()}, blocking=True
    )
    cfg = build_run_config({"run_dir": str(tmp_path / "run"), "model": {"num_layers": 1, "block_size": 4},
                            "target": {"path": str(tiny_target_dir), "num_feature_layers": 3, "mask_token_id": 17}})
    cmd_export(cfg)
    dflash = json.loads((tmp_path / "run" / "export" / "config.json").read_text())["dflash_config"]
    tokenizer, _ = cached_tokenizer(str(tiny_target_dir))
    assert dflash["mask_token_id"] == 16 and dflash["mask_token"] == tokenizer.convert_ids_to_tokens(16)
    assert tokenizer.convert_ids_to_tokens(16) != tokenizer.convert_ids_to_tokens(17)


# ---- resume: the drafter's description, field by field (item 5) -----------------------------------
def test_a_resume_with_another_mask_token_is_refused_unless_forced(tiny_target_dir, stores, run_copy, capfd):
    saved_mask = json.loads((run_copy / "checkpoints" / "step_000002" / "drafter.json").read_text())["mask_token_id"]
    other = saved_mask - 1  # another reserved token (SmolLM2's <jupyter_script>): an ordinary one is refused before resuming
    more = overrides(tiny_target_dir, stores[0], run_copy, **{"train.max_steps": 3, "target.mask_token_id": other})
    with pytest.raises(CheckpointError, match=rf"cannot resume: resolved\.mask_token_id: saved {saved_mask}, now {other} "
                                              r"\(the mask token filling the drafter's blocks \(target\.mask_token_id\)\) "
                                              r"\(these change what training computes; set train\.resume_force=true"):
        cmd_train(load_run_config("configs/default.yaml", more), progress=False)
    summary = cmd_train(load_run_config("configs/default.yaml", more + ["train.resume_force=true"]), progress=False)
    assert summary["steps"] == 3
    resume = [r for r in log_of(run_copy) if r.get("event") == "resume"][-1]
    assert resume["forced_differences"] == [
        f"resolved.mask_token_id: saved {saved_mask}, now {other} (the mask token filling the drafter's blocks (target.mask_token_id))"
    ]  # the description's mask_token_id is the same difference: reported once
    assert "warning: train.resume_force: resuming" in capfd.readouterr().err
    assert json.loads((run_copy / "checkpoints" / "step_000003" / "drafter.json").read_text())["mask_token_id"] == other


def test_a_resume_the_batch_plan_cannot_continue_names_the_ways_to_start_anew(tiny_target_dir, stores, run_copy, capfd):
    """Retraining after `reprocess` (other samples): `train` said "set train.resume_force=true", which
    then failed in the sampler ("num_samples was 242 when saved, is 247 now ... resuming exactly is
    impossible") with no fix. resume_force is named only where it works; the ways that do are named."""
    step = run_copy / "checkpoints" / "step_000002"
    more = overrides(tiny_target_dir, stores[1], run_copy, **{"train.max_steps": 3})  # the store, rebuilt with other samples
    anew = (f"To start anew: train.resume=never starts over in this run_dir, run_dir=<another folder> starts a new run, "
            f"and model.init_from={step} with either starts from that checkpoint's weights")
    for force in ("false", "true"):
        with pytest.raises(CheckpointError) as refused:
            cmd_train(load_run_config("configs/default.yaml", [*more, f"train.resume_force={force}"]), progress=False)
        message = str(refused.value)
        assert message.startswith("cannot resume: resolved.store_digest: saved ")
        assert ("and train.resume_force cannot resume this checkpoint: the batch plan cannot be continued (num_samples was "
                in message)
        assert message.endswith(anew) and "set train.resume_force=true" not in message
    summary = cmd_train(load_run_config("configs/default.yaml", [*more, "train.resume=never"]), progress=False)
    assert summary["steps"] == 3  # the first fix named works
    capfd.readouterr()


def test_a_sampler_that_cannot_continue_a_plan_names_the_ways_to_start_anew():
    from stage2_train.data.config import SamplerConfig
    from stage2_train.data.sampler import LengthMixedSampler

    lengths = [64] * 40
    state = LengthMixedSampler(SamplerConfig(micro_batch_tokens=256), lengths, seed=0).state_dict()
    with pytest.raises(CheckpointError, match=r"sampler state: num_samples was 40 when saved, is 39 now .*resuming exactly "
                                              r"is impossible, train\.resume_force included\. To start anew: "
                                              r"train\.resume=never starts over in this run_dir, run_dir=<another folder>"):
        LengthMixedSampler(SamplerConfig(micro_batch_tokens=256), lengths[:-1], seed=0).load_state_dict(state)


def test_a_resume_whose_weights_do_not_fit_names_no_resume_force_and_no_init_from():
    from stage2_train.train.resume import check_compatible

    saved, now = {"model": {"num_layers": 1}}, {"model": {"num_layers": 2}}
    for force in (False, True):
        with pytest.raises(CheckpointError) as refused:
            check_compatible(saved, now, force, checkpoint="ckpt/step_000002")
        assert str(refused.value) == (
            "cannot resume: model.num_layers: saved 1, now 2 (the drafter's architecture (its weights would not fit)) "
            "(these change what training computes, and train.resume_force cannot resume this checkpoint: its weights do "
            "not fit this drafter (model.num_layers)). To start anew: train.resume=never starts over in this run_dir, "
            "run_dir=<another folder> starts a new run"
        )
    gamma = check_compatible({"loss": {"gamma": 4.0}}, {"loss": {"gamma": 5.0}}, True)  # one force can carry
    assert gamma == ["loss.gamma: saved 4.0, now 5.0 (the position weights of the loss)"]


def test_every_field_of_the_drafters_description_is_compared_on_resume():
    """Fields no setting compares (the target's shape: rope_theta, heads) are named as drafter.<field>;
    one a setting already names (block_size) is reported once, under the setting."""
    from stage2_train.train.resume import check_compatible

    config = {"model": {"block_size": 16}, "resolved": {"mask_token_id": 5}}
    drafter = {"block_size": 16, "rope_theta": 10000.0, "mask_token_id": 5, "version": 1}
    assert check_compatible(config, config, saved_drafter=drafter, drafter=dict(drafter)) == []
    with pytest.raises(CheckpointError, match=r"drafter\.rope_theta: saved 10000\.0, now 1000000\.0 \(the drafter's "
                                              r"description, set by the target's shape \(target\.path\)\)"):
        check_compatible(config, config, saved_drafter=drafter, drafter={**drafter, "rope_theta": 1e6})
    now = {"model": {"block_size": 8}, "resolved": {"mask_token_id": 5}}
    forced = check_compatible(config, now, True, saved_drafter=drafter, drafter={**drafter, "block_size": 8, "version": 2})
    assert forced == ["model.block_size: saved 16, now 8 (the drafter's block, hence anchors, attention and loss weights)"]


def test_a_run_started_from_init_from_resumes_after_that_folder_is_gone(tiny_target_dir, stores, run_copy, tmp_path, capfd):
    """Every launch read model.init_from before resuming, though a resume takes the checkpoint's weights:
    a run started from an export in a scratch folder could not be resumed once the folder was cleaned up
    ("no DFlash drafter at ..."). Without a checkpoint to resume (train.resume=never) it is still refused."""
    gone = tmp_path / "scratch_export"
    more = overrides(tiny_target_dir, stores[0], run_copy, **{"train.max_steps": 3, "model.init_from": str(gone)})
    assert cmd_train(load_run_config("configs/default.yaml", more), progress=False)["steps"] == 3
    assert f"note: model.init_from={gone}" in capfd.readouterr().err
    start = [r for r in log_of(run_copy) if r.get("event") == "run_start"][-1]
    assert start["hyperparameters"]["init_from"] == str(gone)  # the run still says where it started (the doctor reads it)
    with pytest.raises(CheckpointError, match=rf"no DFlash drafter at {re.escape(str(gone))}"):
        cmd_train(load_run_config("configs/default.yaml", more + ["train.resume=never"]), progress=False)


# ---- a checkpoint from before the block budget (item 8) ---------------------------------------------
def strip_block_budget(step: Path) -> dict:
    """step's sampler state as a checkpoint written before the block budget has it; meta.json updated."""
    rank_file = step / "rank_00000.json"
    plain = json.loads(rank_file.read_text())
    for key in ("micro_batch_blocks", "blocks_digest"):
        del plain["loader"][key]
    rank_file.write_text(json.dumps(plain))
    meta = json.loads((step / "meta.json").read_text())
    meta["files"]["rank_00000.json"] = {"bytes": rank_file.stat().st_size, "sha256": file_sha256(rank_file)}
    (step / "meta.json").write_text(json.dumps(meta))
    return plain["loader"]


def test_a_checkpoint_from_before_the_block_budget_resumes_under_resume_force(tiny_target_dir, stores, run_copy, capfd):
    step = run_copy / "checkpoints" / "step_000002"
    saved = strip_block_budget(step)
    assert saved["step_in_epoch"] == 2 and saved["epoch"] == 0  # mid-epoch: the plan matters
    more = overrides(tiny_target_dir, stores[0], run_copy, **{"train.max_steps": 4})
    with pytest.raises(CheckpointError, match=rf"cannot resume {step}: it was saved before micro-batches had a block budget "
                                              r"\(its sampler state lacks micro_batch_blocks, blocks_digest\).*"
                                              r"set train\.resume_force=true to re-plan its epoch 0 from the start .*"
                                              rf"model\.init_from={step} run_dir=<another folder>"):
        cmd_train(load_run_config("configs/default.yaml", more), progress=False)
    assert cmd_train(load_run_config("configs/default.yaml", more + ["train.resume_force=true"]), progress=False)["steps"] == 4
    log = log_of(run_copy)
    resume = [r for r in log if r.get("event") == "resume"][-1]
    assert resume["replanned"] == {"epoch": 0, "saved_step_in_epoch": 2, "saved_micro_step": 0,
                                   "missing": ["micro_batch_blocks", "blocks_digest"]}
    rows = [r for r in log if r["kind"] == "train" and r["step"] > 2]
    assert [(r["step"], r["epoch"], r["step_in_epoch"]) for r in rows] == [(3, 0, 0), (4, 0, 1)]  # the epoch from its start
    assert "epoch 0 re-planned from its start" in capfd.readouterr().err


def test_init_from_a_checkpoint_step_starts_from_its_weights(tiny_target_dir, stores, trained, tmp_path):
    """The other way the refusal above offers: a new run from the checkpoint's weights."""
    from stage2_train.serve.load import init_weights_for
    from stage2_train.train.checkpoint.format import read_weights

    step = trained / "checkpoints" / "step_000002"
    cfg = load_run_config("configs/default.yaml", overrides(tiny_target_dir, stores[0], tmp_path / "new", **{
        "model.init_from": str(step), "train.max_steps": 1}))
    from shared.target import resolve_target

    weights = init_weights_for(step, cfg.model, resolve_target(cfg.target))
    saved, _ = read_weights(step)
    assert sorted(weights) == sorted(saved) and all(bool((weights[k] == saved[k]).all()) for k in saved)
    assert cmd_train(cfg, progress=False)["steps"] == 1
    start = next(r for r in log_of(tmp_path / "new") if r.get("event") == "run_start")
    assert start["hyperparameters"]["init_from"] == str(step)


def test_init_from_on_a_store_grown_from_the_one_trained_on_refuses_a_split_that_holds_out_its_training_rows(
    tiny_target_dir, stores, trained, tmp_path
):
    """Starting from one's own drafter after appending rows and reprocessing (another store digest)
    with another split: the check above ran only on the identical store, so the new run held out rows
    the first drafter trained on and every held-out figure was inflated, silently. Now the rows are
    compared by split key with the store the checkpoint was trained on (refused naming how many); an
    unrelated store passes; where the first store cannot be read (an export records no path) the
    refusal says so."""
    from shared.store import read_manifest
    from stage2_train.serve.trained_on import init_split_problem, read_trained_on

    (tmp_path / "grown").mkdir()
    grown = extract(tiny_target_dir, tmp_path / "grown", chat_rows(24) + chat_rows(12, seed=1))
    step = trained / "checkpoints" / "step_000002"
    record = read_trained_on(step)
    assert record.store == str(stores[0])

    def problem(store, record, **split):
        cfg = load_run_config("configs/default.yaml", overrides(tiny_target_dir, store, tmp_path / "new", **split))
        return init_split_problem(cfg, record, read_manifest(str(store)))

    assert problem(grown, record) is None  # the drafter's own split
    leaked = problem(grown, record, **{"eval.split_seed": 7})
    assert leaked.startswith(f"model.init_from: that drafter was trained on {stores[0]} with eval.holdout_fraction=0.2, "
                             f"eval.split_seed=0 (recorded in {step}); ")
    assert "; 2 sample(s) of this store that this run's split (holdout_fraction=0.2, split_seed=7) holds out are rows it " \
           "trained on there. Set eval.holdout_fraction=0.2 eval.split_seed=0" in leaked
    assert problem(stores[1], record, **{"eval.split_seed": 7}) is None  # no row in common
    unknown = problem(grown, record.__class__(**{**record.__dict__, "store": None}), **{"eval.split_seed": 7})
    assert ("and that store (its path not recorded) cannot be read here as it was (moved, deleted or reprocessed since) to "
            "tell. Set eval.holdout_fraction=0.2 eval.split_seed=0") in unknown


def test_eval_of_a_run_that_held_nothing_out_names_how_to_train_one_that_does(tiny_target_dir, stores, tmp_path, caplog):
    """A small data set at the recipe's eval.holdout_fraction=0.01 holds no sample out: train said nothing,
    and eval then said only "eval.holdout_fraction=0.01 leaves no held-out sample among 24". train now
    warns before the run, and eval says the split is the trained one's and names a run on the same
    store whose split holds samples out."""
    import shlex

    from shared.errors import StoreError
    from shared.reader import StoreReader
    from stage2_train.data.view import split_indices

    reader = StoreReader(str(stores[0]))
    assert len(split_indices(reader, 0.01, 0)[1]) == 0
    run_dir = tmp_path / "run"
    base = overrides(tiny_target_dir, stores[0], run_dir, **{"eval.holdout_fraction": 0.01, "eval.every_steps": 0})
    with caplog.at_level("WARNING", logger="stage2_train.data.run_data"):
        cmd_train(load_run_config("configs/default.yaml", base), progress=False)
    assert [r.getMessage() for r in caplog.records if r.name == "stage2_train.data.run_data"] == [
        f"eval.holdout_fraction=0.01 holds out none of the 24 samples of {stores[0]}: this run is never scored on samples it did "
        f"not train on, and `python -m stage2_train eval` will have none; raise eval.holdout_fraction (to 0.12: about 3 "
        f"samples) or extract more data"]
    with pytest.raises(StoreError) as refused:
        cmd_eval(load_run_config("configs/default.yaml", base))
    message = str(refused.value)
    assert message.startswith("eval.holdout_fraction=0.01 leaves no held-out sample among 24, and the drafter was trained on "
                              "every other one: train a new run (another run_dir) with eval.holdout_fraction=0.12 on the same "
                              "store: `python -m stage2_train train eval.holdout_fraction=0.12 run_dir=NEW_RUN_DIR store.path=")
    settings = shlex.split(re.search(r"`python -m stage2_train train (.*)`", message)[1])
    again = load_run_config("configs/default.yaml", base + [s.replace("NEW_RUN_DIR", str(tmp_path / "new")) for s in settings])
    assert Path(again.store.url(again.run_dir)) == stores[0]
    assert len(split_indices(reader, again.eval.holdout_fraction, again.eval.split_seed)[1]) > 0
