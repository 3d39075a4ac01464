"""Read chat records from JSONL and Parquet files in one deterministic order.

Order is a pure function of the input: files in the order given, records in file order. A record's
``index`` is its position in its file: the 0-based line number for JSONL (every line is a record, so
``count_records`` can count newlines instead of parsing), the row number for Parquet. A line that
cannot be decoded still yields a record, with ``error`` set to its skip reason, so that counts and
indices never depend on content.

A file that cannot be opened or read (missing, a directory, corrupt Parquet) is a ``UserError``
naming the file; a bad line inside a readable file is not.

**Records have a size bound** (``max_record_bytes``: ``peagle extract --max-record-bytes``, 4 MiB by
default): a record of more bytes is yielded as ``too_large`` without being decoded, so one giant line cannot take the process's memory (a 5 MB record lifted extract's peak from ~0.5
to ~2.3 GB; a line of some hundred MB would end it). A JSONL line is read at most that far and the
rest skipped unread; a Parquet row is measured in Arrow (its buffers' bytes) before it becomes Python
objects (Arrow reads the column chunk it is in either way).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peagle.schemas.errors import UserError
from peagle.schemas.extract_config import MAX_RECORD_BYTES
from peagle.stages.extract.conversation import BLANK_LINE, INVALID_UTF8, MALFORMED_JSON, NOT_AN_OBJECT, TOO_LARGE

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
_PARQUET_BATCH_ROWS = 256
_COUNT_CHUNK_BYTES = 1 << 22
_UTF8_BOM = b"\xef\xbb\xbf"
_SKIP_CHUNK_BYTES = 1 << 20
PREVIEW_BYTES = 64  # of a too-large record, kept as its ``raw`` for error lines


@dataclass(frozen=True)
class SourceRecord:
    """One record of one input file.

    ``raw`` is the decoded JSON object, or the line's bytes (without its newline) when it could not
    be decoded; then ``error`` is the skip reason (``malformed_json``, ``invalid_utf8``,
    ``not_an_object``, ``blank_line``).
    """

    path: Path
    index: int
    raw: dict[str, Any] | bytes
    error: str | None = None

    @property
    def basename(self) -> str:
        return self.path.name

    @property
    def where(self) -> str:
        """Where a user finds the record: 'data.jsonl line 12' (1-based) or 'data.parquet row 11'."""
        if is_parquet(self.path):
            return f"{self.path} row {self.index}"
        return f"{self.path} line {self.index + 1}"


def is_parquet(path: Path) -> bool:
    return path.name.lower().endswith(PARQUET_SUFFIXES)


def check_data_path(path: str | Path) -> Path:
    """The path as a Path, if it names a readable data file of a known format.

    Raises:
        UserError: missing, not a regular file, or not ``.jsonl``/``.ndjson``/``.parquet``.
    """
    path = Path(path)
    if not path.name.lower().endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES):
        raise UserError(f"data file {path} is neither JSONL (.jsonl, .ndjson) nor Parquet (.parquet)")
    if not path.exists():
        raise UserError(f"data file {path} does not exist")
    if not path.is_file():
        raise UserError(f"data file {path} is not a regular file")
    return path


def check_has_records(path: str | Path) -> Path:
    """The path as a Path, if it is a data file holding at least one record that is not a blank line.

    Why: an empty file (a failed export, a wrong glob) would make no shard, and the run would "succeed"
    with nothing extracted from it. Reads only up to the first non-blank line (or a Parquet footer).

    Raises:
        UserError: the file is unreadable, empty, or holds only blank lines (naming it).
    """
    path = check_data_path(path)
    if is_parquet(path):
        if _count_file(path) == 0:
            raise UserError(f"data file {path} holds no records (0 rows); nothing to extract from it: "
                            "leave it out of --data")
        return path
    num_lines = 0
    for record in _iter_jsonl(path, 0, None):
        if record.error != BLANK_LINE:
            return path
        num_lines += 1
    what = "is empty (0 bytes)" if num_lines == 0 and path.stat().st_size == 0 else "holds only blank lines"
    raise UserError(f"data file {path} {what}; nothing to extract from it: leave it out of --data")


def count_records(paths: Iterable[str | Path]) -> list[int]:
    """Records per file, without decoding any: newlines for JSONL, footer metadata for Parquet.

    Equals the number of records ``iter_file_records`` yields for each file.

    Raises:
        UserError: a file is missing, unreadable or not valid Parquet.
    """
    return [_count_file(check_data_path(p)) for p in paths]


def iter_file_records(path: str | Path, start: int = 0, stop: int | None = None, *,
                      max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[SourceRecord]:
    """Records ``start <= index < stop`` of one file; records before ``start`` are not decoded, nor is
    a record of more than ``max_record_bytes`` bytes (0: no bound): it comes with ``error`` ``too_large``.

    For Parquet, row groups outside the range are not read at all, so a worker that owns one shard
    of a large file does not pay for the rest.

    Raises:
        UserError: the file is missing, unreadable or not valid Parquet.
    """
    path = check_data_path(path)
    if is_parquet(path):
        return _iter_parquet(path, start, stop, max_record_bytes)
    return _iter_jsonl(path, start, stop, max_record_bytes)


def decode_jsonl_line(line: bytes, *, first: bool = False) -> tuple[dict[str, Any] | bytes, str | None]:
    """``(object, None)`` for a line holding a JSON object, else ``(line bytes, skip reason)``."""
    body = line[:-1] if line.endswith(b"\n") else line
    body = body[:-1] if body.endswith(b"\r") else body
    if first and body.startswith(_UTF8_BOM):
        body = body[len(_UTF8_BOM):]
    if not body.strip():
        return body, BLANK_LINE
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return body, INVALID_UTF8
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return body, MALFORMED_JSON
    if not isinstance(value, dict):
        return body, NOT_AN_OBJECT
    if nesting_depth(value) > MAX_NESTING:
        return body, MALFORMED_JSON
    return value, None


MAX_NESTING = 64  # no chat record nests deeper; deeper ones would overflow the recursion of json.dumps


def nesting_depth(value: Any) -> int:
    """Depth of nested lists/dicts, iteratively (a recursive walk is what such records break)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_NESTING:
                return depth
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _iter_jsonl(path: Path, start: int, stop: int | None, max_record_bytes: int = MAX_RECORD_BYTES
                ) -> Iterator[SourceRecord]:
    try:
        with open(path, "rb") as f:
            index = 0
            while stop is None or index < stop:
                line, whole = _read_line(f, max_record_bytes)  # binary mode splits on b"\n" only
                if not line:
                    return
                if index >= start:
                    if whole:
                        raw, error = decode_jsonl_line(line, first=index == 0)
                    else:
                        raw, error = line[:PREVIEW_BYTES], TOO_LARGE
                    yield SourceRecord(path, index, raw, error)
                index += 1
    except OSError as err:
        raise UserError(f"cannot read data file {path}: {err.strerror or err}") from None


def _read_line(f: Any, limit: int) -> tuple[bytes, bool]:
    """(the next line, True), or, for a line of more than ``limit`` bytes before its newline, (its first
    ``limit`` bytes, False) with the rest read past in bounded chunks, never held; (b"", True) at the end."""
    if not limit:
        return f.readline(), True
    line = f.readline(limit + 1)
    if len(line) <= limit or line.endswith(b"\n"):
        return line, True
    while (rest := f.readline(_SKIP_CHUNK_BYTES)) and not rest.endswith(b"\n"):
        pass
    return line[:limit], False


def _iter_parquet(path: Path, start: int, stop: int | None, max_record_bytes: int = MAX_RECORD_BYTES
                  ) -> Iterator[SourceRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        meta = pf.metadata
        end = meta.num_rows if stop is None else min(stop, meta.num_rows)
        first_row = 0
        for group in range(meta.num_row_groups):
            num_rows = meta.row_group(group).num_rows
            lo, hi = max(start, first_row), min(end, first_row + num_rows)
            if lo < hi:
                batch_start = first_row
                for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=[group]):
                    a, b = max(lo, batch_start), min(hi, batch_start + batch.num_rows)
                    if a < b:  # decode only the rows in range, and of those only rows within the bound
                        yield from _rows(path, batch.slice(a - batch_start, b - a), a, max_record_bytes)
                    batch_start += batch.num_rows
            first_row += num_rows
    except (OSError, pa.ArrowException) as err:
        raise UserError(f"cannot read Parquet data file {path}: {err}") from None


def _rows(path: Path, piece: Any, first: int, max_record_bytes: int) -> Iterator[SourceRecord]:
    """The rows of a Parquet record batch as records, numbered from ``first``; a row whose Arrow buffers
    hold more than ``max_record_bytes`` bytes is ``too_large`` and never made into Python objects."""
    sizes = [piece.slice(i, 1).nbytes for i in range(piece.num_rows)] if max_record_bytes else []
    if all(size <= max_record_bytes for size in sizes):
        for offset, row in enumerate(piece.to_pylist()):
            yield SourceRecord(path, first + offset, row)
        return
    for offset, size in enumerate(sizes):
        if size > max_record_bytes:
            yield SourceRecord(path, first + offset, b"", TOO_LARGE)
        else:
            yield SourceRecord(path, first + offset, piece.slice(offset, 1).to_pylist()[0])


def _count_file(path: Path) -> int:
    try:
        if is_parquet(path):
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                return pq.ParquetFile(path).metadata.num_rows
            except pa.ArrowException as err:
                raise UserError(f"cannot read Parquet data file {path}: {err}") from None
        num_lines, last = 0, b"\n"
        with open(path, "rb") as f:
            while chunk := f.read(_COUNT_CHUNK_BYTES):
                num_lines += chunk.count(b"\n")
                last = chunk[-1:]
        return num_lines + (last != b"\n")  # a final line without newline is a record too
    except OSError as err:
        raise UserError(f"cannot read data file {path}: {err.strerror or err}") from None
