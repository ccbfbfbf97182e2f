"""How hidden states are stored: bf16 bits, fp8 e4m3 with a per-token scale, or fp4 (e2m1 groups of 16
with e4m3 group scales and exact outlier channels, shared/fp4.py); a sample in its stored form.

    encoded = encode_sample(SampleFeatures(...), "fp8")          # arrays of its own, ready to write
    hidden_TLH = decode_hidden(bits, scale, "fp8")                 # bf16, whatever the codec

Shape legend: T tokens, L feature layers, H hidden size, K top-k, N outlier channels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shared import fp4

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_ARRAYS = ("hidden_group_scale", "hidden_outliers")  # token-major, besides hidden and hidden_scale


@dataclass
class SampleFeatures:
    """One extracted sample, host memory, ready to store."""

    sample_id: int
    input_ids_T: np.ndarray  # int32
    loss_mask_T: np.ndarray  # bool
    hidden_TLH: Any  # torch tensor, bf16 or fp32
    topk_logprobs_TK: Any  # torch tensor, float32
    topk_ids_TK: Any  # torch tensor, int


def encode_hidden(hidden_TLH: Any, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """torch [T, L, H] -> stored bits (uint16 for bf16, uint8 for fp8) and the fp8 scale [T, L]."""
    import torch

    if dtype == "bf16":
        return hidden_TLH.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16), None
    x_TLH = hidden_TLH.float()
    amax_TL = x_TLH.abs().amax(dim=-1)
    scale_TL = torch.where(amax_TL > 0, amax_TL / FP8_MAX, torch.ones_like(amax_TL))
    q_TLH = (x_TLH / scale_TL[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q_TLH.view(torch.uint8).numpy(), scale_TL.numpy().astype(np.float32)


@dataclass
class EncodedSample:
    """One sample in its stored form, in arrays of its own (no view into a producer's buffer)."""

    sample_id: int
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # bool [T]
    hidden_bits: np.ndarray  # uint16 (bf16) or uint8 (fp8) [T, L, H]; fp4: uint8 [T, L, H/2]
    hidden_scale: np.ndarray | None  # float32 [T, L], fp8 and fp4
    topk_logprobs: np.ndarray  # float16 [T, K]
    topk_ids: np.ndarray  # int32 [T, K]
    fp4_parts: dict[str, np.ndarray] | None = None  # fp4: FP4_ARRAYS and hidden_outlier_channels

    @property
    def nbytes(self) -> int:
        arrays = (self.input_ids, self.loss_mask, self.hidden_bits, self.hidden_scale, self.topk_logprobs, self.topk_ids,
                  *(self.fp4_parts or {}).values())
        return sum(a.nbytes for a in arrays if a is not None)


def encode_sample(sample: SampleFeatures, dtype: str, outlier_channels: np.ndarray | None = None) -> EncodedSample:
    """A host sample in stored form. Every array is a copy: the caller may reuse (pinned) buffers
    the moment this returns. fp4 needs the store's outlier channels [L, N]."""
    parts = None
    if dtype == "fp4":
        if outlier_channels is None:
            raise ValueError("fp4 encoding needs the store's outlier channels")
        parts = fp4.encode_fp4(sample.hidden_TLH, outlier_channels)
        bits, scale = parts.pop("hidden"), parts.pop("hidden_scale")
    else:
        bits, scale = encode_hidden(sample.hidden_TLH, dtype)
    return EncodedSample(
        sample_id=sample.sample_id,
        input_ids=np.array(sample.input_ids_T, dtype=np.int32),
        loss_mask=np.array(sample.loss_mask_T, dtype=bool),
        hidden_bits=np.array(bits, copy=True),
        hidden_scale=scale,
        topk_logprobs=sample.topk_logprobs_TK.float().numpy().astype(np.float16),
        topk_ids=sample.topk_ids_TK.numpy().astype(np.int32),
        fp4_parts=parts,
    )


def decode_hidden(bits_TLH: np.ndarray, scale_TL: np.ndarray | None, dtype: str, **fp4_parts: np.ndarray) -> Any:
    """Stored bits -> bf16 torch [T, L, H]; fp4 also takes its FP4_ARRAYS and hidden_outlier_channels."""
    import torch

    if dtype == "fp4":
        return fp4.decode_fp4(bits_TLH, scale_TL, **fp4_parts)
    if dtype == "bf16":
        return torch.from_numpy(np.ascontiguousarray(bits_TLH).view(np.int16)).view(torch.bfloat16)
    q_TLH = torch.from_numpy(np.ascontiguousarray(bits_TLH)).view(torch.float8_e4m3fn)
    return (q_TLH.float() * torch.from_numpy(np.ascontiguousarray(scale_TL))[..., None]).to(torch.bfloat16)


def hidden_array_names(dtype: str) -> tuple[str, ...]:
    """The arrays a shard of this codec holds besides StoreReader.REQUIRED."""
    return {"bf16": (), "fp8": ("hidden_scale",)}.get(dtype, ("hidden_scale", *FP4_ARRAYS, "hidden_outlier_channels"))


def hidden_array_specs(dtype: str, tokens: int, layers: int, hidden: int, outlier_channels: int) -> dict[str, tuple[tuple[int, ...], type]]:
    """Name -> (shape, numpy dtype) of the hidden-state arrays of a shard (for verify)."""
    if dtype == "bf16":
        return {"hidden": ((tokens, layers, hidden), np.uint16)}
    if dtype == "fp8":
        return {"hidden": ((tokens, layers, hidden), np.uint8), "hidden_scale": ((tokens, layers), np.float32)}
    return {
        "hidden": ((tokens, layers, hidden // 2), np.uint8),
        "hidden_scale": ((tokens, layers), np.float32),
        "hidden_group_scale": ((tokens, layers, hidden // fp4.GROUP), np.uint8),
        "hidden_outliers": ((tokens, layers, outlier_channels), np.uint16),
        "hidden_outlier_channels": ((layers, outlier_channels), np.int32),
    }


def hidden_problem(arrays: dict[str, np.ndarray], dtype: str, channels: list[list[int]] | None = None) -> str | None:
    """What is wrong with a shard's decoded hidden-state arrays (non-finite values or scales, an
    outlier channel set other than the store's `channels`), or None."""
    bits = arrays["hidden"]
    if dtype == "bf16":
        bad = int(((bits & 0x7F80) == 0x7F80).sum())
    elif dtype == "fp8":
        bad = int(((bits & 0x7F) == 0x7F).sum())
    else:
        bad = int(((arrays["hidden_outliers"] & 0x7F80) == 0x7F80).sum())  # e2m1 codes have no inf/NaN
    if bad:
        return f"{bad} non-finite hidden values"
    if dtype == "bf16":
        return None
    scale = arrays["hidden_scale"]
    if not (np.isfinite(scale) & (scale > 0)).all():
        return f"{int((~(np.isfinite(scale) & (scale > 0))).sum())} hidden_scale values not finite and > 0"
    if dtype == "fp4":
        group = arrays["hidden_group_scale"]
        if ((group & 0x7F) == 0x7F).any() or (group & 0x80).any():
            return f"{int((((group & 0x7F) == 0x7F) | ((group & 0x80) > 0)).sum())} group scales NaN or negative"
        if channels is None or arrays["hidden_outlier_channels"].tolist() != channels:
            return "outlier channels differ from the store's (manifest fp4_outlier_channels)"
    return None
