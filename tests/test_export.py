"""The exported folder is what DFlash loaders read, and it reloads into the same drafter.

.venv/bin/python -m pytest tests/test_export.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from shared.config import build_run_config
from shared.errors import CheckpointError
from shared.target import TargetArch
from stage2_train.commands import cmd_export
from stage2_train.data.batch import DrafterBatch
from stage2_train.model.config import DrafterConfig
from stage2_train.model.description import describe_parts
from stage2_train.model.drafter import DFlashDrafter
from stage2_train.serve.export import export_drafter
from stage2_train.serve.load import folder_description, init_weights_for, load_exported
from stage2_train.train.checkpoint.saver import Checkpointer
from stage2_train.train.checkpoint.select import read_model_weights
from stage2_train.train.config import CheckpointConfig

MASK_ID = 99
LAYER_IDS = [1, 3, 5]


def arch_8_layers() -> TargetArch:
    return TargetArch(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def make_drafter(arch, cfg, seed=0):
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg, arch, len(LAYER_IDS), MASK_ID)
    embed, head = (
        torch.randn(arch.vocab_size, arch.hidden_size),
        torch.randn(arch.vocab_size, arch.hidden_size),
    )
    model.set_frozen_parts(embed, head)
    return model.eval(), embed, head


def one_sample_batch(arch, block_size, seed=1) -> DrafterBatch:
    gen = torch.Generator().manual_seed(seed)
    T, anchors = 20, [3, 9, 14]
    ids = torch.randint(0, MASK_ID, (T,), generator=gen)
    blocks = torch.full((len(anchors), block_size), MASK_ID)
    blocks[:, 0] = ids[anchors]
    return DrafterBatch(
        context_TF=torch.randn(T, len(LAYER_IDS) * arch.hidden_size, generator=gen),
        context_pos_T=torch.arange(T),
        context_seq_T=torch.zeros(T, dtype=torch.long),
        block_ids_NB=blocks,
        block_seq_N=torch.zeros(len(anchors), dtype=torch.long),
        anchor_pos_N=torch.tensor(anchors),
        labels_NB=torch.full((len(anchors), block_size), -100),
        num_samples=1,
        num_tokens=T,
    )


def reference_tensor_names(num_layers: int) -> set[str]:
    """The names the public DFlash drafters ship (z-lab/dflash DFlashDraftModel's parameters)."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for n in range(num_layers):
        names |= {f"layers.{n}.input_layernorm.weight", f"layers.{n}.post_attention_layernorm.weight"}
        names |= {f"layers.{n}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"layers.{n}.self_attn.{p}_norm.weight" for p in "qk"}
        names |= {f"layers.{n}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    return names


TARGET_INFO = {"path": "/models/target", "weights_sha256": "ab" * 32, "mask_token": "<|MASK|>"}


@pytest.fixture
def exported(tmp_path):
    arch = arch_8_layers()
    cfg = DrafterConfig(num_layers=2, block_size=8, init_std=0.2)
    drafter, embed, head = make_drafter(arch, cfg)
    out = export_drafter(drafter, describe_parts(cfg, arch, LAYER_IDS, MASK_ID), TARGET_INFO, tmp_path / "export")
    return out, drafter, embed, head, arch, cfg


def test_config_has_the_dflash_fields_the_loaders_read(exported):
    out, _, _, _, arch, cfg = exported
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 8
    # The TARGET's layer count (reference: build_target_layer_ids(num_target_layers, num_draft_layers)),
    # not the number of feature layers (3) nor the drafter's (2).
    assert config["num_target_layers"] == 8
    assert config["num_hidden_layers"] == 2
    assert config["dflash_config"] == {
        "target_layer_ids": LAYER_IDS,
        "mask_token_id": MASK_ID,
        "mask_token": "<|MASK|>",
    }
    expected = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "max_position_embeddings": 512,
        "vocab_size": 128,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "attention_bias": False,
        "layer_types": ["full_attention", "full_attention"],
    }
    assert {k: config[k] for k in expected} == expected
    target = config["dflash_pipeline"]["target"]
    assert target["path"] == "/models/target" and target["weights_sha256"] == "ab" * 32
    assert target["num_hidden_layers"] == 8 and config["dflash_pipeline"]["format_version"] == 1


def test_weights_have_the_reference_names_and_no_embedding_or_head(exported):
    out = exported[0]
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
        assert fh.metadata() == {"format": "pt"}
        dtypes = {fh.get_tensor(n).dtype for n in names}
        fc_shape = tuple(fh.get_tensor("fc.weight").shape)
    assert names == reference_tensor_names(2)
    assert dtypes == {torch.bfloat16}
    assert fc_shape == (64, 3 * 64)


def test_layers_load_into_transformers_qwen3_modules(exported):
    """transformers' own Qwen3Config reads the file, and its Qwen3DecoderLayer (whose parameter
    names the reference's DFlash layer reuses) takes our layer tensors strictly, shapes included."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    out = exported[0]
    config = Qwen3Config.from_pretrained(out)
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (2, 64, 16)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 2, 96)
    assert (
        config.rope_parameters["rope_theta"] == 1_000_000.0
        and config.rope_parameters["rope_type"] == "default"
    )
    assert config.block_size == 8 and config.num_target_layers == 8
    assert config.dflash_config["target_layer_ids"] == LAYER_IDS and config.tie_word_embeddings is False
    weights, _ = read_model_weights(out)
    for n in range(config.num_hidden_layers):
        layer = Qwen3DecoderLayer(config, n)
        prefix = f"layers.{n}."
        layer.load_state_dict(
            {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}, strict=True
        )


def test_reload_gives_identical_logits(exported, tmp_path):
    out, drafter, embed, head, arch, cfg = exported
    batch = one_sample_batch(arch, cfg.block_size)
    with torch.no_grad():
        # float32 export: bit-identical.
        exact = export_drafter(drafter, describe_parts(cfg, arch, LAYER_IDS, MASK_ID), TARGET_INFO, tmp_path / "fp32", dtype="float32"
        )
        reloaded = load_exported(exact, embed, head)
        assert torch.equal(reloaded.logits(reloaded(batch)), drafter.logits(drafter(batch)))
        # bf16 export (the default): identical to the drafter cast to bf16.
        reloaded = load_exported(out, embed, head)
        assert reloaded.fc.weight.dtype == torch.bfloat16
        cast = DFlashDrafter(cfg, arch, len(LAYER_IDS), MASK_ID)
        cast.load_state_dict(drafter.state_dict())
        cast.to(torch.bfloat16).set_frozen_parts(embed, head)
        assert torch.equal(reloaded.logits(reloaded(batch)), cast.eval().logits(cast(batch)))


def test_an_export_over_another_tools_sharded_weights_is_refused(exported, tmp_path):
    """vLLM and SGLang load the shards a model.safetensors.index.json lists when there is one: a new
    model.safetensors written beside an older sharded drafter would never be served."""
    out, drafter, _, _, arch, cfg = exported
    description = describe_parts(cfg, arch, LAYER_IDS, MASK_ID)
    # Exporting again over our own export is fine (the same file names).
    assert export_drafter(drafter, description, TARGET_INFO, out) == out
    old = tmp_path / "old"
    old.mkdir()
    (old / "model-00001-of-00002.safetensors").write_bytes(b"")
    (old / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"fc.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"other weights \(model-00001-of-00002.safetensors, model.safetensors.index.json\)"):
        export_drafter(drafter, description, TARGET_INFO, old)
    assert sorted(p.name for p in old.iterdir()) == ["model-00001-of-00002.safetensors", "model.safetensors.index.json"]


def test_an_export_of_a_newer_format_version_is_refused(exported):
    """The export is versioned (dflash_pipeline.format_version) and the reader refuses a version it
    does not know, rather than read a newer export's fields as this version means them."""
    out, *_ = exported
    rewrite_config(out, lambda config: config["dflash_pipeline"].update(format_version=2))
    with pytest.raises(CheckpointError, match="format_version 2, this code reads up to 1"):
        folder_description(out)


def test_export_refuses_a_config_that_does_not_describe_the_drafter(exported, tmp_path):
    _, drafter, _, _, arch, cfg = exported
    with pytest.raises(ValueError, match="is not this drafter's"):
        export_drafter(drafter, describe_parts(cfg, arch, [1, 3], MASK_ID), TARGET_INFO, tmp_path / "x")
    with pytest.raises(ValueError, match="block 16"):
        export_drafter(drafter, describe_parts(DrafterConfig(num_layers=2, block_size=16), arch, LAYER_IDS, MASK_ID), TARGET_INFO, tmp_path / "x")
    with pytest.raises(ValueError, match="mask 7"):
        export_drafter(drafter, describe_parts(cfg, arch, LAYER_IDS, 7), TARGET_INFO, tmp_path / "x")


def test_cmd_export_end_to_end(tmp_path, tiny_target_dir):
    """From a run's latest checkpoint with the tiny 6-layer Llama target (SmolLM2 tokenizer)."""
    from shared.target_parts import load_embed_and_head

    arch = TargetArch.from_dir(tiny_target_dir)
    cfg_model = DrafterConfig(num_layers=1, block_size=4, init_std=0.2)
    torch.manual_seed(5)
    trained = DFlashDrafter(cfg_model, arch, 3, 16)
    ckpt = Checkpointer(CheckpointConfig(), tmp_path / "run" / "checkpoints")
    description = describe_parts(cfg_model, arch, [1, 2, 3], 16)
    ckpt.save(50, lambda: {"model": trained.state_dict(), "trainer": {"step": 50}, "drafter": description.to_dict()}, blocking=True)
    step = tmp_path / "run" / "checkpoints" / "step_000050"
    data = {
        "run_dir": str(tmp_path / "run"),
        "target": {"path": str(tiny_target_dir), "num_feature_layers": 3},
        "model": {"num_layers": 1, "block_size": 4, "init_std": 0.2},
    }
    cfg = build_run_config(data)
    result = cmd_export(cfg)
    out = tmp_path / "run" / "export"
    assert result["out_dir"] == str(out) and result["checkpoint"] == str(step / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    assert config["num_target_layers"] == 6 and config["block_size"] == 4 and config["num_hidden_layers"] == 1
    assert config["dflash_config"] == {
        "target_layer_ids": [1, 2, 3],
        "mask_token_id": 16,
        "mask_token": "<empty_output>",
    }
    assert config["dflash_pipeline"]["drafter"] == {**description.to_dict(), "target_weights_sha256": None}
    assert len(config["dflash_pipeline"]["target"]["weights_sha256"]) == 64
    assert (out / "dflash_pipeline_config.yaml").is_file()
    reloaded = load_exported(out, *load_embed_and_head(tiny_target_dir))
    for name, value in trained.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name].float(), value.to(torch.bfloat16).float()), name


# ---- reading published drafters (z-lab's two layouts) -------------------------------------------------
def rewrite_config(folder, edit):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    return folder


def test_the_newer_zlab_layout_with_dflash_fields_inside_dflash_config_loads(exported):
    out, drafter, embed, head, arch, cfg = exported

    def newer_layout(config):
        block, num_target = config.pop("block_size"), config.pop("num_target_layers")
        config["dflash_config"].update(block_size=block, num_target_layers=num_target)

    rewrite_config(out, newer_layout)
    spec = folder_description(out)
    assert (spec.block_size, list(spec.target_layer_ids), spec.mask_token_id) == (8, LAYER_IDS, MASK_ID)
    batch = one_sample_batch(arch, cfg.block_size)
    with torch.no_grad():
        cast = DFlashDrafter(cfg, arch, len(LAYER_IDS), MASK_ID)
        cast.load_state_dict(drafter.state_dict())
        cast.to(torch.bfloat16).set_frozen_parts(embed, head)
        reloaded = load_exported(out, embed, head)
        assert torch.equal(reloaded.logits(reloaded(batch)), cast.eval().logits(cast(batch)))


def test_layer_ids_follow_zlab_rule_when_only_num_target_layers_is_given(exported):
    out = exported[0]
    rewrite_config(out, lambda c: c["dflash_config"].pop("target_layer_ids"))
    rewrite_config(out, lambda c: c["dflash_pipeline"].pop("drafter"))  # as z-lab writes it: no description of ours
    assert list(folder_description(out).target_layer_ids) == [1, 5]  # 2 draft layers over 8 target layers: 1 .. L-3


def foreign(config: dict, **fields) -> None:
    """`config` as another tool writes it (no description of ours), with `fields` set."""
    config["dflash_pipeline"].pop("drafter")
    config.update(fields)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["dflash_config"].pop("mask_token_id"), r"dflash_config\.mask_token_id is missing"),
        (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"rope type 'yarn'"),
        (lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), r"rope type 'yarn'"),
        (lambda c: c.update(layer_types=["sliding_attention", "full_attention"]), r"use_sliding_window=False, sliding_window=None"),
        (lambda c: c.update(layer_types=["chunked_attention", "full_attention"]), r"layer_types \['chunked_attention'\]"),
        (lambda c: c.update(layer_types=["full_attention"]), r"layer_types lists 1 layers"),
        (lambda c: c.update(use_sliding_window=True, layer_types=None), r"use_sliding_window=true without layer_types"),
        (lambda c: c.update(is_causal="yes"), r"is_causal must be true, false or absent"),
        (lambda c: c.update(attention_bias=True), r"attention_bias=true"),
        (lambda c: c.pop("hidden_size"), r"`hidden_size` missing"),
        # a foreign drafter's 0 became num_attention_heads (`or heads`): another shape, with nothing said
        (lambda c: foreign(c, num_key_value_heads=0),
         r"config\.json: num_key_value_heads is 0, not an integer >= 1; leave it out to mean num_attention_heads$"),
        (lambda c: foreign(c, num_key_value_heads="2"), r"num_key_value_heads is '2', not an integer >= 1"),
        (lambda c: foreign(c, num_key_value_heads=3), r"num_key_value_heads=3 does not divide num_attention_heads=4"),
        (lambda c: foreign(c, head_dim=0), r"head_dim is 0, not an integer >= 1; leave it out to mean hidden_size // num_attention_heads"),
        (lambda c: foreign(c, num_attention_heads=0), r"num_attention_heads is 0, not an integer >= 1$"),
    ],
)
def test_what_the_drafter_cannot_compute_is_refused_naming_the_field(exported, edit, message):
    out = rewrite_config(exported[0], edit)
    with pytest.raises(CheckpointError, match=message):
        folder_description(out)


def test_init_from_checks_the_drafter_against_the_target_and_model_config(exported):
    from shared.target import TargetInfo

    out, drafter, _, _, arch, cfg = exported
    target = TargetInfo("", out, arch, LAYER_IDS, MASK_ID, "0" * 64, "0" * 64, "0" * 64)
    weights = init_weights_for(out, cfg, target)
    assert sorted(weights) == sorted(drafter.state_dict())
    assert torch.equal(weights["fc.weight"].float(), drafter.fc.weight.to(torch.bfloat16).float())
    for field, other, setting in (
        ("target_layer_ids", TargetInfo("", out, arch, [1, 2, 3], MASK_ID, "", "", ""), "target.layer_ids"),
        ("mask_token_id", TargetInfo("", out, arch, LAYER_IDS, 7, "", "", ""), "target.mask_token_id"),
    ):
        with pytest.raises(CheckpointError, match=rf"has {field}=.* \({setting}\); set {setting}="):
            init_weights_for(out, cfg, other)
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=2 but this run has 1 \(model\.num_layers\)"):
        init_weights_for(out, DrafterConfig(num_layers=1, block_size=8), target)
    wide = TargetInfo("", out, TargetArch(**{**arch.__dict__, "hidden_size": 128}), LAYER_IDS, MASK_ID, "", "", "")
    with pytest.raises(CheckpointError, match=r"hidden_size=64 but this run has 128"):
        init_weights_for(out, cfg, wide)


def test_a_sliding_window_drafter_exports_and_loads_back_equal(tmp_path):
    """layer_types / sliding_window / use_sliding_window / is_causal go where z-lab and SpecForge read
    them (top level); reading the folder back builds a drafter that computes the same."""
    from testkit.drafter import three_sample_batch, tiny_arch, tiny_drafter

    arch = tiny_arch(kv_heads=2)
    types = ("sliding_attention", "sliding_attention", "full_attention")
    drafter = tiny_drafter(arch, num_layers=3, layer_types=types, sliding_window=5, attention="sdpa")
    cfg = drafter.cfg
    export_drafter(drafter, describe_parts(cfg, arch, [1, 3], MASK_ID), {"path": "x"}, tmp_path / "out", dtype="float32")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["layer_types"], config["sliding_window"], config["use_sliding_window"]) == (list(types), 5, True)
    assert "is_causal" not in config  # unset: sliding layers causal in the block, full ones not (z-lab's default)
    spec = folder_description(tmp_path / "out")
    assert (spec.layer_types, spec.sliding_window, spec.is_causal) == (types, 5, None)
    loaded = load_exported(tmp_path / "out", drafter.embed_VH, drafter.lm_head_VH)
    loaded.attention_backend = drafter.attention_backend = "sdpa"
    batch = three_sample_batch(arch)
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch), drafter(batch))


def test_the_speculators_format_round_trips_into_init_from(exported, tmp_path):
    """export --format speculators: speculators' config.json over the same tensors (its converter's
    mapping: ids + 1, verifier as a local folder); read back, it gives the same drafter spec and
    weights. (tests/test_peers.py loads it in speculators' own class where speculators is installed.)"""
    from stage2_train.serve.load import folder_description as spec_of

    out, drafter, _, _, arch, cfg = exported
    again = tmp_path / "spec"
    export_drafter(drafter, describe_parts(cfg, arch, LAYER_IDS, MASK_ID), {"name": "Qwen/Qwen3-8B", "hub_id": "Qwen/Qwen3-8B",
                   "verifier": "Qwen/Qwen3-8B", "architectures": ["Qwen3ForCausalLM"]}, again, format="speculators")
    config = json.loads((again / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == [i + 1 for i in LAYER_IDS]
    assert config["speculators_config"]["verifier"] == {"name_or_path": "Qwen/Qwen3-8B", "architectures": ["Qwen3ForCausalLM"]}
    assert config["transformer_layer_config"]["num_hidden_layers"] == cfg.num_layers and config["block_size"] == cfg.block_size
    zlab, spec = spec_of(out), spec_of(again)
    assert spec == zlab
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_a_drafter_trained_with_is_causal_false_reads_back_from_its_speculators_export(tmp_path):
    """model.is_causal=false on full layers is speculators' own rule (bidirectional in the block), so
    the export has nothing to write for it; reading it back is the same drafter, not an "edited" file."""
    arch = arch_8_layers()
    cfg = DrafterConfig(num_layers=2, block_size=8, is_causal=False)
    drafter, embed, head = make_drafter(arch, cfg)
    out = export_drafter(drafter, describe_parts(cfg, arch, LAYER_IDS, MASK_ID), TARGET_INFO, tmp_path / "s", format="speculators")
    assert "is_causal" not in json.dumps(json.loads((out / "config.json").read_text())["transformer_layer_config"])
    assert folder_description(out).is_causal is False
    batch = one_sample_batch(arch, cfg.block_size)
    with torch.no_grad():
        torch.testing.assert_close(load_exported(out, embed, head)(batch), drafter.to(torch.bfloat16)(batch))


def test_a_sliding_drafter_is_refused_in_the_speculators_format(tmp_path):
    from testkit.drafter import tiny_arch, tiny_drafter

    arch = tiny_arch(kv_heads=2)
    drafter = tiny_drafter(arch, num_layers=2, layer_types=("sliding_attention", "full_attention"), sliding_window=8)
    with pytest.raises(CheckpointError, match="speculators computes them"):
        export_drafter(drafter, describe_parts(drafter.cfg, arch, [1, 3], MASK_ID), {"path": "x"}, tmp_path / "o", format="speculators")


def test_export_builds_the_drafter_its_checkpoint_describes(tmp_path, tiny_target_dir, capsys):
    """A drafter trained with sliding_window=32: a command line giving 8 is refused naming both; a
    config file giving 8 is ignored (and said): the export is the trained drafter, window 32."""
    import yaml

    from shared.config import load_run_config
    from shared.errors import ConfigError

    arch = TargetArch.from_dir(tiny_target_dir)
    trained_cfg = DrafterConfig(num_layers=1, block_size=4, layer_types=("sliding_attention",), sliding_window=32)
    torch.manual_seed(5)
    trained = DFlashDrafter(trained_cfg, arch, 3, 16)
    description = describe_parts(trained_cfg, arch, [1, 2, 3], 16)
    ckpt = Checkpointer(CheckpointConfig(), tmp_path / "run" / "checkpoints")
    ckpt.save(5, lambda: {"model": trained.state_dict(), "drafter": description.to_dict()}, blocking=True)
    common = [f"run_dir={tmp_path / 'run'}", f"target.path={tiny_target_dir}", "target.num_feature_layers=3"]
    given = ["model.block_size=4", "model.layer_types=[sliding_attention]", "model.sliding_window=8"]
    with pytest.raises(ConfigError, match=r"model\.sliding_window: the drafter has 32, the command line gives 8"):
        cmd_export(load_run_config(None, common + given))
    file = tmp_path / "other.yaml"
    file.write_text(yaml.safe_dump({"model": {"block_size": 4, "layer_types": ["sliding_attention"], "sliding_window": 8}}))
    cmd_export(load_run_config(file, common))
    config = json.loads((tmp_path / "run" / "export" / "config.json").read_text())
    assert (config["sliding_window"], config["layer_types"], config["block_size"]) == (32, ["sliding_attention"], 4)
    err = capsys.readouterr().err
    assert "model.sliding_window: the drafter has 32, the config gives (ignored) 8" in err
    assert "does not read it" not in err  # the config's defaults of settings this drafter never reads: no note
    for given, named in ((["model.projection_dim=32"], r"model\.projection_dim: the drafter does not read it"),
                         (["target.layer_ids=[0,2,3]"], r"target\.layer_ids: the drafter has \[1, 2, 3\], the command line gives \[0, 2, 3\]"),
                         (["target.mask_token_id=5"], r"target\.mask_token_id: the drafter has 16, the command line gives 5")):
        with pytest.raises(ConfigError, match=named):
            cmd_export(load_run_config(None, common + given))


def test_an_export_is_publishable(tmp_path, tiny_target_dir, monkeypatch):
    """Files readable by others, no machine path in config.json, a model card with what the run
    recorded, and --push-to-hub through huggingface_hub (tested up to the library's call)."""
    import os
    import stat

    import huggingface_hub

    arch = TargetArch.from_dir(tiny_target_dir)
    cfg_model = DrafterConfig(num_layers=1, block_size=4)
    trained = DFlashDrafter(cfg_model, arch, 3, 16)
    description = describe_parts(cfg_model, arch, [1, 2, 3], 16)
    Checkpointer(CheckpointConfig(), tmp_path / "run" / "checkpoints").save(
        7, lambda: {"model": trained.state_dict(), "drafter": description.to_dict()}, blocking=True
    )
    calls = []

    class FakeApi:
        def create_repo(self, repo_id, **kw):
            calls.append(("create_repo", repo_id, kw))

        def upload_folder(self, **kw):
            calls.append(("upload_folder", kw["repo_id"], sorted(p.name for p in Path(kw["folder_path"]).iterdir()), kw["ignore_patterns"],
                          kw.get("delete_patterns")))
            return "https://huggingface.co/me/drafter/commit/abc"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    cfg = build_run_config({"run_dir": str(tmp_path / "run"), "target": {"path": str(tiny_target_dir), "num_feature_layers": 3},
                            "model": {"num_layers": 1, "block_size": 4}})
    result = cmd_export(cfg, push_to_hub="me/drafter")
    out = tmp_path / "run" / "export"
    umask = os.umask(0)
    os.umask(umask)
    for name in ("config.json", "model.safetensors", "README.md"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o666 & ~umask, name  # 0644 under the usual umask 022
    text = (out / "config.json").read_text()
    assert str(tmp_path) not in text and str(tiny_target_dir) not in text  # no machine path
    assert json.loads(text)["dflash_pipeline"]["target"]["name"] == tiny_target_dir.name
    card = (out / "README.md").read_text()
    assert "block size 4" in card and "[1, 2, 3]" in card and "7 optimizer steps" in card and "vllm serve" in card
    assert "No held-out evaluation was recorded" in card
    assert result["pushed_to"] == "me/drafter" and calls[0][:2] == ("create_repo", "me/drafter")
    assert calls[1][:2] == ("upload_folder", "me/drafter") and calls[1][3] == ["dflash_pipeline_config.yaml"]
    assert "README.md" in calls[1][2]
    # an earlier push's weights (another drafter's shards and index) go in the same commit: vLLM would load them
    assert {"*.safetensors", "*.safetensors.index.json"} <= set(calls[1][4])


def test_a_speculators_export_names_a_verifier_speculators_can_load(capsys):
    """speculators loads the verifier's embedding and LM head from verifier.name_or_path: the Hub id
    the target came from or was saved from, never a bare folder name without a warning."""
    from stage2_train.commands import verifier_name

    assert verifier_name("Qwen/Qwen3-8B", {}, "Qwen3-8B", "speculators") == "Qwen/Qwen3-8B"
    assert capsys.readouterr().err == ""
    # A local folder saved from a Hub model may be a fine-tune of it, whose head the base's is not: said.
    assert verifier_name(None, {"_name_or_path": "Qwen/Qwen3-8B"}, "my-copy", "speculators") == "Qwen/Qwen3-8B"
    assert "read from the config.json of the local target 'my-copy'" in capsys.readouterr().err
    assert verifier_name(None, {"_name_or_path": "Qwen/Qwen3-8B"}, "my-copy", "zlab") == "Qwen/Qwen3-8B"
    assert capsys.readouterr().err == ""
    assert verifier_name(None, {"_name_or_path": "/models/q"}, "q", "speculators") == "q"
    assert "speculators_config.verifier.name_or_path is 'q'" in capsys.readouterr().err
    assert verifier_name(None, {}, "q", "zlab") == "q" and capsys.readouterr().err == ""


def test_export_and_eval_before_training_say_to_train(tiny_target_dir, tmp_path):
    """`export` (and `eval`) on a run that never trained read the missing checkpoints folder as a weights
    file: "no drafter weights at .../checkpoints: expected model.safetensors", with no way on. They now
    say the run has not trained and name the command that does."""
    from stage2_train.commands import cmd_eval

    cfg = build_run_config({"run_dir": str(tmp_path / "run"), "target": {"path": str(tiny_target_dir), "num_feature_layers": 3}})
    expected = (f"no checkpoint in {tmp_path / 'run' / 'checkpoints'} (no such folder: this run has not trained yet); train "
                f"first (`python -m stage2_train train`), or name one with --checkpoint")
    for command in (lambda: cmd_export(cfg), lambda: cmd_eval(cfg)):
        with pytest.raises(CheckpointError) as refused:
            command()
        assert str(refused.value) == expected
    with pytest.raises(CheckpointError, match=r"^no drafter weights at .*elsewhere: expected model\.safetensors$"):
        cmd_export(cfg, checkpoint=str(tmp_path / "elsewhere"))  # a path given is read as given
