"""The store contract's plain functions (peagle/schemas/store.py)."""

from __future__ import annotations

from peagle.schemas import store as S


def test_mask_token_description_says_how_it_was_chosen():
    assert S.describe_mask_token(151669, None, S.MASK_FROM_UNUSED_ROW) == \
        "151669 (no token) (an embedding row past every id the tokenizer produces)"
    assert S.describe_mask_token(7, "<x>", S.MASK_FROM_FLAG) == "7 <x> (--mask-token-id)"
    assert "older peagle" in S.describe_mask_token(None, None, None)

