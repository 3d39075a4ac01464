"""one_line: the single line a UserError or a benchmark record quotes from a library's error."""

from hypothesis import given
from hypothesis import strategies as st

from peagle.schemas.errors import one_line, show_value


@given(st.text(), st.integers(min_value=1, max_value=300))
def test_any_message_becomes_one_bounded_line(message: str, limit: int) -> None:
    line = one_line(RuntimeError(message), limit, with_type=False)
    assert "\n" not in line and "\r" not in line and 0 < len(line) <= max(limit, len("no message"))
    assert one_line(RuntimeError(message), limit) == f"RuntimeError: {line}"


def test_keeps_the_start_of_a_page_long_error_with_its_whitespace_collapsed() -> None:
    err = ValueError("shape '[513, 4096]' is invalid\n\n   for input of size 1\n" + "frame\n" * 500)
    assert one_line(err, 54) == "ValueError: shape '[513, 4096]' is invalid for input of size 1 fra"
    assert one_line(ValueError("")) == "ValueError: no message"


def test_show_value_names_a_setting_as_flags_take_it() -> None:
    assert show_value([2, 15, 27]) == "2,15,27" and show_value((1,)) == "1"
    assert show_value("") == "''" and show_value("a b") == "'a b'"
    assert show_value(3e-3) == "0.003" and show_value(None) == "None"
