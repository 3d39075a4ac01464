"""When extract fails on bad input, and what it says (input_check.py): pure verdicts, in words."""

from __future__ import annotations

import pytest

from peagle.schemas.errors import UserError
from peagle.stages.extract.conversation import SKIP_REASONS
from peagle.stages.extract.input_check import SKIP_WORDS, BadRecord, check_input, scan_records, words


def _check(num_records: int, skipped: dict[str, int], supervised: int | None = 100, share: float = 0.5) -> None:
    check_input(num_records=num_records, skipped=skipped, examples=[BadRecord("d.jsonl line 3", "malformed_json")],
                supervised_tokens=supervised, max_skipped_share=share, what="extraction")


def test_every_skip_reason_has_words():
    assert set(SKIP_REASONS) <= set(SKIP_WORDS)
    assert words({"malformed_json": 2, "blank_line": 5}) == "5 a blank line, 2 not valid JSON"
    assert str(BadRecord("d.jsonl line 3", "unknown_role", "role 'robot'")) == (
        "d.jsonl line 3: a message with an unknown role (unknown_role: role 'robot')")


def test_the_verdicts():
    _check(10, {"malformed_json": 5})  # half is allowed at the default share
    with pytest.raises(UserError, match=r"skipped 6 of 10 records \(60%, more than --max-skipped-share 0.5\): "
                                        r"6 not valid JSON; first: d.jsonl line 3: not valid JSON"):
        _check(10, {"malformed_json": 6})
    _check(10, {"malformed_json": 6}, share=1.0)
    with pytest.raises(UserError, match="found no usable record: all 2 were skipped"):
        _check(2, {"malformed_json": 1, "messages_not_a_list": 1}, share=1.0)
    with pytest.raises(UserError, match="committed no supervised token"):
        _check(10, {}, supervised=0)
    _check(10, {}, supervised=None)  # not known (records of an older peagle): not judged
    # blank lines are no records: a file of 2 chats and 8 blank lines is fine, one of blank lines only too
    _check(10, {"blank_line": 8}, share=0.1)
    _check(3, {"blank_line": 3}, supervised=None)
    # samples dropped from kept records are not record skips
    _check(10, {"per_turn_truncated_no_loss": 9}, share=0.1)


def test_scan_decodes_every_record(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
                    '{oops\n\n{"messages": "x"}\n')
    scan = scan_records([(str(data), 0, 4)], strict=False)
    assert scan.num_records == 4 and dict(scan.skipped) == {"malformed_json": 1, "blank_line": 1,
                                                            "messages_not_a_list": 1}
    assert [str(b).split(":")[0] for b in scan.examples] == [f"{data} line 2", f"{data} line 4"]
    with pytest.raises(UserError, match=rf"{data} line 2: not valid JSON \(malformed_json\) \[--strict\]"):
        scan_records([(str(data), 0, 4)], strict=True)
