"""A saved drafter is rebuilt as it was trained, whatever the command line says: a value that agrees
with the drafter is accepted, one that contradicts it is refused naming both values, a checkpoint
from before drafter.json is described by what its own run resolved (never today's command line),
and model.init_from refuses a drafter whose weights were trained under other rotary or norm settings.

.venv/bin/python -m pytest -q -p no:xdist tests/test_drafter_identity.py
"""

from __future__ import annotations

import pytest

from stage2_train.model.config import DrafterConfig
from stage2_train.model.description import describe_parts
from testkit.drafter import tiny_arch

LAYER_IDS, MASK_ID = [1, 3], 7
SLIDING = ("sliding_attention", "full_attention")


def sliding_description():
    cfg = DrafterConfig(num_layers=2, block_size=8, layer_types=SLIDING, sliding_window=6)
    return describe_parts(cfg, tiny_arch(), LAYER_IDS, MASK_ID)


def test_a_window_given_alone_is_compared_with_the_drafters_window_not_with_none():
    """model.sliding_window=6 on the command line of a drafter trained with window 6 (model.layer_types
    left to the checkpoint) was refused as 'the command line gives None'; window 4 was named as None too."""
    d = sliding_description()
    assert d.contradictions(DrafterConfig(sliding_window=6), {"model.sliding_window"}) == []
    assert d.contradictions(DrafterConfig(sliding_window=4), {"model.sliding_window"}) == [
        "model.sliding_window: the drafter has 6, the command line gives 4"]


def test_a_projection_size_given_alone_is_compared_with_the_drafters():
    cfg = DrafterConfig(num_layers=1, block_size=8, feature_projection="pca", projection_dim=32)
    d = describe_parts(cfg, tiny_arch(), LAYER_IDS, MASK_ID)
    assert d.contradictions(DrafterConfig(projection_dim=32), {"model.projection_dim"}) == []
    assert d.contradictions(DrafterConfig(projection_dim=16), {"model.projection_dim"}) == [
        "model.projection_dim: the drafter has 32, the command line gives 16"]
    assert d.contradictions(DrafterConfig(projection_dim=None), {"model.projection_dim"}) == [  # null: the target's width
        "model.projection_dim: the drafter has 32, the command line gives None"]
    wide = describe_parts(cfg.model_copy(update={"projection_dim": None}), tiny_arch(), LAYER_IDS, MASK_ID)
    assert wide.projection_dim == 64 and wide.contradictions(DrafterConfig(projection_dim=None), {"model.projection_dim"}) == []


def test_is_causal_false_on_a_drafter_of_full_layers_is_its_own_rule():
    """Full layers with is_causal unset are bidirectional in the block, as is_causal=false says: the
    same drafter. On sliding layers the two differ (unset: causal there), and that is refused."""
    full = describe_parts(DrafterConfig(num_layers=2, block_size=8), tiny_arch(), LAYER_IDS, MASK_ID)
    assert full.contradictions(DrafterConfig(is_causal=False), {"model.is_causal"}) == []
    assert full.contradictions(DrafterConfig(is_causal=True), {"model.is_causal"}) == [
        "model.is_causal: the drafter has None, the command line gives True"]
    assert sliding_description().contradictions(DrafterConfig(is_causal=False), {"model.is_causal"}) == [
        "model.is_causal: the drafter has None, the command line gives False"]


def save_legacy_checkpoint(run_dir, target_dir, target_section):
    """A checkpoint written before drafter.json and before the resolved mask token were recorded: its
    weights and the run config it saved (model and target sections, the resolved layer ids)."""
    import torch

    from shared.target import TargetArch
    from stage2_train.model.drafter import DFlashDrafter
    from stage2_train.train.checkpoint.saver import Checkpointer
    from stage2_train.train.config import CheckpointConfig

    torch.manual_seed(0)
    trained = DFlashDrafter(DrafterConfig(num_layers=1, block_size=4), TargetArch.from_dir(target_dir), 3, 16)
    saved = {"model": {"num_layers": 1, "block_size": 4}, "target": {"path": str(target_dir), **target_section},
             "resolved": {"layer_ids": [1, 2, 3]}}
    Checkpointer(CheckpointConfig(), run_dir / "checkpoints").save(5, lambda: {"model": trained.state_dict(), "config": saved},
                                                                   blocking=True)


def test_a_checkpoint_from_before_drafter_json_keeps_the_mask_token_its_run_trained_with(tmp_path, tiny_target_dir):
    """Its description was rebuilt with today's target.mask_token_id: exported under a config without
    the run's target.mask_token_id=9, config.json said 16; with target.mask_token_id=5 on the command
    line it said 5, and eval scored it so, every block filled with another token, without a word."""
    import json

    from shared.config import load_run_config
    from shared.errors import ConfigError
    from stage2_train.commands import cmd_export

    common = [f"target.path={tiny_target_dir}", "target.num_feature_layers=3"]
    save_legacy_checkpoint(tmp_path / "nine", tiny_target_dir, {"num_feature_layers": 3, "mask_token_id": 9})
    cmd_export(load_run_config(None, [f"run_dir={tmp_path / 'nine'}", *common]))
    assert json.loads((tmp_path / "nine" / "export" / "config.json").read_text())["dflash_config"]["mask_token_id"] == 9
    save_legacy_checkpoint(tmp_path / "default", tiny_target_dir, {"num_feature_layers": 3, "mask_token_id": None})
    with pytest.raises(ConfigError, match=r"target\.mask_token_id: the drafter has 16, the command line gives 5"):
        cmd_export(load_run_config(None, [f"run_dir={tmp_path / 'default'}", *common, "target.mask_token_id=5"]))


@pytest.mark.parametrize("field, value", [("rope_theta", 1_000_000.0), ("rms_norm_eps", 1e-5)])
def test_init_from_refuses_a_drafter_trained_under_other_rotary_or_norm_settings(tmp_path, field, value):
    """A drafter folder whose weights were trained with another rope_theta (or RMSNorm eps) than this
    target's: model.init_from took them and the run trained them under the target's, positions and
    norms silently other than the ones they were fitted to (a published drafter records no target
    weights, and model.allow_other_target lets a recorded one through)."""
    import dataclasses

    import torch

    from shared.errors import CheckpointError
    from shared.target import TargetInfo
    from stage2_train.model.drafter import build_drafter
    from stage2_train.serve.export import export_drafter
    from stage2_train.serve.load import init_weights_for

    arch, cfg = tiny_arch(), DrafterConfig(num_layers=1, block_size=8)
    theirs = describe_parts(cfg, dataclasses.replace(arch, **{field: value}), LAYER_IDS, MASK_ID)
    parts = torch.randn(arch.vocab_size, arch.hidden_size), torch.randn(arch.vocab_size, arch.hidden_size)
    out = export_drafter(build_drafter(theirs, *parts, seed=0), theirs, {"path": "x"}, tmp_path / "other")
    target = TargetInfo("", out, arch, LAYER_IDS, MASK_ID, "", "", "")
    with pytest.raises(CheckpointError, match=rf"model\.init_from=.*other.*: the drafter has {field}={value!r} but this run "
                                              rf"has {getattr(arch, field)!r} \(the target's {field}\); its weights were trained for another target"):
        init_weights_for(out, cfg, target)
    same = export_drafter(build_drafter(describe_parts(cfg, arch, LAYER_IDS, MASK_ID), *parts, seed=0),
                          describe_parts(cfg, arch, LAYER_IDS, MASK_ID), {"path": "x"}, tmp_path / "same")
    assert set(init_weights_for(same, cfg, target)) == set(build_drafter(theirs, *parts).state_dict())


def test_init_from_takes_is_causal_false_for_full_layers_whose_drafter_leaves_it_unset(tmp_path):
    """A speculators drafter has no is_causal (it runs full layers bidirectionally, as is_causal=false
    says): a run with model.is_causal=false was refused 'set model.is_causal=None'. true is refused."""
    import torch

    from shared.errors import CheckpointError
    from shared.target import TargetInfo
    from stage2_train.model.drafter import build_drafter
    from stage2_train.serve.export import export_drafter
    from stage2_train.serve.load import init_weights_for

    arch, cfg = tiny_arch(), DrafterConfig(num_layers=1, block_size=8)
    d = describe_parts(cfg, arch, LAYER_IDS, MASK_ID)
    parts = torch.randn(arch.vocab_size, arch.hidden_size), torch.randn(arch.vocab_size, arch.hidden_size)
    out = export_drafter(build_drafter(d, *parts, seed=0), d, {"path": "x"}, tmp_path / "s", format="speculators")
    target = TargetInfo("", out, arch, LAYER_IDS, MASK_ID, "", "", "")
    assert init_weights_for(out, DrafterConfig(num_layers=1, block_size=8, is_causal=False), target)
    with pytest.raises(CheckpointError, match=r"the drafter has is_causal=None but this run has True \(model\.is_causal\)"):
        init_weights_for(out, DrafterConfig(num_layers=1, block_size=8, is_causal=True), target)


@pytest.mark.parametrize("edit, field", [
    ({"block_size": 6}, "block_size"),
    ({"dflash_config": {"mask_token_id": 5}}, "mask_token_id"),
    ({"dflash_config": {"target_layer_ids": [1, 2]}}, "target_layer_ids"),
    ({"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, "rope_theta"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps"),
])
def test_our_export_whose_config_was_edited_after_export_is_refused_naming_both_values(tmp_path, edit, field):
    """The engines build the drafter from config.json's fields, this pipeline from the description it
    recorded beside them: where they differ, eval and the export doctor would measure another drafter
    than the one served. An edited rms_norm_eps went through (every norm of the served drafter other)."""
    import json

    import torch

    from shared.errors import CheckpointError
    from stage2_train.model.drafter import build_drafter
    from stage2_train.serve.export import export_drafter
    from stage2_train.serve.load import folder_description

    arch = tiny_arch()
    d = describe_parts(DrafterConfig(num_layers=1, block_size=8), arch, LAYER_IDS, MASK_ID)
    parts = torch.randn(arch.vocab_size, arch.hidden_size), torch.randn(arch.vocab_size, arch.hidden_size)
    out = export_drafter(build_drafter(d, *parts, seed=0), d, {"path": "x"}, tmp_path / "e")
    config = json.loads((out / "config.json").read_text())
    config.update({**edit, "dflash_config": {**config["dflash_config"], **edit.get("dflash_config", {})}})
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"config\.json: the fields serving engines read say {field}=.*but the drafter's own "
                                              rf"description \(dflash_pipeline\.drafter\) says .*export again, or make them agree"):
        folder_description(out)


def test_a_speculators_config_without_block_size_reads_speculators_default_of_8(tmp_path):
    """speculators' DFlashSpeculatorConfig (and the DSpark / DFlash2 configs built on it) means 8 by a
    block_size it leaves out; read as z-lab's 16, eval and init_from built a drafter of another block
    (its weights fit any block size, so nothing else showed it)."""
    import json

    import torch

    from stage2_train.model.drafter import build_drafter
    from stage2_train.serve.export import export_drafter
    from stage2_train.serve.load import folder_description

    arch = tiny_arch()
    d = describe_parts(DrafterConfig(num_layers=1, block_size=8), arch, LAYER_IDS, MASK_ID)
    parts = torch.randn(arch.vocab_size, arch.hidden_size), torch.randn(arch.vocab_size, arch.hidden_size)
    out = export_drafter(build_drafter(d, *parts, seed=0), d, {"path": "x"}, tmp_path / "s", format="speculators")
    config = json.loads((out / "config.json").read_text())
    del config["dflash_pipeline"], config["block_size"]
    (out / "config.json").write_text(json.dumps(config))
    assert folder_description(out).block_size == 8


def test_a_drafter_folders_weights_file_loads_as_its_folder(tmp_path):
    """`eval --checkpoint EXPORT/model.safetensors` (the file a user points at) was read as a training
    checkpoint's: 'no drafter.json and no saved run config', naming no fix."""
    import torch

    from shared.target import TargetInfo
    from stage2_train.model.drafter import build_drafter
    from stage2_train.serve.export import export_drafter
    from stage2_train.serve.load import load_drafter

    arch = tiny_arch()
    d = describe_parts(DrafterConfig(num_layers=1, block_size=8), arch, LAYER_IDS, MASK_ID)
    parts = torch.randn(arch.vocab_size, arch.hidden_size), torch.randn(arch.vocab_size, arch.hidden_size)
    out = export_drafter(build_drafter(d, *parts, seed=0), d, {"path": "x"}, tmp_path / "e")
    target = TargetInfo("", out, arch, LAYER_IDS, MASK_ID, "", "", "")
    loaded = load_drafter(out / "model.safetensors", target, parts=parts)
    assert loaded.description == load_drafter(out, target, parts=parts).description
    assert loaded.weights_file == out / "model.safetensors"


def test_the_untrained_floor_of_a_projected_drafter_reads_the_features_through_its_projection():
    """A PCA drafter's projection is fitted from the data before training and never trained: the
    untrained drafter `eval` and bench/compare.py score beside it was built with a zero projection, a
    floor that reads none of the target's features, so 'trained vs untrained' measured the features too."""
    import numpy as np
    import torch

    from shared.config import load_run_config
    from stage2_train.model.drafter import build_drafter
    from stage2_train.serve.evaluation import HeldoutSet

    arch = tiny_arch()
    d = describe_parts(DrafterConfig(num_layers=1, block_size=8, feature_projection="pca", projection_dim=32), arch, LAYER_IDS, MASK_ID)
    parts = torch.randn(arch.vocab_size, arch.hidden_size), torch.randn(arch.vocab_size, arch.hidden_size)
    trained = build_drafter(d, *parts, seed=1)
    trained.set_projection(torch.randn(32, len(LAYER_IDS) * arch.hidden_size))
    heldout = HeldoutSet(target=None, reader=None, heldout=np.array([]), parts=parts)
    floor = heldout.untrained(load_run_config(None, []), d, trained=trained)
    assert torch.equal(floor.projection_RF, trained.projection_RF)
    assert not torch.equal(floor.fc.weight, trained.fc.weight)  # the rest is untrained


def test_the_export_doctor_names_an_rms_norm_eps_edited_after_export(tmp_path):
    """The doctor compared the other fields engines read with the recorded description, not
    rms_norm_eps: an edited one was found only when decoding failed ('cannot tell', exit 3)."""
    import json

    import torch

    from stage2_train.model.drafter import build_drafter
    from stage2_train.serve.export import export_drafter
    from stage2_train.serve.export_checks import check_description
    from stage2_train.serve.export_view import read_export

    arch = tiny_arch()
    d = describe_parts(DrafterConfig(num_layers=1, block_size=8), arch, LAYER_IDS, MASK_ID)
    parts = torch.randn(arch.vocab_size, arch.hidden_size), torch.randn(arch.vocab_size, arch.hidden_size)
    for fmt in ("zlab", "speculators"):
        out = export_drafter(build_drafter(d, *parts, seed=0), d, {"path": "x"}, tmp_path / fmt, format=fmt)
        assert check_description(read_export(out)) == []
        config = json.loads((out / "config.json").read_text())
        (config["transformer_layer_config"] if fmt == "speculators" else config)["rms_norm_eps"] = 1e-5
        (out / "config.json").write_text(json.dumps(config))
        [finding] = check_description(read_export(out))
        assert finding.severity == "error" and finding.field.endswith("rms_norm_eps")
        assert "is 1e-05, but the drafter was trained with 1e-06" in finding.problem
