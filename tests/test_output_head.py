"""The stored log-probs are the target's own distribution: transformers' forward softcaps Gemma 2/3's
logits, divides Granite's and scales Cohere's after the LM head, which extraction applied to nothing
(a Granite top-1 log-prob stored as -1.8 where the model gives -5.6). A transform it does not know is
refused by a one-forward check when the target loads."""

from __future__ import annotations

import pytest
import torch
import transformers

from stage1_extract.forward import check_output_head, output_head, topk_logprobs

SIZES = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


def tiny(config_class, **extra):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**SIZES, **extra)).eval()
    for p in model.parameters():
        p.data.mul_(5)  # logits spread out enough for the transforms to matter
    return model


@pytest.mark.parametrize("config_class, extra", [
    (transformers.Gemma2Config, {"head_dim": 16, "final_logit_softcapping": 3.0}),
    (transformers.GraniteConfig, {"logits_scaling": 8.0}),
    (transformers.CohereConfig, {"logit_scale": 0.5}),
    (transformers.LlamaConfig, {}),
])
def test_the_stored_log_probs_are_those_of_the_models_own_logits(config_class, extra):
    model = tiny(config_class, **extra)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), -1)
        values, indices = topk_logprobs(model.get_decoder()(ids).last_hidden_state[0], output_head(model), 8, 4)
    assert torch.equal(indices.long(), logprobs.topk(8).indices)
    assert torch.allclose(values, logprobs.gather(-1, indices.long()), atol=1e-5)
    check_output_head(model)


def test_a_transform_extraction_does_not_know_is_refused():
    model = tiny(transformers.LlamaConfig)
    forward = model.forward
    model.forward = lambda *a, **k: forward(*a, **k).__class__(logits=forward(*a, **k).logits * 2)
    with pytest.raises(ValueError, match=r"returns other logits than its LM head gives .* the stored log-probs would not be "
                                         r"the model's distribution"):
        check_output_head(model)


def test_a_target_with_a_logit_transform_records_it_in_its_stores_identity(tmp_path):
    """A store a Gemma 2 target made before the transform was applied must read as stale: the
    transform is part of the target's identity, and only for targets that have one (a Llama or Qwen
    store keeps the identity it had)."""
    import json

    from shared.fingerprints import logit_transform

    (tmp_path / "gemma").mkdir()
    (tmp_path / "gemma" / "config.json").write_text(json.dumps({"model_type": "gemma2", "final_logit_softcapping": 30.0}))
    (tmp_path / "vlm").mkdir()
    (tmp_path / "vlm" / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {"final_logit_softcapping": 30.0}}))
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama", "final_logit_softcapping": None}))
    assert logit_transform(tmp_path / "gemma") == logit_transform(tmp_path / "vlm") == {"final_logit_softcapping": 30.0}
    assert logit_transform(tmp_path / "llama") == {}


def test_the_embedded_targets_identity_is_what_it_was(tiny_target_dir):
    from shared.config import load_run_config
    from shared.target import resolve_target

    cfg = load_run_config("configs/default.yaml", [f"target.path={tiny_target_dir}"])
    assert "logit_transform" not in resolve_target(cfg.target).identity()
