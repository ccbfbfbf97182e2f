"""Greedy speculative decoding with a HF target and a drafter: the ground truth for acceptance.

    target_ids = [...]                                        # a prompt, token ids
    proposer = DFlashProposer(drafter, layer_ids)             # or NgramProposer(block_size - 1)
    spec = speculative_generate(target, proposer, target_ids, max_new_tokens=128, eos_token_ids=[2])
    greedy = target_greedy(target, target_ids, max_new_tokens=128, eos_token_ids=[2])
    spec.tokens == greedy.tokens                              # always: verification is exact
    spec.tau, greedy.wall_s / spec.wall_s                     # tokens per target forward, speedup

One sequence at a time, on whatever device the target lives (CPU here). The loop follows the greedy
branch of z-lab/dflash `dflash_generate` (reimplemented, not copied):

1. prefill the prompt with the target (KV cache), capturing the outputs of the feature layers
   (decoder layer i's output = HF `hidden_states[i + 1]`, concatenated in layer order, exactly what
   stage 1 stores); the first new token is the target's argmax;
2. the last accepted token is the anchor at position p; the target's KV cache and the context
   features cover exactly the positions < p. The proposer drafts up to B-1 tokens (a DFlash drafter
   sees the block [anchor, MASK x (B-1)] at positions p..p+B-1 and the features of positions < p,
   as in training; a DSpark drafter drafts up to B from the same block, fewer when its confidence
   head stops it);
3. ONE target forward over [anchor, drafts] verifies them: the longest prefix where draft == target
   argmax is accepted, plus the target's own next token (the bonus). The KV cache is cropped back to
   the accepted positions (`DynamicCache.crop` takes a negative count in transformers 5) and their
   features are appended to the context.

tau = tokens produced per verifying target forward, bonus included: a proposer that always agrees
gets tau = B, one that never does gets 1. The prefill token is not counted (as in the reference).

Shape legend: T tokens so far, P prompt tokens, K drafted tokens (<= B-1), B block size,
L feature layers, H target hidden, F = L * H, V vocab.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from shared.target_model import LayerCapture
from stage2_train.data.batch import IGNORE, DrafterBatch
from stage2_train.model.drafter import DFlashDrafter


class Proposer(Protocol):
    """Drafts tokens after the anchor `tokens[-1]` (at position len(tokens) - 1)."""

    name: str
    max_draft: int  # at most this many tokens per call (B - 1 for a DFlash drafter)
    feature_layer_ids: list[int] | None  # target layers whose outputs the proposer needs, or None

    def propose(self, tokens: list[int], context_TF: torch.Tensor | None) -> list[int]:
        """`context_TF` holds the features of positions < len(tokens) - 1 (None when not needed)."""
        ...


# ---------------------------------------------------------------------------------------------
# Proposers


class DFlashProposer:
    """A block drafter of any variant: one forward over [anchor, MASK x (B-1)], then the drafter's own
    greedy `draft` of the block: DFlash the argmax of slots 1..B-1; DSpark slots 0..B-1 left to right
    with its Markov bias (and, with `confidence_stop`, an early stop from its confidence head);
    DFlash2 slots 1..B-1 left to right through its candidate selector.

    `feature_dtype` rounds the captured features before the drafter sees them (bf16: what the
    drafter was trained on when the store keeps bf16 or fp8 features)."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        layer_ids: list[int],
        *,
        feature_dtype: torch.dtype | None = None,
        name: str = "dflash",
        confidence_stop: float | None = None,
    ):
        if len(layer_ids) != drafter.num_feature_layers:
            raise ValueError(
                f"the drafter fuses {drafter.num_feature_layers} feature layers, got layer ids {layer_ids}"
            )
        self.drafter = drafter
        self.name = name
        self.max_draft = getattr(drafter, "max_draft", drafter.block_size - 1)
        self.feature_layer_ids = list(layer_ids)
        self.feature_dtype = feature_dtype
        self.confidence_stop = confidence_stop

    @torch.no_grad()
    def propose(self, tokens: list[int], context_TF: torch.Tensor | None) -> list[int]:
        if context_TF is None:
            raise ValueError("DFlashProposer needs the context features")
        drafter = self.drafter
        device = drafter.fc.weight.device
        anchor_pos = len(tokens) - 1
        if context_TF.shape[0] != anchor_pos:
            raise ValueError(f"context has {context_TF.shape[0]} positions, the anchor is at {anchor_pos}")
        B = drafter.block_size
        context_TF = context_TF if self.feature_dtype is None else context_TF.to(self.feature_dtype)
        batch = DrafterBatch(
            context_TF=context_TF.to(device),
            context_pos_T=torch.arange(anchor_pos, device=device),
            context_seq_T=torch.zeros(anchor_pos, dtype=torch.long, device=device),
            block_ids_NB=torch.tensor([[tokens[-1]] + [drafter.mask_token_id] * (B - 1)], device=device),
            block_seq_N=torch.zeros(1, dtype=torch.long, device=device),
            anchor_pos_N=torch.tensor([anchor_pos], device=device),
            labels_NB=torch.full((1, B), IGNORE, device=device),
            num_samples=1,
            num_tokens=anchor_pos,
        )
        was_training = drafter.training
        drafter.eval()
        try:
            hidden_BH = drafter(batch)[0]
        finally:
            drafter.train(was_training)
        draft = getattr(drafter, "draft", None)
        if draft is None:  # a stand-in with only forward and logits (tests): DFlash's argmax
            return drafter.logits(hidden_BH[1:]).argmax(-1).tolist()
        return draft(hidden_BH, tokens[-1], self.confidence_stop)


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens (n from
    `max_ngram` down to `min_ngram`) in everything so far and propose what followed it."""

    feature_layer_ids = None

    def __init__(self, max_draft: int, *, max_ngram: int = 3, min_ngram: int = 1, name: str = "ngram"):
        if max_draft < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"need max_draft >= 1 and 1 <= min_ngram <= max_ngram, got {max_draft}, {min_ngram}, {max_ngram}"
            )
        self.max_draft, self.max_ngram, self.min_ngram, self.name = max_draft, max_ngram, min_ngram, name

    def propose(self, tokens: list[int], context_TF: torch.Tensor | None = None) -> list[int]:
        """The most recent match with a full `max_draft` continuation, else the longest one."""
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix, best = tokens[-n:], []
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    continuation = tokens[start + n : start + n + self.max_draft]
                    if len(continuation) == self.max_draft:
                        return continuation
                    best = max(best, continuation, key=len)
            if best:
                return best
        return []


# ---------------------------------------------------------------------------------------------
# Feature capture


@torch.no_grad()
def capture_features(target: Any, input_ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """[T, L, H]: the feature layers' outputs for a whole sequence (what stage 1 stores)."""
    capture = LayerCapture(target, layer_ids)
    try:
        target(input_ids=torch.tensor([input_ids], device=target.device), use_cache=False, logits_to_keep=1)
        return capture.stacked()[0]
    finally:
        capture.close()


# ---------------------------------------------------------------------------------------------
# Generation


@dataclass
class GreedyResult:
    tokens: list[int]  # generated tokens (EOS included when reached)
    wall_s: float


@dataclass
class SpecResult:
    tokens: list[int]  # generated tokens (EOS included when reached)
    acceptance_lengths: list[int]  # tokens produced by each verifying forward (bonus included)
    wall_s: float
    draft_s: float  # time inside the proposer
    # (anchor position, drafts) of every verify, when recorded
    proposals: list[tuple[int, list[int]]] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)  # tokens verified by each forward besides the anchor

    @property
    def num_target_forwards(self) -> int:
        """Verifying forwards (the prefill not counted)."""
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens per verifying target forward, bonus included (1.0 when nothing was verified)."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 1.0


def _eos_set(eos_token_ids: int | list[int] | None) -> set[int]:
    if eos_token_ids is None:
        return set()
    return {eos_token_ids} if isinstance(eos_token_ids, int) else set(eos_token_ids)


def _new_cache(target: Any) -> tuple[Any, dict[str, Any]]:
    """A fresh DynamicCache and the forward kwargs passing it under the name this transformers
    version takes (`cache` in 5.x, where `past_key_values` is deprecated; `past_key_values` before)."""
    import inspect

    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    return cache, {name: cache, "use_cache": True}


def _check_request(prompt_ids: list[int], max_new_tokens: int) -> None:
    if not prompt_ids or max_new_tokens < 1:
        raise ValueError(
            f"need a non-empty prompt and max_new_tokens >= 1, got {len(prompt_ids)}, {max_new_tokens}"
        )


@torch.no_grad()
def target_greedy(
    target: Any, prompt_ids: list[int], *, max_new_tokens: int, eos_token_ids: int | list[int] | None
) -> GreedyResult:
    """The target alone, one token per forward with a KV cache: the reference output and time."""
    _check_request(prompt_ids, max_new_tokens)
    eos = _eos_set(eos_token_ids)
    device = target.device
    start = time.perf_counter()
    _, cache_kw = _new_cache(target)
    out = target(input_ids=torch.tensor([prompt_ids], device=device), **cache_kw, logits_to_keep=1)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < max_new_tokens and tokens[-1] not in eos:
        out = target(input_ids=torch.tensor([[tokens[-1]]], device=device), **cache_kw)
        tokens.append(int(out.logits[0, -1].argmax()))
    return GreedyResult(tokens=tokens, wall_s=time.perf_counter() - start)


@torch.no_grad()
def _verify(target: Any, cache: Any, cache_kw: dict[str, Any], anchor: int, drafts: list[int], eos: set[int]) -> tuple[int, list[int]]:
    """ONE target forward over [anchor, drafts]: (drafts accepted, the new tokens: the accepted
    drafts plus the target's own next token, cut after an EOS). The KV cache is cropped back to the
    last accepted position."""
    out = target(input_ids=torch.tensor([[anchor] + drafts], device=target.device), **cache_kw)
    posterior_K1 = out.logits[0].argmax(-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == posterior_K1[accepted]:
        accepted += 1
    new_tokens = drafts[:accepted] + [posterior_K1[accepted]]
    for i, tok in enumerate(new_tokens):
        if tok in eos:
            new_tokens = new_tokens[: i + 1]
            break
    rejected = len(drafts) - accepted
    if rejected:
        cache.crop(-rejected)  # the cache now ends at the last accepted position
    return accepted, new_tokens


def speculative_generate(
    target: Any,
    proposer: Proposer,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    eos_token_ids: int | list[int] | None,
    record: bool = False,
) -> SpecResult:
    """Greedy speculative decoding; the output equals `target_greedy`'s token for token."""
    _check_request(prompt_ids, max_new_tokens)
    eos = _eos_set(eos_token_ids)
    device = target.device
    capture = LayerCapture(target, proposer.feature_layer_ids) if proposer.feature_layer_ids else None
    draft_s = 0.0
    acceptance: list[int] = []
    drafted: list[int] = []
    proposals: list[tuple[int, list[int]]] = []
    start = time.perf_counter()
    try:
        cache, cache_kw = _new_cache(target)
        out = target(input_ids=torch.tensor([prompt_ids], device=device), **cache_kw, logits_to_keep=1)
        context_TF = capture.stacked()[0].flatten(-2) if capture else None
        tokens = list(prompt_ids) + [int(out.logits[0, -1].argmax())]
        generated = 1
        while generated < max_new_tokens and tokens[-1] not in eos:
            anchor_pos = len(tokens) - 1
            t0 = time.perf_counter()
            drafts = proposer.propose(tokens, context_TF)
            draft_s += time.perf_counter() - t0
            # Never verify past the budget: the accepted drafts plus the bonus must fit.
            drafts = [int(t) for t in drafts[: min(proposer.max_draft, max_new_tokens - generated - 1)]]
            if record:
                proposals.append((anchor_pos, drafts))
            drafted.append(len(drafts))
            accepted, new_tokens = _verify(target, cache, cache_kw, tokens[-1], drafts, eos)
            if capture:
                context_TF = torch.cat([context_TF, capture.stacked()[0].flatten(-2)[: accepted + 1]])
            tokens += new_tokens
            generated += len(new_tokens)
            acceptance.append(len(new_tokens))
    finally:
        if capture:
            capture.close()
    return SpecResult(
        tokens=tokens[len(prompt_ids) :],
        acceptance_lengths=acceptance,
        wall_s=time.perf_counter() - start,
        draft_s=draft_s,
        proposals=proposals,
        drafted=drafted,
    )
