"""Sequence partitioning: split a row's flat COD sequence into S segments, one forward/backward each.

With long contexts the single flat forward may not fit; P-EAGLE's Algorithm 1 splits it into S
segments whose losses (and gradients) add up to the flat forward's exactly (docs/mask.md):

* ownership (:func:`assign_cod_segments`): a depth-0 element belongs to the segment of its position
  ``anchor``; a deeper element to the segment of ``anchor + 1``, its chain's depth-1 position, so all
  depth >= 1 elements of one chain share a segment; segment of position p = ``floor(p·S/L)``;
* causal completion (:func:`plan_segments`): a segment's forward also carries, as key/value context,
  every depth-0 element of the same sample at or before the segment's right boundary. An owned
  query sees depth-0 keys at anchors <= its own (all at or before the boundary) and its own chain
  (depth-0 anchor included, deeper links owned by the same segment), so within the segment it sees
  exactly the keys it sees in the flat sequence; loss is charged on owned elements only.

Positions are per sample (L = the sample's training length); with packing, segment s of a row is
segment s of every sample in it.

:func:`plan_units` turns a row into its *units* (one forward+backward each: the whole row for S = 1,
else one per non-empty segment) with every index the trainer needs, BlockMask indices included. It
runs in the DataLoader workers (``collate``), so the training step only gathers with these indices
on the device and never plans, sorts or reads back anything.

Shape letters: N = flat elements of the row, M = a segment's carried elements, D = samples packed in
the row, E = the row's supervised elements (``supervised_idx_E``), e = those a unit charges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class SegmentPlan:
    """What one segment's forward carries.

    Attributes:
        segment: the segment index s in [0, S).
        indices: ``[M]`` int64 indices into the row's flat element list, ascending (so the carried
            elements keep the flat COD layout and :func:`peagle.model.mask.cod_block_indices` applies).
        owned: ``[M]`` bool, True for elements this segment owns (loss is charged on these only);
            the rest is causal-completion context.
    """

    segment: int
    indices: Tensor
    owned: Tensor


def assign_cod_segments(anchor_pos: Tensor, depth: Tensor, seq_length: int | Tensor, num_segments: int) -> Tensor:
    """Segment id in [0, num_segments) of every element of one sample (docs/mask.md).

    Depth 0 goes by ``anchor``, depth >= 1 by ``anchor + 1`` (P-EAGLE Algorithm 1: depth 1 by
    position, each deeper element inherits its parent's segment one position back, which ends at the
    chain's depth-1 element). Segment of position p is ``floor(p · S / L)`` clamped to S − 1.
    ``seq_length`` may be a per-element tensor (packed samples of different lengths).

    Raises:
        ValueError: when ``num_segments < 1``.
    """
    if num_segments < 1:
        raise ValueError(f"num_segments must be >= 1, got {num_segments}")
    anchor_N = torch.as_tensor(anchor_pos, dtype=torch.long)
    depth_N = torch.as_tensor(depth, dtype=torch.long)
    length_N = torch.as_tensor(seq_length, dtype=torch.long).clamp_min(1)
    position_N = anchor_N + (depth_N > 0).long()
    return torch.div(position_N * num_segments, length_N, rounding_mode="floor").clamp(0, num_segments - 1)


def plan_segments(anchor_pos: Tensor, depth: Tensor, doc_starts: list[int] | Tensor,
                  doc_lengths: list[int] | Tensor, num_segments: int) -> list[SegmentPlan]:
    """Plan the S segment forwards of one packed row.

    Args:
        anchor_pos, depth: the row's flat COD layout (``pack_cod`` output), anchors as row offsets.
        doc_starts: ``[D]`` first training position of each sample in the row, ascending.
        doc_lengths: ``[D]`` each sample's training length (its ``seq_length``).
        num_segments: S.

    Returns:
        One :class:`SegmentPlan` per segment, in order. Segment s carries the elements it owns plus,
        for every sample that owns something in s, that sample's depth-0 elements in segments <= s
        (segments are monotone in position, so this is "at or before the right boundary"). A sample
        that owns nothing in s contributes no context to it (it would serve no query).

    Raises:
        ValueError: when ``num_segments < 1`` or an anchor lies outside every sample.
    """
    anchor_N = torch.as_tensor(anchor_pos, dtype=torch.long)
    depth_N = torch.as_tensor(depth, dtype=torch.long)
    starts_D = torch.as_tensor(doc_starts, dtype=torch.long)
    lengths_D = torch.as_tensor(doc_lengths, dtype=torch.long)
    sample_N = torch.searchsorted(starts_D, anchor_N, right=True) - 1
    inside = (sample_N >= 0) & (anchor_N < (starts_D + lengths_D)[sample_N.clamp_min(0)])
    if not bool(inside.all()):
        raise ValueError("plan_segments: some anchors lie outside every sample (doc_starts/doc_lengths)")
    local_anchor_N = anchor_N - starts_D[sample_N]
    segment_N = assign_cod_segments(local_anchor_N, depth_N, lengths_D[sample_N], num_segments)

    # owns_DS[j, s]: sample j owns at least one element of segment s.
    owns_DS = torch.zeros((starts_D.numel(), num_segments), dtype=torch.bool)
    owns_DS[sample_N, segment_N] = True
    is_context_N = depth_N == 0
    plans = []
    for s in range(num_segments):
        owned_N = segment_N == s
        context_N = is_context_N & (segment_N <= s) & owns_DS[sample_N, s]
        indices_M = torch.nonzero(owned_N | context_N).flatten()
        plans.append(SegmentPlan(segment=s, indices=indices_M, owned=owned_N[indices_M]))
    return plans


@dataclass(frozen=True)
class UnitPlan:
    """One forward+backward of a row, as index tensors (CPU in the worker, moved with the batch).

    Attributes:
        element_idx_M: the unit's elements in the row's flat sequence, ascending (None: all of them).
            The first ``num_real`` are depth-0 elements, whose flat index is their row position, so
            they also index the batch's ``aux_TAH``.
        num_real: R, the unit's depth-0 elements (a host int: it sizes the draft's inputs).
        supervised_idx_e: rows inside the unit whose loss the unit charges.
        target_idx_e: which of the row's E supervised targets those rows are (None: all E, in order).
        block_indices: the unit's BlockMask index arrays (flex attention only), as the training
            method plans them (``TrainingMethod.block_indices``: one square mask, or one per depth).
        depth_starts: K + 1 host ints, where each depth group of the unit starts (and where the last
            ends): ``depth_starts[1] == num_real``. Sequential drafting steps through them.
    """

    element_idx_M: Tensor | None
    num_real: int
    supervised_idx_e: Tensor
    target_idx_e: Tensor | None
    block_indices: Any
    depth_starts: tuple[int, ...] = ()


BlockIndicesFn = Callable[[Tensor, Tensor, Tensor, int, int, tuple[int, ...]], Any]
"""``fn(anchor_M, depth_M, doc_lengths_D, num_tokens, block_size, depth_starts)``: a unit's flex block
indices (``TrainingMethod.block_indices``)."""


def plan_units(anchor_N: Tensor, depth_N: Tensor, doc_starts_D: Tensor, doc_lengths_D: Tensor,
               supervised_idx_E: Tensor, num_segments: int, *, num_depths: int, block_size: int | None,
               block_indices_fn: BlockIndicesFn | None = None) -> list[UnitPlan]:
    """The units of one packed row (module docstring); segments that carry nothing are skipped.

    ``supervised_idx_E`` are the row's supervised flat indices (ascending); ``block_size`` None
    (SDPA) computes no BlockMask indices, else ``block_indices_fn`` does (the training method's).
    Every supervised element is charged by exactly one unit.
    """
    num_tokens = int(doc_lengths_D.sum())

    def unit(idx_M: Tensor | None, supervised_idx_e: Tensor, target_idx_e: Tensor | None) -> UnitPlan:
        anchor, depth = (anchor_N, depth_N) if idx_M is None else (anchor_N[idx_M], depth_N[idx_M])
        per_depth = torch.bincount(depth, minlength=num_depths)[:num_depths]
        depth_starts = (0, *torch.cumsum(per_depth, 0).tolist())
        indices = None if block_size is None else block_indices_fn(anchor, depth, doc_lengths_D, num_tokens,
                                                                    block_size, depth_starts)
        return UnitPlan(idx_M, depth_starts[1], supervised_idx_e, target_idx_e, indices, depth_starts)

    if num_segments == 1:
        return [unit(None, supervised_idx_E, None)]
    units = []
    for seg in plan_segments(anchor_N, depth_N, doc_starts_D, doc_lengths_D, num_segments):
        idx_M = seg.indices
        if idx_M.numel() == 0:
            continue
        # Where each supervised element sits in the segment, and whether the segment owns it.
        pos_E = torch.searchsorted(idx_M, supervised_idx_E).clamp(max=idx_M.numel() - 1)
        charged_E = (idx_M[pos_E] == supervised_idx_E) & seg.owned[pos_E]
        target_idx_e = torch.nonzero(charged_E).flatten()
        units.append(unit(idx_M, pos_E[target_idx_e], target_idx_e))
    return units
