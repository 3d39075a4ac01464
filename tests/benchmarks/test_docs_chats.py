"""benchmarks/docs_chats.py: documentation cut into passages that fit the answers' bounds, prose only."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def docs(load_benchmark):
    with load_benchmark("docs_chats.py") as module:
        yield module


@given(st.lists(st.text(alphabet="ab \n", min_size=0, max_size=900), min_size=1, max_size=12))
def test_passages_stay_within_their_bounds(docs, paragraphs) -> None:
    text = "\n\n".join(p.strip() or "x" for p in paragraphs)
    for title, passage in docs.passages("t", text):
        assert title == "t" and docs.MIN_CHARS <= len(passage) <= docs.MAX_CHARS + 2


def test_docstrings_reads_prose_and_leaves_tests_and_code_out(docs, tmp_path) -> None:
    prose = "A sentence of plain words about what this does and why. " * 8
    (tmp_path / "m.py").write_text(f'"""{prose}"""\n\ndef f():\n    """{"x = [1, 2]; " * 40}"""\n')
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text(f'"""{prose}"""\n')
    (tmp_path / "broken.py").write_text("def (:\n")
    found = list(docs.docstrings(tmp_path))
    assert found == [("m", prose.strip())]
