"""FP8 hidden states: ``float8_e4m3fn`` codes with one float32 scale per (token, aux layer) row.

Why this scaling, what it costs and what it measures: ``docs/fp8.md``. In short: a row of H values
is divided by ``amax(|row|) / 448`` (its largest value maps to e4m3's largest, 448) and cast with
torch's round-to-nearest-even. e4m3's floating exponent then keeps 3 mantissa bits for every
channel down to 1/28672 of the row's largest (the smallest normal, 2^-6, over 448), so the few
channels hundreds of times larger than the rest do not erase the rest, as they would with int8.

Exact rules (every reader and writer goes through these two functions):

* scale = amax / 448 in float32; an all-zero row gets scale 0 and zero codes, so it reads back as
  exactly zero (and ``peagle store check`` still sees it);
* a row holding NaN or inf reads back as all NaN: a broken state stays visibly broken;
* codes are clamped to ±448 before the cast, so no device's cast can saturate or overflow
  differently;
* dequantisation is ``codes · scale`` in float32, then cast to the states' compute dtype (bf16):
  the same on the CPU worker and on the GPU.

Shape letters: T rows (tokens), A aux layers, H hidden size (any leading shape works).
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
STATES_DTYPE = torch.bfloat16
"""What dequantised states are: the dtype a bf16 store holds, so both encodings feed the draft alike."""


def quantize(states_TAH: Tensor) -> tuple[Tensor, Tensor]:
    """Rows of H values -> (``float8_e4m3fn`` codes ``[T, A, H]``, float32 scales ``[T, A]``)."""
    x = states_TAH.float()
    amax_TA = x.abs().amax(dim=-1)
    scale_TA = (amax_TA / FP8_MAX).to(SCALE_DTYPE)
    # A zero row divides by 1 (its codes are 0 either way); NaN/inf scales propagate into the codes.
    divisor_TA = torch.where(scale_TA == 0, torch.ones_like(scale_TA), scale_TA)
    codes_TAH = (x / divisor_TA[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes_TAH, scale_TA


def dequantize(codes_TAH: Tensor, scale_TA: Tensor, dtype: torch.dtype = STATES_DTYPE) -> Tensor:
    """Codes and scales -> states (``dtype``, default bf16), on whatever device they are."""
    return (codes_TAH.float() * scale_TA.float()[..., None]).to(dtype)


def row_bytes(hidden_size: int) -> int:
    """Bytes of one stored (token, layer) row: H codes and one scale."""
    return hidden_size * FP8_DTYPE.itemsize + SCALE_DTYPE.itemsize


__all__ = ["FP8_DTYPE", "FP8_MAX", "SCALE_DTYPE", "STATES_DTYPE", "dequantize", "quantize", "row_bytes"]
