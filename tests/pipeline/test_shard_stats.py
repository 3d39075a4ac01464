"""The row facts of shard statistics (``state_norms``, ``zero_and_non_finite``) equal
their plain definitions on the whole float32 tensor, also where the shortcut through the norm is
wrong: squares of finite values that overflow float32 (norm inf) or underflow it (norm 0)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from peagle.pipeline.shard_stats import state_norms, zero_and_non_finite

SPECIAL = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e30, -3e38, 1e-30, -1e-38, 1.0]


def plain_facts(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    wide = states.float()
    return torch.linalg.vector_norm(wide, dim=-1), (wide == 0).all(dim=-1), ~torch.isfinite(wide).all(dim=-1)


@st.composite
def states(draw) -> torch.Tensor:
    """[n, A, H] states, bf16 or float32, random rows with special values dropped in."""
    n, a, h = draw(st.integers(1, 9)), draw(st.integers(1, 3)), draw(st.integers(1, 12))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    values = torch.randn(n, a, h, generator=gen) * 10.0 ** draw(st.integers(-3, 3))
    flat = values.view(-1, h)
    for _ in range(draw(st.integers(0, 6))):  # a whole special row, or one special value in a row
        row, value = draw(st.integers(0, n * a - 1)), draw(st.sampled_from(SPECIAL))
        if draw(st.booleans()):
            flat[row] = value
        else:
            flat[row, draw(st.integers(0, h - 1))] = value
    return values.to(dtype)


@given(states(), st.sampled_from([1, 2, 4096]))
def test_row_facts_equal_their_plain_definitions(states_nAH, chunk_rows):
    norm, zero, non_finite = plain_facts(states_nAH)
    got_norm = state_norms(states_nAH, chunk_rows=chunk_rows)  # several float32 chunks, or one
    assert got_norm.dtype == torch.float32 and got_norm.shape == norm.shape
    assert torch.equal(got_norm.isnan(), norm.isnan()) and torch.equal(got_norm.nan_to_num(), norm.nan_to_num())
    got_zero, got_non_finite = zero_and_non_finite(states_nAH, got_norm)
    assert torch.equal(got_zero, zero) and torch.equal(got_non_finite, non_finite)


@pytest.mark.parametrize("value, norm, zero, non_finite", [
    (1e30, float("inf"), False, False),  # finite, but the squares overflow float32
    (1e-30, 0.0, False, False),  # not zero, but the squares underflow
    (float("inf"), float("inf"), False, True),
    (0.0, 0.0, True, False),
])
def test_where_the_norm_misleads_the_values_decide(value, norm, zero, non_finite):
    states_nAH = torch.full((2, 1, 8), value, dtype=torch.bfloat16)
    norm_nA = state_norms(states_nAH)
    assert norm_nA.tolist() == [[norm]] * 2
    got_zero, got_non_finite = zero_and_non_finite(states_nAH, norm_nA)
    assert got_zero.tolist() == [[zero]] * 2 and got_non_finite.tolist() == [[non_finite]] * 2
