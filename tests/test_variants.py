"""The DSpark and DFlash2 variants: their batches, modules, loss terms, decoding, description and folders.

.venv/bin/python -m pytest tests/test_variants.py -q

Parity with speculators' and z-lab's own classes is in tests/test_peers.py (where the peers are installed).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from shared.errors import CheckpointError
from stage2_train.data.batch import IGNORE, collate
from stage2_train.model.config import DrafterConfig, LossConfig
from stage2_train.model.description import DrafterDescription, describe_parts
from stage2_train.model.dflash2 import DFlash2Drafter, grouped_conv
from stage2_train.model.drafter import DFlashDrafter, build_drafter
from stage2_train.model.dspark import DSparkDrafter
from stage2_train.model.loss import dflash_loss, position_weights
from stage2_train.serve.export import export_drafter
from stage2_train.serve.load import folder_description, init_weights_for, load_exported
from stage2_train.train.evaluate import score_blocks
from tests.test_model import MASK_ID, tiny_arch
from tests.test_trainer import store  # noqa: F401 - the 40-sample feature store fixture

LAYER_IDS = [1, 3]
BLOCK = 4


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def variant_cfg(variant: str, **extra) -> DrafterConfig:
    sizes = {
        "dflash": {},
        "dspark": {"markov_rank": 8},
        "dflash2": {"conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4},
    }[variant]
    return DrafterConfig(variant=variant, num_layers=2, block_size=BLOCK, attention="sdpa", init_std=0.2, **{**sizes, **extra})


def make_drafter(variant: str, seed: int = 0, arch=None, randomize: bool = True, **extra):
    """A drafter of `variant` whose every weight is random (the heads' and the convolutions' too)."""
    arch = arch or tiny_arch()
    gen = torch.Generator().manual_seed(seed + 50)
    embed, head = torch.randn(arch.vocab_size, arch.hidden_size, generator=gen), torch.randn(arch.vocab_size, arch.hidden_size, generator=gen)
    cfg = variant_cfg(variant, **extra)
    drafter = build_drafter(describe_parts(cfg, arch, LAYER_IDS, MASK_ID), embed, head, runtime=cfg, seed=seed)
    if randomize:
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
                elif "conv" in name or "markov" in name or "confidence" in name or "selector" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return drafter.eval()


def make_samples(lengths, hidden, vocab=100, top_k=8, seed=1, mask=None):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for T in lengths:
        lp_TK = torch.randn(T, top_k, generator=gen).log_softmax(-1).sort(-1, descending=True).values - 0.1
        samples.append({
            "input_ids_T": torch.randint(0, MASK_ID, (T,), generator=gen),
            "loss_mask_T": torch.ones(T, dtype=torch.bool) if mask is None else mask[:T].clone(),
            "hidden_TLH": torch.randn(T, len(LAYER_IDS), hidden, generator=gen),
            "topk_logprobs_TK": lp_TK,
            "topk_ids_TK": torch.stack([torch.randperm(vocab, generator=gen)[:top_k] for _ in range(T)]),
        })
    return samples


# ---------------------------------------------------------------------------------------------
# Batches: DSpark's labels are one token further


def test_a_dspark_batch_labels_slot_k_with_the_token_after_it_and_reads_top_k_row_a_plus_k():
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    (sample,) = make_samples([12], 8, mask=mask)
    ids, lp, top = sample["input_ids_T"], sample["topk_logprobs_TK"], sample["topk_ids_TK"]
    anchors = torch.tensor([2, 4, 9])
    dflash = collate([sample], [anchors], block_size=BLOCK, mask_token_id=MASK_ID, label_shift=0)
    dspark = collate([sample], [anchors], block_size=BLOCK, mask_token_id=MASK_ID, label_shift=1)
    assert torch.equal(dflash.block_ids_NB, dspark.block_ids_NB)  # same input block, same RoPE positions
    for n, a in enumerate(anchors.tolist()):
        for k in range(BLOCK):
            # DFlash: slot k predicts a + k (slot 0 never); DSpark: a + k + 1, every slot
            for batch, c, scorable in ((dflash, a + k, k >= 1), (dspark, a + k + 1, True)):
                scored = scorable and c < 12 and bool(mask[a : c + 1].all())  # the answer ends at 7
                assert int(batch.labels_NB[n, k]) == (int(ids[c]) if scored else IGNORE), (batch.label_shift, a, k)
                if scored:  # top-k row c - 1 holds the target's distribution of token c
                    assert torch.equal(batch.topk_logprobs_NBK[n, k], lp[c - 1])
                    assert torch.equal(batch.topk_ids_NBK[n, k], top[c - 1])
                assert int(batch.prev_ids_NB[n, k]) == int(ids[min(max(c - 1, a), 11)])
    # anchor 4: DSpark slot 2 predicts 7 (unsupervised: the answer ended), slot 3 predicts 8, the next
    # answer's, not scored (the block does not see 7, and decoding never drafts across it)
    assert dspark.labels_NB[1].tolist() == [int(ids[5]), int(ids[6]), IGNORE, IGNORE]
    # anchor 9 runs past the end: DSpark scores 10 and 11, DFlash 10 and 11 from slots 1 and 2
    assert dspark.labels_NB[2].tolist() == [int(ids[10]), int(ids[11]), IGNORE, IGNORE]
    assert dflash.labels_NB[2].tolist() == [IGNORE, int(ids[10]), int(ids[11]), IGNORE]
    assert (dspark.first_slot, dflash.first_slot) == (0, 1)


def test_dspark_weights_decay_from_slot_0():
    assert torch.allclose(position_weights(4, 4.0, first=0), torch.exp(-torch.arange(4.0) / 4.0))
    assert position_weights(4, 4.0)[0] == 0 and torch.allclose(position_weights(4, 4.0)[1:], torch.exp(-torch.arange(3.0) / 4.0))


# ---------------------------------------------------------------------------------------------
# Modules


def test_each_variant_has_its_peers_weight_names_and_shapes():
    arch = tiny_arch()
    names = {v: dict(make_drafter(v, randomize=False).state_dict()) for v in ("dflash", "dspark", "dflash2")}
    base = set(names["dflash"])
    r, V, H = 8, arch.vocab_size, arch.hidden_size
    assert {k: tuple(v.shape) for k, v in names["dspark"].items() if k not in base} == {
        "markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r),
        "confidence_head.proj.weight": (1, H + r), "confidence_head.proj.bias": (1,),
    }
    extra = {k: tuple(v.shape) for k, v in names["dflash2"].items() if k not in base}
    assert extra == {
        **{f"layers.{i}.{c}_conv.{p}": s for i in range(2) for c in ("attention", "mlp")
           for p, s in (("base_kernel", (2, 2, H)), ("kernel_projection.weight", (2 * 2 * (H // 8), H)))},
        "candidate_selector.predecessor_codebook": (V, r), "candidate_selector.successor_codebook": (V, r),
        "candidate_selector.hidden_projection.weight": (r, H),
    }
    assert {k for k in make_drafter("dspark", markov_head="gated").state_dict() if k not in base} >= {
        "markov_head.gate_proj.weight", "markov_head.gate_proj.bias"}
    assert {k for k in make_drafter("dspark", markov_head="rnn").state_dict() if k not in base} >= {"markov_head.joint_proj.weight"}


def test_a_new_dflash2_drafter_computes_the_dflash_drafter_it_extends():
    """Identity convolutions (speculators' and SpecForge's init): the same backbone, the same outputs."""
    dflash = make_drafter("dflash", seed=3)
    dflash2 = make_drafter("dflash2", seed=3, randomize=False)
    assert dflash2.load_state_dict(dflash.state_dict(), strict=False).unexpected_keys == []
    batch = collate(make_samples([14, 11], 64), [torch.tensor([2, 7]), torch.tensor([0, 5, 9])], block_size=BLOCK, mask_token_id=MASK_ID)
    with torch.no_grad():
        assert torch.equal(dflash(batch), dflash2(batch))
        dflash2.layers[0].mlp_conv.kernel_projection.weight.normal_(0, 0.1)
        assert not torch.allclose(dflash(batch), dflash2(batch))


def test_the_grouped_convolution_is_causal_inside_each_block_with_the_coefficient_at_the_output_slot():
    gen = torch.Generator().manual_seed(4)
    N, B, H, G, taps = 3, 5, 8, 4, 3
    x, base = torch.randn(N, B, H, generator=gen), torch.randn(taps, H, generator=gen)
    delta = torch.randn(N, B, taps, H // G, generator=gen)
    out = grouped_conv(x, delta, base, G)
    expected = torch.zeros(N, B, H)
    for n in range(N):
        for t in range(B):
            for c in range(H):
                for tau in range(min(taps, t + 1)):
                    expected[n, t, c] += (base[tau, c] + delta[n, t, tau, c // G]) * x[n, t - tau, c]
    assert torch.allclose(out, expected, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Loss terms


def shifted_batch(lengths=(14, 12), anchors=((1, 6, 11), (0, 4, 9)), label_shift=1, seed=1, greedy=False):
    """A batch of random samples; `greedy`: the text is the target's own greedy text (its stored top-1
    is always the next token), where the selector's label and the data label agree."""
    samples = make_samples(list(lengths), 64, seed=seed)
    if greedy:
        for sample in samples:
            ids, top = sample["input_ids_T"], sample["topk_ids_TK"]
            top[:-1, 0] = ids[1:]
            top[:-1, 1:] = torch.where(top[:-1, 1:] == ids[1:, None], (ids[1:, None] + 1) % MASK_ID, top[:-1, 1:])
    return collate(samples, [torch.tensor(a) for a in anchors], block_size=BLOCK, mask_token_id=MASK_ID, label_shift=label_shift)


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_the_dspark_loss_is_markov_corrected_ce_and_kl_plus_the_confidence_bce(head):
    drafter = make_drafter("dspark", markov_head=head)
    batch = shifted_batch()
    cfg = LossConfig(gamma=4.0, kl_weight=0.5, confidence_weight=0.7)
    with torch.no_grad():
        hidden = drafter(batch)
        loss, m = dflash_loss(hidden, drafter.lm_head_VH, batch, cfg, variant=drafter)
        # by hand: the bias of each slot from the data token before its label, rnn state along the block
        mk = drafter.markov_head
        e = mk.markov_w1.weight[batch.prev_ids_NB]
        z = torch.zeros_like(e)
        state = torch.zeros_like(e[:, 0])
        for k in range(BLOCK):
            if head == "vanilla":
                z[:, k] = e[:, k]
            elif head == "gated":
                z[:, k] = torch.sigmoid(mk.gate_proj(torch.cat([hidden[:, k], e[:, k]], -1))) * e[:, k]
            else:
                a, c, o = mk.joint_proj(torch.cat([state, e[:, k], hidden[:, k]], -1)).chunk(3, -1)
                state = torch.sigmoid(a) * state + (1 - torch.sigmoid(a)) * torch.tanh(c)
                z[:, k] = torch.tanh(o)
        logits = hidden @ drafter.lm_head_VH.T + z @ mk.markov_w2.weight.T
        valid = batch.labels_NB != IGNORE
        w = torch.exp(-torch.arange(BLOCK) / 4.0).expand_as(valid) * valid
        logq = logits.log_softmax(-1)
        ce = -logq.gather(-1, batch.labels_NB.clamp(min=0)[..., None])[..., 0]
        logp = batch.topk_logprobs_NBK.log_softmax(-1)
        kl = (logp.exp() * (logp - logq.gather(-1, batch.topk_ids_NBK))).sum(-1)
        alpha = torch.minimum(batch.topk_logprobs_NBK.exp(), logq.gather(-1, batch.topk_ids_NBK).exp()).sum(-1)
        conf = drafter.confidence_head.proj(torch.cat([hidden, e], -1))[..., 0]
        bce = F.binary_cross_entropy_with_logits(conf, alpha, reduction="none")
        expected = ((w * ce).sum() + 0.5 * (w * kl).sum() + 0.7 * (w * bce).sum()) / w.sum()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    assert float(m["confidence_loss"]) == pytest.approx(float((w * bce).sum() / w.sum()), rel=1e-5)
    assert float(m["accept_rate"]) == pytest.approx(float(alpha[valid].mean()), rel=1e-5)
    assert float(m["accuracy"]) == pytest.approx(float((logits.argmax(-1) == batch.labels_NB)[valid].float().mean()))
    assert m["acc_per_pos"].shape == (BLOCK,)  # every slot of a DSpark block is a draft


def test_the_confidence_head_trains_only_on_slots_scored_against_the_whole_vocabulary():
    """On candidate-softmax slots (loss.full_vocab_slots) q covers ~K+1 candidates, and sum_K min(p, q)
    would call a drafter with 0.4% overlap 33% accepted: those rows train no confidence and stay out
    of accept_rate, while the head still gets a gradient (every DDP rank reduces it)."""
    drafter = make_drafter("dspark")
    batch = shifted_batch()
    cfg = LossConfig(gamma=4.0, kl_weight=0.5, confidence_weight=0.7, full_vocab_slots=1)
    hidden = drafter(batch)
    loss, m = dflash_loss(hidden, drafter.lm_head_VH, batch, cfg, variant=drafter)
    loss.backward()
    assert drafter.confidence_head.proj.weight.grad is not None
    with torch.no_grad():
        mk = drafter.markov_head
        e = mk.markov_w1.weight[batch.prev_ids_NB]
        logq = (hidden @ drafter.lm_head_VH.T + e @ mk.markov_w2.weight.T).log_softmax(-1)
        alpha = torch.minimum(batch.topk_logprobs_NBK.exp(), logq.gather(-1, batch.topk_ids_NBK).exp()).sum(-1)
        conf = drafter.confidence_head.proj(torch.cat([hidden, e], -1))[..., 0]
        bce = F.binary_cross_entropy_with_logits(conf, alpha, reduction="none")
    slot0 = batch.labels_NB[:, 0] != IGNORE  # DSpark's slot 0 is its first draft: the one full-vocabulary slot
    assert int(slot0.sum()) > 0 and int((batch.labels_NB[:, 1:] != IGNORE).sum()) > 0
    assert float(m["accept_rate"]) == pytest.approx(float(alpha[:, 0][slot0].mean()), rel=1e-5)
    assert float(m["confidence_loss"]) == pytest.approx(float(bce[:, 0][slot0].mean()), rel=1e-5)


@pytest.mark.parametrize("misses", ["inject", "drop"])
def test_the_dflash2_selector_loss_reranks_the_drafters_top_k_toward_the_targets_top_1(misses):
    drafter = make_drafter("dflash2")
    batch = shifted_batch(label_shift=0)
    cfg = LossConfig(gamma=4.0, selector_weight=0.6, selector_misses=misses)
    with torch.no_grad():
        hidden = drafter(batch)
        loss, m = dflash_loss(hidden, drafter.lm_head_VH, batch, cfg, variant=drafter)
        unary = hidden @ drafter.lm_head_VH.T
        valid = batch.labels_NB != IGNORE
        w = torch.exp(-(torch.arange(BLOCK) - 1) / 4.0).expand_as(valid) * valid
        ce = -unary.log_softmax(-1).gather(-1, batch.labels_NB.clamp(min=0)[..., None])[..., 0]
        sel = drafter.candidate_selector
        ctx = sel.predecessor_codebook[batch.prev_ids_NB] * (hidden @ sel.hidden_projection.weight.T)
        total, hits, misses_seen = 0.0, 0, 0
        for n, k in valid.nonzero().tolist():
            top1 = int(batch.topk_ids_NBK[n, k, 0])  # the store's top-k is sorted: the target's greedy token
            cand = unary[n, k].topk(4).indices.tolist()

            def scores(ids, n=n, k=k):
                return unary[n, k, ids] + (ctx[n, k] * sel.successor_codebook[ids]).sum(-1)

            hits += int(cand[int(scores(cand).argmax())] == top1)
            if top1 not in cand:
                misses_seen += 1
                if misses == "drop":
                    continue
                cand[-1] = top1
            total += float(w[n, k]) * float(F.cross_entropy(scores(cand)[None], torch.tensor([cand.index(top1)])))
        expected = ((w * ce).sum() + 0.6 * total) / w.sum()
    assert misses_seen > 0  # both rules are exercised
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    assert float(m["selector_accuracy"]) == pytest.approx(hits / int(valid.sum()))


@pytest.mark.parametrize("variant", ["dspark", "dflash2"])
def test_muon_leaves_the_token_indexed_tables_to_adamw_at_its_lr(variant):
    """Muon orthogonalises a whole matrix: on a [V, r] table whose gradient touches a few tokens' rows,
    every touched row moves by about the same amount whatever its gradient. The tables go to AdamW."""
    from stage2_train.train.config import OptimConfig
    from stage2_train.train.schedules import Optimizers, muon_params

    tables = {"dspark": {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"},
              "dflash2": {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"}}[variant]
    # A first step on a gradient of two rows, one 1000x the other: AdamW moves each touched entry by
    # lr x sign (after the decay), untouched rows by the decay only.
    for name in sorted(tables):
        drafter = make_drafter(variant).train()
        opts = Optimizers(drafter, OptimConfig(name="muon", lr=1e-3, muon_lr=2e-3), total_steps=10)
        table = dict(drafter.named_parameters())[name]
        before = table.detach().clone()
        for p in drafter.parameters():
            p.grad = torch.zeros_like(p)
        table.grad[[3, 7]] = torch.tensor([1.0, 1e-3])[:, None].expand(2, table.shape[1])
        opts.step()
        moved = table.detach() - before * (1 - 2e-3 * 0.1)
        assert torch.allclose(moved[[3, 7]], torch.full_like(moved[[3, 7]], -2e-3), atol=1e-6), name
        assert torch.allclose(moved[[0, 1, 2]], torch.zeros_like(moved[[0, 1, 2]]), atol=1e-9), name
    groups = opts.named["adamw"].param_groups
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(1e-3, 0.0), (2e-3, 0.1)] and opts.last_lr() == 1e-3
    assert {id(p) for p in groups[1]["params"]} == {id(p) for n, p in drafter.named_parameters() if n in tables}
    old_layout = opts.state_dict()  # a checkpoint from when the tables were Muon's: refused by name
    old_layout["adamw"]["param_groups"] = old_layout["adamw"]["param_groups"][:1]
    with pytest.raises(CheckpointError, match="adamw held parameter groups of"):
        opts.load_state_dict(old_layout)
    muon, adamw, vocab = muon_params(drafter)
    assert {n for n, _ in vocab} == tables and not tables & {n for n, _ in muon + adamw}
    assert "fc.weight" in dict(muon) and "norm.weight" in dict(adamw)


def test_the_variants_train_their_heads_and_fit_a_batch():
    for variant in ("dspark", "dflash2"):
        drafter = make_drafter(variant, randomize=False).train()
        batch = shifted_batch(label_shift=drafter.label_shift, seed=5, greedy=True)
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-2)
        cfg = LossConfig(gamma=4.0, kl_weight=1.0)
        first = None
        for _ in range(40):
            loss, m = dflash_loss(drafter(batch), drafter.lm_head_VH, batch, cfg, variant=drafter)
            first = first if first is not None else m
            optimizer.zero_grad()
            loss.backward()
            heads = [p for n, p in drafter.named_parameters() if any(s in n for s in ("markov", "confidence", "selector", "conv"))]
            assert heads and all(p.grad is not None and p.grad.abs().sum() > 0 for p in heads), variant
            optimizer.step()
        assert m["accuracy"] > 0.9 and m["loss"] < 0.3 * first["loss"], (variant, float(m["accuracy"]))
        if variant == "dspark":
            assert abs(float(m["confidence_pred_mean"] - m["accept_rate"])) < 0.1  # it learned to predict acceptance
        else:
            assert float(m["selector_accuracy"]) > 0.9


# ---------------------------------------------------------------------------------------------
# Decoding: the drafter drafts what its teacher-forced scoring predicts


@pytest.mark.parametrize("variant, head", [("dspark", "vanilla"), ("dspark", "rnn"), ("dflash2", None)])
def test_a_block_drafted_left_to_right_is_what_teacher_forcing_on_those_drafts_predicts(variant, head):
    extra = {"markov_head": head} if head else {}
    drafter = make_drafter(variant, **extra)
    (sample,) = make_samples([20], 64, seed=6)
    anchor = 12
    single = collate([sample], [torch.tensor([anchor])], block_size=BLOCK, mask_token_id=MASK_ID, label_shift=drafter.label_shift)
    with torch.no_grad():
        drafts = drafter.draft(drafter(single)[0], int(sample["input_ids_T"][anchor]))
    assert len(drafts) == drafter.max_draft == (BLOCK if variant == "dspark" else BLOCK - 1)
    # Write the drafts into the text after the anchor: teacher forcing then conditions on them.
    sample["input_ids_T"][anchor + 1 : anchor + 1 + len(drafts)] = torch.tensor(drafts)
    batch = collate([sample], [torch.tensor([anchor])], block_size=BLOCK, mask_token_id=MASK_ID, label_shift=drafter.label_shift)
    scored = score_blocks(drafter, batch, gamma=4.0)
    assert scored.pred_NB[0, batch.first_slot :].tolist() == drafts
    assert int(scored.accept_N[0]) == len(drafts) + 1  # every draft right, plus the bonus


def test_the_confidence_head_ends_a_dspark_block_early():
    drafter = make_drafter("dspark")
    (sample,) = make_samples([20], 64, seed=7)
    batch = collate([sample], [torch.tensor([10])], block_size=BLOCK, mask_token_id=MASK_ID, label_shift=1)
    with torch.no_grad():
        hidden_BH = drafter(batch)[0]
        whole = drafter.draft(hidden_BH, 5)
        proj = drafter.confidence_head.proj
        proj.weight.zero_()
        proj.bias.fill_(-3.0)  # sigmoid 0.047 per slot
        assert drafter.draft(hidden_BH, 5, confidence_stop=0.5) == whole[:1]  # at least one draft
        proj.bias.fill_(1.0)  # 0.73, 0.53, 0.39, ...
        assert drafter.draft(hidden_BH, 5, confidence_stop=0.5) == whole[:2]
        assert drafter.draft(hidden_BH, 5, confidence_stop=None) == whole


# ---------------------------------------------------------------------------------------------
# Description, export and import


def test_the_description_carries_the_variant_and_refuses_fields_of_another():
    arch = tiny_arch()
    d = describe_parts(variant_cfg("dspark", markov_head="gated"), arch, LAYER_IDS, MASK_ID)
    assert (d.variant, d.markov_rank, d.markov_head, d.confidence_head, d.selector_rank) == ("dspark", 8, "gated", True, None)
    again = DrafterDescription.from_dict(json.loads(json.dumps(d.to_dict())))
    assert again == d and again.model_config().variant == "dspark" and again.model_config().markov_head == "gated"
    with pytest.raises(CheckpointError, match="a dflash drafter's description gives markov_rank"):
        DrafterDescription.from_dict({**d.to_dict(), "variant": "dflash"})
    with pytest.raises(CheckpointError, match="conv_group_size 7 does not divide its hidden size 64"):
        DrafterDescription.from_dict({**describe_parts(variant_cfg("dflash2"), arch, LAYER_IDS, MASK_ID).to_dict(), "conv_group_size": 7})
    plain = describe_parts(variant_cfg("dflash"), arch, LAYER_IDS, MASK_ID).to_dict()
    for edit, message in (({"layer_types": ["full_attention"] * 5}, "lists 5 layer types for"),
                          ({"mask_token_id": plain["vocab_size"]}, "mask_token_id .* is outside its vocabulary"),
                          ({"num_key_value_heads": 3}, "is not a multiple of num_key_value_heads 3")):
        with pytest.raises(CheckpointError, match=message):  # a hand-edited drafter.json, one line naming the field
            DrafterDescription.from_dict({**plain, **edit})
    assert d.contradictions(variant_cfg("dflash2"), {"model.variant"}) == [
        "model.variant: the drafter has dspark, the command line gives dflash2"]
    assert d.contradictions(variant_cfg("dspark", markov_rank=16), {"model.markov_rank"}) == [
        "model.markov_rank: the drafter has 8, the command line gives 16"]
    # a setting this drafter never reads, given on the command line: said, not silently dropped
    assert d.contradictions(variant_cfg("dspark", conv_kernel_size=3, sliding_window=4), {"model.conv_kernel_size", "model.sliding_window"}) == [
        "model.sliding_window: the drafter does not read it (no layer is sliding_attention), the command line gives 4",
        "model.conv_kernel_size: the drafter does not read it (it is a dflash2 setting, the drafter is dspark), the command line gives 3"]
    for variant, cls in (("dflash", DFlashDrafter), ("dspark", DSparkDrafter), ("dflash2", DFlash2Drafter)):
        assert type(make_drafter(variant, randomize=False)) is cls


@pytest.mark.parametrize("variant, fmt", [("dspark", "speculators"), ("dflash2", "speculators"), ("dflash2", "zlab")])
def test_a_variant_exports_and_reads_back_as_the_same_drafter(tmp_path, variant, fmt):
    drafter = make_drafter(variant)
    description = describe_parts(drafter.cfg, drafter.arch, LAYER_IDS, MASK_ID)
    out = export_drafter(drafter, description, {"path": "/models/t", "architectures": ["Qwen3ForCausalLM"]}, tmp_path / "x",
                         dtype="float32", format=fmt)
    config = json.loads((out / "config.json").read_text())
    expected_arch = {"dspark": "DSparkDraftModel", "dflash2": "DFlash2DraftModel"}[variant]
    assert config["architectures"] == [expected_arch]
    if fmt == "speculators":
        assert config["speculators_model_type"] == variant and config["sample_from_anchor"] == (variant == "dspark")
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == drafter.max_draft
    else:
        assert {k: config["dflash_config"][k] for k in ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {
            "block_size": BLOCK, "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}
    assert folder_description(out) == description
    # a folder without our own description (a peer's) reads the same from the peers' fields alone
    del config["dflash_pipeline"]
    (out / "config.json").write_text(json.dumps(config))
    theirs = folder_description(out)
    assert (theirs.variant, theirs.block_size, theirs.target_layer_ids) == (variant, BLOCK, tuple(LAYER_IDS))
    assert all(getattr(theirs, f) == getattr(description, f) for f in ("markov_rank", "markov_head", "confidence_head",
               "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"))
    again = load_exported(out, drafter.embed_VH, drafter.lm_head_VH)
    again.attention_backend = "sdpa"
    batch = shifted_batch(label_shift=drafter.label_shift)
    assert type(again) is type(drafter) and all(torch.equal(v, again.state_dict()[k]) for k, v in drafter.state_dict().items())
    with torch.no_grad():
        assert torch.equal(again(batch), drafter(batch))


def test_speculators_export_refuses_a_block_causal_drafter_and_warns_of_a_head_vllm_does_not_serve(tmp_path, caplog):
    """speculators' config cannot say "causal inside the block": its engines would run the block
    bidirectionally and draft other tokens without an error, so the export is refused; a gated
    Markov head is written (speculators loads it) with a warning that vLLM serves vanilla only."""
    target = {"path": "/models/t", "architectures": ["Qwen3ForCausalLM"]}
    causal = make_drafter("dspark", is_causal=True)
    with pytest.raises(CheckpointError, match="model.is_causal=true .* export the zlab format"):
        export_drafter(causal, describe_parts(causal.cfg, causal.arch, LAYER_IDS, MASK_ID), target, tmp_path / "c",
                       dtype="float32", format="speculators")
    assert not (tmp_path / "c" / "config.json").exists()
    gated = make_drafter("dspark", markov_head="gated")
    with caplog.at_level("WARNING"):
        export_drafter(gated, describe_parts(gated.cfg, gated.arch, LAYER_IDS, MASK_ID), target, tmp_path / "g",
                       dtype="float32", format="speculators")
    assert "model.markov_head=gated" in caplog.text and "vanilla Markov head only" in caplog.text


def test_zlab_layout_refuses_dspark_by_name_and_init_from_checks_the_variant(tmp_path):
    from shared.target import TargetInfo

    drafter = make_drafter("dspark")
    description = describe_parts(drafter.cfg, drafter.arch, LAYER_IDS, MASK_ID)
    with pytest.raises(CheckpointError, match="z-lab's layout has no DSpark drafter.*--format speculators"):
        export_drafter(drafter, description, {"path": "x"}, tmp_path / "z", format="zlab")
    out = export_drafter(drafter, description, {"path": "x"}, tmp_path / "s", dtype="float32", format="speculators")
    target = TargetInfo("", tmp_path, drafter.arch, LAYER_IDS, MASK_ID, "", "", "")
    weights = init_weights_for(out, drafter.cfg, target)
    assert all(torch.equal(weights[k], v) for k, v in drafter.state_dict().items())
    with pytest.raises(CheckpointError, match=r"the drafter has variant='dspark' but this run has 'dflash' \(model.variant\)"):
        init_weights_for(out, variant_cfg("dflash"), target)
    with pytest.raises(CheckpointError, match=r"markov_rank=8 but this run has 16 \(model.markov_rank\)"):
        init_weights_for(out, variant_cfg("dspark", markov_rank=16), target)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "confidence_head_with_markov": False, "dflash_pipeline": {}}))
    with pytest.raises(CheckpointError, match="confidence_head_with_markov=false"):
        folder_description(out)


# ---------------------------------------------------------------------------------------------
# End to end: train, evaluate, export, read back, decode


@pytest.mark.parametrize("variant", ["dspark", "dflash2"])
def test_a_variant_trains_logs_its_metrics_exports_and_decodes_exactly(tiny_target_dir, store, tmp_path, variant):  # noqa: F811
    from stage2_train import commands
    from stage2_train.observe.metrics import read_log
    from stage2_train.serve.load import load_drafter
    from stage2_train.serve.speculative import DFlashProposer, speculative_generate, target_greedy
    from tests.test_trainer import config

    sizes = {"model.markov_rank": 16} if variant == "dspark" else {"model.selector_rank": 16, "model.selector_top_k": 8}
    cfg = config(tiny_target_dir, store, tmp_path, **{
        "model.variant": variant, **sizes, "train.max_steps": 4, "eval.every_steps": 2, "checkpoint.every_steps": 4,
        "loss.kl_weight": 1.0, "loss.full_vocab_slots": 1, "loss.weighting": "dpace",
    })
    commands.cmd_train(cfg, progress=False)
    rows = read_log(tmp_path / "train_log.jsonl", "train")
    drafts = 8 if variant == "dspark" else 7  # block 8: DSpark drafts every slot
    own = ("confidence_loss", "accept_rate", "confidence_pred_mean", "confidence_abs_error") if variant == "dspark" else (
        "selector_loss", "selector_accuracy", "unary_top1_accuracy", "candidate_recall")
    assert len(rows) == 4 and all(isinstance(r[k], float) for r in rows for k in own)
    assert all(len(r["acc_per_pos"]) == drafts for r in rows)
    evals = read_log(tmp_path / "train_log.jsonl", "eval")
    assert len(evals[-1]["acc_per_pos"]) == drafts and evals[-1]["walk_tau"] >= 1.0
    assert len(evals[-1]["accept_hist"]) == drafts + 1
    run_start = [e for e in read_log(tmp_path / "train_log.jsonl", "event") if e["event"] == "run_start"][0]
    assert run_start["drafter"]["variant"] == variant and run_start["hyperparameters"]["variant"] == variant

    out = commands.cmd_export(cfg, format="speculators", out=str(tmp_path / "export"))
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["speculators_model_type"] == variant and out["block_size"] == 8
    from shared.target import resolve_target

    target = resolve_target(cfg.target)
    trained, folder = load_drafter(tmp_path / "checkpoints", target), load_drafter(tmp_path / "export", target)
    assert trained.description == folder.description and trained.description.variant == variant
    assert all(torch.equal(v.bfloat16(), folder.drafter.state_dict()[k]) for k, v in trained.drafter.state_dict().items())

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    prompt = list(range(300, 312))
    greedy = target_greedy(model, prompt, max_new_tokens=24, eos_token_ids=None)
    spec = speculative_generate(model, DFlashProposer(trained.drafter, target.layer_ids), prompt, max_new_tokens=24, eos_token_ids=None)
    assert spec.tokens == greedy.tokens
    assert max(spec.drafted) == drafts and all(1 <= a <= drafts + 1 for a in spec.acceptance_lengths)


def test_check_says_where_dspark_confidence_is_not_trained():
    from shared.config import load_run_config

    def said(*overrides):
        return any("confidence head trains on the first 1 slot" in n for n in load_run_config("default", list(overrides)).notes())

    assert said("model.variant=dspark") and not said("model.variant=dspark", "loss.full_vocab_slots=null")
    assert not said() and not said("model.variant=dspark", "model.confidence_head=false")


def test_the_card_serves_each_variant_as_the_engines_do_and_states_exactness_as_measured(tmp_path):
    """A DSpark drafter drafts every slot: vLLM serves it as method dspark with B speculative tokens
    (it refuses fewer), its vanilla head only; DFlash2 has no engine yet; the exactness claim is the
    eval's own count, not a promise."""
    from stage2_train.serve.card import write_card

    arch = tiny_arch()
    cards = {}
    for variant, extra in (("dflash", {}), ("dspark", {"markov_head": "gated"}), ("dflash2", {})):
        d = describe_parts(variant_cfg(variant, **extra), arch, LAYER_IDS, MASK_ID)
        facts = {"eval": {"tau": 1.5, "lo": 1.4, "hi": 1.6, "prompts": 8, "max_new_tokens": 64, "num_exact": 6}}
        out = tmp_path / variant
        out.mkdir()
        cards[variant] = (d, write_card(out, d, facts).read_text())
    d, card = cards["dspark"]
    assert '"method": "dspark"' in card and f'"num_speculative_tokens": {d.block_size}' in card
    assert "gated head is not one of them" in card and "--speculative-algorithm DFLASH" not in card
    d, card = cards["dflash"]
    assert '"method": "dflash"' in card and f'"num_speculative_tokens": {d.block_size - 1}' in card and "DFLASH" in card
    assert "vllm serve" not in cards["dflash2"][1] and "No engine serves DFlash2" in cards["dflash2"][1]
    assert all("6 of 8 outputs equal to the target's own" in c and "every output equal" not in c for _, c in cards.values())


def test_an_eval_with_a_confidence_stop_records_it_and_the_card_states_it(tmp_path):
    """`eval` with eval.confidence_stop decodes a DSpark drafter with early-ended blocks; its tau was
    recorded and restated on the model card as if whole blocks were drafted (what the card's vLLM
    command serves), with nothing saying a stop was used."""
    from pathlib import Path
    from types import SimpleNamespace

    from shared.config import load_run_config
    from stage2_train.commands import _card_facts
    from stage2_train.serve.card import write_card
    from stage2_train.serve.evaluation import early_stop
    from stage2_train.serve.speculative import DFlashProposer, NgramProposer

    def stop(drafter, value):
        return early_stop(DFlashProposer(drafter, LAYER_IDS, confidence_stop=value))

    dspark = make_drafter("dspark")
    assert stop(dspark, 0.5) == 0.5 and stop(dspark, None) is None
    assert stop(make_drafter("dspark", confidence_head=False), 0.5) is None and stop(make_drafter("dflash"), 0.5) is None
    assert early_stop(NgramProposer(3)) is None

    root = Path(__file__).resolve().parents[1]
    cfg = load_run_config(root / "configs/default.yaml", [f"run_dir={tmp_path / 'run'}"])
    step = tmp_path / "run" / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    (step / "model.safetensors").write_bytes(b"")
    description = describe_parts(variant_cfg("dspark"), tiny_arch(), LAYER_IDS, MASK_ID)
    for value, said in ((0.5, True), (None, False)):
        trained = {"interval": {"tau": 1.5, "lo": 1.4, "hi": 1.6, "num_prompts": 8}, "num_exact": 8, "tau": 1.5,
                   "confidence_stop": value}
        recorded = {"checkpoint": str(step / "model.safetensors"), "split": {},
                    "online": {"num_prompts": 8, "max_new_tokens": 64, "proposers": {"trained": trained}}}
        (tmp_path / "run" / "eval").mkdir(exist_ok=True)
        (tmp_path / "run" / "eval" / "step_000004.json").write_text(json.dumps(recorded))
        loaded = SimpleNamespace(weights_file=step / "model.safetensors", trained_on=None)
        out = tmp_path / f"card{value}"
        out.mkdir()
        card = write_card(out, description, _card_facts(cfg, {"name": "t"}, loaded)).read_text()
        assert "8 prompts x 64 new tokens, greedy" in card
        assert ("greedy, each block ended early by the confidence head (eval.confidence_stop=0.5" in card) is said


def test_a_speculators_drafter_with_a_reduced_draft_vocabulary_is_refused_by_name(tmp_path):
    """speculators can train a drafter over a reduced vocabulary (draft_vocab_size, its own lm_head and
    d2t/t2d maps). model.init_from took its weights, and the trainer then refused them as 'unexpected
    ['d2t', 'lm_head.weight', 't2d']' under model.num_layers, naming neither the cause nor a fix."""
    from safetensors.torch import load_file, save_file

    from shared.target import TargetInfo

    drafter = make_drafter("dflash")
    out = export_drafter(drafter, describe_parts(drafter.cfg, drafter.arch, LAYER_IDS, MASK_ID), {"path": "x"}, tmp_path / "s",
                         dtype="float32", format="speculators")
    config = json.loads((out / "config.json").read_text())
    del config["dflash_pipeline"]
    (out / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 32}))
    weights = load_file(out / "model.safetensors")
    V, H = drafter.arch.vocab_size, drafter.arch.hidden_size
    save_file({**weights, "lm_head.weight": torch.zeros(32, H), "d2t": torch.arange(32), "t2d": torch.zeros(V, dtype=torch.bool)},
              out / "model.safetensors")
    target = TargetInfo("", tmp_path, drafter.arch, LAYER_IDS, MASK_ID, "", "", "")
    message = rf"draft_vocab_size=32 but the verifier's vocab_size is {V}: a reduced draft vocabulary .* \(draft_vocab_size = vocab_size\)"
    with pytest.raises(CheckpointError, match=message):
        init_weights_for(out, drafter.cfg, target)
    with pytest.raises(CheckpointError, match=message):
        load_exported(out, drafter.embed_VH, drafter.lm_head_VH)
    (out / "config.json").write_text(json.dumps({**config, "draft_vocab_size": V}))  # the full vocabulary: ours
    assert folder_description(out).vocab_size == V


def test_another_trainers_drafter_architecture_is_refused_by_name(tmp_path):
    """A SpecForge Domino drafter (architectures DominoDraftModel: the DFlash backbone plus a GRU head)
    was read as a DFlash drafter: model.init_from took its weights and the trainer then refused its own
    head as 'unexpected' weights, never naming the architecture."""
    from safetensors.torch import load_file, save_file

    from shared.target import TargetInfo

    drafter = make_drafter("dflash")
    out = export_drafter(drafter, describe_parts(drafter.cfg, drafter.arch, LAYER_IDS, MASK_ID), {"path": "x"}, tmp_path / "d",
                         dtype="float32")
    config = json.loads((out / "config.json").read_text())
    del config["dflash_pipeline"]
    config["dflash_config"].update({"projector_type": "domino", "emb_dim": 8, "gru_hidden_dim": 8, "shift_label": True})
    (out / "config.json").write_text(json.dumps({**config, "architectures": ["DominoDraftModel"]}))
    H = drafter.arch.hidden_size
    save_file({**load_file(out / "model.safetensors"), "prefix_gru.weight_ih_l0": torch.zeros(24, H)}, out / "model.safetensors")
    target = TargetInfo("", tmp_path, drafter.arch, LAYER_IDS, MASK_ID, "", "", "")
    message = r"architectures \['DominoDraftModel'\] is not a drafter this pipeline builds \(DFlashDraftModel, DSparkDraftModel, DFlash2DraftModel\)"
    with pytest.raises(CheckpointError, match=message):
        init_weights_for(out, drafter.cfg, target)
    with pytest.raises(CheckpointError, match=message):
        load_exported(out, drafter.embed_VH, drafter.lm_head_VH)


def test_a_zlab_layout_dspark_config_is_read_with_specforges_defaults(tmp_path):
    """Only SpecForge writes DSpark in z-lab's layout; what it leaves out means its defaults (no Markov head,
    a confidence head only with confidence_head_alpha > 0, on the hidden state alone), not speculators'
    (tests/test_peers_variants.py checks SpecForge's own saves)."""
    drafter = make_drafter("dflash")
    out = export_drafter(drafter, describe_parts(drafter.cfg, drafter.arch, LAYER_IDS, MASK_ID), {"path": "x"}, tmp_path / "d",
                         dtype="float32")
    config = json.loads((out / "config.json").read_text())
    del config["dflash_pipeline"]

    def read(**fields):
        (out / "config.json").write_text(json.dumps({**config, "architectures": ["DSparkDraftModel"],
                                                     "dflash_config": {**config["dflash_config"], **fields}}))
        return folder_description(out)

    with pytest.raises(CheckpointError, match="confidence_head_with_markov=false: this pipeline's confidence head reads"):
        read(markov_rank=8, confidence_head_alpha=1.0)
    with pytest.raises(CheckpointError, match="markov_rank=0: this pipeline builds DSpark with a Markov head"):
        read(confidence_head_alpha=1.0, confidence_head_with_markov=True)
    d = read(markov_rank=8)
    assert (d.variant, d.markov_rank, d.markov_head, d.confidence_head) == ("dspark", 8, "vanilla", False)
    assert read(markov_rank=8, confidence_head_alpha=0.5, confidence_head_with_markov=True).confidence_head is True


def test_export_to_a_file_is_refused_by_name(tmp_path):
    """`export --out` naming a file (or a path under one) ended in FileExistsError / NotADirectoryError
    tracebacks from mkdir, after the checkpoint was loaded."""
    drafter = make_drafter("dflash2")
    description = describe_parts(drafter.cfg, drafter.arch, LAYER_IDS, MASK_ID)
    (tmp_path / "notes.txt").write_text("mine")
    for out in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "export"):
        with pytest.raises(CheckpointError, match=rf"export --out {out}: {tmp_path / 'notes.txt'} is a file, not a folder"):
            export_drafter(drafter, description, {"path": "x"}, out)
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("edit, message", [
    ({"block_size": 1}, "the drafter's block_size is 1: it must be an integer >= 2"),
    ({"block_size": "4"}, "the drafter's block_size is '4': it must be an integer >= 2"),
    ({"dflash_config": {"target_layer_ids": [-1, 3]}}, r"the drafter's target_layer_ids \[-1, 3\] must be target layer indices"),
    ({"dflash_config": {"target_layer_ids": "1,3"}}, r"the drafter's target_layer_ids \['1', ',', '3'\] must be"),
    ({"rope_theta": "1e6", "rope_parameters": {"rope_type": "default", "rope_theta": "1e6"}}, "rope_theta is '1e6', not a number > 0"),
])
def test_a_hand_edited_drafter_config_is_refused_naming_the_field(tmp_path, edit, message):
    """A config.json with block_size 1 loaded a drafter that drafts nothing, target_layer_ids [-1, 3]
    one that reads the target's last layer (a negative index) in decoding, and a string where a number
    belongs crashed in a comparison or in float() with a bare traceback."""
    drafter = make_drafter("dflash")
    out = export_drafter(drafter, describe_parts(drafter.cfg, drafter.arch, LAYER_IDS, MASK_ID), {"path": "x"}, tmp_path / "d",
                         dtype="float32")
    config = json.loads((out / "config.json").read_text())
    del config["dflash_pipeline"]
    edited = {**config, **edit, "dflash_config": {**config["dflash_config"], **edit.get("dflash_config", {})}}
    (out / "config.json").write_text(json.dumps(edited))
    with pytest.raises(CheckpointError, match=rf"{out / 'config.json'}: .*{message}"):
        load_exported(out, drafter.embed_VH, drafter.lm_head_VH)
    if edit.get("block_size") == 1:  # a checkpoint's drafter.json: the same checks
        with pytest.raises(CheckpointError, match=message):
            DrafterDescription.from_dict({**describe_parts(drafter.cfg, drafter.arch, LAYER_IDS, MASK_ID).to_dict(), "block_size": 1})


def test_the_export_doctor_does_not_tell_to_serve_dflash2_in_an_engine(tmp_path):
    """The model card says no engine serves DFlash2 (vLLM's loader drops its convolutions); the export
    doctor told its user to serve it in vLLM / SGLang with B - 1 speculative tokens."""
    from stage2_train.serve.diagnose import describe_layout
    from stage2_train.serve.export_view import read_export

    notes = {}
    for variant, fmt in (("dflash2", "zlab"), ("dflash2", "speculators"), ("dflash", "zlab")):
        drafter = make_drafter(variant)
        out = export_drafter(drafter, describe_parts(drafter.cfg, drafter.arch, LAYER_IDS, MASK_ID), {"path": "x"},
                             tmp_path / f"{variant}-{fmt}", dtype="float32", format=fmt)
        notes[variant, fmt] = describe_layout(read_export(out))[1]
    for fmt in ("zlab", "speculators"):
        assert notes["dflash2", fmt].startswith("no engine serves DFlash2 drafters as released") and "vLLM num_speculative" not in notes["dflash2", fmt]
    assert notes["dflash", "zlab"] == f"serve with {BLOCK - 1} speculative tokens (vLLM num_speculative_tokens={BLOCK - 1}; SGLang reads block_size={BLOCK})"


def test_check_warns_before_training_a_dspark_drafter_no_export_layout_carries():
    """z-lab's layout has no DSpark and speculators' refuses sliding or block-causal layers, so a DSpark
    drafter trained so could not be exported: `export` said it only after the training."""
    from shared.config import load_run_config

    def warned(*overrides):
        return [w for w in load_run_config("default", ["model.variant=dspark", *overrides]).recipe_warnings() if "no export" in w]

    assert warned("model.layer_types=[sliding_attention,full_attention]", "model.sliding_window=64", "model.num_layers=2") == [
        "model.variant=dspark with sliding_attention layers: no export layout carries this drafter (z-lab's has no DSpark; "
        "speculators' computes sliding layers another way and has no is_causal), so `python -m stage2_train export` will refuse it; train "
        "full-attention layers with model.is_causal unset to serve it"]
    assert warned("model.is_causal=true")[0].startswith("model.variant=dspark with model.is_causal=true: no export layout")
    assert warned() == [] and warned("model.is_causal=false") == []
