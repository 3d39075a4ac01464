"""A shard's Parquet file (docs/store.md): its Arrow schema, the table of a shard's samples, the file
written and read. **The file's types and settings are known here only** (the column names are
``schemas.store.PARQUET_COLUMNS``); the twin of :mod:`peagle.pipeline.shard_tensors`.

:func:`parquet_table` turns a shard's samples into its one-row-per-sample table (extract's writer),
:func:`write_parquet` writes it with fixed settings so that the same rows give the same bytes (a
killed and resumed run, or n workers instead of one, give the same store: docs/reliability.md), and
:func:`read_shard_rows` reads a committed shard's table (or some of its columns), its content checked
whole against the commit record first. What the columns mean, sample by sample and token by token, is
:mod:`peagle.pipeline.raw_reader` (as stored) and :mod:`peagle.pipeline.store_reader` (in training
coordinates).

A new column: its name in ``PARQUET_COLUMNS``, its type in :data:`PARQUET_SCHEMA`, its value in
:func:`parquet_table` (from a field of :class:`ParquetSample`, which extract's samples then carry).
"""

from __future__ import annotations

import itertools
import mmap
from pathlib import Path
from typing import Protocol, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from peagle.pipeline.store import Store, damaged, shard_file
from peagle.schemas import store as S

PARQUET_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("source", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.uint8())),
    ("num_tokens", pa.int64()),
    ("token_offset", pa.int64()),
])
assert tuple(PARQUET_SCHEMA.names) == S.PARQUET_COLUMNS


class ParquetSample(Protocol):
    """What a shard's row is made from (extract's ``TokenizedSample`` is one)."""

    sample_id: str
    source: str
    input_ids: list[int]
    loss_mask: list[int]


def parquet_table(samples: Sequence[ParquetSample]) -> pa.Table:
    """One row per sample (docs/store.md); ``token_offset`` is the sample's first row in the tensors."""
    lengths = [len(s.input_ids) for s in samples]
    offsets = list(itertools.accumulate(lengths, initial=0))[:-1]
    return pa.table({
        "sample_id": [s.sample_id for s in samples],
        "source": [s.source for s in samples],
        "input_ids": [s.input_ids for s in samples],
        "loss_mask": [s.loss_mask for s in samples],
        "num_tokens": lengths,
        "token_offset": offsets,
    }, schema=PARQUET_SCHEMA)


def write_parquet(table: pa.Table, path: str | Path) -> None:
    """Fixed settings only: same rows, same pyarrow version -> same bytes."""
    pq.write_table(table, path, compression="zstd", compression_level=3, use_dictionary=False,
                   write_statistics=False, row_group_size=max(1, table.num_rows), data_page_version="2.0")


def read_shard_rows(store: Store, index: int, columns: list[str] | None = None) -> pa.Table:
    """Shard ``index``'s Parquet table, optionally only some columns; the file's content is checked
    first (``Store.check_content``, on the same mapping the table is read from).

    Raises:
        UserError: the file differs from its commit record, or does not parse (one line naming it).
    """
    rel = store.shard(index).parquet
    path = shard_file(store.root, store.shard(index), "parquet")
    try:
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as err:  # ValueError: an empty file cannot be mapped
        raise damaged(path, err) from err
    store.check_content(index, rel, data)
    try:
        return pq.read_table(pa.BufferReader(pa.py_buffer(data)), columns=columns)
    except (OSError, pa.ArrowException) as err:
        raise damaged(path, err) from err


__all__ = ["PARQUET_SCHEMA", "ParquetSample", "parquet_table", "read_shard_rows", "write_parquet"]
