"""COD sampling (docs/cod.md): counts, chain structure, supervision, layout, determinism, packing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle.model.mask import dense_peagle_mask
from peagle.stages.train.cod import cod_depth_counts, cod_generator, generate_cod_sample_indices, pack_cod


@st.composite
def cod_inputs(draw):
    seq_length = draw(st.integers(0, 60))
    density = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    mask = [draw(st.floats(0, 1)) < density for _ in range(seq_length)]
    return dict(
        seq_length=seq_length,
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        num_depths=draw(st.integers(1, 8)),
        down_sample_ratio=draw(st.sampled_from([0.3, 0.5, 0.7, 0.9, 1.0])),
        down_sample_ratio_min=draw(st.sampled_from([0.0, 0.2, 0.5])),
        max_anchors=draw(st.one_of(st.none(), st.integers(0, 10))),
        generator=torch.Generator().manual_seed(draw(st.integers(0, 2**31))),
    )


def by_depth(anchor: torch.Tensor, depth: torch.Tensor) -> dict[int, list[int]]:
    """Reference positions (anchor + depth) of each depth, in output order."""
    out: dict[int, list[int]] = {}
    for a, d in zip(anchor.tolist(), depth.tolist()):
        out.setdefault(d, []).append(a + d)
    return out


def test_counts_formula() -> None:
    # int((n_valid - d) * max(r^d, r_min)) for d = 1..K-1.
    assert cod_depth_counts(100, 5, 0.7, 0.2) == [69, 48, 33, 23]
    assert cod_depth_counts(100, 8, 0.7, 0.2)[4:] == [19, 18, 18]  # the floor r_min takes over at d = 5
    assert cod_depth_counts(1, 4) == [0, 0, 0]  # never negative
    assert cod_depth_counts(100, 1) == []
    # max_anchors caps depth 1 and scales the rest by the same factor (69 -> 10: x 10/69.3).
    assert cod_depth_counts(100, 5, 0.7, 0.2, max_anchors=10) == [10, 6, 4, 3]
    assert cod_depth_counts(100, 5, 0.7, 0.2, max_anchors=500) == [69, 48, 33, 23]


def test_seed_worked_example() -> None:
    """The docstring's draw: one document of length 6, r = 0.8, depths 0..3."""
    anchor, depth = generate_cod_sample_indices(6, torch.ones(6, dtype=torch.bool), 4, 0.8, 0.2,
                                                generator=torch.Generator().manual_seed(2))
    assert anchor.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 3, 4, 0, 3, 0]
    assert depth.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3]
    assert anchor.dtype == depth.dtype == torch.int64


@settings(max_examples=150)
@given(cod_inputs())
def test_cod_properties(kwargs) -> None:
    seq_length, m = kwargs["seq_length"], kwargs["loss_mask"].tolist()
    anchor, depth = generate_cod_sample_indices(**kwargs)
    assert anchor.dtype == depth.dtype == torch.int64
    # Layout: grouped by depth in order, strictly position-sorted inside (so no duplicates).
    keys = list(zip(depth.tolist(), anchor.tolist()))
    assert keys == sorted(set(keys))
    assert bool((anchor >= 0).all())
    positions = by_depth(anchor, depth)
    assert positions.get(0, []) == list(range(seq_length))
    assert max(positions, default=0) <= kwargs["num_depths"] - 1

    counts = cod_depth_counts(sum(m), kwargs["num_depths"], kwargs["down_sample_ratio"],
                              kwargs["down_sample_ratio_min"], kwargs["max_anchors"])
    previous: list[int] | None = None
    for d in range(1, kwargs["num_depths"]):
        if previous is None:
            pool = {p for p in range(1, seq_length) if m[p]}
        else:
            pool = {p + 1 for p in previous if p + 1 < seq_length and m[p + 1]}
        drawn = positions.get(d, [])
        assert set(drawn) <= pool  # supervised, anchor >= 0, and extends a drawn chain
        assert len(drawn) == min(counts[d - 1], len(pool))
        if not drawn:
            assert not any(k > d for k in positions)
            break
        previous = drawn
    # Chains nested: every depth-d element's (anchor, d - 1) exists; every depth >= 1 is supervised.
    present = set(keys)
    for d, a in keys:
        if d >= 1:
            assert (d - 1, a) in present and m[a + d]
    if kwargs["max_anchors"] is not None:
        assert len(positions.get(1, [])) <= kwargs["max_anchors"]


@st.composite
def capped_inputs(draw, max_length: int = 300):
    """Longer samples than :func:`cod_inputs` and always a cap, often one that binds."""
    seq_length = draw(st.integers(0, max_length))
    density = draw(st.sampled_from([0.05, 0.3, 0.8, 1.0]))
    rng = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    return dict(
        seq_length=seq_length,
        loss_mask=torch.rand(seq_length, generator=rng) < density,
        num_depths=draw(st.integers(1, 8)),
        down_sample_ratio=draw(st.sampled_from([0.3, 0.7, 1.0])),
        down_sample_ratio_min=draw(st.sampled_from([0.0, 0.2, 0.5])),
        max_anchors=draw(st.integers(0, 40)),
        generator=torch.Generator().manual_seed(draw(st.integers(0, 2**31))),
    )


def check_chain_cap(anchor: torch.Tensor, depth: torch.Tensor, seq_length: int, max_anchors: int, num_depths: int) -> int:
    """``max_anchors`` as --help states it, on one sample's draw; returns the number of chains."""
    chains = set(anchor[depth >= 1].tolist())
    assert chains == set(anchor[depth == 1].tolist())  # every deeper element extends a depth-1 chain
    assert len(chains) <= max_anchors
    assert anchor.numel() <= seq_length + max_anchors * (num_depths - 1)
    return len(chains)


@settings(max_examples=200)
@given(capped_inputs())
def test_max_anchors_caps_chains_per_sample(kwargs) -> None:
    anchor, depth = generate_cod_sample_indices(**kwargs)
    m = kwargs["loss_mask"]
    num_chains = check_chain_cap(anchor, depth, kwargs["seq_length"], kwargs["max_anchors"], kwargs["num_depths"])
    # The cap takes away no more than it must: the uncapped draw's chains, up to M.
    if kwargs["num_depths"] > 1:
        uncapped = cod_depth_counts(int(m.sum()), kwargs["num_depths"], kwargs["down_sample_ratio"],
                                    kwargs["down_sample_ratio_min"])[0]
        pool = int(m[1:].sum())
        assert num_chains == min(kwargs["max_anchors"], uncapped, pool)
    else:
        assert num_chains == 0


@settings(max_examples=40)
@given(st.lists(capped_inputs(max_length=120), min_size=1, max_size=4), st.integers(0, 12), st.integers(2, 8))
def test_max_anchors_is_per_sample_in_a_packed_row(samples, max_anchors: int, num_depths: int) -> None:
    """Packed samples keep their own caps: the row may hold M chains per sample, never more in any one."""
    per_sample, doc_starts, start = [], [], 0
    for kwargs in samples:
        kwargs = {**kwargs, "max_anchors": max_anchors, "num_depths": num_depths}
        per_sample.append(generate_cod_sample_indices(**kwargs))
        doc_starts.append(start)
        start += kwargs["seq_length"]
    anchor, depth, _ = pack_cod(per_sample, doc_starts)
    ends = doc_starts[1:] + [start]
    for kwargs, first, end in zip(samples, doc_starts, ends):
        mine = (anchor >= first) & (anchor < end)
        check_chain_cap(anchor[mine] - first, depth[mine], kwargs["seq_length"], max_anchors, num_depths)


@settings(max_examples=30)
@given(cod_inputs(), st.integers(0, 2**31))
def test_same_generator_seed_same_draw(kwargs, seed: int) -> None:
    first = generate_cod_sample_indices(**{**kwargs, "generator": torch.Generator().manual_seed(seed)})
    second = generate_cod_sample_indices(**{**kwargs, "generator": torch.Generator().manual_seed(seed)})
    assert all(torch.equal(x, y) for x, y in zip(first, second))


GOLDEN_DRAW = [439, 444, 595, 416]  # torch.randint(0, 1000, (4,)) from cod_generator(0, 0, "sample-0")


def test_cod_generator_is_stable_and_keyed() -> None:
    def draw(run_seed: int, epoch: int, sample_id: str) -> list[int]:
        return torch.randint(0, 1000, (4,), generator=cod_generator(run_seed, epoch, sample_id)).tolist()

    # A golden value: changing the hash silently changes every run's data, so it must fail loudly.
    assert draw(0, 0, "sample-0") == draw(0, 0, "sample-0") == GOLDEN_DRAW
    assert len({tuple(draw(*key)) for key in [(0, 0, "a"), (1, 0, "a"), (0, 1, "a"), (0, 0, "b")]}) == 4
    # JSON keying: ("1", "2") must not collide with ("12", "") the way naive concatenation would.
    assert draw(1, 2, "x") != draw(12, 0, "x")


def test_default_settings_on_a_long_sample_draw_fewer_deep_elements() -> None:
    m = torch.ones(2000, dtype=torch.bool)
    m[-1] = False  # m[n - 2] = 0 always (no x_n)
    anchor, depth = generate_cod_sample_indices(2000, m, generator=cod_generator(0, 0, "long"))
    per_depth = torch.bincount(depth).tolist()
    assert per_depth[0] == 2000 and len(per_depth) == 8
    assert all(a >= b for a, b in zip(per_depth, per_depth[1:]))


def test_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="seq_length"):
        generate_cod_sample_indices(5, torch.ones(4))
    with pytest.raises(ValueError, match="anchor would be -1"):
        generate_cod_sample_indices(4, torch.ones(4), filter_position_zero=False)
    # Allowed when position 0 is not supervised: same pools as with the filter.
    m = torch.tensor([0, 1, 1, 1])
    a = generate_cod_sample_indices(4, m, 3, filter_position_zero=False, generator=torch.Generator().manual_seed(1))
    b = generate_cod_sample_indices(4, m, 3, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@settings(max_examples=30)
@given(st.lists(cod_inputs(), min_size=1, max_size=3), st.integers(0, 5))
def test_pack_cod(samples, gap: int) -> None:
    """Packing = per-sample draws offset into the row, in (depth, anchor) order; the packed row's
    mask is the block-diagonal of the per-sample masks."""
    per_sample, doc_starts, start = [], [], 0
    for kwargs in samples:
        per_sample.append(generate_cod_sample_indices(**kwargs))
        doc_starts.append(start)
        start += kwargs["seq_length"]
    anchor, depth, position = pack_cod(per_sample, doc_starts)
    keys = list(zip(depth.tolist(), anchor.tolist()))
    assert keys == sorted(set(keys))
    expected = sorted(
        (d, a + s, a + d) for (anchors, depths), s in zip(per_sample, doc_starts)
        for a, d in zip(anchors.tolist(), depths.tolist())
    )
    assert list(zip(depth.tolist(), anchor.tolist(), position.tolist())) == expected

    lengths = [k["seq_length"] for k in samples]
    total = max(sum(lengths) + gap, 1)
    packed_mask = dense_peagle_mask(anchor, depth, torch.tensor(lengths), total)
    sample_of = torch.searchsorted(torch.tensor(doc_starts), anchor, right=True) - 1
    for j, (anchors, depths) in enumerate(per_sample):
        rows = torch.nonzero(sample_of == j).flatten()
        own = dense_peagle_mask(anchors, depths, torch.tensor([lengths[j]]), max(lengths[j], 1))
        assert torch.equal(packed_mask[rows][:, rows], own)
        others = torch.nonzero(sample_of != j).flatten()
        assert not bool(packed_mask[rows][:, others].any())
