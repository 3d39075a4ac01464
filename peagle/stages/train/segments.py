"""Sequence partitioning: split a row's flat COD sequence into S segments, one forward/backward each.

With long contexts the single flat forward may not fit; P-EAGLE's Algorithm 1 splits it into S
segments whose losses (and gradients) add up to the flat forward's exactly (DESIGN §4):

* ownership (:func:`assign_cod_segments`): a depth-0 element belongs to the segment of its position
  ``anchor``; a deeper element to the segment of ``anchor + 1``, its chain's depth-1 position, so all
  depth >= 1 elements of one chain share a segment; segment of position p = ``floor(p·S/L)``;
* causal completion (:func:`plan_segments`): a segment's forward also carries, as key/value context,
  every depth-0 element of the same sample at or before the segment's right boundary. An owned
  query sees depth-0 keys at anchors <= its own (all at or before the boundary) and its own chain
  (depth-0 anchor included, deeper links owned by the same segment), so within the segment it sees
  exactly the keys it sees in the flat sequence; loss is charged on owned elements only.

Positions are per sample (L = the sample's training length); with packing, segment s of a row is
segment s of every sample in it. Shape letters: N = flat elements of the row, M = a segment's
carried elements, D = samples packed in the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SegmentPlan:
    """What one segment's forward carries.

    Attributes:
        segment: the segment index s in [0, S).
        indices: ``[M]`` int64 indices into the row's flat element list, ascending (so the carried
            elements keep the flat COD layout and :func:`peagle.model.mask.cod_block_mask` applies).
        owned: ``[M]`` bool, True for elements this segment owns (loss is charged on these only);
            the rest is causal-completion context.
    """

    segment: int
    indices: Tensor
    owned: Tensor


def assign_cod_segments(anchor_pos: Tensor, depth: Tensor, seq_length: int | Tensor, num_segments: int) -> Tensor:
    """Segment id in [0, num_segments) of every element of one sample (DESIGN §4).

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
