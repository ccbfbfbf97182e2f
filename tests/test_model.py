"""The DFlash drafter: parameter names, reference parity, the packed attention mask, frozen parts.

.venv/bin/python -m pytest tests/test_model.py -q
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from shared.errors import InputFileError
from shared.target import TargetArch
from shared.target_parts import load_embed_and_head
from stage2_train.data.batch import DrafterBatch
from stage2_train.model import drafter as model_module
from stage2_train.model.attention import resolve_backend
from stage2_train.model.config import DrafterConfig
from stage2_train.model.drafter import DFlashDrafter
from testkit.drafter import MASK_ID, make_packed_batch, three_sample_batch, tiny_arch, tiny_drafter

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---------------------------------------------------------------------------------------------
# Config and export names


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match=r"model\.num_layers must be >= 1"):
        DrafterConfig.from_dict({"num_layers": 0})
    with pytest.raises(ValueError, match=r"model\.block_size"):
        DrafterConfig.from_dict({"block_size": 1})
    with pytest.raises(ValueError, match=r"model\.attention must be one of"):
        DrafterConfig.from_dict({"attention": "flash"})
    with pytest.raises(ValueError, match=r"model\.num_layer: unknown key"):
        DrafterConfig.from_dict({"num_layer": 2})
    assert resolve_backend("auto", torch.device("cpu")) == "sdpa"
    assert resolve_backend("eager", torch.device("cpu")) == "eager"
    assert DrafterConfig().recipe_warnings() == []
    assert "16" in DrafterConfig(block_size=8).recipe_warnings()[0]


def test_state_dict_is_the_reference_export_format():
    arch = tiny_arch(kv_heads=2)
    model = tiny_drafter(arch, num_layers=2)
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for n in range(2):
        expected |= {f"layers.{n}.input_layernorm.weight", f"layers.{n}.post_attention_layernorm.weight"}
        expected |= {f"layers.{n}.self_attn.{p}_proj.weight" for p in "qkvo"}
        expected |= {f"layers.{n}.self_attn.{p}_norm.weight" for p in "qk"}
        expected |= {f"layers.{n}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    state = model.state_dict()
    assert set(state) == expected
    assert state["fc.weight"].shape == (64, 2 * 64)
    assert state["layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)  # GQA: 2 kv heads
    assert state["layers.0.self_attn.q_norm.weight"].shape == (16,)
    assert state["layers.0.mlp.gate_proj.weight"].shape == (96, 64)  # intermediate = target's
    # The frozen parts are buffers: moved with the model, never saved, never trained.
    assert {name for name, _ in model.named_buffers()} == {"embed_VH", "lm_head_VH"}
    assert all(not b.requires_grad for b in model.buffers())
    assert {name for name, _ in model.named_parameters()} == expected


def test_tied_frozen_parts_are_stored_once_and_shapes_are_checked():
    arch = tiny_arch()
    model = DFlashDrafter(DrafterConfig(block_size=4), arch, 1, MASK_ID)
    embed = torch.randn(100, 64)
    model.set_frozen_parts(embed, embed)
    assert model.embed_VH is model.lm_head_VH
    assert len(list(model.buffers())) == 1
    with pytest.raises(ValueError, match="embed must be"):
        model.set_frozen_parts(torch.randn(100, 32), embed)
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashDrafter(DrafterConfig(), arch, 1, mask_token_id=100)


# ---------------------------------------------------------------------------------------------
# Labels and blocks


def test_block_and_label_layout_hand_example():
    tokens = [[10, 11, 12, 13, 14, 15]]
    batch = make_packed_batch(tokens, [[0, 2, 3]], block_size=4, feat_dim=8)
    M = MASK_ID
    assert batch.block_ids_NB.tolist() == [[10, M, M, M], [12, M, M, M], [13, M, M, M]]
    # Slot k predicts the token at anchor + k; slot 0 and slots past the end are not scored.
    assert batch.labels_NB.tolist() == [[-100, 11, 12, 13], [-100, 13, 14, 15], [-100, 14, 15, -100]]


# ---------------------------------------------------------------------------------------------
# Parity with the reference forward (built from HF Qwen3 components)


def hf_reference_forward(model: DFlashDrafter, arch: TargetArch, feats_CF, ctx_pos_C, block_ids_B, anchor):
    """The z-lab `DFlashDraftModel.forward` data flow for one sequence and one block, written
    with transformers' Qwen3 modules: context = the tokens before the anchor, no mask."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3MLP,
        Qwen3RMSNorm,
        Qwen3RotaryEmbedding,
        rotate_half,
    )

    cfg = Qwen3Config(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=len(model.layers),
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        rms_norm_eps=arch.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta},
    )
    state = model.state_dict()

    def norm(name, dim):
        module = Qwen3RMSNorm(dim, eps=arch.rms_norm_eps)
        module.weight.data.copy_(state[name])
        return module

    def lin(name):
        return lambda x: F.linear(x, state[name])

    A, G, D = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    B = len(block_ids_B)
    position_ids = torch.cat([ctx_pos_C, anchor + torch.arange(B)])[None]
    hidden = F.embedding(block_ids_B[None], model.embed_VH)
    target_hidden = norm("hidden_norm.weight", arch.hidden_size)(lin("fc.weight")(feats_CF[None]))
    cos, sin = Qwen3RotaryEmbedding(cfg)(hidden, position_ids)
    cos, sin = cos[:, None], sin[:, None]
    for n in range(len(model.layers)):
        p = f"layers.{n}."
        residual = hidden
        x = norm(p + "input_layernorm.weight", arch.hidden_size)(hidden)
        q = norm(p + "self_attn.q_norm.weight", D)(
            lin(p + "self_attn.q_proj.weight")(x).view(1, B, A, D)
        ).transpose(1, 2)
        k = torch.cat(
            [lin(p + "self_attn.k_proj.weight")(target_hidden), lin(p + "self_attn.k_proj.weight")(x)], 1
        )
        v = torch.cat(
            [lin(p + "self_attn.v_proj.weight")(target_hidden), lin(p + "self_attn.v_proj.weight")(x)], 1
        )
        k = norm(p + "self_attn.k_norm.weight", D)(k.view(1, -1, G, D)).transpose(1, 2)
        v = v.view(1, -1, G, D).transpose(1, 2)
        q = q * cos[..., -B:, :] + rotate_half(q) * sin[..., -B:, :]
        k = k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(A // G, 1), v.repeat_interleave(A // G, 1)
        attn = F.scaled_dot_product_attention(q, k, v)  # no mask: the block sees all of it
        hidden = residual + lin(p + "self_attn.o_proj.weight")(attn.transpose(1, 2).reshape(1, B, A * D))
        mlp = Qwen3MLP(cfg)
        for part in ("gate", "up", "down"):
            getattr(mlp, f"{part}_proj").weight.data.copy_(state[f"{p}mlp.{part}_proj.weight"])
        hidden = hidden + mlp(norm(p + "post_attention_layernorm.weight", arch.hidden_size)(hidden))
    return norm("norm.weight", arch.hidden_size)(hidden)[0]


@pytest.mark.parametrize("kv_heads,head_dim", [(4, 16), (2, 32)])  # MHA; GQA with A*D != H
def test_forward_matches_reference_dataflow(kv_heads, head_dim):
    arch = tiny_arch(kv_heads=kv_heads, head_dim=head_dim)
    model = tiny_drafter(arch, num_layers=2, block_size=4, attention="sdpa")
    tokens = [list(range(3, 3 + 17))]
    anchor = 11
    batch = make_packed_batch(tokens, [[anchor]], 4, 2 * arch.hidden_size)
    with torch.no_grad():
        ours = model(batch)[0]
        visible = batch.context_pos_T < anchor
        ref = hf_reference_forward(
            model,
            arch,
            batch.context_TF[visible],
            batch.context_pos_T[visible],
            batch.block_ids_NB[0],
            anchor,
        )
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# The packed attention mask


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_fast_backends_match_naive_reference(kv_heads):
    arch = tiny_arch(kv_heads=kv_heads)
    model = tiny_drafter(arch, num_layers=2, attention="sdpa", attention_chunk_blocks=2)
    batch = three_sample_batch(arch)  # shuffled packing, an anchor at 0 in two samples
    outputs, grads = {}, {}
    for backend in ("naive", "sdpa", "eager"):
        model.attention_backend = backend
        model.zero_grad()
        out = model(batch)
        out.square().sum().backward()
        outputs[backend] = out.detach()
        grads[backend] = model.layers[0].self_attn.k_proj.weight.grad.clone()
    assert torch.isfinite(outputs["naive"]).all()
    for backend in ("sdpa", "eager"):
        torch.testing.assert_close(outputs[backend], outputs["naive"], atol=1e-5, rtol=1e-5, msg=backend)
        torch.testing.assert_close(grads[backend], grads["naive"], atol=1e-4, rtol=1e-4, msg=backend)


def test_flex_block_mask_matches_naive_reference():
    """The flex mask_mod and BlockMask over the whole pack (CPU flex is unfused, forward only)."""
    arch = tiny_arch(kv_heads=2)
    model = tiny_drafter(arch, num_layers=2)
    batch = three_sample_batch(arch)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.attention_backend = "naive"
        ref = model(batch)
        model.attention_backend = "flex"
        torch.testing.assert_close(model(batch), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.device
def test_flex_matches_naive_forward_and_backward(device):
    """The drafter's flex path (compiled with inductor on a GPU) against the rule written out, its
    gradients included."""
    if device.type != "cuda":
        pytest.skip("CPU flex has no backward: test_flex_block_mask_matches_naive_reference checks its forward")
    arch = tiny_arch(kv_heads=2)
    model = tiny_drafter(arch, num_layers=2).to(device)
    batch = three_sample_batch(arch).to(device)
    model.attention_backend = "naive"
    ref = model(batch)
    ref.square().sum().backward()
    ref_grad = model.fc.weight.grad.clone()
    model.zero_grad()
    model.attention_backend = "flex"
    out = model(batch)
    out.square().sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.fc.weight.grad, ref_grad, atol=1e-3, rtol=1e-3)


def _block(batch, sample, anchor):
    return int(((batch.block_seq_N == sample) & (batch.anchor_pos_N == anchor)).nonzero()[0, 0])


@pytest.mark.parametrize("backend", ["sdpa", "naive"])
def test_blocks_see_only_their_sample_before_the_anchor(backend):
    arch = tiny_arch(kv_heads=2)
    model = tiny_drafter(arch, attention_chunk_blocks=3)
    model.attention_backend = backend
    batch = three_sample_batch(arch)
    n = _block(batch, sample=0, anchor=11)
    n_zero = _block(batch, sample=0, anchor=0)
    with torch.no_grad():
        base = model(batch)

        def run_perturbed(rows_T=None, block=None):
            feats = batch.context_TF.clone()
            ids = batch.block_ids_NB.clone()
            if rows_T is not None:
                feats[rows_T] += 5.0
            if block is not None:
                ids[block, 0] = (ids[block, 0] + 1) % MASK_ID
            perturbed = DrafterBatch(**{**batch.__dict__, "context_TF": feats, "block_ids_NB": ids})
            return model(perturbed)

        same_sample = batch.context_seq_T == 0
        at_or_after = run_perturbed(same_sample & (batch.context_pos_T >= 11))
        torch.testing.assert_close(at_or_after[n], base[n], atol=0, rtol=0)
        other_sample = run_perturbed(batch.context_seq_T != 0)
        torch.testing.assert_close(other_sample[n], base[n], atol=0, rtol=0)
        torch.testing.assert_close(other_sample[n_zero], base[n_zero], atol=0, rtol=0)
        before = run_perturbed(same_sample & (batch.context_pos_T == 10))
        assert (before[n] - base[n]).abs().max() > 1e-3
        # An anchor at position 0 sees no context at all, and still produces finite output.
        everything = run_perturbed(torch.ones_like(same_sample))
        torch.testing.assert_close(everything[n_zero], base[n_zero], atol=0, rtol=0)
        assert torch.isfinite(base).all()
        # Blocks never see each other.
        other_block = run_perturbed(block=_block(batch, sample=0, anchor=5))
        torch.testing.assert_close(other_block[n], base[n], atol=0, rtol=0)
        own_block = run_perturbed(block=n)
        assert (own_block[n] - base[n]).abs().max() > 1e-3


def test_block_slots_attend_bidirectionally():
    """Slot 1 depends on slot 3's input (no causal mask inside a block)."""
    arch = tiny_arch()
    model = tiny_drafter(arch, num_layers=1, attention="sdpa")
    batch = make_packed_batch([list(range(20))], [[6]], 4, 2 * 64)
    emb = model.embed_VH.clone()
    with torch.no_grad():
        base = model(batch)
        ids = batch.block_ids_NB.clone()
        ids[0, 3] = 42
        changed = model(DrafterBatch(**{**batch.__dict__, "block_ids_NB": ids}))
    assert (changed[0, 1] - base[0, 1]).abs().max() > 1e-3
    assert torch.equal(model.embed_VH, emb)


def test_logits_use_the_frozen_head():
    arch = tiny_arch()
    model = tiny_drafter(arch)
    hidden = torch.randn(3, 4, 64)
    torch.testing.assert_close(model.logits(hidden), hidden @ model.lm_head_VH.T)


# ---------------------------------------------------------------------------------------------
# Frozen target parts read from safetensors


def _tiny_hf(kind: str, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    return Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common))


@pytest.mark.parametrize(
    "kind,tied,shard",
    [("llama", True, None), ("qwen3", False, None), ("qwen3", False, "10KB"), ("llama", True, "10KB")],
)
def test_load_embed_and_head_matches_hf(tmp_path, kind, tied, shard):
    model = _tiny_hf(kind, tied)
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)
    embed, head = load_embed_and_head(tmp_path)
    torch.testing.assert_close(embed, model.get_input_embeddings().weight.detach(), atol=0, rtol=0)
    torch.testing.assert_close(head, model.get_output_embeddings().weight.detach(), atol=0, rtol=0)
    assert (embed is head) == tied
    if not tied:
        assert not torch.equal(embed, head)


def test_load_embed_and_head_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="target folder not found"):
        load_embed_and_head(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_embed_and_head(tmp_path)
    from safetensors.torch import save_file

    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(InputFileError, match="no embedding tensor"):
        load_embed_and_head(tmp_path)
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": false}')
    with pytest.raises(InputFileError, match="tie_word_embeddings=false"):
        load_embed_and_head(tmp_path)


def test_bf16_autocast_gives_attention_one_dtype(monkeypatch):
    """fp32 master weights under bf16 autocast: q/k (after RMSNorm) and v reach attention alike."""
    norm = model_module.RMSNorm(8, 1e-6)
    assert norm(torch.randn(3, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    seen = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    arch = tiny_arch(kv_heads=2)
    model = tiny_drafter(arch, num_layers=2, attention="sdpa")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(three_sample_batch(arch))
    out.float().square().sum().backward()
    assert seen and all(dtypes == (torch.bfloat16,) * 3 for dtypes in seen), seen


def test_activation_checkpointing_gives_identical_outputs_and_gradients():
    arch = tiny_arch(kv_heads=2)
    batch = three_sample_batch(arch)
    results = []
    for recompute in (False, True):
        model = tiny_drafter(arch, num_layers=2, attention="sdpa", activation_checkpointing=recompute)
        out = model(batch)
        out.square().sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    assert torch.equal(results[0][0], results[1][0])
    assert len(results[0][1]) == len(results[1][1]) > 0
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_drafter_layers_can_start_as_the_targets_last_layers(tiny_target_dir):
    """model.init=target_layers: layer j of the drafter is the target's layer L-n+j, its final norm
    the target's, and fc passes the deepest feature layer through."""
    from safetensors.torch import load_file

    from shared.target_parts import load_target_layers
    from stage2_train.model.description import describe_parts
    from stage2_train.model.drafter import build_drafter, init_from_target_layers

    arch = TargetArch.from_dir(tiny_target_dir)  # 6 layers, 64 wide (Llama: no q/k norms)
    embed, head = load_embed_and_head(tiny_target_dir)
    description = describe_parts(DrafterConfig(num_layers=2, block_size=4), arch, [1, 2, 3], 16)
    drafter = build_drafter(description, embed, head, seed=0)
    copied = init_from_target_layers(drafter, load_target_layers(tiny_target_dir, [4, 5]))
    target = load_file(tiny_target_dir / "model.safetensors")
    assert torch.equal(drafter.layers[0].self_attn.q_proj.weight, target["model.layers.4.self_attn.q_proj.weight"])
    assert torch.equal(drafter.layers[1].mlp.down_proj.weight, target["model.layers.5.mlp.down_proj.weight"])
    assert torch.equal(drafter.norm.weight, target["model.norm.weight"])
    assert torch.equal(drafter.hidden_norm.weight, target["model.layers.4.input_layernorm.weight"])
    H = arch.hidden_size
    assert torch.equal(drafter.fc.weight, torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], dim=1))
    assert "layers.0.self_attn.q_norm.weight" not in copied  # a Llama target has none: they stay ones
    assert torch.equal(drafter.layers[0].self_attn.q_norm.weight, torch.ones(arch.head_dim))
