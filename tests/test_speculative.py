"""Speculative decoding is exact, tau means what it says, and offline block metrics match decoding.

.venv/bin/python -m pytest tests/test_speculative.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shared.config import build_run_config
from shared.target import TargetArch, TargetConfig, resolve_layer_ids
from shared.target_parts import load_embed_and_head
from stage2_train.data.loader import collate
from stage2_train.model.config import DrafterConfig
from stage2_train.model.drafter import DFlashDrafter
from stage2_train.serve.online_eval import bootstrap_tau, heldout_prompts, interval_text, online_eval
from stage2_train.serve.speculative import (
    DFlashProposer,
    NgramProposer,
    capture_features,
    speculative_generate,
    target_greedy,
)
from stage2_train.train.evaluate import decode_walk, offline_eval, score_blocks

BLOCK = 4
MASK_ID = 16  # <empty_output> in the SmolLM2 tokenizer the tiny target uses


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def layer_ids(tiny_target_dir):
    return resolve_layer_ids(
        TargetConfig(path=str(tiny_target_dir), num_feature_layers=3), TargetArch.from_dir(tiny_target_dir)
    )


@pytest.fixture(scope="module")
def drafter(tiny_target_dir, layer_ids):
    arch = TargetArch.from_dir(tiny_target_dir)
    torch.manual_seed(0)
    model = DFlashDrafter(
        DrafterConfig(num_layers=1, block_size=BLOCK, init_std=0.2), arch, len(layer_ids), MASK_ID
    )
    model.set_frozen_parts(*load_embed_and_head(tiny_target_dir))
    return model.eval()


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (7, 12)]


class OracleProposer:
    """Knows the target's greedy continuation; `wrong=True` proposes a different token every time."""

    feature_layer_ids = None

    def __init__(self, full_tokens: list[int], max_draft: int, wrong: bool = False, vocab: int = 49152):
        self.full, self.max_draft, self.wrong, self.vocab = full_tokens, max_draft, wrong, vocab
        self.name = "never" if wrong else "oracle"

    def propose(self, tokens, context_TF):
        assert tokens == self.full[: len(tokens)]
        nxt = self.full[len(tokens) : len(tokens) + self.max_draft]
        return [(t + 1) % self.vocab for t in nxt] if self.wrong else nxt


def test_dflash_untrained_output_equals_target_greedy(target, drafter, layer_ids, prompts):
    for prompt in prompts:
        greedy = target_greedy(target, prompt, max_new_tokens=21, eos_token_ids=None)
        spec = speculative_generate(
            target, DFlashProposer(drafter, layer_ids), prompt, max_new_tokens=21, eos_token_ids=None
        )
        assert spec.tokens == greedy.tokens and len(spec.tokens) == 21
        assert sum(spec.acceptance_lengths) == 20  # everything after the prefill token
        assert all(1 <= a <= BLOCK for a in spec.acceptance_lengths)
        assert spec.tau == 20 / spec.num_target_forwards


def test_oracle_gets_tau_block_size_and_never_agreeing_gets_one(target, prompts):
    prompt = prompts[0]
    num_iters = 5
    max_new = 1 + num_iters * BLOCK
    greedy = target_greedy(target, prompt, max_new_tokens=max_new, eos_token_ids=None)
    full = prompt + greedy.tokens
    oracle = speculative_generate(
        target, OracleProposer(full, BLOCK - 1), prompt, max_new_tokens=max_new, eos_token_ids=None
    )
    assert oracle.tokens == greedy.tokens
    assert oracle.acceptance_lengths == [BLOCK] * num_iters and oracle.tau == BLOCK
    never = speculative_generate(
        target,
        OracleProposer(full, BLOCK - 1, wrong=True),
        prompt,
        max_new_tokens=max_new,
        eos_token_ids=None,
    )
    assert never.tokens == greedy.tokens
    assert never.acceptance_lengths == [1] * (max_new - 1) and never.tau == 1.0


def test_eos_stops_both_decoders_at_the_same_token(target, drafter, layer_ids, prompts):
    prompt = prompts[1]
    free = target_greedy(target, prompt, max_new_tokens=16, eos_token_ids=None).tokens
    eos = free[9]
    stop = free.index(eos)
    greedy = target_greedy(target, prompt, max_new_tokens=16, eos_token_ids=[eos])
    assert greedy.tokens == free[: stop + 1]
    oracle = OracleProposer(prompt + free, BLOCK - 1)
    for proposer in (oracle, DFlashProposer(drafter, layer_ids)):
        spec = speculative_generate(target, proposer, prompt, max_new_tokens=16, eos_token_ids=eos)
        assert spec.tokens == greedy.tokens


def test_ngram_proposer_continues_the_latest_match():
    ngram = NgramProposer(3)
    assert ngram.propose([1, 2, 3, 9, 1, 2, 3]) == [9, 1, 2]
    assert ngram.propose([5, 7, 5, 8, 7]) == [5, 8, 7]  # "7" last seen at index 1
    assert ngram.propose([4, 5, 6]) == []
    assert NgramProposer(2, max_ngram=2).propose([1, 2, 1, 3, 1, 2]) == [1, 3]
    # The latest match of "7 7" (position 5) continues with one token only; position 0 has a full continuation.
    assert NgramProposer(3, max_ngram=2).propose([7, 7, 1, 2, 3, 7, 7, 7]) == [1, 2, 3]


def test_ngram_baseline_is_exact_and_accepts_repeats(target, prompts):
    prompt = prompts[0] * 3  # repetition makes the target's continuation predictable from the prompt
    greedy = target_greedy(target, prompt, max_new_tokens=24, eos_token_ids=None)
    spec = speculative_generate(
        target, NgramProposer(BLOCK - 1), prompt, max_new_tokens=24, eos_token_ids=None
    )
    assert spec.tokens == greedy.tokens
    assert spec.tau > 1.5  # the tiny target repeats itself; the n-gram drafter sees it


def test_incremental_context_equals_full_sequence_features(target, drafter, layer_ids, prompts):
    """The features the decoder accumulates (prefill + accepted rows of each verify, cache cropped)
    equal one forward over the final sequence: every recorded draft is reproduced from them."""
    prompt = prompts[0]
    spec = speculative_generate(
        target, DFlashProposer(drafter, layer_ids), prompt, max_new_tokens=17, eos_token_ids=None, record=True
    )
    full = prompt + spec.tokens
    features_TF = capture_features(target, full, layer_ids).flatten(1)
    proposer = DFlashProposer(drafter, layer_ids)
    assert spec.proposals and spec.proposals[0][0] == len(prompt)
    for anchor_pos, drafts in spec.proposals:
        redo = proposer.propose(full[: anchor_pos + 1], features_TF[:anchor_pos])
        assert redo[: len(drafts)] == drafts


class MemoryReader:
    """What offline_eval and heldout_prompts need from a StoreReader, in memory."""

    def __init__(self, samples: list[dict]):
        self.samples = samples
        self.lengths = np.array([len(s["input_ids_T"]) for s in samples])
        self.sample_ids = np.array([s["sample_id"] for s in samples])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def greedy_sample(target, prompt, layer_ids, max_new, sample_id):
    tokens = prompt + target_greedy(target, prompt, max_new_tokens=max_new, eos_token_ids=None).tokens
    return {
        "sample_id": sample_id,
        "input_ids_T": torch.tensor(tokens),
        "loss_mask_T": torch.tensor([False] * len(prompt) + [True] * max_new),
        "hidden_TLH": capture_features(target, tokens, layer_ids),
    }


def test_offline_blocks_predict_online_decoding(target, drafter, layer_ids, prompts):
    """On the target's own greedy continuation, the offline path (store sample -> collate -> drafter)
    drafts exactly what online decoding drafts at the same anchors, and accepts as much."""
    prompt = prompts[1]
    sample = greedy_sample(target, prompt, layer_ids, max_new=20, sample_id=0)
    spec = speculative_generate(
        target, DFlashProposer(drafter, layer_ids), prompt, max_new_tokens=20, eos_token_ids=None, record=True
    )
    assert spec.tokens == sample["input_ids_T"][len(prompt) :].tolist()
    anchors = torch.arange(len(prompt), len(sample["input_ids_T"]) - BLOCK + 1)
    batch = collate([sample], [anchors], block_size=BLOCK, mask_token_id=MASK_ID, gather_topk=False)
    scored = score_blocks(drafter, batch, gamma=4.0)
    accept_N, pred_NB = scored.accept_N, scored.pred_NB
    offline = {int(a): (pred_NB[n, 1:].tolist(), int(accept_N[n])) for n, a in enumerate(anchors)}
    compared = 0
    for (anchor_pos, drafts), accepted in zip(spec.proposals, spec.acceptance_lengths):
        if anchor_pos in offline and len(drafts) == BLOCK - 1:
            assert offline[anchor_pos] == (drafts, accepted)
            compared += 1
    assert compared >= 3


def test_decode_walk_visits_what_decoding_visits():
    accept = {10: 1, 11: 3, 12: 1, 13: 1, 14: 2, 15: 1, 16: 4, 17: 1, 20: 1}
    assert decode_walk(accept) == [(10, 1), (11, 3), (14, 2), (16, 4), (20, 1)]
    assert decode_walk({0: 2, 1: 1, 5: 1, 6: 3}) == [(0, 2), (5, 1), (6, 3)]  # 2 is unsupervised: resume at 5


class PartlyRightDrafter(torch.nn.Module):
    """A stand-in drafter that knows the target's greedy text and is wrong exactly where
    (anchor + k) % 5 == 0. It encodes its prediction in a 1-wide hidden state, so the online
    proposer and the offline scorer both read it through forward() and logits()."""

    def __init__(self, full_tokens, block_size=BLOCK, vocab=49152):
        super().__init__()
        self.full, self.block_size, self.vocab = full_tokens, block_size, vocab
        self.mask_token_id, self.num_feature_layers = MASK_ID, 3
        self.fc = torch.nn.Linear(1, 1)

    def forward(self, batch):
        pos_NB = batch.anchor_pos_N[:, None] + torch.arange(self.block_size)
        full = torch.tensor(self.full + [0] * self.block_size)
        pred_NB = torch.where(pos_NB % 5 == 0, (full[pos_NB] + 1) % self.vocab, full[pos_NB])
        return pred_NB[..., None].float()

    def logits(self, hidden):
        return torch.nn.functional.one_hot(hidden[..., 0].long(), self.vocab).float()


def test_offline_walk_tau_equals_online_tau_on_the_same_text(target, layer_ids, prompts):
    prompt = prompts[1]
    sample = greedy_sample(target, prompt, layer_ids, max_new=30, sample_id=0)
    full = sample["input_ids_T"].tolist()
    stub = PartlyRightDrafter(full)
    spec = speculative_generate(
        target, DFlashProposer(stub, layer_ids), prompt, max_new_tokens=30, eos_token_ids=None, record=True
    )
    assert spec.tokens == full[len(prompt) :]
    offline = offline_eval(stub, MemoryReader([sample]), [0], max_anchors_per_seq=None)
    assert offline["accept_hist"][1:] != [0] * (BLOCK - 1)  # some blocks accept drafts, some do not
    # Offline anchors run to the response's end, and a block that runs into it gets no bonus token,
    # as decoding gets none: the replayed walk is decoding's own, last verification included.
    online = list(zip((a for a, _ in spec.proposals), spec.acceptance_lengths))
    anchors = torch.arange(len(prompt), len(full) - 1)
    batch = collate([sample], [anchors], block_size=BLOCK, mask_token_id=MASK_ID, gather_topk=False)
    accept_N = score_blocks(stub, batch, gamma=4.0).accept_N
    walk = decode_walk(dict(zip(anchors.tolist(), accept_N.tolist())))
    assert walk == online
    assert offline["walk_tau"] == pytest.approx(spec.tau)
    assert offline["walk_tau"] < offline["accept_len"]  # the block mean over-weights the easy stretches


def test_offline_eval_counts_every_block_and_matches_its_histogram(target, drafter, layer_ids, prompts):
    samples = [greedy_sample(target, p, layer_ids, max_new=14, sample_id=i) for i, p in enumerate(prompts)]
    reader = MemoryReader(samples)
    result = offline_eval(drafter, reader, [0, 1], max_anchors_per_seq=None, batch_tokens=24)
    expected_blocks = sum(14 - 1 for _ in prompts)  # anchors: every supervised t with t + 1 supervised
    assert result["num_samples"] == 2 and result["num_blocks"] == expected_blocks
    assert sum(result["accept_hist"]) == expected_blocks and len(result["accept_hist"]) == BLOCK
    mean_accept = sum((j + 1) * c for j, c in enumerate(result["accept_hist"])) / expected_blocks
    assert result["accept_len"] == pytest.approx(mean_accept)
    assert drafter.training is False
    assert offline_eval(drafter, reader, [0, 1], max_anchors_per_seq=3)["num_blocks"] == 6
    assert offline_eval(drafter, reader, [0, 1], max_anchors_per_seq=3)["walk_tau"] is None


def test_offline_eval_pools_its_metrics_and_their_standard_errors_from_the_samples(target, drafter, layer_ids, prompts):
    """ce is the decay-weighted CE of every scored slot, pooled; each *_se is the standard error of
    the per-sample values (computed here from each sample alone)."""
    import numpy as np

    from stage2_train.data.anchors import AnchorSampler
    from stage2_train.data.config import SamplerConfig
    from stage2_train.train.evaluate import DENSE_ANCHORS

    samples = [greedy_sample(target, p, layer_ids, max_new=14, sample_id=i) for i, p in enumerate(prompts)]
    reader = MemoryReader(samples)
    result = offline_eval(drafter, reader, list(range(len(samples))), max_anchors_per_seq=None, gamma=4.0)
    sampler = AnchorSampler(SamplerConfig(max_anchors_per_seq=DENSE_ANCHORS), block_size=BLOCK, seed=0)
    ce_sum = w_sum = 0.0
    per_sample_ce, per_sample_walk = [], []
    for sample in samples:
        anchors = sampler.anchors(sample["loss_mask_T"], sample_id=int(sample["sample_id"]), epoch=0)
        batch = collate([sample], [anchors], block_size=BLOCK, mask_token_id=MASK_ID, gather_topk=False)
        scored = score_blocks(drafter, batch, gamma=4.0)
        ce_sum, w_sum = ce_sum + float((scored.w_NB * scored.ce_NB).sum()), w_sum + float(scored.w_NB.sum())
        per_sample_ce.append(float((scored.w_NB * scored.ce_NB).sum() / scored.w_NB.sum()))
        visits = decode_walk(dict(zip(anchors.tolist(), scored.accept_N.tolist())))
        per_sample_walk.append(sum(a for _, a in visits) / len(visits))
    assert result["ce"] == pytest.approx(ce_sum / w_sum, rel=1e-5)
    assert result["ce_se"] == pytest.approx(np.std(per_sample_ce, ddof=1) / np.sqrt(len(samples)), rel=1e-5)
    assert result["walk_tau_se"] == pytest.approx(np.std(per_sample_walk, ddof=1) / np.sqrt(len(samples)), rel=1e-5)


def test_online_eval_reports_tau_and_exactness(target, prompts):
    max_new = 1 + 3 * BLOCK
    fulls = [p + target_greedy(target, p, max_new_tokens=max_new, eos_token_ids=None).tokens for p in prompts]

    class PerPrompt:
        feature_layer_ids = None
        max_draft = BLOCK - 1

        def __init__(self, wrong):
            self.wrong, self.name = wrong, str(wrong)

        def propose(self, tokens, context_TF):
            full = next(f for f in fulls if f[: len(tokens)] == tokens)
            return OracleProposer(full, BLOCK - 1, wrong=self.wrong).propose(tokens, context_TF)

    result = online_eval(
        target,
        {"oracle": PerPrompt(False), "never": PerPrompt(True)},
        prompts,
        max_new_tokens=max_new,
        eos_token_ids=None,
    )
    assert result["num_prompts"] == 2
    assert result["proposers"]["oracle"]["tau"] == BLOCK and result["proposers"]["oracle"]["exact"]
    assert result["proposers"]["oracle"]["accept_hist"] == [0, 0, 0, 6]
    assert result["proposers"]["never"]["tau"] == 1.0 and result["proposers"]["never"]["num_exact"] == 2


def test_an_interval_needs_five_prompts_and_prompts_without_a_verifying_forward_are_left_out():
    """One prompt gave "tau 2.000 [2.000, 2.000]" as a 95% interval, and a prompt whose first token ended
    the turn (0 verifying forwards) made resamples divide 0 by 0: lo/hi nan (review, probe3b/3d)."""
    one = bootstrap_tau([[40, 20, 140]])
    assert one == {"tau": 2.0, "lo": None, "hi": None, "num_prompts": 1, "num_without_forwards": 0}
    assert interval_text(one) == "2.000 (1 prompt: too few for an interval)"
    rows = [[40 + 4 * i, 20, 140] for i in range(5)]  # taus 2.0, 2.2, ..., 2.8
    assert bootstrap_tau(rows[:4])["lo"] is None and interval_text(bootstrap_tau(rows[:4])).endswith("(4 prompts: too few for an interval)")
    five = bootstrap_tau(rows)
    assert 2.0 <= five["lo"] < five["tau"] == 2.4 < five["hi"] <= 2.8 and five["num_prompts"] == 5
    assert interval_text(five) == f"2.400 [{five['lo']:.3f}, {five['hi']:.3f}]"
    # An empty prompt among two: left out and counted, no nan; paired, the difference has no interval either.
    paired = bootstrap_tau([[0, 0, 0], [40, 20, 140]], baseline=[[0, 0, 0], [20, 20, 140]])
    assert paired == {"tau": 2.0, "lo": None, "hi": None, "num_prompts": 1, "num_without_forwards": 1,
                      "diff": 1.0, "diff_lo": None, "diff_hi": None}
    # Among twelve, the interval is the one of the eleven others: the empty prompt changes nothing.
    twelve = [[0, 0, 0]] + [[40 + i, 20, 140] for i in range(11)]
    assert bootstrap_tau(twelve) == {**bootstrap_tau(twelve[1:]), "num_without_forwards": 1}
    assert not any(isinstance(v, float) and np.isnan(v) for v in bootstrap_tau(twelve).values())
    assert bootstrap_tau([[0, 0, 0]])["tau"] is None and interval_text(bootstrap_tau([[0, 0, 0]])).startswith("none")


class BlockVerifyTie:
    """What bf16 verification does to near-tied logits, made certain: while hooked, a target forward over
    more than one new token (a block verification; greedy decoding and the prefill's last position are
    one) gives `token` the argmax at the block's first position, so speculative output leaves greedy."""

    def __init__(self, target, token):
        self.handle = target.lm_head.register_forward_hook(self.hook)
        self.token = token

    def hook(self, module, args, logits_BTV):
        if logits_BTV.shape[1] > 1:
            logits_BTV = logits_BTV.clone()
            logits_BTV[:, 0, self.token] = logits_BTV.max() + 1.0
        return logits_BTV


def test_outputs_that_differ_from_greedy_are_said_per_proposer_and_mark_the_paired_difference(target, prompts):
    """With eval.online_dtype=bf16 most outputs differed from the target's greedy ones and the printed
    taus and paired difference said nothing (review, probe3e): now each proposer's line says on how many
    prompts, a note says why, and the paired difference is marked as comparing different texts."""
    from stage2_train.serve.evaluation import add_intervals, one_line, online_notes

    class Drafts:
        feature_layer_ids, max_draft = None, BLOCK - 1

        def __init__(self, name, drafts):
            self.name, self.drafts = name, drafts

        def propose(self, tokens, context_TF):
            return self.drafts

    tie = BlockVerifyTie(target, token=5)
    try:
        online = online_eval(target, {"single": Drafts("single", []), "block": Drafts("block", [7, 7, 7])}, prompts,
                             max_new_tokens=9, eos_token_ids=None)
    finally:
        tie.handle.remove()
    block, single = online["proposers"]["block"], online["proposers"]["single"]
    assert block["exact_per_prompt"] == [False, False] and block["num_exact"] == 0 and not block["exact"]
    assert single["exact_per_prompt"] == [True, True] and single["exact"]
    add_intervals(online, "single")
    assert block["interval"]["diff_texts_differ"] == 2 and "diff" not in single["interval"]
    online.update({"dtype": "bf16", "num_prompts_asked": 2})
    notes = online_notes(online, "single")
    assert notes[0].startswith("outputs differ from the target's greedy output: block on 2 of 2 prompts. Why: the "
                               "target ran with eval.online_dtype=bf16: ")
    assert "eval.online_dtype=fp32 gives exact outputs" in notes[0] and "single on" not in notes[0]
    assert notes[1] == "2 prompts with a verifying forward: too few for a 95% interval over prompts (it takes 5); the taus are point values only"
    online["notes"] = notes
    line = one_line({"online": online, "offline": {}}, trained="single")
    assert line == (
        "single tau 1.000 (2 prompts: too few for an interval), 0.0 drafted/step | "
        "block tau 1.000 (2 prompts: too few for an interval), 2.2 drafted/step, output differs from greedy on 2 of 2 "
        "prompts (+0.000 vs single, different texts)"
    )
    online["dtype"] = "fp32"
    assert "in fp32 verification should reproduce it exactly" in online_notes(online, "single")[0]


def test_a_comparison_without_intervals_still_tabulates_and_plots(tmp_path):
    """bench/compare.py reads lo/hi and diff_lo/diff_hi: a group of too few prompts has none, and its
    table and plot say so instead of failing; a rule that needs an interval is not met."""
    from bench.compare import plot, rows
    from stage2_train.serve.evaluation import add_intervals

    def proposer(per_prompt):
        return {"per_prompt": per_prompt, "exact_per_prompt": [True] * len(per_prompt), "num_exact": len(per_prompt), "exact": True}

    online = {"num_prompts": 3, "proposers": {
        "fp8": proposer([[40, 20, 60], [30, 20, 60], [50, 20, 60]]),
        "fp4": proposer([[38, 20, 60], [30, 20, 60], [52, 20, 60]]),
        "ngram": proposer([[25, 20, 10], [20, 20, 5], [30, 20, 8]]),
    }}
    add_intervals(online, "fp8", {"heldout": [0, 1, 2], "excerpt": [0], "question": []})
    results = {name: {"exact": p["exact"], **p["groups"], "drafted_per_step": p["drafted_interval"]} for name, p in online["proposers"].items()}
    result = {"config": "configs/default.yaml", "steps": 4, "baseline": "fp8", "max_new_tokens": 8, "results": results,
              "prompts": {"all": 3, "heldout": 3, "excerpt": 1, "question": 0}}
    table = {row[0]: row for row in rows(result)}
    rule = table["decision rule: fp4 - fp8 paired online tau interval contains 0"]
    assert rule[1] == "+0.000 (3 prompts: too few for an interval)" and rule[4] == "**no**"
    fp4 = next(row for name, row in table.items() if name.startswith("online tau `fp4`"))
    assert fp4[1] == "2.000 (3 prompts: too few for an interval) / 3.00 (3 prompts: too few for an interval) / 2.000 / 1.900"
    assert "paired vs `fp8`: +0.000 (3 prompts: too few for an interval)" in fp4[3]
    best = table["best drafter `fp8` against the n-gram drafter (same prompts)"]
    assert best[3] == "n-gram 1.250 (3 prompts: too few for an interval)" and best[4] == "**no**"
    plot(result, tmp_path / "compare.png")
    assert (tmp_path / "compare.png").stat().st_size > 0


def test_online_wall_times_leave_out_the_first_calls_warm_up(target, prompts):
    """On a GPU the first drafter call compiles its attention (tens of seconds): charged to whichever
    proposer ran first, it would read as that drafter's slowness."""
    import time

    class CompilesOnce:
        feature_layer_ids, max_draft, name, calls = None, BLOCK - 1, "first", 0

        def propose(self, tokens, context_TF):
            CompilesOnce.calls += 1
            if CompilesOnce.calls == 1:
                time.sleep(1.0)
            return []

    result = online_eval(target, {"first": CompilesOnce()}, prompts, max_new_tokens=4, eos_token_ids=None)
    assert CompilesOnce.calls > 1 and result["proposers"]["first"]["wall_s"] < 0.5


def test_heldout_prompts_are_the_tokens_before_the_first_supervised_one():
    def sample(sid, mask):
        return {
            "sample_id": sid,
            "input_ids_T": torch.arange(10, 10 + len(mask)),
            "loss_mask_T": torch.tensor(mask, dtype=torch.bool),
        }

    reader = MemoryReader(
        [sample(5, [0, 0, 0, 1, 1, 0, 1]), sample(6, [0, 0]), sample(7, [1, 1]), sample(8, [0, 1])]
    )
    assert heldout_prompts(reader, [0, 1, 2, 3], 8) == [(5, [10, 11, 12]), (8, [10])]
    assert heldout_prompts(reader, [0, 1, 2, 3], 1) == [(5, [10, 11, 12])]
    # a copy's prompt (other answer, same opening) is decoded once: two would count one prompt twice
    copies = MemoryReader([sample(5, [0, 0, 1, 1]), sample(9, [0, 0, 1, 0]), sample(8, [0, 1])])
    assert heldout_prompts(copies, [0, 1, 2], 8) == [(5, [10, 11]), (8, [10])]


def test_evaluations_take_one_sample_per_split_key_before_any_second():
    """The offline and online evals take the first N held-out samples: copies of a prompt that sit
    together in the store filled them, and an interval over them counted one prompt as several."""
    import numpy as np

    from stage2_train.data.split import spread_over_keys

    keys = np.array([7, 7, 7, 3, 9, 3, 7, 1])
    assert spread_over_keys(keys, np.arange(8)).tolist() == [0, 3, 4, 7, 1, 5, 2, 6]
    assert spread_over_keys(keys, np.array([1, 2, 5, 6])).tolist() == [1, 5, 2, 6]
    assert spread_over_keys(keys, np.array([], dtype=np.int64)).tolist() == []


def test_cmd_eval_end_to_end(tmp_path, tiny_target_dir, chat_file, drafter):
    """Stage 1 extracts a store from the tiny target; cmd_eval evaluates a checkpoint on its held-out split.
    More prompts are asked for than the split has: the shortfall is printed (review, probe3d)."""

    from shared.config import load_run_config
    from stage1_extract.commands import cmd_extract
    from stage2_train.commands import cmd_eval
    from stage2_train.train.checkpoint.saver import Checkpointer
    from stage2_train.train.config import CheckpointConfig
    from testkit.data import stage1_overrides

    run_dir = tmp_path / "run"
    cfg1 = load_run_config(None, stage1_overrides(tiny_target_dir, chat_file, run_dir))
    cmd_extract(cfg1, progress=False)
    from shared.target import resolve_target
    from stage2_train.model.description import describe

    description = describe(DrafterConfig(num_layers=1, block_size=BLOCK), resolve_target(cfg1.target))
    ckpt = Checkpointer(CheckpointConfig(), run_dir / "checkpoints")
    ckpt.save(10, lambda: {"model": drafter.state_dict(), "trainer": {"step": 10}, "drafter": description.to_dict()}, blocking=True)

    data = {
        "run_dir": str(run_dir),
        "seed": 0,
        "target": {"path": str(tiny_target_dir), "num_feature_layers": 3, "dtype": "fp32"},
        "store": {"shard_mb": 1},
        "model": {"num_layers": 1, "block_size": BLOCK, "init_std": 0.2},
        "eval": {
            "holdout_fraction": 0.3,
            "online_num_prompts": 50,
            "online_max_new_tokens": 9,
            "offline_max_samples": 4,
        },
    }
    cfg = build_run_config(data)
    result = cmd_eval(cfg)
    assert result["checkpoint"].endswith("step_000010/model.safetensors")
    assert (
        result["offline"]["num_samples"] == min(4, result["num_heldout"])
        and result["offline"]["num_blocks"] > 0
    )
    online = result["online"]["proposers"]
    assert set(online) == {"trained", "untrained", "ngram"}
    assert all(p["exact"] for p in online.values())
    assert result["gap"]["online_tau"] == online["trained"]["tau"]
    assert result["offline"]["walk_tau"] is not None  # every anchor scored, as the final eval
    num = result["online"]["num_prompts"]
    assert num == 5 == len(result["online"]["sample_ids"])  # every held-out sample with a prompt: 5 of the 50 asked
    for name, p in online.items():
        interval = p["interval"]
        assert interval["lo"] <= round(p["tau"], 4) == interval["tau"] <= interval["hi"]
        assert interval["num_prompts"] == num and interval["num_without_forwards"] == 0
        assert ("diff" in interval) == (name != "trained")
        assert interval.get("diff_texts_differ", 0) == 0  # fp32: every output equals greedy, the texts are the same
    assert online["untrained"]["interval"]["diff"] == round(online["untrained"]["tau"] - online["trained"]["tau"], 4)
    written = json.loads((run_dir / "eval" / "step_000010.json").read_text())
    assert written["gap"] == result["gap"]
    shortfall = ("5 prompts decoded of the 50 asked (eval.online_num_prompts): the held-out split has no more samples "
                 "with a prompt (tokens before their first supervised one)")
    assert written["online"]["notes"] == result["online"]["notes"] == [shortfall]
    assert result["summary"].startswith("trained tau ") and "untrained tau" in result["summary"] and "ngram tau" in result["summary"]
    assert "differs" not in result["summary"] and "different texts" not in result["summary"]
    from stage2_train.__main__ import show_eval

    assert show_eval(result).endswith(f"{result['summary']}\nnote: {shortfall}")
    # The drafter is the checkpoint's: a command line that describes another one is refused by name.
    from shared.errors import ConfigError

    other = build_run_config({**data, "model": {**data["model"], "num_layers": 2}})
    other.overridden = frozenset({"model.num_layers"})
    with pytest.raises(ConfigError, match=r"model\.num_layers: the drafter has 1, the command line gives 2"):
        cmd_eval(other)
