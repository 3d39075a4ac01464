"""Writing and committing one shard (docs/store.md, "Committing one shard"): **the protocol is written
here only**. Extract's writer, `peagle store convert` and the planted faults of
:mod:`peagle.testing.store_faults` all commit through :func:`write_and_commit_shard`; what they write
into the two files is theirs (:mod:`peagle.pipeline.shard_parquet`, :mod:`peagle.pipeline.shard_tensors`,
or a byte copy).

The protocol: the Parquet file, then the tensor file, each written under a temp name, measured (size,
sha256, crc32 per block) and renamed into place (``write_shard_file``); then the commit record
holding those measures (``commit_shard``), from which on the shard exists. When the second file
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
from typing import Callable, NamedTuple

from peagle.pipeline.atomic import atomic_write_json, publish, raise_if_disk_full, temp_path_for
from peagle.pipeline.contained import inside
from peagle.pipeline.content_check import file_digests
from peagle.pipeline.failpoints import failpoint
from peagle.pipeline.store import rebuild_manifest
from peagle.schemas import store as S

FileWriter = Callable[[Path], None]
"""``write(tmp_path)``: writes one shard file's whole content at ``tmp_path``."""


class ShardFile(NamedTuple):
    """A published shard file as its commit record describes it."""

    size: int
    sha256: str
    crc32: tuple[str, ...]  # per CRC32_BLOCK_BYTES block


def write_shard_file(root: Path, rel: str, write) -> ShardFile:
    """Write one shard file via ``write(tmp_path)``, publish it atomically; returns its size and digests
    (measured on the temp file, before the rename)."""
    final = inside(root, rel)
    tmp = temp_path_for(final)
    try:
        write(tmp)
        failpoint("extract.write")
        size, (digest, crc) = tmp.stat().st_size, file_digests(tmp)
        publish(tmp, final)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise_if_disk_full(err, final)
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return ShardFile(size, digest, crc)


def commit_shard(root: str | os.PathLike, record: S.ShardRecord) -> None:
    """Make a shard visible: write its commit record atomically, then refresh the manifest.

    The shard's two files must already be in place (``write_shard_file``). A crash before the
    commit record leaves files that no reader sees; the re-run rewrites them identically.
    """
    root = Path(root)
    failpoint("extract.before_commit")
    atomic_write_json(root / S.commit_name(record.index), record.to_dict())
    failpoint("extract.after_commit")
    rebuild_manifest(root)


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
