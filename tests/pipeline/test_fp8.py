"""FP8 rows (pipeline/fp8.py): the error bound per element, channels hundreds of times larger than the
rest, all-zero and non-finite rows, round-to-nearest-even, and what int8 would do instead."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle.pipeline import fp8


def _relative_error(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x.float() - y.float()).abs() / x.float().abs()


def hidden_like(num_rows: int, hidden: int, *, outlier: float, seed: int = 0) -> torch.Tensor:
    """Rows shaped like LLM hidden states: O(1) channels plus two channels ``outlier`` times larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, 3, hidden, generator=g)
    x[..., 7] *= outlier
    x[..., 100] *= -outlier / 2
    return x.to(torch.bfloat16)


def test_codes_scales_and_the_bound_per_element():
    x = hidden_like(64, 256, outlier=300.0)
    codes, scale = fp8.quantize(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:2]
    assert torch.equal(codes.float().abs().amax(-1), torch.full(x.shape[:2], 448.0))  # each row's max maps to 448
    y = fp8.dequantize(codes, scale)
    assert y.dtype == torch.bfloat16
    # e4m3 keeps 3 mantissa bits for every value above 2^-6 of the scaled range: relative error <= 2^-4
    # (plus bf16's own 2^-9 for the dequantised value).
    # Values below that (here only O(1) values near 0: about 1%) keep their absolute error below half of
    # the smallest normal step.
    normal = x.float().abs() >= scale[..., None] * 2.0**-6
    assert normal.float().mean() > 0.98
    assert _relative_error(x, y)[normal].max() <= 2.0**-4 + 2.0**-8
    tiny_error = (x.float() - y.float()).abs()[~normal] / scale[..., None].expand_as(x)[~normal]
    assert tiny_error.max() <= 2.0**-10 + 2.0**-12


def test_small_channels_survive_outliers_hundreds_of_times_larger_where_int8_erases_them():
    x = hidden_like(256, 512, outlier=500.0, seed=1)
    small = torch.ones(512, dtype=torch.bool)
    small[[7, 100]] = False
    y = fp8.dequantize(*fp8.quantize(x))
    fp8_error = (torch.linalg.vector_norm((x - y).float()[..., small], dim=-1)
                 / torch.linalg.vector_norm(x.float()[..., small], dim=-1))
    assert fp8_error.max() < 0.05
    # int8 with the same per-row scale: the O(1) channels fall below half a step and become 0.
    step = x.float().abs().amax(-1, keepdim=True) / 127
    int8 = (x.float() / step).round().clamp(-127, 127) * step
    int8_error = (torch.linalg.vector_norm((x.float() - int8)[..., small], dim=-1)
                  / torch.linalg.vector_norm(x.float()[..., small], dim=-1))
    assert int8_error.median() > 0.5


def test_an_all_zero_row_reads_back_as_exactly_zero_and_non_finite_rows_stay_non_finite():
    x = torch.randn(4, 2, 32).to(torch.bfloat16)
    x[1, 0] = 0
    x[2, 1, 5] = float("nan")
    x[3, 0, 9] = float("inf")
    codes, scale = fp8.quantize(x)
    y = fp8.dequantize(codes, scale)
    assert scale[1, 0] == 0 and torch.equal(y[1, 0], torch.zeros(32, dtype=torch.bfloat16))
    assert torch.isnan(y[2, 1]).all() and torch.isnan(y[3, 0]).all()  # the whole row: visibly broken
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[2, 0]).all() and torch.isfinite(y[3, 1]).all()


def test_rounding_is_torch_round_to_nearest_even():
    # 1 + 1/16 lies halfway between 1 and 1.125 (e4m3: 3 mantissa bits): ties go to the even mantissa, 1.
    row = torch.tensor([[[448.0, 1.0625, 1.1875, -3.25]]])
    codes, scale = fp8.quantize(row)
    assert scale.item() == 1.0
    assert codes.float().flatten().tolist() == [448.0, 1.0, 1.25, -3.25]


@settings(max_examples=40)
@given(st.integers(1, 6), st.integers(1, 48), st.floats(1e-3, 1e4), st.integers(0, 2**31 - 1))
def test_round_trip_is_idempotent_and_bounded(rows, hidden, magnitude, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2, hidden, generator=g) * magnitude).to(torch.bfloat16)
    codes, scale = fp8.quantize(x)
    y = fp8.dequantize(codes, scale)
    row_error = torch.linalg.vector_norm((x - y).float(), dim=-1) / torch.linalg.vector_norm(x.float(), dim=-1)
    assert row_error.max() <= 2.0**-4
    again_codes, again_scale = fp8.quantize(y)  # dequantised states quantise back to themselves
    assert torch.allclose(fp8.dequantize(again_codes, again_scale).float(), y.float(), rtol=2.0**-8, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_any_input_dtype(dtype):
    x = torch.randn(3, 2, 8).to(dtype)
    codes, scale = fp8.quantize(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
