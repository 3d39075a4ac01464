"""Sequence partitioning (docs/mask.md): ownership, chain cohesion, and exact causal completion."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle.model.mask import dense_peagle_mask
from peagle.stages.train.cod import generate_cod_sample_indices, pack_cod
from peagle.stages.train.segments import assign_cod_segments, plan_segments
from peagle.testing.cod_masks import cod_block_mask


@st.composite
def packed_rows(draw):
    """A row of 1-3 COD-sampled samples, packed, with optional padding at the end of the row."""
    num_depths = draw(st.integers(1, 6))
    per_sample, starts, lengths, start = [], [], [], 0
    for _ in range(draw(st.integers(1, 3))):
        length = draw(st.integers(1, 40))
        density = draw(st.sampled_from([0.3, 0.9, 1.0]))
        mask = torch.tensor([draw(st.floats(0, 1)) < density for _ in range(length)])
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        per_sample.append(generate_cod_sample_indices(length, mask, num_depths, 0.8, 0.2, generator=gen))
        starts.append(start)
        lengths.append(length)
        start += length
    anchor, depth, _ = pack_cod(per_sample, starts)
    return anchor, depth, starts, lengths, start + draw(st.integers(0, 4)), draw(st.integers(1, 6))


@settings(max_examples=60)
@given(st.integers(0, 50), st.integers(0, 5), st.integers(1, 60), st.integers(1, 8))
def test_assign_matches_brute_force(anchor: int, depth: int, seq_length: int, num_segments: int) -> None:
    # Segment of position p: the largest s with boundary s*L/S <= p (exact rational), capped at S-1.
    position = anchor + (1 if depth > 0 else 0)
    expected = max(s for s in range(num_segments) if s * seq_length <= position * num_segments)
    got = assign_cod_segments(torch.tensor([anchor]), torch.tensor([depth]), seq_length, num_segments)
    assert got.tolist() == [expected]


def test_seed_example_two_segments() -> None:
    anchor = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 3, 4, 0, 3, 0])
    depth = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3])
    # L = 6, S = 2: positions 0-2 -> segment 0, 3-5 -> segment 1; chains go by anchor + 1.
    assert assign_cod_segments(anchor, depth, 6, 2).tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 0]
    first, second = plan_segments(anchor, depth, [0], [6], 2)
    assert first.indices.tolist() == [0, 1, 2, 6, 7, 10, 12]
    assert first.owned.all()
    assert second.indices.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 11]
    assert second.owned.tolist() == [False] * 3 + [True] * 6


@settings(max_examples=60)
@given(packed_rows())
def test_plan_segments_properties(row) -> None:
    anchor, depth, starts, lengths, total, num_segments = row
    plans = plan_segments(anchor, depth, starts, lengths, num_segments)
    assert [p.segment for p in plans] == list(range(num_segments))

    # Every element is owned by exactly one segment.
    owner = torch.full_like(anchor, -1)
    for plan in plans:
        assert torch.equal(plan.indices, plan.indices.unique())  # ascending, no repeats
        owned = plan.indices[plan.owned]
        assert bool((owner[owned] == -1).all())
        owner[owned] = plan.segment
    assert bool((owner >= 0).all())

    # A chain's depth >= 1 elements share one segment: that of its depth-1 position anchor + 1.
    sample = torch.searchsorted(torch.tensor(starts), anchor, right=True) - 1
    local = anchor - torch.tensor(starts)[sample]
    for i in range(anchor.numel()):
        length = lengths[int(sample[i])]
        position = int(local[i]) + (1 if int(depth[i]) > 0 else 0)
        assert int(owner[i]) == min(position * num_segments // length, num_segments - 1)
        if int(depth[i]) >= 2:
            parent = torch.nonzero((anchor == anchor[i]) & (depth == depth[i] - 1)).item()
            assert owner[parent] == owner[i]

    # Causal completion: every carried element (owned queries and the context they read through
    # deeper layers) sees exactly the keys it sees in the full flat sequence.
    full = dense_peagle_mask(anchor, depth, torch.tensor(lengths), total)
    for plan in plans:
        carried = torch.zeros(anchor.numel(), dtype=torch.bool)
        carried[plan.indices] = True
        assert not bool(full[plan.indices][:, ~carried].any())
        # Context is depth 0 only and serves a sample that owns something in the segment.
        context = plan.indices[~plan.owned]
        assert bool((depth[context] == 0).all())
        owned_samples = set(sample[plan.indices[plan.owned]].tolist())
        assert set(sample[context].tolist()) <= owned_samples


@settings(max_examples=10)
@given(packed_rows())
def test_segment_attention_equals_flat_attention(row) -> None:
    """Two attention layers: owned outputs of each segment == the flat forward's, so losses add up."""
    anchor, depth, starts, lengths, total, num_segments = row
    lengths_t = torch.tensor(lengths)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, anchor.numel(), 8, generator=gen, dtype=torch.float64)

    def two_layers(x_, anchor_, depth_):
        mask = dense_peagle_mask(anchor_, depth_, lengths_t, total)
        for _ in range(2):
            x_ = torch.nn.functional.scaled_dot_product_attention(x_, x_ * 0.5, x_, attn_mask=mask) + x_
        return x_

    flat = two_layers(x, anchor, depth)
    for plan in plan_segments(anchor, depth, starts, lengths, num_segments):
        if plan.indices.numel() == 0:
            continue
        seg = two_layers(x[:, :, plan.indices], anchor[plan.indices], depth[plan.indices])
        torch.testing.assert_close(seg[:, :, plan.owned], flat[:, :, plan.indices[plan.owned]])
        # The carried elements keep the flat layout, so the metadata-built BlockMask applies.
        cod_block_mask(anchor[plan.indices], depth[plan.indices], lengths_t, total, block_size=8)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_segments"):
        assign_cod_segments(torch.tensor([0]), torch.tensor([0]), 4, 0)
    with pytest.raises(ValueError, match="outside every sample"):
        plan_segments(torch.tensor([0, 5]), torch.tensor([0, 0]), [0], [4], 2)
