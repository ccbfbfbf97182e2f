"""The export doctor: each serving mismatch planted in a copy of a good export is named, with the fix.

.venv/bin/python -m pytest tests/test_export_doctor.py -q

Good exports are written by our own export code from a tiny drafter over the `tiny_target_dir`
target (6 layers, hidden 64, SmolLM2's tokenizer: vocabulary 49152, mask token 16 `<empty_output>`,
feature layers [1, 2, 3] by the DFlash rule). "Another trainer's" export is the same folder without
our `dflash_pipeline` record, so only what any DFlash config says is there to judge.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.config import build_run_config, load_run_config
from shared.fingerprints import weights_fingerprint
from shared.target import TargetArch, TargetConfig
from stage2_train.__main__ import main
from stage2_train.commands import cmd_export
from stage2_train.model.config import DrafterConfig
from stage2_train.model.description import describe_parts
from stage2_train.model.drafter import DFlashDrafter
from stage2_train.serve.diagnose import DecodeSettings, diagnose_export
from stage2_train.train.checkpoint.saver import Checkpointer
from stage2_train.train.config import CheckpointConfig

from .conftest import chat_rows, stage1_overrides, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
NO_DECODE = DecodeSettings(num_prompts=0)


@pytest.fixture(scope="module")
def exports(tiny_target_dir, tmp_path_factory) -> dict[str, Path]:
    """A random 1-layer drafter (block 4, layers [1, 2, 3], mask 16) exported in both layouts."""
    root = tmp_path_factory.mktemp("exports")
    arch = TargetArch.from_dir(tiny_target_dir)
    model = DrafterConfig(num_layers=1, block_size=4, init_std=0.2)
    torch.manual_seed(5)
    drafter = DFlashDrafter(model, arch, 3, 16)
    description = describe_parts(model, arch, [1, 2, 3], 16, weights_fingerprint(tiny_target_dir))
    Checkpointer(CheckpointConfig(), root / "run" / "checkpoints").save(
        50,
        lambda: {"model": drafter.state_dict(), "trainer": {"step": 50}, "drafter": description.to_dict()},
        blocking=True,
    )
    cfg = build_run_config(
        {
            "run_dir": str(root / "run"),
            "target": {"path": str(tiny_target_dir), "num_feature_layers": 3},
            "model": {"num_layers": 1, "block_size": 4},
        }
    )
    return {
        layout: Path(cmd_export(cfg, out=str(root / layout), format=layout)["out_dir"])
        for layout in ("zlab", "speculators")
    }


def planted(exports, tmp_path, edit, *, layout="zlab", ours=True) -> Path:
    """A copy of the good export with `edit(config)` applied to its config.json; `ours=False` drops
    our own record (another trainer's export)."""
    folder = shutil.copytree(exports[layout], tmp_path / f"planted-{layout}")
    config = json.loads((folder / "config.json").read_text())
    if not ours:
        config.pop("dflash_pipeline")
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def doctor(folder, target_dir, **kwargs) -> dict:
    return diagnose_export(
        str(folder), TargetConfig(path=str(target_dir)), settings=kwargs.pop("settings", NO_DECODE), **kwargs
    )


def named(report, field: str, severity: str | None = None) -> dict:
    """The one finding about `field` (and of `severity` when given)."""
    found = [f for f in report["findings"] if f["field"] == field and severity in (None, f["severity"])]
    assert len(found) == 1, (field, report["findings"])
    return found[0]


def fields(report) -> set[str]:
    return {f["field"] for f in report["findings"]}


def set_in(*path_and_value):
    """An edit setting config[a][b]... = value (None deletes the key)."""
    *path, value = path_and_value

    def edit(config):
        node = config
        for key in path[:-1]:
            node = node[key]
        if value is None:
            node.pop(path[-1])
        else:
            node[path[-1]] = value

    return edit


def both(*edits):
    def edit(config):
        for e in edits:
            e(config)

    return edit


# ---- a good export ---------------------------------------------------------------------------------


def test_a_good_export_passes_and_is_decoded(exports, tiny_target_dir):
    report = doctor(
        exports["zlab"], tiny_target_dir, settings=DecodeSettings(num_prompts=2, max_new_tokens=12)
    )
    assert (
        report["findings"] == [] and report["written_by"] == "dflash-pipeline" and report["layout"] == "z-lab"
    )
    accepted = report["acceptance"]
    assert accepted["prompts"] == "2 built-in prompts" and set(accepted["proposers"]) == {"drafter", "ngram"}
    for entry in accepted["proposers"].values():
        # Two prompts: too few for an interval (serve/online_eval.py MIN_INTERVAL_PROMPTS), none is given.
        assert entry["exact"] and entry["lo"] is None is entry["hi"] and entry["num_prompts"] == 2 and 1.0 <= entry["tau"] <= 4.0
    from stage2_train.serve.diagnose import format_text

    assert f"drafter tau {accepted['proposers']['drafter']['tau']:.3f} (2 prompts: too few for an interval) | ngram tau " in format_text(report)
    speculators = doctor(exports["speculators"], tiny_target_dir)
    assert speculators["findings"] == [] and speculators["layout"] == "speculators"


def test_the_cli_prints_one_line_per_finding_and_exits_1(exports, tiny_target_dir, tmp_path, capsys):
    args = ["doctor", "--target", str(tiny_target_dir), "--prompts", "0", f"run_dir={tmp_path / 'run'}"]
    assert main([*args, "--export", str(exports["zlab"])]) == 0
    assert (
        capsys.readouterr().out.splitlines()[-1]
        == "verdict: no mismatch found between the drafter, its target"
    )
    bad = planted(exports, tmp_path, set_in("dflash_config", "mask_token_id", 60000))
    assert main([*args, "--export", str(bad)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(
        line.startswith(
            "ERROR   dflash_config.mask_token_id: is 60000, outside the target's vocabulary [0, 49152)"
        )
        and "| fix: set dflash_config.mask_token_id to the id the drafter was trained with (the target's: 16 (<empty_output>))"
        in line
        for line in lines
    ), lines
    assert main([*args, "--export", str(bad), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["num_errors"] == len([f for f in report["findings"] if f["severity"] == "error"]) >= 1


def test_a_drafter_that_cannot_be_decoded_here_is_no_healthy_verdict(exports, tiny_target_dir, tmp_path, capsys):
    """Another trainer's folder this pipeline cannot build (SpecForge's Domino: the DFlash backbone and a
    GRU head) passed every field check, was 'not decoded' in a note, and exited 0 under "no mismatch
    found": a script gating on the doctor took it for a checked drafter. It now exits 3, cannot tell."""
    domino = planted(exports, tmp_path, set_in("architectures", ["DominoDraftModel"]), ours=False)
    args = ["doctor", "--target", str(tiny_target_dir), "--prompts", "2", f"run_dir={tmp_path / 'run'}", "--export", str(domino)]
    assert main(args) == 3
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("note: not decoded: ") and "DominoDraftModel" in line for line in lines), lines
    assert lines[-1] == "verdict: cannot tell: no mismatch found, but the drafter could not be decoded here (the note above says why)"
    assert main([a if a != "2" else "0" for a in args]) == 0  # not asked to decode: the field checks are the verdict


def test_hub_ids_are_read_from_the_local_cache(exports, tiny_target_dir, tmp_path, monkeypatch):
    from .conftest import add_to_hub_cache

    cache = tmp_path / "hub"
    add_to_hub_cache(cache, "someone/tiny-dflash", exports["zlab"])
    add_to_hub_cache(cache, "someone/tiny-target", tiny_target_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    report = doctor("someone/tiny-dflash", "someone/tiny-target")
    assert report["findings"] == [] and report["export"].startswith(
        str(cache / "models--someone--tiny-dflash" / "snapshots")
    )


# ---- mask token ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mask, why",
    [
        (2, "the tokenizer's eos token '<|im_end|>'"),
        (1, "the tokenizer's bos token '<|im_start|>'"),
        (300, "'om', an ordinary token that text tokenizes to"),
    ],
)
def test_a_mask_token_that_text_or_the_template_produces_is_named(
    exports, tiny_target_dir, tmp_path, mask, why
):
    """Trained that way (the description agrees), so only the token itself is wrong."""
    token = {2: "<|im_end|>", 1: "<|im_start|>", 300: "om"}[mask]
    edit = both(
        set_in("dflash_config", "mask_token_id", mask),
        set_in("dflash_config", "mask_token", token),
        set_in("dflash_pipeline", "drafter", "mask_token_id", mask),
    )
    report = doctor(planted(exports, tmp_path, edit), tiny_target_dir)
    finding = named(report, "dflash_config.mask_token_id", "error")
    assert finding["problem"] == f"is {mask}, {why}: the drafter cannot tell its mask slots from real text"
    assert (
        finding["fix"]
        == "retrain with a reserved token (target.mask_token_id=16 (<empty_output>)) and export again"
    )


def test_a_special_token_the_chat_template_writes_is_not_a_mask(exports, tiny_target_dir, tmp_path):
    template = "{%- for m in messages %}{{ '<jupyter_text>' + m['content'] }}{%- endfor %}"
    target = with_template(tiny_target_dir, tmp_path / "target", template)
    edit = both(
        set_in("dflash_config", "mask_token_id", 12),
        set_in("dflash_config", "mask_token", "<jupyter_text>"),
        set_in("dflash_pipeline", "drafter", "mask_token_id", 12),
    )
    report = doctor(planted(exports, tmp_path, edit), target)
    assert named(report, "dflash_config.mask_token_id", "error")["problem"] == (
        "is 12, '<jupyter_text>', which the chat template writes into every conversation: the drafter cannot "
        "tell its mask slots from real text"
    )
    # The same token is reserved for the target whose template never writes it (only a warning: not 16).
    assert [
        f["severity"] for f in doctor(planted(exports, tmp_path / "b", edit), tiny_target_dir)["findings"]
    ] == ["warning"]


def test_a_mask_token_other_than_the_targets_is_a_warning(exports, tiny_target_dir, tmp_path):
    edit = both(
        set_in("dflash_config", "mask_token_id", 15),
        set_in("dflash_config", "mask_token", "<jupyter_script>"),
        set_in("dflash_pipeline", "drafter", "mask_token_id", 15),
    )
    report = doctor(planted(exports, tmp_path, edit), tiny_target_dir)
    assert [f["severity"] for f in report["findings"]] == ["warning"]
    assert named(report, "dflash_config.mask_token_id")["fix"].startswith(
        "if the drafter was trained with 16, set dflash_config.mask_token_id=16"
    )


def test_a_mask_token_string_that_resolves_to_another_id_is_named(exports, tiny_target_dir, tmp_path):
    report = doctor(
        planted(exports, tmp_path, set_in("dflash_config", "mask_token", "<|MASK|>")), tiny_target_dir
    )
    finding = named(report, "dflash_config.mask_token")
    assert finding["problem"].startswith(
        "is '<|MASK|>', which resolves to id 49152 in the target's tokenizer, not dflash_config.mask_token_id=16"
    )
    assert finding["fix"] == "set dflash_config.mask_token='<empty_output>'"
    absent = doctor(
        planted(exports, tmp_path / "absent", set_in("dflash_config", "mask_token", None)), tiny_target_dir
    )
    assert named(absent, "dflash_config.mask_token")["problem"].startswith(
        "is absent, so SGLang uses '<|MASK|>', which resolves to id 49152"
    )


def test_an_edited_mask_id_contradicts_the_drafters_description(exports, tiny_target_dir, tmp_path):
    report = doctor(planted(exports, tmp_path, set_in("dflash_config", "mask_token_id", 15)), tiny_target_dir)
    finding = [
        f
        for f in report["findings"]
        if f["field"] == "dflash_config.mask_token_id" and "edited" in f["problem"]
    ][0]
    assert finding["problem"].startswith("is 15, but the drafter was trained with 16 (its description")
    assert finding["fix"].startswith("set dflash_config.mask_token_id back to 16")


# ---- target layers ---------------------------------------------------------------------------------


def test_missing_layer_ids_say_which_layers_the_engines_would_pick(exports, tiny_target_dir, tmp_path):
    report = doctor(
        planted(exports, tmp_path, set_in("dflash_config", "target_layer_ids", None)), tiny_target_dir
    )
    finding = [f for f in report["findings"] if "is missing" in f["problem"]][0]
    assert finding["field"] == "dflash_config.target_layer_ids"
    assert (
        "build_target_layer_ids(6, num_hidden_layers=1) = [3]" in finding["problem"]
        and "trained on [1, 2, 3]" in finding["problem"]
    )
    assert (
        finding["fix"]
        == "write dflash_config.target_layer_ids = the layers the drafter was trained on ([1, 2, 3])"
    )
    theirs = doctor(
        planted(exports, tmp_path / "theirs", set_in("dflash_config", "target_layer_ids", None), ours=False),
        tiny_target_dir,
    )
    assert (
        "the drafter was trained on 3 layers (fc.weight's input width)"
        in named(theirs, "dflash_config.target_layer_ids")["problem"]
    )


@pytest.mark.parametrize(
    "ids, severity, says, fix",
    [
        (
            [2, 3, 4],
            "warning",
            "speculators' aux_hidden_state_layer_ids (id + 1) written as z-lab's target_layer_ids",
            "if the drafter was trained on the rule's layers, set dflash_config.target_layer_ids=[1, 2, 3]",
        ),
        (
            [0, 1, 2],
            "warning",
            "HF hidden_states indices taken for layer ids",
            "set dflash_config.target_layer_ids=[1, 2, 3]",
        ),
        (
            [1, 2, 5],
            "error",
            "includes the target's last layer (5)",
            "retrain on layers up to 4 (the DFlash rule ends at 3: [1, 2, 3])",
        ),
        (
            [1, 2, 6],
            "error",
            "names layers [6] the target does not have (layers 0..5)",
            "the DFlash rule for this target gives [1, 2, 3]",
        ),
        (
            [1, 2],
            "error",
            "lists 2 layers, but fc.weight fuses 3",
            "list the 3 layers the drafter was trained on",
        ),
    ],
)
def test_layer_ids_shifted_last_beyond_or_miscounted_are_named(
    exports, tiny_target_dir, tmp_path, ids, severity, says, fix
):
    report = doctor(
        planted(exports, tmp_path, set_in("dflash_config", "target_layer_ids", ids), ours=False),
        tiny_target_dir,
    )
    finding = named(report, "dflash_config.target_layer_ids", severity)
    assert says in finding["problem"] and fix in finding["fix"]


def test_speculators_layer_ids_without_the_plus_one_are_named(exports, tiny_target_dir, tmp_path):
    report = doctor(
        planted(
            exports,
            tmp_path,
            set_in("aux_hidden_state_layer_ids", [1, 2, 3]),
            layout="speculators",
            ours=False,
        ),
        tiny_target_dir,
    )
    finding = named(report, "aux_hidden_state_layer_ids", "warning")
    assert "z-lab's ids written without speculators' + 1" in finding["problem"]
    assert (
        finding["fix"]
        == "if the drafter was trained on the rule's layers, set aux_hidden_state_layer_ids=[2, 3, 4]"
    )


def test_num_target_layers_of_another_target_is_named(exports, tiny_target_dir, tmp_path):
    report = doctor(planted(exports, tmp_path, set_in("num_target_layers", 36)), tiny_target_dir)
    finding = named(report, "num_target_layers")
    assert finding["problem"].startswith("is 36, the target has 6 decoder layers")
    assert finding["fix"].startswith(
        "set num_target_layers=6 if the drafter was trained on this target's features"
    )


# ---- shape, rotary, identity -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, severity",
    [
        ("hidden_size", 128, "error"),
        ("vocab_size", 151936, "error"),
        ("num_attention_heads", 8, "warning"),  # and q_proj's shape then disagrees with the weights: an error
        ("head_dim", 32, "warning"),
    ],
)
def test_width_vocabulary_and_heads_against_the_target(
    exports, tiny_target_dir, tmp_path, key, value, severity
):
    report = doctor(planted(exports, tmp_path, set_in(key, value), ours=False), tiny_target_dir)
    finding = [
        f
        for f in report["findings"]
        if f["field"] == key and f["problem"].startswith(f"is {value}, the target's is")
    ]
    assert len(finding) == 1 and finding[0]["severity"] == severity, report["findings"]
    assert (
        finding[0]["fix"]
        == "use the target the drafter was made for, or retrain the drafter against this target"
    )
    if key == "num_attention_heads":
        shape = [
            f
            for f in report["findings"]
            if f["problem"].startswith("8 heads of 16 give q_proj (128, 64), the weights hold (64, 64)")
        ]
        assert len(shape) == 1 and shape[0]["severity"] == "error"


def test_rotary_settings_against_the_target(exports, tiny_target_dir, tmp_path):
    theta = both(set_in("rope_theta", 1e6), set_in("rope_parameters", "rope_theta", 1e6))
    report = doctor(planted(exports, tmp_path / "theta", theta, ours=False), tiny_target_dir)
    assert named(report, "rope_theta", "warning")["problem"].startswith("is 1e+06, the target's is 10000")
    yarn = set_in("rope_scaling", {"rope_type": "yarn", "factor": 4.0})
    theirs = doctor(planted(exports, tmp_path / "yarn", yarn, ours=False), tiny_target_dir)
    assert named(theirs, "rope_scaling", "warning")["problem"].startswith(
        "rotary scaling is 'yarn', the target's is 'default'"
    )
    ours = doctor(planted(exports, tmp_path / "ours", yarn), tiny_target_dir)
    assert "trained the drafter with plain, full RoPE" in named(ours, "rope_scaling", "error")["problem"]
    partial = doctor(
        planted(exports, tmp_path / "partial", set_in("partial_rotary_factor", 0.5), ours=False),
        tiny_target_dir,
    )
    assert named(partial, "partial_rotary_factor", "warning")["problem"].startswith(
        "partial rotary factor is 0.5, the target's is 1.0"
    )


def test_a_drafter_trained_against_other_target_weights_is_named(exports, tiny_target_dir, tmp_path):
    other = both(
        set_in("dflash_pipeline", "target", "weights_sha256", "ab" * 32),
        set_in("dflash_pipeline", "drafter", "target_weights_sha256", "ab" * 32),
    )
    finding = named(
        doctor(planted(exports, tmp_path, other), tiny_target_dir),
        "dflash_pipeline.target.weights_sha256",
        "error",
    )
    assert finding["problem"].startswith("the drafter was trained against target weights abababababab")
    assert "acceptance collapses when the target's weights change" in finding["problem"]


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda embed: embed.clone(), None),  # the target's own head (tied to its embedding): fine
        (lambda embed: torch.roll(embed, 1, 0), "its rows are the target's shifted by one token"),
        (lambda embed: torch.randn_like(embed), "it is not the target's LM head"),
    ],
)
def test_an_lm_head_shipped_with_the_drafter_is_compared_with_the_targets(
    exports, tiny_target_dir, tmp_path, make, says
):
    from shared.target_parts import load_embed_and_head

    folder = planted(exports, tmp_path, lambda config: None)
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = make(load_embed_and_head(tiny_target_dir)[1]).to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"))
    report = doctor(folder, tiny_target_dir)
    if says is None:
        assert report["findings"] == []
    else:
        assert named(report, "lm_head.weight", "error")["problem"].startswith(says)


# ---- the store: its template against the target's today ---------------------------------------------

# At extraction: the empty thinking block is rendered unless enable_thinking is true (a no-thinking default).
NO_THINKING_DEFAULT = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{%- if m['role'] == 'assistant' %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{{ m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- if not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
# Today: Qwen3's rule, thinking unless enable_thinking is false.
QWEN3_STYLE = NO_THINKING_DEFAULT.replace(
    "{%- if not enable_thinking %}", "{%- if enable_thinking is defined and enable_thinking is false %}"
)
OTHER_SYSTEM = NO_THINKING_DEFAULT.replace(
    "{%- for m in messages %}", "{{ '<|im_start|>system\\nBe terse.<|im_end|>\\n' }}{%- for m in messages %}"
)


def with_template(target_dir: Path, out: Path, template: str) -> Path:
    """A copy of the target (same weights and vocabulary) with another chat template."""
    shutil.copytree(target_dir, out)
    (out / "chat_template.jinja").write_text(template)
    return out


@pytest.fixture(scope="module")
def store(tiny_target_dir, tmp_path_factory):
    """A store extracted with the no-thinking-default template, and that target's folder."""
    from stage1_extract.commands import cmd_extract

    root = tmp_path_factory.mktemp("store")
    target = with_template(tiny_target_dir, root / "target", NO_THINKING_DEFAULT)
    data = write_jsonl(root / "chat.jsonl", chat_rows(10))
    cfg = load_run_config(ROOT / "configs/default.yaml", stage1_overrides(target, data, root / "run"))
    cmd_extract(cfg, progress=False)
    return cfg.store.url(cfg.run_dir), target, data


def test_a_store_rendered_as_the_target_renders_today_passes_and_gives_the_prompts(exports, store, tmp_path):
    url, target, _ = store
    report = doctor(
        exports["zlab"],
        target,
        store=url,
        settings=DecodeSettings(num_prompts=2, max_new_tokens=8, holdout_fraction=0.5),
    )
    assert report["findings"] == []
    assert "chat template: 8 stored prompts equal today's rendering of their messages" in report["notes"]
    assert (
        "thinking mode: the stored prompts render as enable_thinking=False; serve in the same mode (chat_template_kwargs) "
        "or acceptance falls" in report["notes"]
    )
    assert report["acceptance"]["prompts"] == "2 held-out store prompts"


def test_a_thinking_mode_that_differs_from_the_data_is_named(exports, store, tmp_path):
    url, target, _ = store
    today = with_template(target, tmp_path / "qwen3-style", QWEN3_STYLE)
    report = doctor(exports["zlab"], today, store=url)
    assert named(report, "manifest chat_template_sha256", "error")["problem"].startswith(
        "the data was rendered with another chat template"
    )
    finding = named(report, "chat template (enable_thinking)", "error")
    assert (
        "the stored prompt is what today's template renders with enable_thinking=False" in finding["problem"]
    )
    assert finding["fix"].startswith('serve with chat_template_kwargs={"enable_thinking": false}')


def test_another_template_is_named_where_the_renders_differ(exports, store, tmp_path):
    url, target, data = store
    today = with_template(target, tmp_path / "other", OTHER_SYSTEM)
    finding = named(doctor(exports["zlab"], today, store=url), "chat template", "error")
    assert (
        "the stored prompt and today's rendering of its messages differ at character 12" in finding["problem"]
    )
    assert "Be terse." in finding["problem"]
    moved = tmp_path / "moved.jsonl"
    shutil.move(data, moved)
    try:
        hashes_only = doctor(exports["zlab"], today, store=url)
        assert fields(hashes_only) == {"manifest chat_template_sha256"}
        assert any(
            n.startswith("chat template: the data the store was made from") and "(--data PATH gives it)" in n
            for n in hashes_only["notes"]
        )
        assert "chat template" in fields(doctor(exports["zlab"], today, store=url, data=str(moved)))
    finally:
        shutil.move(moved, data)


def test_a_store_made_from_a_sharegpt_array_is_read_back_in_its_format(exports, store, tmp_path):
    """The doctor reads rows with stage 1's reader, in the format the manifest records: a ShareGPT
    JSON array (forced with data.format) renders back as stage 1 rendered it."""
    from stage1_extract.commands import cmd_extract

    _, target, _ = store
    rows = [{"conversations": [{"from": "human", "value": m["messages"][0]["content"]},
                               {"from": "gpt", "value": m["messages"][1]["content"]}]} for m in chat_rows(6)]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(rows))
    cfg = load_run_config(ROOT / "configs/default.yaml",
                          stage1_overrides(target, data, tmp_path / "run", **{"data.format": "sharegpt"}))
    cmd_extract(cfg, progress=False)
    url = cfg.store.url(cfg.run_dir)
    assert json.loads((Path(url) / "manifest.json").read_text())["data"]["format"] == "sharegpt"
    report = doctor(exports["zlab"], target, store=url, settings=DecodeSettings(num_prompts=1, max_new_tokens=4))
    assert "chat template: 6 stored prompts equal today's rendering of their messages" in report["notes"]


def test_rows_of_a_data_file_changed_since_extraction_are_not_blamed_on_the_template(exports, store):
    """The doctor read the data file by sample id as it is today: reordered or edited after extraction,
    another row's messages were rendered against each stored prompt and the unchanged chat template
    was named an error ("serve with the template the data was rendered with"). Each row's opening is
    now checked against the one the store recorded; rows that are not the store's are left out, named."""
    url, target, data = store
    original = data.read_text()
    lines = original.splitlines()
    try:
        data.write_text("\n".join(lines[::-1]) + "\n")
        reordered = doctor(exports["zlab"], target, store=url)
        assert "chat template" not in fields(reordered)
        assert (
            f"chat template: 8 stored sample(s) not compared, their rows of {data} (rows 0, 1, 2, 3 and 4 more) being other "
            f"rows than they were extracted from ({data} changed since extraction); pass --data with the file as it was "
            f"extracted, or run `python -m stage1_extract reprocess` to extract the file as it is now"
        ) in reordered["notes"]
        edited = json.loads(lines[1])
        edited["messages"][0]["content"] = "an edited question"
        data.write_text("\n".join([lines[0], json.dumps(edited), *lines[2:]]) + "\n")
        one_row = doctor(exports["zlab"], target, store=url)
        assert "chat template" not in fields(one_row)
        assert "chat template: 7 stored prompts equal today's rendering of their messages" in one_row["notes"]
        assert any(n.startswith(f"chat template: 1 stored sample(s) not compared, their rows of {data} (rows 1) being")
                   for n in one_row["notes"])
    finally:
        data.write_text(original)
