"""Writing and committing one shard (docs/store.md, "Committing one shard"): **the protocol is written
here only**. Extract's writer, `peagle store convert` and the planted faults of
:mod:`peagle.testing.store_faults` all commit through :func:`write_and_commit_shard`; what they write
into the two files is theirs (:mod:`peagle.pipeline.shard_parquet`, :mod:`peagle.pipeline.shard_tensors`,
or a byte copy).

The protocol: the Parquet file, then the tensor file, each written under a temp name, measured (size,
sha256, crc32 per block) and renamed into place (``store.write_shard_file``); then the commit record
holding those measures (``store.commit_shard``), from which on the shard exists. When the second file
cannot be written, the first is removed again, also on an interrupt (``BaseException``: Ctrl-C's
KeyboardInterrupt, a SystemExit): readers would ignore it (no commit record), but a half shard is
not even left on disk. A SIGKILL leaves one, and a failure between the second rename
and the commit record leaves both files (``extract.before_commit``): no reader looks at them, and the
re-run writes them again, byte for byte (docs/reliability.md). Every path written or removed is
``contained.inside`` the store.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Callable

from peagle.pipeline.contained import inside
from peagle.pipeline.store import commit_shard, write_shard_file
from peagle.schemas import store as S

FileWriter = Callable[[Path], None]
"""``write(tmp_path)``: writes one shard file's whole content at ``tmp_path``."""


def write_and_commit_shard(root: str | os.PathLike, record: S.ShardRecord, *, write_rows: FileWriter | None,
                           write_tensors: FileWriter) -> S.ShardRecord:
    """Write shard ``record.index``'s two files under the names ``record`` gives (``parquet``,
    ``safetensors``), then commit ``record`` with their sizes, sha256 and crc32 (what it held for
    them is replaced). Returns the committed record.

    ``write_rows`` None: the shard's Parquet file stays the one already committed, and ``record``'s
    measures of it stand (a shard whose tensors alone are rewritten: ``store_faults.rewrite_shard``).

    Raises:
        UserError: a full disk (one line), a name that leads outside the store.
    """
    root = Path(root)
    rows = None if write_rows is None else write_shard_file(root, record.parquet, write_rows)
    try:
        tensors = write_shard_file(root, record.safetensors, write_tensors)
    except BaseException:  # an interrupt too (module docstring)
        if rows is not None:
            inside(root, record.parquet).unlink(missing_ok=True)
        raise
    if rows is not None:
        record = replace(record, parquet_bytes=rows.size, parquet_sha256=rows.sha256, parquet_crc32=rows.crc32)
    record = replace(record, safetensors_bytes=tensors.size, safetensors_sha256=tensors.sha256,
                     safetensors_crc32=tensors.crc32)
    commit_shard(root, record)
    return record


__all__ = ["FileWriter", "write_and_commit_shard"]
