"""Readers: deterministic order, per-file indices, counts that match iteration, bad lines as records."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from peagle.schemas.errors import UserError
from peagle.stages.extract.readers import check_has_records, count_records, decode_jsonl_line, iter_file_records


def iter_records(paths):
    """Every record of every file, files in the given order (as extract's shards walk them)."""
    for path in paths:
        yield from iter_file_records(path)


def _chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}


def _write_jsonl(path: Path, records: list[dict], *, trailing_newline: bool = True) -> Path:
    text = "\n".join(json.dumps(r) for r in records) + ("\n" if trailing_newline else "")
    path.write_text(text, encoding="utf-8")
    return path


def _write_parquet(path: Path, records: list[dict], row_group_size: int = 3) -> Path:
    # pa.array infers one struct type over all rows (Table.from_pylist would use the first row's keys).
    table = pa.Table.from_batches([pa.RecordBatch.from_struct_array(pa.array(records))])
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def test_files_in_given_order_records_in_file_order(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [_chat(i) for i in range(3)])
    b = _write_parquet(tmp_path / "b.parquet", [_chat(i) for i in range(10, 17)])
    c = _write_jsonl(tmp_path / "c.jsonl", [_chat(i) for i in range(20, 22)], trailing_newline=False)

    records = list(iter_records([c, a, b]))

    assert [(r.path.name, r.index) for r in records] == (
        [("c.jsonl", 0), ("c.jsonl", 1)] + [("a.jsonl", i) for i in range(3)] + [("b.parquet", i) for i in range(7)]
    )
    assert [r.raw["messages"][0]["content"] for r in records] == (
        ["q20", "q21", "q0", "q1", "q2"] + [f"q{i}" for i in range(10, 17)]
    )
    assert all(r.error is None for r in records)
    assert count_records([c, a, b]) == [2, 3, 7]


def test_bad_lines_are_records_with_a_reason(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [
        json.dumps(_chat(0)).encode(),
        b'{"messages": [',  # truncated JSON
        b'{"messages": "caf\xe9"}',  # latin-1 byte, not UTF-8
        b"[1, 2, 3]",
        b"42",
        b"   ",
        json.dumps(_chat(1)).encode() + b"\r",  # CRLF line ending
    ]
    path.write_bytes(b"\n".join(lines))

    records = list(iter_records([path]))

    assert [r.error for r in records] == [
        None, "malformed_json", "invalid_utf8", "not_an_object", "not_an_object", "blank_line", None,
    ]
    assert records[1].raw == b'{"messages": ['
    assert records[2].raw == b'{"messages": "caf\xe9"}'
    assert records[6].raw == _chat(1)
    assert count_records([path]) == [len(lines)]
    assert records[2].where == f"{path} line 3"


def test_utf8_bom_and_deep_nesting(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(_chat(0)).encode() + b"\n" + b"[" * 100_000 + b"\n")
    records = list(iter_records([path]))
    assert records[0].error is None and records[0].raw == _chat(0)
    assert records[1].error == "malformed_json"


@pytest.mark.parametrize("content", [b"", b"\n", b"{}", b"{}\n\n"])
def test_count_matches_iteration_on_edge_files(tmp_path, content):
    path = tmp_path / "edge.jsonl"
    path.write_bytes(content)
    assert count_records([path]) == [len(list(iter_records([path])))]


def test_decode_jsonl_line_keeps_non_ascii():
    value, error = decode_jsonl_line(json.dumps({"t": "日本 🙂"}, ensure_ascii=False).encode() + b"\n")
    assert error is None and value == {"t": "日本 🙂"}


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_file_record_range(tmp_path, suffix):
    records = [_chat(i) for i in range(11)]
    if suffix == "jsonl":
        path = _write_jsonl(tmp_path / "r.jsonl", records)
    else:
        path = _write_parquet(tmp_path / "r.parquet", records, row_group_size=4)

    for start, stop in [(0, None), (0, 11), (3, 9), (4, 8), (10, 20), (11, None), (5, 5)]:
        got = list(iter_file_records(path, start, stop))
        expected = range(start, min(11, stop if stop is not None else 11))
        assert [r.index for r in got] == list(expected)
        assert [r.raw["messages"][1]["content"] for r in got] == [f"a{i}" for i in expected]


def test_parquet_rows_are_dicts_with_unified_fields(tmp_path):
    records = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo",
                                                          "reasoning_content": "hm"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    ]
    path = _write_parquet(tmp_path / "mixed.parquet", records)
    rows = [r.raw for r in iter_records([path])]
    # Parquet gives every row every column, and every message every struct field (None where absent).
    assert rows[0]["conversations"] is None and rows[1]["messages"] is None
    assert rows[0]["messages"][0]["reasoning_content"] is None
    assert rows[0]["messages"][1]["reasoning_content"] == "hm"
    assert next(iter(iter_records([path]))).where == f"{path} row 0"


def test_unreadable_files_are_user_errors_naming_the_file(tmp_path):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(UserError, match="missing.jsonl"):
        count_records([missing])
    with pytest.raises(UserError, match="missing.jsonl"):
        list(iter_records([missing]))

    directory = tmp_path / "dir.jsonl"
    directory.mkdir()
    with pytest.raises(UserError, match="dir.jsonl"):
        list(iter_records([directory]))

    unknown = tmp_path / "data.csv"
    unknown.write_text("a,b\n")
    with pytest.raises(UserError, match="data.csv"):
        count_records([unknown])

    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"this is not parquet at all")
    with pytest.raises(UserError, match="corrupt.parquet"):
        count_records([corrupt])
    with pytest.raises(UserError, match="corrupt.parquet"):
        list(iter_records([corrupt]))


def test_unreadable_file_fails_before_any_record_of_it(tmp_path):
    good = _write_jsonl(tmp_path / "good.jsonl", [_chat(0)])
    records = iter_records([good, tmp_path / "gone.jsonl"])
    assert next(records).index == 0
    with pytest.raises(UserError, match="gone.jsonl"):
        next(records)


def test_a_file_without_a_record_is_refused_naming_it(tmp_path):
    """Empty input must not count as success (issue 37): 0 bytes, only blank lines (a BOM and CRLF
    included) and 0 Parquet rows are one line each; one record anywhere is enough."""
    cases = {"empty.jsonl": (b"", "is empty (0 bytes)"), "blank.jsonl": (b"\n \n\t\r\n", "holds only blank lines"),
             "bom.jsonl": (b"\xef\xbb\xbf\n\n", "holds only blank lines")}
    for name, (content, words) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(UserError, match=f"^data file {tmp_path / name} {re.escape(words)}; nothing to extract"):
            check_has_records(tmp_path / name)
    pq.write_table(pa.table({"messages": pa.array([], pa.string())}), tmp_path / "none.parquet")
    with pytest.raises(UserError, match="none.parquet holds no records"):
        check_has_records(tmp_path / "none.parquet")
    (tmp_path / "late.jsonl").write_bytes(b"\n\n{oops\n")  # a bad record is a record: input_check judges it
    assert check_has_records(tmp_path / "late.jsonl") == tmp_path / "late.jsonl"


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_record_above_the_bound_is_too_large_and_never_decoded(tmp_path, suffix):
    """A record of more bytes than ``max_record_bytes`` comes as ``too_large`` at its index, the records
    around it as usual, and the bound can be raised (0: none); counts still match iteration."""
    records = [_chat(0), {"messages": [{"role": "user", "content": "x" * 5000},
                                       {"role": "assistant", "content": "y"}]}, _chat(2)]
    path = tmp_path / f"data{suffix}"
    (_write_jsonl if suffix == ".jsonl" else _write_parquet)(path, records)
    got = list(iter_file_records(path, max_record_bytes=2000))
    assert [(r.index, r.error) for r in got] == [(0, None), (1, "too_large"), (2, None)]
    assert got[0].raw == records[0] and got[2].raw == records[2] and len(got[1].raw) <= 2000
    assert [r.raw for r in iter_file_records(path, max_record_bytes=0)] == records
    assert [r.index for r in iter_file_records(path, 1, 3, max_record_bytes=2000)] == [1, 2]
    assert count_records([path]) == [3]


def test_a_giant_line_is_read_past_in_bounded_memory(tmp_path):
    """One 64 MiB line (a few hundred MB ended extract before) costs the reader about the bound, not
    the line: it is read at most that far and the rest skipped in 1 MiB chunks."""
    import tracemalloc

    path = tmp_path / "giant.jsonl"
    with open(path, "wb") as f:
        f.write(json.dumps(_chat(0)).encode() + b"\n")
        f.write(b'{"messages": "' + b"z" * (64 << 20) + b'"}\n')
        f.write(json.dumps(_chat(2)).encode() + b"\n")
    tracemalloc.start()
    got = [(r.index, r.error) for r in iter_file_records(path, max_record_bytes=1 << 20)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert got == [(0, None), (1, "too_large"), (2, None)]
    assert peak < 8 << 20, f"peak {peak:,} bytes"
