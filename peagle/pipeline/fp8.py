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

import functools

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
STATES_DTYPE = torch.bfloat16
"""What dequantised states are: the dtype a bf16 store holds, so both encodings feed the draft alike."""


CHUNK_ROWS = 256
"""Rows of states that a CPU thread running torch on one core (extract's shard writer) converts at a
time: a chunk's float32 temporaries (4 MiB each at H = 4096) stay in the cache, which made an
8B-shaped sample's quantisation 5x and its dequantisation 4x faster than whole-tensor temporaries
(benchmarks/writer_throughput.py)."""


def chunk_rows() -> int | None:
    """Rows per pass on this thread: ``CHUNK_ROWS`` where torch runs on one core, None (whole tensors,
    as before) where its ops run on several threads. There every op is a parallel region whose
    threads wait for each other, a few ms each on a loaded machine, and many small passes lost.
    Row by row, the result is the same either way."""
    return CHUNK_ROWS if torch.get_num_threads() == 1 else None


def quantize(states_TAH: Tensor) -> tuple[Tensor, Tensor]:
    """Rows of H values -> (``float8_e4m3fn`` codes ``[T, A, H]``, float32 scales ``[T, A]``)."""
    rows_per_pass = chunk_rows() if states_TAH.device.type == "cpu" else None
    if rows_per_pass is None or states_TAH[..., 0].numel() <= rows_per_pass:
        return _quantize_rows(states_TAH)
    flat_RH = states_TAH.reshape(-1, states_TAH.shape[-1])
    codes_RH = torch.empty(flat_RH.shape, dtype=FP8_DTYPE)
    scale_R = torch.empty(flat_RH.shape[0], dtype=SCALE_DTYPE)
    for start in range(0, flat_RH.shape[0], rows_per_pass):
        rows = slice(start, start + rows_per_pass)
        codes_RH[rows], scale_R[rows] = _quantize_rows(flat_RH[rows])
    return codes_RH.view(states_TAH.shape), scale_R.view(states_TAH.shape[:-1])


def _quantize_rows(states_TAH: Tensor) -> tuple[Tensor, Tensor]:
    x = states_TAH.float()
    amax_TA = x.abs().amax(dim=-1)
    scale_TA = (amax_TA / FP8_MAX).to(SCALE_DTYPE)
    # A zero row divides by 1 (its codes are 0 either way); NaN/inf scales propagate into the codes.
    divisor_TA = torch.where(scale_TA == 0, torch.ones_like(scale_TA), scale_TA)
    codes_TAH = (x / divisor_TA[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes_TAH, scale_TA


def dequantize(codes_TAH: Tensor, scale_TA: Tensor, dtype: torch.dtype = STATES_DTYPE) -> Tensor:
    """Codes and scales -> states (``dtype``, default bf16), on whatever device they are."""
    rows_per_pass = chunk_rows() if codes_TAH.device.type == "cpu" else None
    if rows_per_pass is None or codes_TAH.numel() == 0:
        return _dequantize_rows(codes_TAH.float(), scale_TA, dtype)
    # torch converts float8 to float32 one element at a time on the CPU: looking the 256 possible
    # codes up in a table gives the same float32 values 6x faster.
    hidden = codes_TAH.shape[-1]
    codes_RH, scale_R = codes_TAH.reshape(-1, hidden), scale_TA.reshape(-1)
    out_RH = torch.empty(codes_RH.shape, dtype=dtype)
    for start in range(0, codes_RH.shape[0], rows_per_pass):
        rows = slice(start, start + rows_per_pass)
        index = codes_RH[rows].view(torch.uint8).reshape(-1).long()
        values_RH = torch.index_select(_code_values(), 0, index).view(-1, hidden)
        out_RH[rows] = _dequantize_rows(values_RH, scale_R[rows], dtype)
    return out_RH.view(codes_TAH.shape)


def _dequantize_rows(values_TAH: Tensor, scale_TA: Tensor, dtype: torch.dtype) -> Tensor:
    return (values_TAH * scale_TA.float()[..., None]).to(dtype)


@functools.cache
def _code_values() -> Tensor:
    """The float32 value of each of the 256 ``float8_e4m3fn`` codes (NaN for 0x7F and 0xFF)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()


def row_bytes(hidden_size: int) -> int:
    """Bytes of one stored (token, layer) row: H codes and one scale."""
    return hidden_size * FP8_DTYPE.itemsize + SCALE_DTYPE.itemsize


__all__ = ["CHUNK_ROWS", "FP8_DTYPE", "FP8_MAX", "SCALE_DTYPE", "STATES_DTYPE", "chunk_rows", "dequantize",
           "quantize", "row_bytes"]
