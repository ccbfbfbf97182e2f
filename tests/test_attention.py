"""The attention plans: sliding-window layers, every backend against the rule written out, compiled
flex over many pack shapes without recompiling, and dtypes under bf16 autocast.

    .venv/bin/python -m pytest tests/test_attention.py -q
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from stage2_train.model.attention import FULL, MaskKind, layer_kinds
from testkit.drafter import (
    MASK_ID,
    compiled_flex_over_packs,
    make_packed_batch,
    three_sample_batch,
    tiny_arch,
    tiny_drafter,
)


def test_layer_kinds_follow_zlab_reading_of_the_config():
    sliding, full = MaskKind(5, True), FULL
    assert layer_kinds(None, 2, None, None) == [full, full]
    assert layer_kinds(("sliding_attention", "full_attention"), 2, 5, None) == [sliding, full]
    # is_causal set: every layer follows it, full ones included
    assert layer_kinds(("sliding_attention", "full_attention"), 2, 5, True) == [sliding, MaskKind(None, True)]
    assert layer_kinds(("sliding_attention",), 1, 5, False) == [MaskKind(5, False)]


def test_the_sliding_rule_is_zlabs():
    """A query at absolute position a + i sees key k when (a + i) - k < W; in the block, slots j <= i
    (and i - j < W); the matrices of z-lab's `_attention_mask` for a 12-token context, block 4, W 5."""
    kind = MaskKind(window=5, causal=True)
    a, B = 12, 4
    q = torch.arange(a, a + B)[:, None]
    k = torch.arange(a + B)[None, :]
    in_block = k >= a
    before_anchor = (k < a) | in_block
    visible = before_anchor & kind.visible(q, k, in_block)
    rows = ["".join(str(int(x)) for x in row[:a]) + "|" + "".join(str(int(x)) for x in row[a:]) for row in visible]
    assert rows == ["000000001111|1000", "000000000111|1100", "000000000011|1110", "000000000001|1111"]
    w3 = MaskKind(window=3, causal=True)
    last = (before_anchor & w3.visible(q, k, in_block))[-1]
    assert "".join(str(int(x)) for x in last[a:]) == "0111"  # z-lab windows the block too when W < B


@pytest.mark.parametrize("causal", [None, False])
@pytest.mark.parametrize("window", [1, 3, 6, 40])
def test_every_backend_matches_the_naive_rule_with_sliding_layers(window, causal):
    arch = tiny_arch(kv_heads=2)
    types = ("sliding_attention", "sliding_attention", "full_attention")
    model = tiny_drafter(arch, num_layers=3, attention_chunk_blocks=2, layer_types=types, sliding_window=window, is_causal=causal)
    batch = three_sample_batch(arch)
    outputs, grads = {}, {}
    for backend in ("naive", "sdpa", "eager"):
        model.attention_backend = backend
        model.zero_grad()
        out = model(batch)
        out.square().sum().backward()
        outputs[backend] = out.detach()
        grads[backend] = model.layers[0].self_attn.k_proj.weight.grad.clone()
    for backend in ("sdpa", "eager"):
        torch.testing.assert_close(outputs[backend], outputs["naive"], atol=1e-5, rtol=1e-5, msg=backend)
        torch.testing.assert_close(grads[backend], grads["naive"], atol=1e-4, rtol=1e-4, msg=backend)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.attention_backend = "flex"  # uncompiled on CPU: the mask, forward only
        torch.testing.assert_close(model(batch), outputs["naive"], atol=1e-5, rtol=1e-5)
    # a window changes the answer (the test would pass on a rule that ignores it otherwise)
    if window < 40:
        model.attention_backend = "naive"
        plain = tiny_drafter(arch, num_layers=3, attention="sdpa")
        plain.load_state_dict(model.state_dict())
        plain.set_frozen_parts(model.embed_VH, model.lm_head_VH)
        plain.attention_backend = "naive"
        with torch.no_grad():
            assert not torch.allclose(plain(batch), outputs["naive"], atol=1e-4)


def test_a_window_shrinks_the_sdpa_plan_on_long_contexts():
    """The groups' masks hold only the context a window can reach: at 8K tokens, W 512 vs full."""
    from stage2_train.model.attention import _plan_groups

    T, B = 8192, 16
    anchors = sorted(random.Random(0).sample(range(T - B), 512))  # the recipe: 512 anchors per sample
    batch = make_packed_batch([[1] * T], [anchors], B, 8)
    full = _plan_groups(batch, B, 64, "sdpa", FULL)
    sliding = _plan_groups(batch, B, 64, "sdpa", MaskKind(512, True))
    full_bytes = sum(g.mask_QC.numel() for g in full.groups)
    sliding_bytes = sum(g.mask_QC.numel() for g in sliding.groups)
    assert sliding_bytes * 2 < full_bytes, (sliding_bytes, full_bytes)  # bench/attention.py gives the figures


def random_batch(rng: random.Random, arch, block_size=4):
    lengths = [rng.randint(block_size + 2, 60) for _ in range(rng.randint(1, 4))]
    tokens = [[rng.randrange(MASK_ID) for _ in range(n)] for n in lengths]
    anchors = [sorted(rng.sample(range(n - 1), rng.randint(1, min(6, n - 1)))) for n in lengths]
    return make_packed_batch(tokens, anchors, block_size, 2 * arch.hidden_size, seed=rng.randrange(1000))


@pytest.mark.slow  # ~60 s on 2 cores: `make test-all`
@pytest.mark.device
def test_compiled_flex_compiles_a_fixed_number_of_times_over_twenty_pack_shapes(monkeypatch, device):
    """The mask is built from index tensors only: 20 micro-batches of different shapes cost a few
    compilations (dynamo's counters: one per size-1 specialisation, a pack of one block or of one
    128-key tile, none after), and compiled flex equals the naive rule on each. Dynamo's guards decide
    recompilation whatever the backend; CPU compiles with aot_eager (see COMPILE_BACKEND), a GPU
    (`--device cuda`) with inductor in bf16, on packs of training's size (>= 10 blocks each: a pack of
    <= 128 query rows, one flex block, compiles once more, once)."""
    from stage2_train.model import attention

    if device.type == "cuda":
        rng, packs = random.Random(0), []
        for _ in range(20):
            lengths = [rng.randint(200, 900) for _ in range(rng.randint(2, 6))]
            anchors = [sorted(rng.sample(range(n - 16), rng.randint(8, 40))) for n in lengths]
            packs.append(make_packed_batch([[0] * n for n in lengths], anchors, 16, 1).to(device))
        graphs, worst = compiled_flex_over_packs(packs, FULL, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, check=3)
        tolerance = 5e-2  # bf16 attention against the rule in bf16
    else:
        monkeypatch.setattr(attention, "COMPILE_BACKEND", "aot_eager")
        arch, rng = tiny_arch(kv_heads=2), random.Random(0)
        packs = [random_batch(rng, arch) for _ in range(20)]
        graphs, worst = compiled_flex_over_packs(packs, MaskKind(6, True), heads=4, kv_heads=2, head_dim=16)
        tolerance = 1e-4
    assert worst < tolerance, worst  # every pack checked equals the rule written out
    assert graphs[-1] <= 6 and graphs[9] == graphs[-1], f"graphs compiled after each of 20 packs: {graphs}"


def test_under_bf16_autocast_the_context_is_not_upcast():
    """On GPU training runs under bf16 autocast with fp32 master weights: fc must take the bf16
    context as it comes (an fp32 copy of [T, n*H] is ~1.3 GB per 8B micro-batch) and emit bf16."""
    arch = tiny_arch(kv_heads=2)
    model = tiny_drafter(arch, num_layers=1)
    batch = three_sample_batch(arch)
    batch.context_TF = batch.context_TF.to(torch.bfloat16)
    seen = {}
    model.fc.register_forward_hook(lambda m, i, o: seen.update(fc_in=i[0].dtype, fc_out=o.dtype))
    model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.update(mlp_out=o.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(batch)
    assert seen == {"fc_in": torch.bfloat16, "fc_out": torch.bfloat16, "mlp_out": torch.bfloat16}
    assert model.fc.weight.dtype == torch.float32 and torch.isfinite(out.float()).all()
    out.float().square().sum().backward()
    assert model.fc.weight.grad.dtype == torch.float32  # master weights keep fp32 gradients
    seen.clear()
    model(batch)  # without autocast the weights' dtype rules: the context is cast once, to fp32
    assert seen["fc_in"] == torch.float32


def test_compiled_flex_has_room_for_each_mask_kind_and_mode_and_no_graph_for_a_lone_block():
    """Dynamo stops compiling a function after 8 graphs and then runs flex unfused (the whole mask
    and scores materialised: an out-of-memory at 8B). Each mask kind x training / evaluation x the
    shape specialisations needs its graph; a micro-batch of one block must not add one by its strides."""
    import torch._dynamo

    from stage2_train.model import attention

    with torch._dynamo.config.patch(recompile_limit=8):
        attention._block_mask_builder.cache_clear()
        attention._flex_attention.cache_clear()
        attention._flex_attention(True)
        assert torch._dynamo.config.recompile_limit >= 64
    one_block = make_packed_batch([[1] * 40], [[10]], 4, 2 * tiny_arch().hidden_size, seed=0)
    index = attention.flex_index(one_block, 4)
    assert all(t.is_contiguous() and 0 not in t.stride() for t in index.values())
    attention._flex_attention.cache_clear()  # the next compiled call raises the limit again after the patch's undo
