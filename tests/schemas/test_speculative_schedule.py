"""A K per batch size (vLLM's num_speculative_tokens_per_batch_size): its text form, and what vLLM 0.32
serves right refused otherwise in one line."""

from __future__ import annotations

import pytest

from peagle.schemas.errors import UserError
from peagle.schemas.speculative_schedule import check_schedule, parse_schedule, schedule_text


def test_the_text_form_reads_back_as_written():
    schedule = parse_schedule("1:8, 2-3:4,4-8:0")
    assert schedule == [[1, 1, 8], [2, 3, 4], [4, 8, 0]]
    assert schedule_text(schedule) == "1:8,2-3:4,4-8:0"
    assert check_schedule(schedule, speculative_tokens=8, parallel=False, where="w") == schedule


@pytest.mark.parametrize("text", ["1-8", "a:3", "1:x", "1-2-3:4", ""])
def test_a_malformed_schedule_is_one_line(text):
    with pytest.raises(UserError, match=r"--speculative-schedule takes ranges of batch sizes and their K"):
        parse_schedule(text)


@pytest.mark.parametrize("schedule, fault", [
    ([[2, 8, 4]], "ascending ranges from 1"),  # batch size 1 has no K
    ([[1, 4, 4], [3, 8, 0]], "ascending ranges from 1"),  # overlapping
    ([[1, 4, 4], [6, 5, 0]], "ascending ranges from 1"),  # a range that ends before it starts
    ([[1, 1, 9]], "K = 9 for batch sizes 1-1; the export serves K = 8"),  # vLLM would cap it unsaid
    ([[1, 1, -1]], "K = -1"),
    ([], "not a list of"),
    ([[1, 1, True]], "not a list of"),
])
def test_a_schedule_vllm_would_serve_otherwise_is_refused(schedule, fault):
    with pytest.raises(UserError, match=fault):
        check_schedule(schedule, speculative_tokens=8, parallel=False, where="config.json")


def test_a_p_eagle_schedule_takes_its_served_k_or_none():
    """vLLM 0.32 drafts every parallel step with the engine's K mask slots: a smaller K hands one request
    another's drafts (peagle/schemas/speculative_schedule.py); EAGLE-3 takes any K up to the engine's."""
    assert check_schedule([[1, 2, 6], [3, 8, 0]], speculative_tokens=6, parallel=True, where="w") == [[1, 2, 6],
                                                                                                     [3, 8, 0]]
    assert check_schedule([[1, 1, 6], [2, 8, 3]], speculative_tokens=6, parallel=False, where="w")
    with pytest.raises(UserError, match=r"P-EAGLE draft's schedule takes K = 6 \(the served K\) or 0, not K = 3"):
        check_schedule([[1, 1, 6], [2, 8, 3]], speculative_tokens=6, parallel=True, where="w")
