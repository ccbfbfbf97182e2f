"""Parity of the DSpark and DFlash2 drafters with the peers' own classes (speculators 0.9.0, z-lab dflash 0.1.0).

    bash tests/peers_install.sh          # once; prints DFLASH_PEERS
    DFLASH_PEERS=... .venv/bin/python -m pytest -q tests/test_peers.py tests/test_peers_variants.py

Skipped without DFLASH_PEERS, as tests/test_peers.py (whose helpers these use). In fp32, on tiny shapes:

- speculators: our export (format "speculators") loaded by its `DSparkDraftModel` / `DFlash2DraftModel`
  with no missing or unexpected key; on one packed row of two documents, its training forward and ours
  give the same hidden states, logits (DSpark: Markov-corrected), confidence logits (DSpark) and
  selector scores (DFlash2), and the same loss: its KL (+ confidence BCE / + selector CE) with its mask-count
  normaliser equals ours when our stored top-k is the whole vocabulary (K = V, where our top-k KL and
  overlap are its full-vocabulary ones) and our objective is divided by the scored slots. Every
  anchor of the row is one (max_anchors = their count), so its random draw has one outcome.
  DSpark's mask differs by one position between the two (speculators masks slot k by loss_mask[p+k],
  we by the token it predicts, p+k+1, DeepSpec's rule): our samples' masks are theirs shifted by one,
  so both score the same slots. Then what speculators saves (`save_pretrained`) reads back as our
  drafter, weight for weight.
- z-lab: our DFlash2 export (format "zlab") loaded by its `DFlash2DraftModel`: its forward for one
  anchor at a time equals our packed one, and its greedy `propose` drafts what our `draft` drafts.

Shape legend: T tokens of the packed row, N blocks, B block size, H hidden, V vocab, R rank.
"""

from __future__ import annotations

import json

import pytest
import torch

from shared.errors import CheckpointError
from shared.target_parts import load_embed_and_head
from stage2_train.data.batch import IGNORE, collate
from stage2_train.model.config import DrafterConfig, LossConfig
from stage2_train.model.description import describe_parts
from stage2_train.model.drafter import build_drafter
from stage2_train.model.loss import dflash_loss
from stage2_train.serve.export import export_drafter
from stage2_train.serve.load import folder_description, load_exported
from tests.test_model import MASK_ID, tiny_arch
from tests.test_peers import (
    ATOL,
    BLOCK,
    LAYER_IDS,
    PEERS,
    head_module,
    max_diff,
    write_verifier,
    zlab_block,
)

pytestmark = pytest.mark.skipif(not PEERS, reason="peer packages not installed: run `bash tests/peers_install.sh`")

LENGTHS = [22, 18]  # two documents in one packed row
SUPERVISED = [(4, 13), (4, 10)]  # per document: [start, end) of the loss mask speculators reads
SIZES = {"dspark": {"markov_rank": 8}, "dflash2": {"conv_group_size": 16, "selector_rank": 8, "selector_top_k": 32}}


def variant_drafter(variant: str, embed_VH, head_VH, seed: int = 0, **extra):
    """A 3-layer drafter (GQA 4/2) of `variant`, every weight random: norms, heads, convolutions."""
    arch = tiny_arch(kv_heads=2)
    cfg = DrafterConfig(variant=variant, num_layers=3, block_size=BLOCK, attention="sdpa", init_std=0.2, **{**SIZES[variant], **extra})
    drafter = build_drafter(describe_parts(cfg, arch, LAYER_IDS, MASK_ID), embed_VH, head_VH, runtime=cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif "base_kernel" in name:  # near the identity it starts from, every tap used
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            elif any(s in name for s in ("conv", "markov", "confidence", "selector")):
                p.copy_((0.05 if "conv" in name else 0.3) * torch.randn(p.shape, generator=gen))
    return drafter.eval()


@pytest.fixture
def verifier(tmp_path):
    return write_verifier(tmp_path / "verifier", tiny_arch(kv_heads=2))


def exported(drafter, out, verifier, fmt="speculators"):
    description = describe_parts(drafter.cfg, drafter.arch, LAYER_IDS, MASK_ID)
    info = {"name": str(verifier), "architectures": ["Qwen3ForCausalLM"]}
    return export_drafter(drafter, description, info, out, dtype="float32", format=fmt)


def packed_row(hidden: int, seed: int = 4):
    """speculators' inputs for one packed row: features, ids, loss mask, the verifier's pre-norm last
    hidden state, document ids and positions restarting per document; and the anchors it will take."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(LENGTHS)
    inputs = {
        "hidden_states": torch.randn(1, T, len(LAYER_IDS) * hidden, generator=gen),
        "input_ids": torch.randint(0, MASK_ID, (1, T), generator=gen),
        "loss_mask": torch.zeros(1, T, dtype=torch.long),
        "verifier_last_hidden_states": torch.randn(1, T, hidden, generator=gen),
        "document_ids": torch.cat([torch.full((n,), d) for d, n in enumerate(LENGTHS)])[None],
        "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None],
    }
    starts = [0, LENGTHS[0]]
    for start, (lo, hi) in zip(starts, SUPERVISED):
        inputs["loss_mask"][0, start + lo : start + hi] = 1
    anchors = [list(range(lo, hi)) for lo, hi in SUPERVISED]  # every supervised position: blocks end inside their document
    return inputs, anchors, starts


def our_samples(inputs, teacher_TV, starts, label_shift: int):
    """The row as our store's samples, with the whole vocabulary as the stored top-k (sorted), so our
    top-k KL and overlap are speculators' full-vocabulary ones. A DSpark sample's loss mask is the
    row's shifted by one: we mask a slot by the token it predicts, speculators by its input position."""
    samples = []
    for start, n in zip(starts, LENGTHS):
        mask_T = inputs["loss_mask"][0, start : start + n].bool()
        if label_shift:
            mask_T = torch.cat([torch.zeros(1, dtype=torch.bool), mask_T[:-1]])
        logp_TV = teacher_TV[start : start + n].log_softmax(-1)
        lp_TK, ids_TK = logp_TV.sort(-1, descending=True)
        samples.append({
            "input_ids_T": inputs["input_ids"][0, start : start + n],
            "loss_mask_T": mask_T,
            "hidden_TLH": inputs["hidden_states"][0, start : start + n].reshape(n, len(LAYER_IDS), -1),
            "topk_logprobs_TK": lp_TK, "topk_ids_TK": ids_TK,
        })
    return samples


def speculators_variant(folder, variant):
    pytest.importorskip("speculators", reason="speculators not on DFLASH_PEERS")
    from speculators.models.attention import create_float_mask
    from speculators.models.dflash2 import DFlash2DraftModel
    from speculators.models.dspark import DSparkDraftModel

    cls = {"dspark": DSparkDraftModel, "dflash2": DFlash2DraftModel}[variant]
    # Asked for the loading info, speculators hands back HF's (model, info) before refilling the
    # verifier's parts (embed_tokens, lm_head): the model comes from a plain call.
    _, info = cls.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    model = cls.from_pretrained(str(folder), dtype=torch.float32)
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl = "eager"
    model._create_mask_fn = create_float_mask
    return model.eval(), info


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_speculators_dspark_computes_our_logits_confidence_and_loss(tmp_path, verifier, head):
    pytest.importorskip("speculators", reason="speculators not on DFLASH_PEERS")
    from speculators.losses import eager

    drafter = variant_drafter("dspark", *load_embed_and_head(verifier), markov_head=head)
    folder = exported(drafter, tmp_path / "spec", verifier)
    config = json.loads((folder / "config.json").read_text())
    assert (config["speculators_model_type"], config["sample_from_anchor"], config["markov_head_type"]) == ("dspark", True, head)
    model, info = speculators_variant(folder, "dspark")
    assert not any(info.values()), info
    theirs_sd = model.state_dict()
    assert all(torch.equal(theirs_sd[k], v) for k, v in drafter.state_dict().items())
    assert torch.equal(theirs_sd["embed_tokens.weight"], drafter.embed_VH) and torch.equal(theirs_sd["lm_head.weight"], drafter.lm_head_VH)

    inputs, anchors, starts = packed_row(drafter.arch.hidden_size)
    N = sum(len(a) for a in anchors)
    with torch.no_grad():
        h, unary, targets, _, block_idx = model._backbone_forward(**inputs, max_anchors=N)
        assert block_idx.tolist() == [s + a + k for s, run in zip(starts, anchors) for a in run for k in range(BLOCK)]
        prev_NB = inputs["input_ids"][0, block_idx].view(N, BLOCK)  # sample_from_anchor: slot k follows token p+k
        h_NBH = h.view(N, BLOCK, -1)
        prev_emb = model.markov_head.prev_embeddings(prev_NB)
        their_logits = unary.view(N, BLOCK, -1) + model.markov_head.block_bias(prev_token_ids=prev_NB, hidden_states=h_NBH, prev_emb=prev_emb)
        their_conf = model.confidence_head(torch.cat([h_NBH, prev_emb], -1))
        _, their_loss, their_metrics = model(
            **inputs, loss_config={"kl_div": (eager.kl_div_loss, 1.0)}, tv_loss_fn=eager.tv_loss, gamma=4.0, max_anchors=N,
            confidence_head_alpha=0.7,
        )
        teacher_TV = model.verifier_lm_head(model.verifier_norm(inputs["verifier_last_hidden_states"][0]))
        batch = collate(our_samples(inputs, teacher_TV, starts, 1), [torch.tensor(a) for a in anchors], block_size=BLOCK,
                        mask_token_id=MASK_ID, label_shift=1)
        ours = drafter(batch)
        rows = drafter.loss_rows(ours, batch)
        our_logits = (drafter.logits(ours).float() + drafter.markov_head.bias(rows.z).view(N, BLOCK, -1))
        scored = (batch.labels_NB != IGNORE).sum()
        cfg = LossConfig(gamma=4.0, ce_weight=0.0, kl_weight=1.0, confidence_weight=0.7)
        our_loss, our_metrics = dflash_loss(ours, drafter.lm_head_VH, batch, cfg, normalizer=scored.float(), variant=drafter)
    assert torch.equal(batch.prev_ids_NB, prev_NB)
    diffs = {
        "hidden": max_diff(ours, h_NBH), "logits": max_diff(our_logits, their_logits),
        "confidence": max_diff(rows.conf.view(N, BLOCK), their_conf),
        "loss": abs(float(our_loss) - float(their_loss)),
        "accept_rate": abs(float(our_metrics["accept_rate"]) - float(their_metrics["accept_rate_sum"] / their_metrics["accept_rate_total"])),
    }
    print(f"speculators DSpark ({head} head), {N} blocks: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    assert int(scored) == int(their_metrics["accept_rate_total"])  # the same slots scored
    assert diffs["hidden"] <= ATOL and diffs["confidence"] <= ATOL and diffs["accept_rate"] <= ATOL
    assert diffs["logits"] <= 10 * ATOL and diffs["loss"] <= ATOL * max(1.0, float(their_loss))


def test_speculators_dflash2_computes_our_selector_scores_and_loss(tmp_path, verifier):
    pytest.importorskip("speculators", reason="speculators not on DFLASH_PEERS")
    from speculators.losses import eager

    drafter = variant_drafter("dflash2", *load_embed_and_head(verifier))
    folder = exported(drafter, tmp_path / "spec", verifier)
    model, info = speculators_variant(folder, "dflash2")
    assert not any(info.values()), info
    assert all(torch.equal(model.state_dict()[k], v) for k, v in drafter.state_dict().items())

    inputs, anchors, starts = packed_row(drafter.arch.hidden_size, seed=5)
    N = sum(len(a) for a in anchors)
    with torch.no_grad():
        h, unary, targets, _, block_idx = model._backbone_forward(**inputs, max_anchors=N)
        prev = model._predecessor_ids(inputs["input_ids"], block_idx)
        cand = unary.topk(32, dim=-1).indices
        their_scores = model.candidate_selector.score_candidates(unary, h, prev.reshape(1, -1), cand)
        _, their_loss, their_metrics = model(
            **inputs, loss_config={"kl_div": (eager.kl_div_loss, 1.0)}, tv_loss_fn=eager.tv_loss, gamma=4.0, max_anchors=N,
            selector_loss_alpha=0.6,
        )
        teacher_TV = model.verifier_lm_head(model.verifier_norm(inputs["verifier_last_hidden_states"][0]))
        batch = collate(our_samples(inputs, teacher_TV, starts, 0), [torch.tensor(a) for a in anchors], block_size=BLOCK,
                        mask_token_id=MASK_ID)
        ours = drafter(batch)
        our_unary = drafter.logits(ours).float()
        ctx = drafter.loss_rows(ours, batch).ctx
        our_scores = drafter.candidate_selector.scores(our_unary.reshape(N * BLOCK, -1).gather(1, cand[0]), ctx, cand[0])
        scored = (batch.labels_NB != IGNORE).sum()
        cfg = LossConfig(gamma=4.0, ce_weight=0.0, kl_weight=1.0, selector_weight=0.6)
        our_loss, our_metrics = dflash_loss(ours, drafter.lm_head_VH, batch, cfg, normalizer=scored.float(), variant=drafter)
    assert torch.equal(batch.prev_ids_NB.reshape(1, -1), prev.reshape(1, -1))
    recall = float(their_metrics["unary_candidate_recall_at_32_sum"] / their_metrics["unary_candidate_recall_at_32_total"])
    diffs = {
        "hidden": max_diff(ours.reshape(h.shape), h), "unary": max_diff(our_unary.reshape(unary.shape), unary),
        "scores": max_diff(our_scores, their_scores[0]), "loss": abs(float(our_loss) - float(their_loss)),
        "recall": abs(float(our_metrics["candidate_recall"]) - recall),
    }
    print(f"speculators DFlash2, {N} blocks: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    assert 0 < recall < 1  # both the inject rule and plain hits are exercised
    assert diffs["hidden"] <= ATOL and diffs["recall"] <= ATOL
    assert diffs["unary"] <= 10 * ATOL and diffs["scores"] <= 10 * ATOL and diffs["loss"] <= ATOL * max(1.0, float(their_loss))


@pytest.mark.parametrize("variant", ["dspark", "dflash2"])
def test_what_speculators_saves_reads_back_as_our_drafter(tmp_path, verifier, variant):
    drafter = variant_drafter(variant, *load_embed_and_head(verifier))
    model, _ = speculators_variant(exported(drafter, tmp_path / "spec", verifier), variant)
    model.save_pretrained(tmp_path / "resaved")
    saved = json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert saved["speculators_model_type"] == variant
    description = folder_description(tmp_path / "resaved")
    assert description == describe_parts(drafter.cfg, drafter.arch, LAYER_IDS, MASK_ID)
    again = load_exported(tmp_path / "resaved", drafter.embed_VH, drafter.lm_head_VH)
    assert set(again.state_dict()) == set(drafter.state_dict())
    assert all(torch.equal(again.state_dict()[k], v) for k, v in drafter.state_dict().items())


def test_zlab_dflash2_computes_our_blocks_and_drafts_our_tokens(tmp_path):
    zlab = pytest.importorskip("dflash.model", reason="z-lab dflash not on DFLASH_PEERS")
    gen = torch.Generator().manual_seed(9)
    arch = tiny_arch(kv_heads=2)
    drafter = variant_drafter("dflash2", torch.randn(arch.vocab_size, arch.hidden_size, generator=gen),
                              torch.randn(arch.vocab_size, arch.hidden_size, generator=gen))
    folder = exported(drafter, tmp_path / "zlab", "unused", fmt="zlab")
    model, info = zlab.DFlash2DraftModel.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    model = model.eval()
    assert not any(info.values()), info
    assert (model.block_size, model.candidate_selector.top_k) == (BLOCK, 32)
    samples = [{
        "input_ids_T": torch.randint(0, MASK_ID, (n,), generator=gen), "loss_mask_T": torch.ones(n, dtype=torch.bool),
        "hidden_TLH": torch.randn(n, len(LAYER_IDS), arch.hidden_size, generator=gen),
    } for n in (16, 13)]
    anchors = [[3, 7, 12], [0, 5, 9]]
    batch = collate(samples, [torch.tensor(a) for a in anchors], block_size=BLOCK, mask_token_id=MASK_ID, gather_topk=False)
    head = head_module(drafter.lm_head_VH)
    worst, n, drafted = 0.0, 0, 0
    with torch.no_grad():
        ours_NBH = drafter(batch)
        for sample, sample_anchors in zip(samples, anchors):
            context_TF = sample["hidden_TLH"].flatten(1)
            for a in sample_anchors:
                noise_BH = torch.nn.functional.embedding(batch.block_ids_NB[n], drafter.embed_VH)
                theirs_BH = zlab_block(model, context_TF[:a], noise_BH, a)
                worst = max(worst, max_diff(theirs_BH, ours_NBH[n]))
                tokens, _, _ = model.propose(theirs_BH[None, 1:], batch.block_ids_NB[n, :1], head, 0.0)
                assert tokens[0].tolist() == drafter.draft(ours_NBH[n], int(batch.block_ids_NB[n, 0]))
                drafted += BLOCK - 1
                n += 1
    print(f"z-lab DFlash2, {n} blocks: max|hidden diff| {worst:.2e}; {drafted} greedy drafts equal")
    assert worst <= ATOL


@pytest.mark.parametrize("fields, refused", [
    ({"markov_rank": 8, "confidence_head_alpha": 1.0}, "confidence_head_with_markov=false: this pipeline's confidence head reads"),
    ({"confidence_head_alpha": 1.0, "confidence_head_with_markov": False}, "markov_rank=0: this pipeline builds DSpark with a Markov head"),
    ({"markov_rank": 8}, None),  # SpecForge's default: no confidence head
    ({"markov_rank": 8, "markov_head_type": "gated", "confidence_head_alpha": 0.5, "confidence_head_with_markov": True}, None),
])
def test_what_specforge_saves_as_dspark_is_read_with_specforges_defaults(tmp_path, fields, refused):
    """SpecForge's DSparkDraftModel (z-lab's layout: the only DSpark there) leaves out what it defaults:
    no Markov head, a confidence head only with confidence_head_alpha > 0, reading the hidden state alone.
    Read with speculators' defaults instead, its drafters failed check_fit on a confidence head of
    another shape, or a Markov head they do not have."""
    specforge = pytest.importorskip("specforge.modeling.draft.dspark", reason="SpecForge not on DFLASH_PEERS")
    from transformers import Qwen3Config

    from stage2_train.serve.load import load_exported

    arch = tiny_arch(kv_heads=2)
    config = Qwen3Config(hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size, num_hidden_layers=1,
                         num_attention_heads=arch.num_attention_heads, num_key_value_heads=2, head_dim=arch.head_dim,
                         vocab_size=arch.vocab_size)
    config.num_target_layers, config.block_size, config.architectures = 6, BLOCK, ["DSparkDraftModel"]
    config.dflash_config = {"target_layer_ids": LAYER_IDS, "mask_token_id": MASK_ID, **fields}
    theirs = specforge.DSparkDraftModel(config)
    theirs.save_pretrained(tmp_path / "sf")
    embed = head = torch.zeros(arch.vocab_size, arch.hidden_size)
    if refused:
        with pytest.raises(CheckpointError, match=refused):
            load_exported(tmp_path / "sf", embed, head)
        return
    ours = load_exported(tmp_path / "sf", embed, head)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    assert (ours.cfg.markov_rank, ours.cfg.markov_head, ours.confidence_head is not None) == (
        8, fields.get("markov_head_type", "vanilla"), "confidence_head_alpha" in fields)
