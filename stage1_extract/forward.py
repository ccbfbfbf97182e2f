"""The target forward of one batch: the chosen layers' outputs and the top-k log-probabilities.

Per token: the outputs of the chosen decoder layers (HF hidden_states[i + 1], captured by hooks on
those layers, so the other layers' states are never kept) and the top-k log-probabilities of the
target's next-token distribution (final norm + LM head, log-softmax in fp32, computed in chunks so
the [tokens, vocab] logits never exist whole).

A packed batch under flash-attn gets its samples' boundaries once (`packed_lengths`): left to
itself, transformers derives them from the position ids in every layer, a few host syncs each
(~108 per forward of a 36-layer target).
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from shared.errors import ConfigError
from shared.fingerprints import LOGIT_TRANSFORMS
from shared.target_model import LayerCapture
from stage1_extract.batching import TokenizedRow

# Kernels that keep packed samples apart from the position ids alone (with no KV cache): flash-attn's
# varlen path, and the masks transformers builds for the others from its packed-sequence detection.
FLASH_PACKING = ("flash_attention_2", "flash_attention_3")
MASK_PACKING = ("sdpa", "eager", "flex_attention")


def check_packing(attn_implementation: str, model_type: str) -> None:
    """Refuse packed extraction (`extract.packed=on`) where the attention cannot keep the samples of
    a packed batch apart: they would attend to each other and the store would hold the mix."""
    why = None
    if attn_implementation not in FLASH_PACKING + MASK_PACKING:
        why = f"attention {attn_implementation!r} takes no packed-sequence mask"
    elif attn_implementation in MASK_PACKING:
        masking = importlib.import_module("transformers.masking_utils")
        module = _modeling_module(model_type)
        if not hasattr(masking, "find_packed_sequence_indices"):
            why = "this transformers version cannot detect packed sequences (install transformers>=4.57)"
        elif module is None or not hasattr(module, "create_causal_mask"):
            why = f"the {model_type!r} model builds its attention mask without transformers' packed-sequence detection"
    if why:
        raise ConfigError(
            f"extract.packed=on with target.attn_implementation={attn_implementation}: {why}, so packed samples "
            f"would attend to each other; set extract.packed=off (padded batches) or use flash_attention_2 on a GPU"
        )


def _modeling_module(model_type: str) -> Any:
    """The transformers module holding the causal-LM class of `model_type` (imported, no weights)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    cls = getattr(transformers, name, None) if name else None
    return importlib.import_module(cls.__module__) if cls is not None else None


# What transformers' forward does to lm_head's output before the logits it returns (shared/target.py
# LOGIT_TRANSFORMS: Gemma 2/3 cap them, Granite divides, Cohere multiplies; part of a store's identity).
# The stored log-probs must be the model's own distribution: `check_output_head` compares with a real
# forward once per extraction.


def output_head(model: Any) -> Any:
    """h -> the logits transformers' forward returns: lm_head, then the config's transform (if any)."""
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    lm_head = model.lm_head
    cap, scaling, scale = (getattr(config, name, None) for name in LOGIT_TRANSFORMS)
    if not (cap or scaling or scale):
        return lm_head

    def head(h: Any) -> Any:  # in place: no second [chunk, vocab] fp32 tensor (the memory plan counts one)
        logits = lm_head(h).float()
        if scaling:
            logits.div_(scaling)
        if scale:
            logits.mul_(scale)
        if cap:
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    return head


def check_output_head(model: Any, num_tokens: int = 8) -> None:
    """Refuse a target whose forward turns lm_head's output into its logits some way `output_head`
    does not know (its stored log-probs would not be the model's distribution): one forward of a few
    tokens, on every rank (a tensor-parallel forward is collective)."""
    import torch

    device = next(model.parameters()).device
    ids_1N = torch.arange(1, num_tokens + 1, device=device)[None] % model.config.get_text_config().vocab_size
    with torch.inference_mode():
        want = model(input_ids=ids_1N, use_cache=False).logits[0].float()
        got = output_head(model)(model.get_decoder()(input_ids=ids_1N, use_cache=False).last_hidden_state[0]).float()
    if not torch.allclose(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()) + 1e-3):
        raise ValueError(
            f"the target's forward ({type(model).__name__}) returns other logits than its LM head gives (max difference "
            f"{float((got - want).abs().max()):.3g}): a transform of the logits extraction does not apply (it knows "
            f"{', '.join(LOGIT_TRANSFORMS)}), so the stored log-probs would not be the model's distribution"
        )


def check_packed_forward(model: Any, lengths: tuple[int, int] = (6, 10)) -> None:
    """Refuse packed extraction where the target's forward lets a packed sample see the one before it:
    a sequence mixer that is not attention (Qwen3-Next's and Qwen3.5's gated DeltaNet, Mamba, short
    convolutions) takes no packed mask, and its state runs on across the samples of a packed row, which
    `check_packing` cannot tell from the model type. One forward of two short samples packed against
    the second alone, on every rank (a tensor-parallel forward is collective)."""
    import torch

    device = next(model.parameters()).device
    decoder = model.get_decoder()
    ids_N = (torch.arange(sum(lengths), device=device) * 7 + 3) % model.config.get_text_config().vocab_size
    positions_1N = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    with torch.inference_mode():
        packed = decoder(input_ids=ids_N[None], position_ids=positions_1N, use_cache=False,
                         **packed_lengths(model, list(lengths), device)).last_hidden_state[0, lengths[0]:].float()
        alone = decoder(input_ids=ids_N[None, lengths[0]:], use_cache=False).last_hidden_state[0].float()
    # Relative to the whole output, not per value: bf16 rounding differs by ~1e-2, a leak by ~1.
    error = float((packed - alone).norm() / alone.norm().clamp_min(1e-6))
    if error > 0.1:
        raise ConfigError(
            f"extract.packed: the target ({type(model).__name__}) gives a packed sample other features than the same sample "
            f"alone (relative difference {error:.2g}): a layer of it that is not attention carries its state across the "
            f"samples of a packed batch, so the store would hold each sample mixed with the ones before it; set "
            f"extract.packed=off (padded batches)"
        )


def topk_logprobs(final_hidden_NH: Any, lm_head: Any, k: int, chunk: int) -> tuple[Any, Any]:
    """Top-k of log_softmax(lm_head(h)) in fp32, chunked over tokens.

    log_softmax is monotone, so the top-k of the logits minus their logsumexp is the top-k of the
    log-probs; the logsumexp is then taken in place, so no second [chunk, vocab] fp32 tensor is
    made (at Qwen3's 152K vocab and 8K-token chunks that tensor is 5 GB)."""
    import torch

    values, indices = [], []
    for start in range(0, final_hidden_NH.shape[0], chunk):
        logits_CV = lm_head(final_hidden_NH[start : start + chunk]).float()
        top = torch.topk(logits_CV, k, dim=-1)
        max_C1 = logits_CV.amax(dim=-1, keepdim=True)
        logsumexp_C1 = max_C1 + logits_CV.sub_(max_C1).exp_().sum(dim=-1, keepdim=True).log_()
        values.append(top.values - logsumexp_C1)
        indices.append(top.indices.to(torch.int32))
    return torch.cat(values), torch.cat(indices)


def packed_lengths(model: Any, lengths: list[int], device: Any) -> dict[str, Any]:
    """The varlen kwargs of transformers' flash-attn path (`FlashAttentionKwargs` in
    modeling_flash_attention_utils: cumulative sequence lengths as int32 on the device, the longest
    as a Python int), passed through the decoder call to every attention layer; empty for the other
    kernels, which take packing from their mask."""
    import torch

    if model.config._attn_implementation not in FLASH_PACKING:
        return {}
    cu_seq_lens = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)).to(device)
    longest = int(max(lengths))
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": longest, "max_length_k": longest}


def forward_batch(model: Any, capture: LayerCapture, rows: list[TokenizedRow], top_k: int, chunk: int, packed: bool) -> list[tuple[Any, Any, Any]]:
    """Per row: (hidden [T, L, H], topk_logprobs [T, K], topk_ids [T, K]) on the model's device."""
    import torch

    device = next(model.parameters()).device
    decoder = model.get_decoder()
    lengths = [len(r.input_ids) for r in rows]
    with torch.inference_mode():
        if packed:
            ids_1N = torch.from_numpy(np.concatenate([r.input_ids for r in rows]).astype(np.int64))[None].to(device)
            pos_1N = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
            # No KV cache: with one, transformers turns its packed-sequence detection off and sdpa/eager
            # attend across samples; flash-attn would stay right but fill a cache it never reads.
            varlen = packed_lengths(model, lengths, device)
            final_1NH = decoder(input_ids=ids_1N, position_ids=pos_1N, use_cache=False, **varlen).last_hidden_state
            hidden_1NLH = capture.stacked()
            values_NK, ids_NK = topk_logprobs(final_1NH[0], output_head(model), top_k, chunk)
            bounds = np.concatenate([[0], np.cumsum(lengths)])
            return [
                (hidden_1NLH[0, a:b], values_NK[a:b], ids_NK[a:b]) for a, b in zip(bounds[:-1], bounds[1:])
            ]
        width = max(lengths)
        ids_BT = torch.zeros((len(rows), width), dtype=torch.long)
        attn_BT = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            ids_BT[b, : lengths[b]] = torch.from_numpy(r.input_ids.astype(np.int64))
            attn_BT[b, : lengths[b]] = 1
        final_BTH = decoder(input_ids=ids_BT.to(device), attention_mask=attn_BT.to(device), use_cache=False).last_hidden_state
        hidden_BTLH = capture.stacked()
        # Only real tokens go through the LM head: padding is never computed twice nor stored.
        keep_BT = attn_BT.bool().to(device)
        values_NK, ids_NK = topk_logprobs(final_BTH[keep_BT], output_head(model), top_k, chunk)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        return [
            (hidden_BTLH[b, : lengths[b]], values_NK[bounds[b] : bounds[b + 1]], ids_NK[bounds[b] : bounds[b + 1]])
            for b in range(len(rows))
        ]
