"""The embedded default target, its GGUF conversion, and the DFlash layer rule."""

from __future__ import annotations

import pytest
import torch

from shared.embedded import default_target_dir, embedded_gguf_path
from shared.target import (
    TargetArch,
    TargetConfig,
    default_mask_token_id,
    dflash_layer_ids,
    load_tokenizer,
    resolve_layer_ids,
)


def test_layer_rule_matches_published_drafters():
    """z-lab's build_target_layer_ids exactly (dflash 0.1.0 `dflash/model.py`), rounding included."""
    assert dflash_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B DFlash drafter
    assert dflash_layer_ids(30, 3) == [1, 14, 27]
    assert dflash_layer_ids(94, 5) == [1, 24, 46, 68, 91]  # round(23.5) = 24: not 1 + round(22.5) = 23
    assert dflash_layer_ids(30, 1) == [15]  # one layer: the middle one
    assert dflash_layer_ids(36, 1) == [18]
    with pytest.raises(ValueError, match="num_feature_layers=40"):
        dflash_layer_ids(30, 40)


def zlab_rule(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published rule written out as z-lab writes it, for an exhaustive comparison."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + (i * (end - start)) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def test_layer_rule_equals_zlab_for_every_depth_and_count():
    for layers in range(4, 129):
        for count in range(1, min(layers - 3, 12) + 1):
            assert dflash_layer_ids(layers, count) == zlab_rule(layers, count), (layers, count)


def test_the_last_layer_is_refused():
    arch = TargetArch.from_dir(default_target_dir())  # 30 layers
    with pytest.raises(ValueError, match=r"includes the last layer \(29\).*serving engines never capture it"):
        resolve_layer_ids(TargetConfig(layer_ids=[1, 14, 29]), arch)
    assert resolve_layer_ids(TargetConfig(layer_ids=[1, 14, 28]), arch) == [1, 14, 28]


def test_explicit_layer_ids_are_checked_against_the_target():
    arch = TargetArch.from_dir(default_target_dir())
    assert resolve_layer_ids(TargetConfig(layer_ids=[2, 4]), arch) == [2, 4]
    with pytest.raises(ValueError, match="names layer 30, but the target has 30 layers"):
        resolve_layer_ids(TargetConfig(layer_ids=[2, 30]), arch)


def test_default_target_is_smollm2_with_a_mask_token():
    arch = TargetArch.from_dir(default_target_dir())
    assert (arch.model_type, arch.num_hidden_layers, arch.hidden_size, arch.vocab_size) == ("llama", 30, 576, 49152)
    cfg = TargetConfig()
    tokenizer = load_tokenizer(cfg)
    mask_id = default_mask_token_id(cfg, arch, tokenizer)
    assert tokenizer.convert_ids_to_tokens(mask_id) == "<empty_output>"


def test_missing_target_folder_is_a_clear_error(tmp_path):
    from shared.target import resolve_target_dir

    with pytest.raises(FileNotFoundError, match=r"no config.json in .*Qwen3-8B\. Give a local HF model folder, a Hub id"):
        resolve_target_dir(TargetConfig(path=str(tmp_path / "Qwen3-8B")))


@pytest.mark.slow  # ~60 s on 2 cores: `make test-all`
def test_converted_checkpoint_matches_the_gguf_model():
    """The bf16 safetensors conversion predicts what the GGUF-loaded model predicts."""
    from transformers import AutoModelForCausalLM

    gguf = embedded_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    converted = AutoModelForCausalLM.from_pretrained(default_target_dir(), dtype=torch.float32).eval()
    tokenizer = load_tokenizer(TargetConfig())
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is a Python list?"}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.inference_mode():
        ref_TV = reference(ids).logits[0].float()
        out_TV = converted(ids).logits[0].float()
    # Weights differ only by bf16 rounding of the dequantized values.
    assert (ref_TV.argmax(-1) == out_TV.argmax(-1)).float().mean() >= 0.9
    assert (ref_TV - out_TV).abs().max() < 0.05 * ref_TV.abs().max()
    for name, tensor in converted.state_dict().items():
        assert torch.isfinite(tensor).all(), name


def test_a_target_without_a_chat_template_names_how_to_give_it_one(tiny_target_dir, tmp_path):
    """A base model (no chat template) was refused with "the tokenizer has no chat template" and no
    way on; the refusal now says how to give one, and that way works."""
    import json
    import shutil

    from shared.config import load_run_config
    from shared.errors import ConfigError
    from stage1_extract.plan import cmd_plan
    from testkit.data import chat_rows, stage1_overrides, write_jsonl

    base = shutil.copytree(tiny_target_dir, tmp_path / "base")
    template = (base / "chat_template.jinja").read_text()
    (base / "chat_template.jinja").unlink()
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    cfg = load_run_config("configs/default.yaml", stage1_overrides(base, data, tmp_path / "run"))
    with pytest.raises(ConfigError, match=rf"target\.path='{base}': the tokenizer has no chat template \(a base model\?\), .*: use "
                                          rf"the model's chat \(instruct\) version, or a copy of {base} with that template in "
                                          r"chat_template\.jinja, set as target\.path$"):
        cmd_plan(cfg)
    (base / "chat_template.jinja").write_text(template)
    assert cmd_plan(cfg)["samples"] == 4


def test_a_mask_token_text_produces_is_refused_before_extraction_and_training(tiny_target_dir, tmp_path):
    """A preset's target.mask_token_id inherited onto another target family (llama-3.1-8b's 128002 on
    Qwen2.5: an ordinary BPE token there), or any id text or the template produces, was extracted and
    trained on without a word; only the export doctor, after the whole run, said to retrain. stage 1
    and train now refuse it naming the target's own reserved token, and take that one."""
    from shared.config import load_run_config
    from shared.errors import ConfigError
    from stage1_extract import commands
    from stage2_train.commands import cmd_train
    from testkit.data import chat_rows, stage1_overrides, train_overrides_for, write_jsonl

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6))
    for mask, why in ((300, "'om', an ordinary token that text tokenizes to"), (2, "the tokenizer's eos token '<|im_end|>'"),
                      (1, "the tokenizer's bos token '<|im_start|>'")):
        cfg = load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "run",
                                                                         **{"target.mask_token_id": mask}))
        with pytest.raises(ConfigError) as refused:
            commands.cmd_extract(cfg, progress=False)
        assert str(refused.value) == (
            f"target.mask_token_id={mask} is {why}: the drafter could not tell its mask slots from real text (and the export "
            f"doctor refuses such a drafter); a preset's id belongs to its own target. Set target.mask_token_id=16 (<empty_output>)")
    assert not (tmp_path / "run" / "store" / "manifest.json").exists()
    commands.cmd_extract(load_run_config("configs/default.yaml", stage1_overrides(tiny_target_dir, data, tmp_path / "run",
                                                                                   **{"target.mask_token_id": 16})), progress=False)
    train = train_overrides_for(tiny_target_dir, tmp_path / "run" / "store", tmp_path / "run",
                                {"target.mask_token_id": 300, "train.max_steps": 1, "train.device": "cpu"})
    with pytest.raises(ConfigError, match=r"^target\.mask_token_id=300 is 'om', an ordinary token"):
        cmd_train(load_run_config("configs/default.yaml", train), progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_presets_mask_token_beyond_another_targets_vocabulary_names_the_way_out(tiny_target_dir, tmp_path):
    """`inherit: qwen3-8b` onto another target: its 151669 lies past that target's vocabulary, and the
    refusal said only "must be in [0, 49152), got 151669", though the user never set it. It now says
    where it came from and the override that takes the target's own, which then works."""
    from shared.config import load_run_config
    from shared.errors import ConfigError
    from stage1_extract.plan import cmd_plan
    from testkit.data import chat_rows, write_jsonl

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"inherit: qwen3-8b\nrun_dir: {tmp_path / 'run'}\ntarget:\n  path: {tiny_target_dir}\n  num_feature_layers: 3\n"
                    f"data:\n  path: {data}\n  regenerate: false\n")
    with pytest.raises(ConfigError) as refused:
        cmd_plan(load_run_config(mine, []))
    assert str(refused.value) == ("target.mask_token_id must be in [0, 49152) (this target's vocabulary), got 151669: a preset's "
                                  "id belongs to its own target; set target.mask_token_id=null to take this target's reserved one")
    assert cmd_plan(load_run_config(mine, ["target.mask_token_id=null"]))["samples"] == 4


def test_a_target_without_a_known_reserved_token_is_offered_one(tiny_target_dir, tmp_path):
    """`target.mask_token_id=null` on a target this pipeline knows no mask for (a Mistral, or a preset's
    id cleared) was refused with "choose an unused special token id", naming none; it now names the
    first reserved one, which then works."""
    import json
    import shutil

    from shared.config import load_run_config
    from shared.errors import ConfigError
    from stage1_extract.plan import cmd_plan
    from testkit.data import chat_rows, stage1_overrides, write_jsonl

    target = shutil.copytree(tiny_target_dir, tmp_path / "target")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # SmolLM2's known mask, <empty_output>, renamed
        (target / name).write_text((target / name).read_text().replace("<empty_output>", "<reserved_0>"))
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    cfg = load_run_config("configs/default.yaml", stage1_overrides(target, data, tmp_path / "run"))
    with pytest.raises(ConfigError) as refused:
        cmd_plan(cfg)
    assert str(refused.value) == ("target.mask_token_id is not set and this target has no known reserved token: set an unused "
                                  "special token's id (its first: target.mask_token_id=3, <repo_name>)")
    assert "<empty_output>" not in json.dumps(json.loads((target / "tokenizer.json").read_text()))
    plan = cmd_plan(load_run_config("configs/default.yaml", stage1_overrides(target, data, tmp_path / "run",
                                                                              **{"target.mask_token_id": 3})))
    assert plan["samples"] == 4


def test_a_copy_of_a_target_folder_shares_its_tokenizer_and_an_edited_one_does_not(tiny_target_dir, tmp_path):
    """The tokenizer (and its fingerprints) is cached per folder and, on a miss, by the content of the
    folder's non-weight files: a copy loads nothing again; a copy whose chat template or tokenizer was
    edited is its own tokenizer, with its own fingerprints."""
    import shutil

    from shared.target import cached_tokenizer

    first, prints = cached_tokenizer(str(tiny_target_dir))
    copy = shutil.copytree(tiny_target_dir, tmp_path / "copy")
    assert cached_tokenizer(str(copy))[0] is first and cached_tokenizer(str(copy))[1] == prints
    (copy / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    edited, edited_prints = cached_tokenizer(str(copy))
    assert edited is not first and edited.chat_template == "{{ messages[0]['content'] }}"
    assert edited_prints["chat_template_sha256"] != prints["chat_template_sha256"]
    assert cached_tokenizer(str(tiny_target_dir))[0] is first
