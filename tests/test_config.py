"""Config system: unknown keys, bad values, overrides, presets, the resolved copy, recipe checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shared.config import apply_overrides, load_run_config, parse_override

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_load_and_sections_are_typed():
    cfg = load_run_config(ROOT / "configs/default.yaml", [])
    assert cfg.run_dir == "runs/default"
    assert cfg.extract.top_k == 64
    assert cfg.store.dtype == "bf16"
    assert cfg.target.num_feature_layers == 3


@pytest.mark.parametrize("preset", ["default.yaml", "cpu-long.yaml", "qwen3-8b.yaml", "llama-3.1-8b.yaml"])
def test_every_preset_validates(preset):
    cfg = load_run_config(ROOT / "configs" / preset, [])
    assert cfg.store.dtype in ("bf16", "fp8")


def test_presets_inherit_and_differ_in_few_fields():
    qwen = load_run_config(ROOT / "configs/qwen3-8b.yaml", [])
    assert qwen.target.mask_token_id == 151669
    assert qwen.extract.top_k == 64  # inherited from recipe.yaml


def test_unknown_key_is_rejected_with_dotted_name():
    with pytest.raises(ValueError, match=r"extract\.topk: unknown key"):
        load_run_config(ROOT / "configs/default.yaml", ["extract.topk=5"])


def test_unknown_section_is_rejected():
    with pytest.raises(ValueError, match=r"trian: unknown top-level key"):
        load_run_config(None, ["trian.lr=1"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("extract.top_k=0", r"extract\.top_k must be in 1\.\.1024, got 0"),
        ("extract.top_k=abc", r"extract\.top_k must be an integer, got 'abc'"),
        ("store.dtype=fp2", r"store\.dtype must be one of \['bf16', 'fp8', 'fp4'\], got 'fp2'"),
        ("generate.top_p=1.5", r"generate\.top_p must be in \(0, 1\], got 1\.5"),
        ("data.on_bad_row=ignore", r"data\.on_bad_row must be one of"),
        ("target.layer_ids=[3,1]", r"target\.layer_ids must be distinct, ascending"),
        ("data.regenerate=yes please", r"data\.regenerate must be true or false"),
    ],
)
def test_bad_values_name_key_and_value(override, message):
    with pytest.raises(ValueError, match=message):
        load_run_config(ROOT / "configs/default.yaml", [override])


def test_override_parsing():
    assert parse_override("generate.temperature=1e-4") == (["generate", "temperature"], "1e-4")
    assert parse_override("target.layer_ids=[1, 5]") == (["target", "layer_ids"], [1, 5])
    assert parse_override("run_dir=/tmp/x") == (["run_dir"], "/tmp/x")
    with pytest.raises(ValueError, match="must look like key=value"):
        parse_override("extract.top_k")
    with pytest.raises(ValueError, match="top-level key or section.key"):
        parse_override("a.b.c=1")
    data = apply_overrides({"extract": {"top_k": 3}}, ["extract.top_k=5", "seed=7"])
    assert data == {"extract": {"top_k": 5}, "seed": 7}


def test_float_fields_accept_yaml_exponent_strings():
    cfg = load_run_config(ROOT / "configs/default.yaml", ["generate.temperature=1e-1"])
    assert cfg.generate.temperature == pytest.approx(0.1)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_run_config(ROOT / "configs/default.yaml", ["extract.top_k=7"])
    path = cfg.write_resolved(tmp_path / "resolved.yaml")
    again = load_run_config(path, [])
    assert again.to_dict() == cfg.to_dict()
    assert yaml.safe_load(path.read_text())["extract"]["top_k"] == 7


def test_check_command_warns_on_recipe_departures():
    out = subprocess.run(
        [sys.executable, "-m", "stage1_extract", "check", "generate.temperature=1.0"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    assert "top_k: 64" in out.stdout
    assert "WARNING: generate: temperature=1.0" in out.stderr


def test_cli_reports_config_errors_without_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "stage1_extract", "plan", "extract.top_k=-1"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "error: extract.top_k must be in 1..1024, got -1" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("preset", ["qwen3-8b.yaml", "llama-3.1-8b.yaml"])
def test_the_8b_presets_follow_the_recipe(preset):
    """The CPU default departs from the recipe for cost; presets that inherit it must not."""
    assert load_run_config(ROOT / "configs" / preset, []).recipe_warnings() == []


def test_check_names_every_measured_alternative_the_config_does_not_use(hub_8b):
    """The 8B presets keep the recipe; `check` names each lever beside it, and drops the ones in use."""
    recipe = load_run_config(ROOT / "configs" / "qwen3-8b.yaml", [])
    keys = [line.split("=")[0] for line in recipe.alternatives()]
    assert keys == [
        "store.dtype", "model.variant", "model.layer_types", "model.feature_projection", "loss.weighting",
        "loss.distill_positions", "optim.name", "checkpoint.keep_best",
    ]
    chosen = load_run_config(
        ROOT / "configs" / "qwen3-8b.yaml",
        ["store.dtype=fp4", "model.variant=dflash2", "loss.weighting=dpace", "optim.name=muon", "checkpoint.keep_best=true"],
    )
    assert [line.split("=")[0] for line in chosen.alternatives()] == [
        "model.layer_types", "model.feature_projection", "loss.distill_positions",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "stage2_train", "check", "--config", "configs/qwen3-8b.yaml"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    assert "# alternatives to the recipe" in out.stderr and "#   loss.weighting=dpace: online tau +0.11" in out.stderr


def test_every_field_of_every_section_documents_itself():
    """`check --explain` is the config's documentation: every key needs a description (and one that
    belongs to it: a docstring placed under the wrong field would describe its neighbour)."""
    from shared.config import registered_sections

    missing = [key for cls in registered_sections().values() for key, _, _, doc in cls.explain() if not doc.strip()]
    assert missing == []
    docs = {key: doc for cls in registered_sections().values() for key, _, _, doc in cls.explain()}
    assert "MASK" in docs["target.mask_token_id"] and "pickle" in docs["target.allow_pickle_weights"]
    assert "recompute" in docs["model.activation_checkpointing"] and "drafter folder" in docs["model.init_from"]


def preset_sources(path: Path) -> dict[str, Path]:
    """Dotted key -> the preset file whose value wins, following `inherit:` as the loader does."""
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    bases = data.pop("inherit", None) or []
    out: dict[str, Path] = {}
    for base in [bases] if isinstance(bases, str) else bases:
        out.update(preset_sources(path.parent / base))
    for section, values in data.items():
        keys = [f"{section}.{k}" for k in values] if isinstance(values, dict) else [section]
        out.update(dict.fromkeys(keys, path))
    return out


@pytest.mark.parametrize("preset", ["qwen3-8b.yaml", "llama-3.1-8b.yaml"])
def test_a_gpu_preset_takes_nothing_from_a_cpu_preset(preset):
    """The 8B presets stand on the published recipe (recipe.yaml) and their own target and paths:
    every value they take from a CPU preset (default.yaml, cpu-long.yaml) is listed here (none)."""
    cpu = {ROOT / "configs" / "default.yaml", ROOT / "configs" / "cpu-long.yaml"}
    sources = preset_sources(ROOT / "configs" / preset)
    assert sorted(k for k, src in sources.items() if src in cpu) == []
    assert sources["log.every_steps"].name == "recipe.yaml" and sources["sampler.micro_batch_tokens"].name == "recipe.yaml"
    cfg = load_run_config(ROOT / "configs" / preset, [])
    assert (cfg.log.every_steps, cfg.generate.rows_per_part, cfg.train.cpu_threads) == (10, 1024, 0)
    assert cfg.recipe_warnings() == []


def test_a_users_config_anywhere_inherits_a_preset_by_name(tmp_path, hub_8b):
    """The README's quick start: a config of the user's own that inherits the published preset."""
    mine = tmp_path / "elsewhere" / "my-qwen3.yaml"
    mine.parent.mkdir()
    mine.write_text("inherit: qwen3-8b\nrun_dir: runs/my-qwen3\ndata:\n  path: /data/sharegpt.jsonl\n")
    cfg = load_run_config(mine)
    assert cfg.target.path == "Qwen/Qwen3-8B" and cfg.run_dir == "runs/my-qwen3" and cfg.model.num_layers == 5
    assert cfg.value("data.path") == "/data/sharegpt.jsonl" and cfg.recipe_warnings() == []


def test_settings_nothing_reads_are_said_at_check_and_train():
    """A sweep over model.sliding_window with no sliding layer, or over a DSpark head on a DFlash
    drafter, is a sweep over nothing: each such value is named with why (the presets give none)."""
    import stage2_train  # noqa: F401 - its rules

    given = ["model.sliding_window=4", "model.projection_dim=32", "model.markov_rank=8", "loss.selector_weight=2",
             "optim.muon_lr=0.01", "eval.confidence_stop=0.5"]
    warnings = [w for w in load_run_config("configs/default.yaml", given).recipe_warnings() if "does nothing" in w]
    assert warnings == [
        "model.sliding_window=4 does nothing: no layer of model.layer_types is sliding_attention",
        "model.projection_dim=32 does nothing: model.feature_projection=none",
        "model.markov_rank=8 does nothing: it is a dspark setting and model.variant=dflash",
        "loss.selector_weight=2.0 does nothing: it is a dflash2 setting and model.variant=dflash",
        "optim.muon_lr=0.01 does nothing: optim.name=adamw",
    ]
    for preset in ("default", "cpu-long", "recipe", "qwen3-8b", "llama-3.1-8b"):
        assert not [w for w in load_run_config(preset, []).recipe_warnings() if "does nothing" in w], preset
    dspark = load_run_config("configs/default.yaml", ["model.variant=dspark", "model.markov_rank=8", "eval.confidence_stop=0.5"])
    assert not [w for w in dspark.recipe_warnings() if "does nothing" in w]
    # DSpark without its confidence head drafts whole blocks and trains no confidence term: a stop
    # threshold or a confidence weight there changed nothing, silently.
    headless = load_run_config("configs/default.yaml", [
        "model.variant=dspark", "model.confidence_head=false", "eval.confidence_stop=0.5", "loss.confidence_weight=2",
        "loss.weighting=decay", "loss.dpace_alpha=0.3",
    ])
    assert [w for w in headless.recipe_warnings() if "does nothing" in w] == [
        "loss.confidence_weight=2.0 does nothing: model.confidence_head=false",
        "loss.dpace_alpha=0.3 does nothing: loss.weighting=decay",
    ]


def test_confidence_stop_under_a_drafter_that_cannot_stop_is_named_for_the_drafters_eval_loads():
    """`check` called eval.confidence_stop inert under model.variant=dflash, yet `eval` of a DSpark
    checkpoint (loaded as its own description says) applies it: a note says where it applies."""
    import stage2_train  # noqa: F401 - its rules

    for given, why in ((["eval.confidence_stop=0.5"], "model.variant=dflash"),
                       (["model.variant=dspark", "model.confidence_head=false", "eval.confidence_stop=0.5"], "model.confidence_head=false")):
        cfg = load_run_config("configs/default.yaml", given)
        assert not [w for w in cfg.recipe_warnings() if "confidence_stop" in w]
        assert [n for n in cfg.notes() if n.startswith("eval.confidence_stop")] == [
            f"eval.confidence_stop=0.5 stops no block of this run's drafter ({why}: it drafts whole blocks); `python -m stage2_train eval` applies it "
            f"to a DSpark drafter with a confidence head that it loads (--checkpoint of a DSpark run, or a DSpark export)"]
    dspark = load_run_config("configs/default.yaml", ["model.variant=dspark", "eval.confidence_stop=0.5"])
    assert not [n for n in dspark.notes() if n.startswith("eval.confidence_stop")]
    others = load_run_config("configs/default.yaml", [
        "model.projection_scale=none", "model.projection_fit_tokens=1000", "noise.std=0", "noise.warmup_steps=50",
        "eval.every_steps=0", "eval.offline_max_anchors_per_seq=4",
    ])
    assert [w for w in others.recipe_warnings() if "does nothing" in w] == [
        "model.projection_scale=none does nothing: model.feature_projection=none",
        "model.projection_fit_tokens=1000 does nothing: model.feature_projection=none",
        "noise.warmup_steps=50 does nothing: noise.std=0",
        "eval.offline_max_anchors_per_seq=4 does nothing: eval.every_steps=0 (the final eval scores every anchor)",
    ]
    kept = load_run_config("configs/default.yaml", ["eval.every_steps=0", "checkpoint.keep_best=true"])
    assert not [w for w in kept.recipe_warnings() if "offline_max_anchors_per_seq" in w]  # keep_best compares on them
    # A warm start from the target's layers is not applied over weights model.init_from gives.
    started = load_run_config("configs/default.yaml", ["model.init=target_layers", "model.init_from=/some/drafter"])
    assert [w for w in started.recipe_warnings() if "does nothing" in w] == [
        "model.init=target_layers does nothing: model.init_from gives the starting weights",
    ]


def test_stage1_check_names_its_departures_from_the_recipe(capsys):
    """Stage 1's only recipe check was temperature/top_p: a config generating 16-token answers into
    1,024-token samples from 3 target layers printed "no departures from the published DFlash recipe"."""
    from stage1_extract import __main__ as stage1_cli

    given = ["generate.max_new_tokens=16", "data.max_length=1024", "target.num_feature_layers=3", "extract.top_k=8"]
    assert load_run_config(ROOT / "configs" / "recipe.yaml", []).recipe_warnings() == []
    assert load_run_config(ROOT / "configs" / "recipe.yaml", given).recipe_warnings() == [
        "target.num_feature_layers=3 departs from the recipe (5 target layers feed the drafter)",
        "data.max_length=1024 departs from the recipe (3072): longer samples are truncated (data.on_long)",
        "generate.max_new_tokens=16 departs from the recipe (2048): a longer answer is cut there (kept with its "
        "end-of-turn marker unsupervised, its row's later turns dropped)",
        "extract.top_k=8 departs from the recipe (64): the target's top-k the KL term and candidate slots read",
    ]
    layers = load_run_config(ROOT / "configs" / "recipe.yaml", ["target.layer_ids=[1,9,17]"]).recipe_warnings()
    assert layers == ["target.layer_ids=[1, 9, 17]: 3 target layers feed the drafter; the DFlash recipe feeds 5 (configs/recipe.yaml)"]
    # The CPU presets depart on purpose (each value's reason is in its file): these, and no others of stage 1.
    for preset in ("default.yaml", "cpu-long.yaml"):
        stage1_keys = [w.split("=")[0] for w in load_run_config(ROOT / "configs" / preset, []).recipe_warnings()
                       if w.split(".")[0] in ("target", "data", "generate", "extract", "store")]
        assert stage1_keys == ["target.num_feature_layers", "data.max_length", "generate.max_new_tokens"], preset
    assert stage1_cli.main(["check", *given]) == 0
    err = capsys.readouterr().err
    assert "WARNING: generate.max_new_tokens=16 departs from the recipe (2048)" in err
    assert "no departures from the published DFlash recipe" not in err


def test_stage1_check_warns_when_the_backend_is_vllm_and_vllm_is_not_installed(monkeypatch, capsys):
    """`check` passed a config inheriting qwen3-8b (generate.backend: vllm) on a node without vllm;
    `generate` then failed. Found without importing vllm (importlib's find_spec)."""
    from stage1_extract import __main__ as stage1_cli
    from stage1_extract import backends as generate  # where vllm_installed lives

    monkeypatch.setattr(generate, "vllm_installed", lambda: False)
    assert stage1_cli.main(["check", "generate.backend=vllm"]) == 0
    assert "WARNING: generate.backend=vllm, but vllm is not installed here: install it with `pip install -e '.[gpu]'`" in capsys.readouterr().err
    assert stage1_cli.main(["check", "--quiet", "generate.backend=vllm"]) == 0
    assert capsys.readouterr().err == ""
    assert stage1_cli.main(["check", "generate.backend=auto"]) == 0  # auto falls back to transformers
    assert "vllm" not in capsys.readouterr().err
    monkeypatch.setattr(generate, "vllm_installed", lambda: True)
    assert stage1_cli.main(["check", "generate.backend=vllm"]) == 0
    assert "not installed" not in capsys.readouterr().err


def test_a_misspelt_preset_in_inherit_names_the_file_that_inherits_it_and_the_preset_meant(tmp_path):
    """`inherit: qwen3_8b` in a user's config was refused as "config file not found: qwen3_8b": it
    named neither the file holding the typo nor the preset meant."""
    from shared.errors import InputFileError

    mine = tmp_path / "my-qwen3.yaml"
    mine.write_text("inherit: qwen3_8b\nrun_dir: /scratch/runs/mine\n")
    with pytest.raises(InputFileError) as refused:
        load_run_config(mine, [])
    assert str(refused.value) == (f"{mine}: inherit: config file not found: qwen3_8b (a path, or a preset name: cpu-long, "
                                  f"default, llama-3.1-8b, qwen3-8b, recipe; did you mean qwen3-8b?)")
    with pytest.raises(InputFileError, match=r"^config file not found: lama-3\.1-8b \(.*; did you mean llama-3\.1-8b\?\)$"):
        load_run_config("lama-3.1-8b", [])
