"""stage2_train/model/flops.py: the training step's model FLOPs by hand, and the replayed work of a
step equal to what the loader hands the trainer.

    .venv/bin/python -m pytest tests/test_flops.py -q
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from shared.reader import StoreReader
from shared.store import StoreConfig
from stage2_train.data.anchors import AnchorSampler
from stage2_train.data.batch import IGNORE
from stage2_train.data.config import SamplerConfig
from stage2_train.data.loader import PrefetchLoader
from stage2_train.data.sampler import LengthMixedSampler
from stage2_train.model.config import DrafterConfig
from stage2_train.model.drafter import DFlashDrafter
from stage2_train.model.flops import DrafterShape, StepWork, step_work, train_step_flops, utilization
from testkit.drafter import tiny_arch
from testkit.store import make_store, samples

# H=4, A=2 heads, G=1 kv head, D=2, I=8, V=10, 3 feature layers, block 4.
ARCH = tiny_arch(hidden=4, heads=2, kv_heads=1, head_dim=2, vocab=10, inter=8)
SHAPE = DrafterShape.of(DrafterConfig(num_layers=1, block_size=4), ARCH, num_feature_layers=3)
# One sample of 8 tokens with one block anchored at 3: its 4 query rows see keys 0..2 and its 4 slots
# (4 x 7 = 28 pairs); slots 1..3 are scored.
WORK = StepWork(context_tokens=8, blocks=1, scored_rows=3, attention_pairs=28)


def test_the_shape_is_the_drafters():
    assert SHAPE == DrafterShape(hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10, num_layers=1,
                                 num_feature_layers=3, block_size=4)
    wide = DrafterShape.of(DrafterConfig(num_layers=2, intermediate_size=16), ARCH, 5)
    assert (wide.intermediate, wide.num_layers, wide.num_feature_layers, wide.block_size) == (16, 2, 5, 16)


def test_train_step_flops_by_hand():
    # per block row and layer: q 4*2*2 + k,v 2*4*1*2 + o 2*2*4 + MLP 3*4*8 = 16 + 16 + 16 + 96 = 144 weights
    assert train_step_flops(SHAPE, WORK) == {
        "layers": 6 * 144 * 4,  # 4 block rows = 3456
        "context_kv": 6 * 16 * 8,  # k/v over 8 context tokens = 768
        "fc": 4 * (3 * 4 * 4) * 8,  # 48 weights, no input gradient = 1536
        "attention": 12 * 2 * 2 * 28,  # 12 x D x A per pair = 1344
        "lm_head": 4 * 10 * 4 * 3,  # 3 scored rows = 480
        "total": 7584,
    }


def test_train_step_flops_scale_with_layers_where_they_should():
    one = train_step_flops(SHAPE, WORK)
    three = train_step_flops(DrafterShape(**{**SHAPE.__dict__, "num_layers": 3}), WORK)
    for part in ("layers", "context_kv", "attention"):
        assert three[part] == 3 * one[part]
    for part in ("fc", "lm_head"):  # once per step, whatever the depth
        assert three[part] == one[part]


def test_utilization_is_flops_over_time_and_peak():
    rows = [{"step_s": 2.0, "forward_s": 0.25, "backward_s": 0.5, "optim_s": 0.25}] * 2  # 1 s of compute a step
    got = utilization(SHAPE, [WORK, WORK], rows, peak=7584.0)
    assert (got["mfu"], got["mfu_compute_only"]) == (0.5, 1.0)  # 7,584 FLOPs a step (the hand count)
    assert got["achieved_tflops"] == 7584 / 2 / 1e12 and got["tflop_per_step"] == 7584 / 1e12
    assert got["flops_share"] == {"layers": 3456 / 7584, "context_kv": 768 / 7584, "fc": 1536 / 7584,
                                  "attention": 1344 / 7584, "lm_head": 480 / 7584}
    assert utilization(SHAPE, [WORK], rows[:1])["mfu"] is None  # no peak known (CPU)


def test_flop_count_weights_are_the_drafters():
    """The weight counts behind the formula are the drafter's trainable matrices."""
    model = DFlashDrafter(DrafterConfig(num_layers=2, block_size=4), ARCH, num_feature_layers=3, mask_token_id=9)
    matrices = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad and p.dim() == 2}
    assert sum(v for n, v in matrices.items() if n.startswith("layers.")) == 2 * 144
    assert matrices == {**{n: v for n, v in matrices.items() if n.startswith("layers.")}, "fc.weight": 3 * 4 * 4}


def test_variant_flops_by_hand():
    # r 2 over V 10, H 4: DSpark's W2 z on the 3 scored rows, its gate [(H + r) -> r] and confidence
    # head [(H + r) -> 1] on the 4 block rows.
    dspark = DrafterShape.of(DrafterConfig(variant="dspark", num_layers=1, block_size=4, markov_rank=2, markov_head="gated"), ARCH, 3)
    assert dspark.markov_rank == 2 and dspark.selector_rank == 0
    assert train_step_flops(dspark, WORK)["variant"] == 6 * (10 * 2 * 3 + (6 * 2 + 6) * 4)  # 792
    rnn = DrafterShape(**{**dspark.__dict__, "markov_head": "rnn", "confidence_head": False})
    assert train_step_flops(rnn, WORK)["variant"] == 6 * (10 * 2 * 3 + (2 * 2 + 4) * 6 * 4)  # joint [(2r + H) -> 3r]
    # DFlash2, 2 taps, groups of 2 channels (2 groups), r 2, K 3: per layer two convolutions, each a kernel
    # projection [H -> 2 sides x 2 taps x 2 groups] and 2 sides x 2 taps of products over H, on 4 block rows;
    # P [H -> r] on the block rows; 3 candidates' r-dot products on the 3 scored rows.
    dflash2 = DrafterShape.of(DrafterConfig(variant="dflash2", num_layers=1, block_size=4, conv_kernel_size=2, conv_group_size=2,
                                            selector_rank=2, selector_top_k=3), ARCH, 3)
    conv = 2 * (4 * 8 + 2 * 4 * 2)
    assert train_step_flops(dflash2, WORK)["variant"] == 6 * (conv * 4 + 4 * 2 * 4 + 3 * 2 * 3)  # 2604
    assert train_step_flops(dflash2, WORK)["total"] == 7584 + 2604  # the DFlash backbone's parts unchanged
    assert "variant" not in train_step_flops(SHAPE, WORK)


def test_variant_flop_weights_are_the_modules():
    """The matrices variant_flops counts are the variant modules' trained matrices."""
    from stage2_train.model.dflash2 import DFlash2Drafter
    from stage2_train.model.dspark import DSparkDrafter

    dspark = DSparkDrafter(DrafterConfig(variant="dspark", num_layers=1, block_size=4, markov_rank=2, markov_head="gated"), ARCH, 3, 9)
    sizes = {n: p.numel() for n, p in dspark.named_parameters() if n.startswith(("markov_head.", "confidence_head."))}
    assert sizes == {"markov_head.markov_w1.weight": 10 * 2, "markov_head.markov_w2.weight": 10 * 2,  # W1: a gather
                     "markov_head.gate_proj.weight": 6 * 2, "markov_head.gate_proj.bias": 2,
                     "confidence_head.proj.weight": 6, "confidence_head.proj.bias": 1}
    dflash2 = DFlash2Drafter(DrafterConfig(variant="dflash2", num_layers=1, block_size=4, conv_kernel_size=2, conv_group_size=2,
                                           selector_rank=2, selector_top_k=3), ARCH, 3, 9)
    sizes = {n: p.numel() for n, p in dflash2.named_parameters() if "conv" in n or "selector" in n}
    assert sizes == {**{f"layers.0.{c}.kernel_projection.weight": 4 * 8 for c in ("attention_conv", "mlp_conv")},
                     **{f"layers.0.{c}.base_kernel": 2 * 2 * 4 for c in ("attention_conv", "mlp_conv")},
                     "candidate_selector.predecessor_codebook": 20, "candidate_selector.successor_codebook": 20,
                     "candidate_selector.hidden_projection.weight": 4 * 2}


@pytest.mark.parametrize("label_shift", [0, 1])
def test_step_work_is_what_the_loader_hands_the_trainer(tmp_path, label_shift):
    """Replayed from the sampler and anchor sampler alone, each step's tokens, blocks, scored rows and
    attention pairs equal those of the micro-batches the loader collates for it, with a block budget
    that binds (the packing then depends on each sample's blocks); a DSpark run's (label_shift 1)
    scored rows are its shifted labels."""
    url = str(tmp_path / "store")
    make_store(url, [samples(9, seed=1, tokens=(20, 90)), samples(8, seed=2, tokens=(20, 90), first_id=9)], StoreConfig())
    reader = StoreReader(url)
    cfg = SamplerConfig(micro_batch_tokens=200, micro_batch_blocks=60, max_anchors_per_seq=40)
    anchors = AnchorSampler(cfg, block_size=4, seed=3)
    sampler = LengthMixedSampler(cfg, reader.lengths, seed=3, grad_accum=2,
                                 blocks=anchors.block_counts(reader.lengths, reader.supervised_pairs()))
    loader = PrefetchLoader(reader, sampler, anchors, mask_token_id=9, num_threads=1, gather_topk=False, label_shift=label_shift)
    seen: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for loaded in loader:
        batch, totals = loaded.batch, seen[(loaded.epoch, loaded.step_in_epoch)]
        totals[0] += batch.context_TF.shape[0]
        totals[1] += batch.labels_NB.shape[0]
        totals[2] += int((batch.labels_NB != IGNORE).sum())
        totals[3] += int((batch.anchor_pos_N + 4).sum()) * 4
    rows = [{"epoch": e, "step_in_epoch": s} for e, s in seen]
    masks = {reader[i]["sample_id"]: reader[i]["loss_mask_T"].numpy() for i in range(len(reader))}
    fresh = AnchorSampler(cfg, block_size=4, seed=3)
    replayed = step_work(sampler, fresh, reader.sample_ids, masks, rows, label_shift=label_shift)
    assert len(rows) > 2 and sum(w.blocks for w in replayed) > 0
    assert [(w.context_tokens, w.blocks, w.scored_rows, w.attention_pairs) for w in replayed] == [tuple(t) for t in seen.values()]
