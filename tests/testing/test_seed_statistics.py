"""Seed statistics: Welch's t-test against hand-computed values and the table's critical values."""

from __future__ import annotations

import pytest

from peagle.testing.seed_statistics import describe, welch


def test_welch() -> None:
    # a = 1, 2, 3 and b = 4, 5, 6: t = -3 / sqrt(2/3) = -3.674 at df = 4 (critical 2.776).
    result = welch([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    assert result["diff"] == pytest.approx(-3.0) and result["t"] == pytest.approx(-3.6742, abs=1e-4)
    assert result["df"] == pytest.approx(4.0) and result["t_crit"] == 2.776 and result["beyond_noise"]
    assert not welch([1.0, 2.0, 3.0], [1.5, 2.5, 3.5])["beyond_noise"]
    # Unequal variances: Welch's df, floored for the table (conservative).
    uneven = welch([1.0, 1.1, 0.9], [3.0, 5.0, 1.0, 4.0])
    assert 3.0 < uneven["df"] < 3.2 and uneven["t_crit"] == 3.182
    assert welch([1.0], [2.0, 3.0])["beyond_noise"] is None


def test_describe() -> None:
    summary = describe([1.0, 2.0, 3.0])
    assert summary["mean"] == 2.0 and summary["std"] == 1.0 and summary["se"] == pytest.approx(3**-0.5)
    assert describe([4.0])["std"] is None and describe([4.0])["n"] == 1
