"""Character-level helpers of span location: token masks from spans, and where two renders differ."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from peagle.stages.extract.spans import common_prefix_len, diff_region, spans_to_token_mask


def test_spans_to_token_mask_counts_straddling_tokens():
    offsets = [(0, 3), (3, 6), (6, 9), (9, 9), (9, 12), (12, 15)]
    # Span [4, 10) overlaps tokens 1 (straddles the start), 2, 3 (zero-width at 9) and 4 (straddles the end).
    assert spans_to_token_mask(offsets, [(4, 10)]) == [0, 1, 1, 1, 1, 0]
    assert spans_to_token_mask(offsets, [(12, 15), (0, 3)]) == [1, 0, 0, 0, 0, 1]
    assert spans_to_token_mask(offsets, [(3, 6), (6, 9)]) == [0, 1, 1, 0, 0, 0]


def test_diff_region_is_what_only_the_first_render_has():
    assert diff_region("<a>xyz</a>", "<a></a>") == (3, 6)
    assert diff_region("same", "same") == (4, 4)
    # Renders that agree around the edit can shift the region by a character: "<tool_call>...<|im_end|>"
    # vs "<|im_end|>" share their first "<" (token_kinds places a token by the majority of its characters).
    assert diff_region("A<tool_call>x</tool_call><|im_end|>", "A<|im_end|>") == (2, 26)


@given(st.text(max_size=20), st.text(max_size=20), st.text(max_size=20), st.text(max_size=20))
def test_diff_region_is_a_minimal_edit(head, inserted, other, tail):
    a, b = head + inserted + tail, head + other + tail
    start, end = diff_region(a, b)
    assert start == common_prefix_len(a, b) and start <= end <= len(a)
    assert a[:start] == b[:start] and a[end:] == b[len(b) - (len(a) - end):]  # the rest is common
    assert end - start >= len(a) - len(b)  # at least what a has more than b
    assert end - start <= len(inserted)  # never more than the edit itself
