"""The DFlash loss: position weights, hand-computed values, top-k KL, chunking, metric sums, overfit.

.venv/bin/python -m pytest tests/test_loss.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from stage2_train.data.batch import DrafterBatch
from stage2_train.model.config import LossConfig, recipe_gamma
from stage2_train.model.loss import (
    COUNT_KEYS,
    dflash_loss,
    finalize_metrics,
    loss_weights,
    position_weights,
    sum_counts,
)
from testkit.drafter import MASK_ID, make_packed_batch, tiny_arch, tiny_drafter

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def labels_only_batch(labels_NB, topk_lp=None, topk_ids=None) -> DrafterBatch:
    N, B = labels_NB.shape
    return DrafterBatch(
        context_TF=torch.zeros(0, 1),
        context_pos_T=torch.zeros(0, dtype=torch.long),
        context_seq_T=torch.zeros(0, dtype=torch.long),
        block_ids_NB=torch.zeros(N, B, dtype=torch.long),
        block_seq_N=torch.zeros(N, dtype=torch.long),
        anchor_pos_N=torch.zeros(N, dtype=torch.long),
        labels_NB=labels_NB,
        topk_logprobs_NBK=topk_lp,
        topk_ids_NBK=topk_ids,
    )


# ---------------------------------------------------------------------------------------------
# Config and recipe


def test_config_validation_and_recipe_warnings():
    with pytest.raises(ValueError, match=r"loss\.gamma must be a finite number > 0, got 0"):
        LossConfig.from_dict({"gamma": 0})
    with pytest.raises(ValueError, match=r"loss\.ce_chunk_blocks"):
        LossConfig.from_dict({"ce_chunk_blocks": 0})
    with pytest.raises(ValueError, match=r"loss\.ce_weight and loss\.kl_weight must not both be 0"):
        LossConfig.from_dict({"ce_weight": 0})
    with pytest.raises(ValueError, match=r"loss\.decay: unknown key"):
        LossConfig.from_dict({"decay": 7})
    assert (recipe_gamma(16), recipe_gamma(10), recipe_gamma(8), recipe_gamma(12)) == (7.0, 5.0, 4.0, None)
    assert LossConfig().recipe_warnings(block_size=16) == []
    assert LossConfig(gamma=5).recipe_warnings(block_size=10) == []
    assert LossConfig(gamma=4).recipe_warnings(block_size=8) == []
    (warning,) = LossConfig(gamma=4).recipe_warnings(block_size=16)
    assert "loss.gamma=4" in warning and "7" in warning
    assert "no published gamma" in LossConfig().recipe_warnings(block_size=12)[0]
    assert "CE only" in LossConfig(kl_weight=0.5).recipe_warnings()[0]


def test_position_weights_are_the_exponential_decay():
    w = position_weights(16, 7.0)
    assert w[0] == 0
    expected = torch.tensor([math.exp(-(k - 1) / 7.0) for k in range(1, 16)])
    torch.testing.assert_close(w[1:], expected)
    assert w[1] == 1.0
    labels = torch.tensor([[-100, 3, -100, 5], [-100, -100, 2, -100]])
    w_NB = loss_weights(labels, 2.0)
    torch.testing.assert_close(w_NB, torch.tensor([[0, 1, 0, math.exp(-1.0)], [0, 0, math.exp(-0.5), 0]]))


# ---------------------------------------------------------------------------------------------
# Hand-computed values


def test_loss_and_metrics_match_hand_computation():
    """lm_head = identity, so hidden == logits. Slot k is scored against labels[:, k], no shift."""
    gamma = 2.0
    hidden = torch.tensor(
        [
            [[9.0, 9.0, 9.0, 9.0], [0.0, 2.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.5]],  # slot1 right, slot2 wrong
            [[9.0, 9.0, 9.0, 9.0], [0.0, 0.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0]],  # slot1 right, slot2 unscored
        ],
        requires_grad=True,
    )
    labels = torch.tensor([[-100, 1, 2], [-100, 3, -100]])
    loss, m = dflash_loss(hidden, torch.eye(4), labels_only_batch(labels), LossConfig(gamma=gamma))

    def ce(row, label):
        return math.log(sum(math.exp(x) for x in row)) - row[label]

    w1, w2 = 1.0, math.exp(-1 / gamma)
    ce01, ce02, ce11 = ce([0, 2, 0, 0], 1), ce([1, 0, 0, 0.5], 2), ce([0, 0, 0, 3], 3)
    expected = (w1 * ce01 + w2 * ce02 + w1 * ce11) / (w1 + w2 + w1)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["loss"].item() == pytest.approx(expected, rel=1e-6)
    assert m["num_valid"].item() == 3
    assert m["accuracy"].item() == pytest.approx(2 / 3)
    assert m["correct_per_pos"].tolist() == [2, 0] and m["valid_per_pos"].tolist() == [2, 1]
    assert m["acc_per_pos"].tolist() == [1.0, 0.0]
    # Block 0: slot 1 right, slot 2 wrong -> 1 draft + the bonus = 2. Block 1: slot 1 right, then the
    # response ends (slot 2 unscored) -> decoding stops there with no bonus = 1.
    assert m["accept_len"].item() == 1.5
    loss.backward()
    assert hidden.grad[:, 0].abs().sum() == 0 and hidden.grad[1, 2].abs().sum() == 0  # unscored slots
    # The same logits judged against labels shifted by one slot give a different loss.
    shifted = torch.tensor([[-100, 2, -100], [-100, -100, -100]])
    assert dflash_loss(hidden, torch.eye(4), labels_only_batch(shifted), LossConfig(gamma=gamma))[0] != loss


def test_accept_len_and_accuracy_from_counts():
    counts = {k: torch.tensor(0.0) for k in COUNT_KEYS}
    counts.update(
        correct_per_pos=torch.tensor([8.0, 4.0, 1.0]),
        valid_per_pos=torch.tensor([10.0, 8.0, 4.0]),
        accept_sum=torch.tensor(21.0),
        num_blocks=torch.tensor(10.0),
    )
    m = finalize_metrics(counts, LossConfig())
    torch.testing.assert_close(m["acc_per_pos"], torch.tensor([0.8, 0.5, 0.25]))
    assert m["accept_len"].item() == pytest.approx(2.1)  # per block: accepted drafts + the bonus token


def test_streak_counts_consecutive_hits_from_slot_one():
    V = 5
    labels = torch.tensor([[-100, 1, 2, 3, 4], [-100, 1, 2, 3, 4], [-100, -100, -100, -100, -100]])
    preds = torch.tensor([[0, 1, 2, 0, 4], [0, 0, 2, 3, 4], [0, 1, 2, 3, 4]])
    hidden = torch.nn.functional.one_hot(preds, V).float() * 10
    _, m = dflash_loss(hidden, torch.eye(V), labels_only_batch(labels), LossConfig())
    assert m["accept_sum"].item() == (2 + 1) + (0 + 1)  # accepted run + the bonus, per scored block
    assert m["num_blocks"].item() == 2  # the block with nothing scored does not count
    assert m["accept_len"].item() == 2.0
    # A block whose first slots are unscored (anchored in a prompt, loss.distill_positions=all)
    # is no draft decoding would make: it counts for accuracy, not for accept_len.
    labels = torch.tensor([[-100, 1, 2, 3, 4], [-100, -100, -100, 3, 4]])
    preds = torch.tensor([[0, 1, 0, 3, 4], [0, 1, 2, 3, 4]])
    hidden = torch.nn.functional.one_hot(preds, V).float() * 10
    _, m = dflash_loss(hidden, torch.eye(V), labels_only_batch(labels), LossConfig())
    assert m["num_blocks"].item() == 1 and m["accept_len"].item() == 2.0
    assert m["correct_per_pos"].tolist() == [1, 0, 2, 2]


@pytest.mark.parametrize("label_shift", [0, 1])
def test_a_block_whose_last_draft_ends_the_response_earns_no_bonus(label_shift):
    """Decoding cuts its tokens after the end of turn: a block whose every draft is right and whose
    last draft is the response's last token gives B - 1 tokens (DSpark B), not one more. A block
    followed by more of the response earns the bonus."""
    from stage2_train.data.batch import collate

    B, V = 4, 40
    ids = torch.arange(10, 20)

    def accept(mask, anchors):
        sample = {"input_ids_T": ids, "loss_mask_T": torch.tensor(mask, dtype=torch.bool), "hidden_TLH": torch.zeros(10, 1, 2),
                  "topk_logprobs_TK": torch.zeros(10, 1), "topk_ids_TK": torch.zeros(10, 1, dtype=torch.long)}
        batch = collate([sample], [torch.tensor(anchors)], block_size=B, mask_token_id=0, gather_topk=False, label_shift=label_shift)
        hidden = torch.nn.functional.one_hot(batch.labels_NB.clamp(min=0), V).float() * 10  # every draft right
        _, m = dflash_loss(hidden, torch.eye(V), batch, LossConfig())
        return m["accept_sum"].item()

    drafts = B - 1 + label_shift
    answer_to_the_end = [False, False] + [True] * 8  # 9, the sample's last token, ends the answer
    assert accept(answer_to_the_end, [2 - label_shift]) == drafts + 1  # the answer goes on after the block
    assert accept(answer_to_the_end, [6 - label_shift]) == drafts  # its last draft is token 9
    answer_then_template = [False, False] + [True] * 6 + [False, False]  # 7 ends the answer, 8-9 template
    assert accept(answer_then_template, [4 - label_shift]) == drafts


# ---------------------------------------------------------------------------------------------
# Top-k KL


def test_topk_kl_definition():
    gen = torch.Generator().manual_seed(0)
    N, B, V, K = 3, 4, 11, 5
    hidden = torch.randn(N, B, V, generator=gen)
    labels = torch.randint(0, V, (N, B), generator=gen)
    labels[:, 0] = -100
    labels[2, 3] = -100
    target_logits = torch.randn(N, B, V, generator=gen)
    lp, ids = target_logits.log_softmax(-1).topk(K, dim=-1)
    lp[2, 3] = float("nan")  # an unscored slot may hold anything
    ids[2, 3] = 10_000
    cfg = LossConfig(ce_weight=0.0, kl_weight=1.0, gamma=3.0)
    loss, m = dflash_loss(hidden, torch.eye(V), labels_only_batch(labels, lp, ids), cfg)
    assert torch.isfinite(loss)
    expected_num = expected_den = 0.0
    for n in range(N):
        for k in range(1, B):
            if labels[n, k] < 0:
                continue
            p = lp[n, k].softmax(-1)
            logq = hidden[n, k].log_softmax(-1)[ids[n, k]]
            kl = (p * (p.log() - logq)).sum().item()
            assert kl >= 0
            w = math.exp(-(k - 1) / 3.0)
            expected_num += w * kl
            expected_den += w
    assert loss.item() == pytest.approx(expected_num / expected_den, rel=1e-5)
    assert m["kl"].item() == pytest.approx(expected_num / expected_den, rel=1e-5)
    # Drafter == target over the full vocabulary with K == V: zero KL.
    lp_full, ids_full = target_logits.log_softmax(-1).topk(V, dim=-1)
    zero, _ = dflash_loss(target_logits, torch.eye(V), labels_only_batch(labels, lp_full, ids_full), cfg)
    assert abs(zero.item()) < 1e-6
    with pytest.raises(ValueError, match="kl_weight"):
        dflash_loss(hidden, torch.eye(V), labels_only_batch(labels), cfg)


# ---------------------------------------------------------------------------------------------
# Chunking, normalisation, aggregation


def _random_case(N=10, B=4, H=8, V=50, K=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, B, H, generator=gen)
    head = torch.randn(V, H, generator=gen)
    labels = torch.randint(0, V, (N, B), generator=gen)
    labels[:, 0] = -100
    labels[torch.rand(N, B, generator=gen) < 0.2] = -100
    lp = torch.randn(N, B, K, generator=gen).log_softmax(-1)
    ids = torch.randint(0, V, (N, B, K), generator=gen)
    return hidden, head, labels_only_batch(labels, lp, ids)


def test_chunked_lm_head_gives_the_same_loss_and_gradients():
    hidden, head, batch = _random_case()
    results = []
    for chunk in (1, 3, 1000):
        h = hidden.clone().requires_grad_(True)
        loss, m = dflash_loss(h, head, batch, LossConfig(kl_weight=0.3, ce_chunk_blocks=chunk))
        loss.backward()
        results.append((loss.detach(), h.grad, m["correct_per_pos"]))
    for loss, grad, correct in results[:2]:
        torch.testing.assert_close(loss, results[-1][0])
        torch.testing.assert_close(grad, results[-1][1])
        assert torch.equal(correct, results[-1][2])


def test_summed_counts_equal_the_whole_batch():
    hidden, head, batch = _random_case(N=12)
    cfg = LossConfig(kl_weight=0.5)
    _, whole = dflash_loss(hidden, head, batch, cfg)
    parts = []
    for sl in (slice(0, 5), slice(5, 12)):
        part = labels_only_batch(batch.labels_NB[sl], batch.topk_logprobs_NBK[sl], batch.topk_ids_NBK[sl])
        parts.append(dflash_loss(hidden[sl], head, part, cfg)[1])
    merged = finalize_metrics(sum_counts(parts), cfg)
    for key in ("loss", "ce", "kl", "accuracy", "acc_per_pos", "accept_len"):
        torch.testing.assert_close(merged[key], whole[key], msg=key)


def test_global_normalizer_and_empty_batch():
    hidden, head, batch = _random_case()
    cfg = LossConfig()
    loss, m = dflash_loss(hidden, head, batch, cfg)
    scaled, _ = dflash_loss(hidden, head, batch, cfg, normalizer=2 * m["weight_sum"])
    torch.testing.assert_close(scaled, loss / 2)
    h = hidden.clone().requires_grad_(True)
    empty = labels_only_batch(torch.full_like(batch.labels_NB, -100))
    loss0, m0 = dflash_loss(h, head, empty, cfg)
    loss0.backward()
    assert loss0.item() == 0 and m0["num_valid"].item() == 0 and torch.isfinite(m0["accept_len"])
    assert h.grad.abs().sum() == 0


# ---------------------------------------------------------------------------------------------
# End to end: the drafter learns


def test_tiny_drafter_overfits_fixed_samples():
    arch = tiny_arch(hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=100)
    model = tiny_drafter(arch, num_layers=2, block_size=4, attention="sdpa", seed=0)
    for p in model.parameters():  # the default init (0.02) trains faster than the tests' 0.2
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.05)
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, MASK_ID, (n,), generator=gen).tolist() for n in (20, 14, 26)]
    anchors = [[0, 4, 9, 15], [1, 6, 10], [0, 3, 8, 12, 19, 22]]
    batch = make_packed_batch(tokens, anchors, 4, 2 * 64, seed=1)
    cfg = LossConfig(gamma=4.0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    _, first = dflash_loss(model(batch), model.lm_head_VH, batch, cfg)
    for _ in range(150):
        loss, m = dflash_loss(model(batch), model.lm_head_VH, batch, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _, last = dflash_loss(model(batch), model.lm_head_VH, batch, cfg)
    assert first["accuracy"] < 0.2
    assert last["accuracy"] >= 0.98, last["accuracy"]
    assert last["loss"] < 0.1 * first["loss"]
    assert last["accept_len"] > 3.8  # 3 scored slots per block, + the bonus


def test_candidate_softmax_equals_the_full_one_when_the_candidates_are_the_whole_vocabulary():
    """Slots past loss.full_vocab_slots take a softmax over [label, stored top-k ids]. With every
    other token among the top-k, that softmax IS the full one: same loss, same gradient."""
    torch.manual_seed(0)
    N, B, V = 3, 5, 7
    hidden = torch.randn(N, B, V, requires_grad=True)
    head = torch.randn(V, V)
    labels = torch.randint(0, V, (N, B))
    labels[:, 0] = -100
    labels[2, 3:] = -100
    # top-k = every token but the label, in a shuffled order, with arbitrary target log-probs
    def others(label: int) -> torch.Tensor:
        return torch.tensor([t for t in torch.randperm(V).tolist() if t != max(label, 0)])

    ids = torch.stack([torch.stack([others(int(label)) for label in row]) for row in labels])
    lp = torch.randn(N, B, V - 1)
    batch = labels_only_batch(labels, lp, ids)
    cfg_full = LossConfig(gamma=3.0, kl_weight=0.5)
    cfg_cand = LossConfig(gamma=3.0, kl_weight=0.5, full_vocab_slots=1)
    loss_full, m_full = dflash_loss(hidden, head, batch, cfg_full)
    (grad_full,) = torch.autograd.grad(loss_full, hidden)
    loss_cand, m_cand = dflash_loss(hidden, head, batch, cfg_cand)
    (grad_cand,) = torch.autograd.grad(loss_cand, hidden)
    # KL over the top-k: the full softmax gives the label's mass to no stored id, the candidate one neither.
    assert loss_cand.item() == pytest.approx(loss_full.item(), rel=1e-5)
    torch.testing.assert_close(grad_cand, grad_full, rtol=1e-4, atol=1e-6)
    assert m_cand["correct_per_pos"].tolist() == m_full["correct_per_pos"].tolist()


def test_candidate_softmax_counts_the_label_once_when_it_is_among_the_top_k():
    hidden = torch.zeros(1, 2, 4, requires_grad=True)  # equal logits everywhere
    head = torch.eye(4)
    labels = torch.tensor([[-100, 2]])
    ids = torch.tensor([[[0, 1, 2], [0, 1, 2]]])  # the label (2) is a top-k id too
    lp = torch.log(torch.tensor([[[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]]]))
    loss, _ = dflash_loss(hidden, head, labels_only_batch(labels, lp, ids), LossConfig(full_vocab_slots=0))
    assert loss.item() == pytest.approx(math.log(3))  # 3 distinct candidates, not 4


# ---- D-PACE and distilling on every position -------------------------------------------------------
# speculators 0.9.0 `losses/utils.py::dpace_loss_decay` on 2 blocks x 6 slots, alpha 0.5 (the
# helper script is in the closing note): slot 0 is the anchor, block 0 has a gap at slot 3.
DPACE_CE = [[0.0, 0.1, 0.5, 1.2, 0.3, 2.0], [0.0, 0.7, 0.05, 3.0, 0.4, 0.9]]
DPACE_MASK = [[0, 1, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0]]
DPACE_SPECULATORS = [
    [0.0, 2.76137686, 1.80895805, 0.0, 1.04391313, 0.37801108],
    [0.0, 1.86153412, 1.11324143, 0.38319609, 0.0, 0.0],
]


def test_dpace_weights_equal_speculators_on_a_fixed_batch():
    from stage2_train.model.loss import dpace_weights

    w = dpace_weights(torch.tensor(DPACE_CE), torch.tensor(DPACE_MASK, dtype=torch.bool), alpha=0.5)
    torch.testing.assert_close(w, torch.tensor(DPACE_SPECULATORS), atol=1e-6, rtol=0)
    ones = dpace_weights(torch.tensor(DPACE_CE), torch.tensor(DPACE_MASK, dtype=torch.bool), alpha=1.0)
    assert ones.tolist() == [[0, 4, 3, 0, 2, 1], [0, 3, 2, 1, 0, 0]]  # alpha 1: the scored slots from k on


def test_dpace_loss_weights_each_slot_by_its_detached_continuation():
    """The gradient of the D-PACE objective with respect to slot k's CE is w_k / (scored slots):
    the weights come from the CE but carry no gradient themselves."""
    arch = tiny_arch(kv_heads=2)
    model = tiny_drafter(arch, num_layers=1, block_size=6)
    tokens = [[int(t) for t in torch.randint(0, MASK_ID, (30,), generator=torch.Generator().manual_seed(2))]]
    batch = make_packed_batch(tokens, [[3, 10, 17]], 6, 2 * arch.hidden_size)
    cfg = LossConfig(gamma=4.0, weighting="dpace", dpace_alpha=0.5)
    hidden = model(batch)
    loss, metrics = dflash_loss(hidden, model.lm_head_VH, batch, cfg)
    # by hand: CE per slot, weights from it, divided by the count of scored slots
    logits = model.logits(hidden).float()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.labels_NB.reshape(-1).clamp(min=0), reduction="none").view(3, 6)
    mask = batch.labels_NB != -100
    from stage2_train.model.loss import dpace_weights

    w = dpace_weights(ce.detach(), mask, 0.5)
    want = (w * torch.where(mask, ce, 0.0)).sum() / mask.sum()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    decay = dflash_loss(hidden, model.lm_head_VH, batch, LossConfig(gamma=4.0))[1]
    assert float(metrics["loss"]) == pytest.approx(float(decay["loss"]))  # the reported metric does not move


def test_distilling_every_position_adds_prompt_slots_to_the_kl_term_only():
    """distill_positions=all: blocks anchored in the prompt too; their slots carry the target's
    top-k (KL) but no CE, and the metrics stay those of the assistant slots."""
    from stage2_train.data.batch import collate

    T, K = 20, 4
    ids = torch.arange(100, 100 + T)
    mask = torch.zeros(T, dtype=torch.bool)
    mask[12:] = True  # a 12-token prompt
    sample = {
        "input_ids_T": ids, "loss_mask_T": mask, "hidden_TLH": torch.randn(T, 2, 8),
        "topk_logprobs_TK": torch.randn(T, K), "topk_ids_TK": torch.randint(0, 50, (T, K)),
    }
    anchors = torch.tensor([2, 9, 13])
    plain = collate([sample], [anchors], block_size=4, mask_token_id=MASK_ID)
    distill = collate([sample], [anchors], block_size=4, mask_token_id=MASK_ID, distill_all=True)
    assert (plain.labels_NB[0] == -100).all() and (plain.labels_NB[1, 1:3] == -100).all()  # prompt: nothing
    assert distill.labels_NB[0, 1:].tolist() == [103, 104, 105] and distill.supervised_NB[0].sum() == 0
    assert distill.supervised_NB[1].tolist() == [False, False, False, True]  # slot 3 = position 12
    assert torch.equal(distill.supervised_NB, plain.labels_NB != -100)
    assert (distill.topk_ids_NBK[0, 1:] != 0).any()  # the target's distribution where the prompt is
    arch = tiny_arch(hidden=8, heads=2, kv_heads=2, head_dim=4, vocab=200)
    model = tiny_drafter(arch, num_layers=1, block_size=4, num_feature_layers=2)
    torch.manual_seed(0)
    hidden_plain, hidden_distill = model(plain), model(distill)
    cfg = LossConfig(gamma=4.0, kl_weight=1.0, distill_positions="all")
    loss_plain, metrics_plain = dflash_loss(hidden_plain, model.lm_head_VH, plain, cfg)
    loss_distill, metrics_distill = dflash_loss(hidden_distill, model.lm_head_VH, distill, cfg)
    for key in ("ce", "kl", "accuracy", "accept_len", "num_valid"):
        assert float(metrics_distill[key]) == pytest.approx(float(metrics_plain[key]), rel=1e-5), key
    assert float(loss_distill.detach()) != pytest.approx(float(loss_plain.detach()))  # the prompt's KL is in the objective
    with pytest.raises(ValueError, match="loss.distill_positions"):
        LossConfig(distill_positions="all", kl_weight=0.0)
