"""The codec of `store.dtype: fp4`: hidden states as 4-bit floats (e2m1) in groups of 16 along the
hidden dimension with one fp8 e4m3 scale per group, and per layer a few outlier channels kept exact.

    arrays = encode_fp4(hidden_TLH, channels_LN)        # what write_shard stores
    hidden_TLH = decode_fp4(**arrays)                    # bf16, what the reader returns

Per token and layer, with that layer's N outlier channels (the N of largest mean |x| on the store's
first shard, `fit_outlier_channels`; fixed for the whole store) set apart and zeroed:
    s = amax / 2688 over the other channels, fp32 (1 where amax = 0)    -> hidden_scale [T, L] float32
    g = e4m3(min(amax_g / s / 6, 448)), round to nearest even, per group -> hidden_group_scale [T, L, H/16] uint8
    q = e2m1(x / (g * s)): the nearest of +-{0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code, 0 where
        g * s = 0; two codes a byte, element 2i in the low nibble      -> hidden [T, L, H/2] uint8
    the outlier channels, bf16                                          -> hidden_outliers [T, L, N] uint16
    the channel set                                                     -> hidden_outlier_channels [L, N] int32
Decoding is e2m1(q) * (g * s) in fp32, the outlier channels put back, then bf16. All arithmetic is
fp32, in this order, so an independent quantizer reproduces the stored values exactly (the test).

Why a per-token scale beside the group scales (NVFP4's layout): e4m3 alone spans 2^-9..448, so group
maxima outside ~0.003..2688 would underflow or saturate; relative to the token's own maximum the
group scales never do, whatever the target's activation scale. It costs 4 bytes per token and layer.
Why outlier channels: a few massive-activation channels would otherwise set the scale of their group
(and of the token) and flatten every other value in it to 0.

Shape legend: T tokens, L layers, H hidden size, G = H/16 groups, N outlier channels per layer.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

GROUP = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
TOKEN_RANGE = E2M1_MAX * E4M3_MAX  # s maps the token's largest value to the largest group scale x 6
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code 0..7; code | 8 is the negative value


def bytes_per_token(num_layers: int, hidden_size: int, outlier_channels: int) -> int:
    """Stored bytes of one token's hidden states: codes, group scales, token scales, exact channels."""
    return num_layers * (hidden_size // 2 + hidden_size // GROUP + 4 + 2 * outlier_channels)


def check_hidden_size(hidden_size: int, outlier_channels: int) -> str | None:
    """Why this width cannot be stored as fp4, or None."""
    if hidden_size % GROUP:
        return f"fp4 needs a hidden size divisible by {GROUP}, the target's is {hidden_size}"
    if outlier_channels >= hidden_size:
        return f"store.fp4_outlier_channels={outlier_channels} must be below the hidden size {hidden_size}"
    return None


def fit_outlier_channels(abs_sum_LH: np.ndarray, outlier_channels: int) -> np.ndarray:
    """Per layer, the `outlier_channels` channels of largest summed |x| (ties: the lower channel),
    ascending: int32 [L, N]."""
    L, H = abs_sum_LH.shape
    out = np.empty((L, outlier_channels), dtype=np.int32)
    for layer in range(L):
        order = np.lexsort((np.arange(H), -abs_sum_LH[layer]))  # largest first, then by channel
        out[layer] = np.sort(order[:outlier_channels])
    return out


def e2m1_codes(y: Any) -> Any:
    """fp32 tensor -> uint8 e2m1 codes: round to nearest, ties to the even code, |y| clamped to 6.
    Codes 2..7 are the fp32 value rounded to one mantissa bit (read off its bits); below 1, steps of 0.5."""
    import torch

    a = y.abs().clamp_(max=E2M1_MAX)
    below_one = (a * 2).round_().to(torch.int32)  # 0, 0.5, 1 -> codes 0, 1, 2 (round: half to even)
    bits = a.clamp(min=1.0).view(torch.int32)
    bits = (bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22  # round off 22 of 23 mantissa bits, ties to even
    code = torch.where(a < 1, below_one, bits - 252)  # (127 + e) * 2 + m - 252 = 2 + 2e + m
    negative = (y < 0) & (code > 0)  # no -0: the bits of a value are unique
    return (code | (negative.to(torch.int32) << 3)).to(torch.uint8)


def encode_fp4(hidden_TLH: Any, channels_LN: np.ndarray) -> dict[str, np.ndarray]:
    """torch [T, L, H] (bf16 or fp32) -> the stored arrays (see the module docstring)."""
    import torch

    x_TLH = hidden_TLH.to(torch.float32, copy=True)  # zeroed in place below
    T, L, H = x_TLH.shape
    G = H // GROUP
    index_TLN = torch.as_tensor(np.asarray(channels_LN), dtype=torch.long)[None].expand(T, L, -1)
    outliers_TLN = x_TLH.gather(2, index_TLN).to(torch.bfloat16)
    x_TLH.scatter_(2, index_TLN, 0.0)
    x_TLGS = x_TLH.view(T, L, G, GROUP)
    group_amax_TLG = x_TLGS.abs().amax(dim=-1)
    amax_TL = group_amax_TLG.amax(dim=-1)
    scale_TL = torch.where(amax_TL > 0, amax_TL / TOKEN_RANGE, torch.ones_like(amax_TL))
    group_TLG = (group_amax_TLG / scale_TL[..., None] / E2M1_MAX).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    step_TLG = group_TLG.float() * scale_TL[..., None]
    # x / inf = 0: a group whose scale is 0 stores codes 0, with no pass over the whole tensor for it.
    step_TLG = torch.where(step_TLG > 0, step_TLG, torch.tensor(float("inf")))
    bits_TLH = x_TLGS.div_(step_TLG[..., None]).numpy().view(np.uint32).reshape(T, L, H)
    # The code depends only on sign, exponent, the top 2 mantissa bits and whether any other is set.
    index_TLH = (bits_TLH >> 20) & 0xFFE
    index_TLH |= (bits_TLH & 0x1FFFFF) != 0
    codes_TLH = np.take(_code_table(), index_TLH)
    packed_TLB = codes_TLH[..., 0::2] | (codes_TLH[..., 1::2] << 4)
    return {
        "hidden": packed_TLB,
        "hidden_scale": scale_TL.numpy().astype(np.float32),
        "hidden_group_scale": group_TLG.view(torch.uint8).numpy(),
        "hidden_outliers": outliers_TLN.view(torch.int16).numpy().view(np.uint16),
        "hidden_outlier_channels": np.asarray(channels_LN, dtype=np.int32),
    }


@cache
def _code_table() -> np.ndarray:
    """uint8 [4096]: e2m1_codes of every fp32 value class (sign, exponent, mantissa bits 22 and 21,
    any lower bit set): the encoder's lookup, made from the definition above."""
    import torch

    index = np.arange(4096, dtype=np.uint32)
    bits = ((index >> 1) << 21) | (index & 1)
    return e2m1_codes(torch.from_numpy(bits.view(np.float32))).numpy()


@cache
def _pair_values() -> np.ndarray:
    """byte -> (low nibble's value, high nibble's value), fp32 [256, 2]."""
    values = np.array(list(E2M1_GRID) + [-v for v in E2M1_GRID], dtype=np.float32)
    codes = np.arange(256)
    return np.stack([values[codes & 15], values[codes >> 4]], axis=1)


def decode_fp4(
    hidden: np.ndarray, hidden_scale: np.ndarray, hidden_group_scale: np.ndarray, hidden_outliers: np.ndarray,
    hidden_outlier_channels: np.ndarray,
) -> Any:
    """The stored arrays -> bf16 torch [T, L, H]."""
    import torch

    T, L, B = hidden.shape
    H = 2 * B
    values_TLGS = torch.from_numpy(np.take(_pair_values(), hidden, axis=0)).view(T, L, H // GROUP, GROUP)
    group_TLG = torch.from_numpy(np.ascontiguousarray(hidden_group_scale)).view(torch.float8_e4m3fn).float()
    step_TLG = group_TLG * torch.from_numpy(np.ascontiguousarray(hidden_scale))[..., None]
    x_TLH = values_TLGS.mul_(step_TLG[..., None]).view(T, L, H)
    index_TLN = torch.as_tensor(np.asarray(hidden_outlier_channels), dtype=torch.long)[None].expand(T, L, -1)
    exact_TLN = torch.from_numpy(np.ascontiguousarray(hidden_outliers).view(np.int16)).view(torch.bfloat16).float()
    return x_TLH.scatter_(2, index_TLN, exact_TLN).to(torch.bfloat16)
