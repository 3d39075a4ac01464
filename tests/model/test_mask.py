"""The P-EAGLE mask: mask_mod vs a brute-force reading of docs/mask.md, dense vs mask_mod, and the
metadata-built BlockMask vs create_block_mask (block indices and flex forward)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

from peagle.model.mask import block_mask_from_indices, cod_block_indices, dense_peagle_mask
from peagle.testing.cod_masks import cod_block_mask, create_peagle_mask_mod

# Eager flex on CPU (forward only) is what we test; the "use torch.compile" advice is noise here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

BLOCK_FIELDS = (
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
)

# The seeds' worked example: one document of length 6, chains from anchors 0,1,3,4 (depth 1), 0,3
# (depth 2) and 0 (depth 3).
SEED_ANCHOR = [0, 1, 2, 3, 4, 5, 0, 1, 3, 4, 0, 3, 0]
SEED_DEPTH = [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3]


def random_flat_row(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A packed row in flat COD layout: random documents, nested chains, padding of both kinds.

    Padding elements appear inside the layout (depth-0 positions of the padded tail, as when COD runs
    over a padded row) and appended after it with arbitrary depths, as a trainer may pad N.
    """
    rng = random.Random(seed)
    lengths = [rng.randint(1, 12) for _ in range(rng.randint(1, 4))]
    pad = rng.choice([0, 0, rng.randint(1, 6)])
    total = sum(lengths) + pad
    num_depths = rng.randint(1, 5)
    drop_depth0 = rng.random() < 0.2  # the rule and the block builder must not assume a full depth 0
    elements: set[tuple[int, int]] = set()
    start = 0
    for length in lengths:
        for p in range(start, start + length):
            if not drop_depth0 or rng.random() < 0.7:
                elements.add((0, p))
        chain_rate = rng.choice([0.1, 0.6])  # sparse chains make adjacent runs across depth groups
        chains = [a for a in range(start, start + length - 1) if rng.random() < chain_rate]
        for d in range(1, num_depths):
            chains = [a for a in chains if a + d < start + length and rng.random() < 0.8]
            elements.update((d, a) for a in chains)
        start += length
    for p in range(start, total):
        if rng.random() < 0.5:
            elements.add((0, p))
    ordered = sorted(elements) or [(0, 0)]
    if pad and rng.random() < 0.5:
        ordered += [(rng.randint(0, num_depths), rng.randint(start, total - 1)) for _ in range(rng.randint(1, 7))]
    depth = torch.tensor([d for d, _ in ordered], dtype=torch.long)
    anchor = torch.tensor([a for _, a in ordered], dtype=torch.long)
    return anchor, depth, torch.tensor(lengths), total


def brute_force_mask(anchor: list[int], depth: list[int], lengths: list[int], total: int) -> list[list[bool]]:
    """docs/mask.md read literally, one pair at a time."""
    doc_of_pos = [-1] * total
    pos = 0
    for doc, length in enumerate(lengths):
        for _ in range(length):
            doc_of_pos[pos] = doc
            pos += 1
    out = []
    for q in range(len(anchor)):
        row = []
        for k in range(len(anchor)):
            same_doc = doc_of_pos[anchor[q]] == doc_of_pos[anchor[k]]
            q_real = doc_of_pos[anchor[q]] != -1
            context = depth[k] == 0 and anchor[k] <= anchor[q]
            chain = anchor[k] == anchor[q] and depth[k] <= depth[q]
            row.append(same_doc and q_real and (context or chain))
        out.append(row)
    return out


def assert_same_blocks(expected, actual) -> None:
    for name in BLOCK_FIELDS:
        want, got = getattr(expected, name), getattr(actual, name)
        assert want.dtype == got.dtype and want.shape == got.shape, name
        assert torch.equal(want, got), f"{name}:\n{want}\n{got}"
    assert expected.seq_lengths == actual.seq_lengths


def test_seed_example_mask() -> None:
    anchor, depth = torch.tensor(SEED_ANCHOR), torch.tensor(SEED_DEPTH)
    dense = dense_peagle_mask(anchor, depth, torch.tensor([6]), 6)
    # Depth-3 element (anchor 0, position 3) sees the real token at anchor 0 and its own chain.
    assert dense[12].nonzero().flatten().tolist() == [0, 6, 10, 12]
    # Depth-2 element of anchor 3 sees depth-0 anchors 0..3 and the depth-1 element of anchor 3.
    assert dense[11].nonzero().flatten().tolist() == [0, 1, 2, 3, 8, 11]
    assert dense.tolist() == brute_force_mask(SEED_ANCHOR, SEED_DEPTH, [6], 6)


@settings(max_examples=40)
@given(seed=st.integers(0, 2**32 - 1))
def test_mask_mod_and_dense_match_brute_force(seed: int) -> None:
    anchor, depth, lengths, total = random_flat_row(seed)
    expected = brute_force_mask(anchor.tolist(), depth.tolist(), lengths.tolist(), total)
    mask_mod = create_peagle_mask_mod(anchor, depth, lengths, total)
    evaluated = create_mask(mask_mod, 1, 1, anchor.numel(), anchor.numel(), device="cpu")[0, 0]
    assert evaluated.tolist() == expected
    assert torch.equal(dense_peagle_mask(anchor, depth, lengths, total), evaluated)


@settings(max_examples=40)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 2, 3, 4, 8, 16]))
def test_block_mask_equals_create_block_mask(seed: int, block_size: int) -> None:
    anchor, depth, lengths, total = random_flat_row(seed)
    mask_mod = create_peagle_mask_mod(anchor, depth, lengths, total)
    expected = create_block_mask(mask_mod, None, None, anchor.numel(), anchor.numel(), device="cpu",
                                 BLOCK_SIZE=block_size)
    assert_same_blocks(expected, cod_block_mask(anchor, depth, lengths, total, block_size=block_size))


@pytest.mark.parametrize("block_size", [2, 3, 4])
def test_block_mask_full_block_spanning_depth_groups(block_size: int) -> None:
    """One long chain: its depth-j and depth-(j+1) runs are adjacent, so a key block straddling two
    depth groups is fully visible only through the union of two runs."""
    anchor = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 1, 1, 1, 1, 1])
    depth = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5])
    mask_mod = create_peagle_mask_mod(anchor, depth, torch.tensor([8]), 8)
    expected = create_block_mask(mask_mod, None, None, 13, 13, device="cpu", BLOCK_SIZE=block_size)
    assert_same_blocks(expected, cod_block_mask(anchor, depth, torch.tensor([8]), 8, block_size=block_size))


@pytest.mark.parametrize("block_size", [2, 3, 4])
def test_block_mask_padding_inside_a_visible_span(block_size: int) -> None:
    """Padding elements (anchors 8..15) between the depth-0 and depth-1 groups sit inside the flat
    span of a chain's merged run: blocks holding them are never full, padding-only blocks never set."""
    anchor = torch.tensor([0, 1] + list(range(8, 16)) + [1, 1, 1, 1, 1])
    depth = torch.tensor([0] * 10 + [1, 2, 3, 4, 5])
    mask_mod = create_peagle_mask_mod(anchor, depth, torch.tensor([8]), 16)
    expected = create_block_mask(mask_mod, None, None, 15, 15, device="cpu", BLOCK_SIZE=block_size)
    assert_same_blocks(expected, cod_block_mask(anchor, depth, torch.tensor([8]), 16, block_size=block_size))


def test_block_mask_default_block_size_on_a_long_packed_row() -> None:
    """Several 128-blocks, full and partial ones, with packing and padding; flex forward == SDPA."""
    rng = random.Random(7)
    lengths = [300, 90, 200]
    total = sum(lengths) + 20
    elements, start = [], 0
    for length in lengths:
        elements += [(0, p) for p in range(start, start + length)]
        chains = sorted(rng.sample(range(start, start + length - 1), length // 2))
        for d in range(1, 4):
            chains = [a for a in chains if a + d < start + length and rng.random() < 0.7]
            elements += [(d, a) for a in chains]
        start += length
    elements = sorted(elements) + [(3, total - 1)] * 5  # appended padding
    depth = torch.tensor([d for d, _ in elements])
    anchor = torch.tensor([a for _, a in elements])
    lengths_t = torch.tensor(lengths)
    num_elements = anchor.numel()

    mask_mod = create_peagle_mask_mod(anchor, depth, lengths_t, total)
    expected = create_block_mask(mask_mod, None, None, num_elements, num_elements, device="cpu")
    ours = block_mask_from_indices(cod_block_indices(anchor, depth, lengths_t, total), mask_mod, device="cpu")
    assert_same_blocks(expected, ours)
    assert int(ours.full_kv_num_blocks.sum()) > 0 and int(ours.kv_num_blocks.sum()) > 0

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, num_elements, 16, generator=gen) for _ in range(3))
    flex_out = flex_attention(q, k, v, block_mask=ours)
    dense = dense_peagle_mask(anchor, depth, lengths_t, total)
    sdpa_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    real = dense.any(dim=-1)  # padding queries see nothing: SDPA gives NaN there, flex zeros
    torch.testing.assert_close(flex_out[:, :, real], sdpa_out[:, :, real], atol=1e-5, rtol=1e-5)


@settings(max_examples=8)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([16, 32]))
def test_flex_forward_equals_sdpa_with_dense_mask(seed: int, block_size: int) -> None:
    anchor, depth, lengths, total = random_flat_row(seed)
    block_mask = cod_block_mask(anchor, depth, lengths, total, block_size=block_size)
    dense = dense_peagle_mask(anchor, depth, lengths, total)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, anchor.numel(), 8, generator=gen) for _ in range(3))
    flex_out = flex_attention(q, k, v, block_mask=block_mask)
    sdpa_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    real = dense.any(dim=-1)
    torch.testing.assert_close(flex_out[:, :, real], sdpa_out[:, :, real], atol=1e-5, rtol=1e-5)
    assert torch.equal(flex_out[:, :, ~real], torch.zeros_like(flex_out[:, :, ~real]))


def test_block_indices_reject_a_scrambled_layout() -> None:
    anchor, depth = torch.tensor(SEED_ANCHOR[::-1]), torch.tensor(SEED_DEPTH[::-1])
    with pytest.raises(ValueError, match="flat COD layout"):
        cod_block_indices(anchor, depth, torch.tensor([6]), 6)


def test_anchor_outside_row_is_rejected() -> None:
    with pytest.raises(ValueError, match="anchors must lie"):
        dense_peagle_mask(torch.tensor([0, 6]), torch.tensor([0, 0]), torch.tensor([6]), 6)


def depth_groups(depth: torch.Tensor) -> list[slice]:
    """The depth groups of a row whose elements are all in flat COD layout (depth ascending)."""
    starts = torch.searchsorted(depth, torch.arange(int(depth.max()) + 2)).tolist()
    return [slice(a, b) for a, b in zip(starts, starts[1:]) if b > a]


@settings(max_examples=40)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 2, 3, 4, 8, 16]))
def test_one_depth_over_the_elements_before_it_in_every_form(seed: int, block_size: int) -> None:
    """Sequential drafting's mask (``rows``): one depth group's queries over every element up to it, as
    mask_mod, dense rows, per-document masks and metadata-built block indices; each equals the full
    row's mask cut to those rows and columns, and the blocks equal create_block_mask's."""
    from peagle.model.mask import dense_mask, document_ids, document_masks, peagle_mask_mod

    anchor, depth, lengths, total = random_flat_row(seed)
    if bool((depth[1:] < depth[:-1]).any()):  # padding appended at random depths: no depth groups
        return
    doc = document_ids(anchor, lengths, total)
    full = dense_mask(anchor, depth, doc)
    for rows in depth_groups(depth):
        mask_mod = peagle_mask_mod(anchor, depth, doc, rows)
        num_q = rows.stop - rows.start
        evaluated = create_mask(mask_mod, 1, 1, num_q, rows.stop, device="cpu")[0, 0]
        assert torch.equal(evaluated, full[rows, : rows.stop])
        assert torch.equal(dense_mask(anchor, depth, doc, rows), evaluated)
        per_doc = document_masks(anchor, depth, doc, rows)
        rebuilt = torch.zeros(num_q, rows.stop, dtype=torch.bool)
        for q_idx, k_idx, mask in zip(per_doc.index_per_doc, per_doc.key_index_per_doc, per_doc.mask_per_doc):
            rebuilt[q_idx[:, None], k_idx[None, :]] = mask
        assert torch.equal(rebuilt, evaluated)
        expected = create_block_mask(mask_mod, None, None, num_q, rows.stop, device="cpu", BLOCK_SIZE=block_size)
        indices = cod_block_indices(anchor, depth, lengths, total, block_size=block_size, rows=rows)
        assert_same_blocks(expected, block_mask_from_indices(indices, mask_mod))


@settings(max_examples=8)
@given(seed=st.integers(0, 2**32 - 1))
def test_flex_forward_over_one_depth_equals_sdpa(seed: int) -> None:
    from peagle.model.mask import dense_mask, document_ids, peagle_mask_mod

    anchor, depth, lengths, total = random_flat_row(seed)
    if bool((depth[1:] < depth[:-1]).any()):
        return
    doc = document_ids(anchor, lengths, total)
    gen = torch.Generator().manual_seed(seed)
    for rows in depth_groups(depth):
        block_mask = block_mask_from_indices(cod_block_indices(anchor, depth, lengths, total, block_size=16, rows=rows),
                                             peagle_mask_mod(anchor, depth, doc, rows))
        dense = dense_mask(anchor, depth, doc, rows)
        q = torch.randn(1, 2, rows.stop - rows.start, 8, generator=gen)
        k, v = (torch.randn(1, 2, rows.stop, 8, generator=gen) for _ in range(2))
        flex_out = flex_attention(q, k, v, block_mask=block_mask)
        real = dense.any(dim=-1)
        sdpa_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        torch.testing.assert_close(flex_out[:, :, real], sdpa_out[:, :, real], atol=1e-5, rtol=1e-5)
