"""The one acceptance-length formula and the histogram every eval mode counts into."""

from __future__ import annotations

import math

import pytest
import torch

from peagle.stages.eval.acceptance import AcceptanceHistogram, acceptance_lengths


def test_acceptance_lengths_is_one_plus_cumulative_per_depth_rates():
    assert acceptance_lengths([8, 6, 3], 10) == pytest.approx([1.8, 2.4, 2.7])
    assert all(math.isnan(x) for x in acceptance_lengths([0, 0], 0))


def test_histogram_views_agree():
    hist = AcceptanceHistogram(3)
    for a in [0, 1, 1, 2, 3, 3, 3, 0, 2, 3]:
        hist.add(a)
    assert hist.num_steps == 10
    assert hist.accepted_at_depth() == [8, 6, 4]
    assert hist.per_depth_acceptance() == pytest.approx([0.8, 0.6, 0.4])
    assert hist.conditional_acceptance() == pytest.approx([0.8, 6 / 8, 4 / 6])
    # AL(K) is the mean tokens per step: 1 + mean(a).
    assert hist.acceptance_length() == pytest.approx(1 + hist.num_accepted_tokens / hist.num_steps)
    # AL(k) for k < K is the mean of 1 + min(a, k) over the same steps (truncation).
    steps = [0, 1, 1, 2, 3, 3, 3, 0, 2, 3]
    for k in (1, 2, 3):
        assert hist.acceptance_lengths()[k - 1] == pytest.approx(1 + sum(min(a, k) for a in steps) / len(steps))


def test_teacher_forced_chain_formula():
    """docs/draft-and-export.md: AL(K) = 1 + Σ_d mean_over_anchors(Π_{j<=d} correct_j), computed via the histogram."""
    g = torch.Generator().manual_seed(0)
    correct_KC = torch.rand(4, 500, generator=g) < 0.7
    hist = AcceptanceHistogram(4)
    for a in correct_KC.long().cumprod(0).sum(0).tolist():
        hist.add(a)
    direct = 1 + correct_KC.long().cumprod(0).float().mean(1).cumsum(0)
    assert hist.acceptance_lengths() == pytest.approx(direct.tolist())


def test_merge_and_dict():
    a, b = AcceptanceHistogram(2), AcceptanceHistogram(2)
    a.add(2, times=3)
    b.add(0)
    a.merge(b)
    d = a.to_dict()
    assert d["accept_counts"] == [1, 0, 3]
    assert d["acceptance_length"] == pytest.approx(1 + 6 / 4)
    with pytest.raises(AssertionError):
        a.add(3)
