"""Shard files' content checksums (docs/store.md): computed at commit, checked on read, block by block.

A shard file's commit record holds zlib's crc32 of each ``CRC32_BLOCK_BYTES`` block of it
(:func:`file_digests`, in the same read as its sha256). A reader compares the blocks it reads with
them the first time it reads them (:func:`check_blocks`, through ``Store.check_content``), so a byte
changed after the commit stops it before anything uses the byte.

Why it is cheap enough to be on by default:

* **only what is read, once.** :class:`ContentChecks` remembers which blocks passed, in anonymous
  shared memory that the DataLoader workers forked from the process that opened the store share with
  it: each block is checked once per opened store (one epoch of a run pays, the next ones do not),
  by whichever process reads it first, and a loader pays for a shard batch by batch instead of
  stalling on the whole file;
* **over the map the reader reads anyway**: the sum pages the rows in for the reads that follow;
* **on several cores.** A block's crc is the combination (:func:`crc32_combine`) of the crc32s of its
  ``PIECE_BYTES`` pieces, computed on a small thread pool (zlib lets go of the GIL while it sums), so
  a worker waits ~1/``NUM_THREADS`` of a sequential check: zlib's crc32 runs at ~2 to 6 GB/s per
  core depending on how it was built, which alone would cost a loader worker tens of ms per batch.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

from peagle.schemas import store as S

PIECE_BYTES = 4 << 20
"""A block is summed in pieces of this many bytes, in parallel, then combined."""
NUM_THREADS = 4
"""Threads per process that sum pieces (each DataLoader worker has its own, started on first use)."""


def file_digests(path: str | os.PathLike, chunk: int = 1 << 22) -> tuple[str, tuple[str, ...]]:
    """(sha256, crc32 of each ``CRC32_BLOCK_BYTES`` block, 8 hex digits each) of a file, in one read:
    committing and ``peagle store verify`` pay for one pass, not two. An empty file has one block."""
    chunk = min(chunk, S.CRC32_BLOCK_BYTES)
    assert S.CRC32_BLOCK_BYTES % chunk == 0
    h, crcs, crc, in_block = hashlib.sha256(), [], 0, 0
    with open(path, "rb") as f:
        while piece := f.read(chunk):
            h.update(piece)
            crc, in_block = zlib.crc32(piece, crc), in_block + len(piece)
            if in_block == S.CRC32_BLOCK_BYTES:
                crcs.append(f"{crc:08x}")
                crc, in_block = 0, 0
    if in_block or not crcs:
        crcs.append(f"{crc:08x}")
    return h.hexdigest(), tuple(crcs)


# --------------------------------------------------------------------------------------------------
# Which blocks passed


class ContentChecks:
    """Which checksummed blocks of an opened store's files passed: one byte per block in anonymous
    shared memory (module docstring). Two processes that read a block at the same moment may both
    check it; that only costs."""

    def __init__(self, first_slot: dict[tuple[int, str], int], num_slots: int):
        self._first_slot = first_slot  # (shard index, file) -> the slot of its block 0
        self._passed = mmap.mmap(-1, max(1, num_slots))  # MAP_SHARED: forked children write into it

    @classmethod
    def of(cls, records: list[S.ShardRecord]) -> "ContentChecks":
        first_slot, num_slots = {}, 0
        for r in records:
            for rel in (r.parquet, r.safetensors):
                first_slot[(r.index, rel)] = num_slots
                num_slots += len(r.crc32_of(rel))
        return cls(first_slot, num_slots)

    def __reduce__(self) -> tuple:
        # A spawned (not forked) process cannot share the map: it starts with nothing checked.
        return (ContentChecks, (self._first_slot, len(self._passed)))

    def passed(self, index: int, rel: str, block: int) -> bool:
        return self._passed[self._first_slot[(index, rel)] + block] == 1

    def mark(self, index: int, rel: str, block: int) -> None:
        self._passed[self._first_slot[(index, rel)] + block] = 1


def blocks_touched(ranges: Iterable[tuple[int, int]]) -> list[int]:
    """The blocks that byte ranges ``[start, stop)`` touch, in order."""
    size = S.CRC32_BLOCK_BYTES
    return sorted({b for start, stop in ranges if stop > start for b in range(start // size, (stop - 1) // size + 1)})


def check_blocks(checks: ContentChecks, index: int, rel: str, want: tuple[str, ...], data: Any,
                 blocks: Iterable[int] | None = None) -> str | None:
    """Compare ``blocks`` (every one when None) of shard ``index``'s file ``rel``, whose bytes are
    ``data``, with their recorded crc32s ``want``, skipping blocks that passed; marks those that pass.

    Returns:
        None when all pass, else what differs, in words (the file's size or the first bad block).
    """
    size = S.CRC32_BLOCK_BYTES
    if len(want) != max(1, -(-len(data) // size)):
        return f"{len(data)} bytes, its commit record has checksums of {len(want)} blocks"
    view = memoryview(data)
    try:
        for b in range(len(want)) if blocks is None else blocks:
            if checks.passed(index, rel, b):
                continue
            got = block_crc32(view[b * size:(b + 1) * size])
            if got != want[b]:
                return (f"bytes {b * size:,} to {min((b + 1) * size, len(data)):,}: crc32 {got}, its commit record "
                        f"says {want[b]}")
            checks.mark(index, rel, b)
    finally:
        view.release()
    return None


# --------------------------------------------------------------------------------------------------
# One block's crc32, on several threads


def block_crc32(view: memoryview) -> str:
    """zlib's crc32 of ``view`` (8 hex digits): its whole pieces summed on the thread pool and combined,
    the tail continued from them."""
    num_whole = len(view) // PIECE_BYTES
    if num_whole < 2:
        return f"{zlib.crc32(view):08x}"
    pieces = [view[i * PIECE_BYTES:(i + 1) * PIECE_BYTES] for i in range(num_whole)]
    try:
        crcs = list(_pool().map(zlib.crc32, pieces))
    finally:
        for piece in pieces:
            piece.release()
    crc = crcs[0]
    for piece_crc in crcs[1:]:
        crc = crc32_combine(crc, piece_crc, PIECE_BYTES)
    return f"{zlib.crc32(view[num_whole * PIECE_BYTES:], crc):08x}"


_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """This process's pool (a forked DataLoader worker inherits its parent's object, not its threads)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), ThreadPoolExecutor(NUM_THREADS, thread_name_prefix="peagle-crc32"))
        return _POOL[1]


_SHIFT: dict[int, tuple[int, ...]] = {}


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32(A + B) from crc1 = crc32(A), crc2 = crc32(B) and len(B), as zlib's ``crc32_combine``.

    ``zlib.crc32(B, c) ^ zlib.crc32(B)`` is a linear function of ``c`` over GF(2) that depends on B's
    length only (:func:`_shift`); crc32(A + B) = ``zlib.crc32(B, crc1)``, so it is that function of
    crc1, xor crc2.
    """
    return _apply(_shift(len2), crc1) ^ crc2


def _shift(length: int) -> tuple[int, ...]:
    """The matrix (one column per bit) of ``c -> zlib.crc32(B, c) ^ zlib.crc32(B)`` for ``length``
    bytes B: from sums over zero bytes up to 64 KiB, squared above (a few ms, once per length and
    process)."""
    columns = _SHIFT.get(length)
    if columns is None:
        if length <= 1 << 16 or length % 2:
            zeros = bytes(length)
            base = zlib.crc32(zeros)
            columns = tuple(zlib.crc32(zeros, 1 << bit) ^ base for bit in range(32))
        else:
            half = _shift(length // 2)
            columns = tuple(_apply(half, column) for column in half)
        _SHIFT[length] = columns
    return columns


def _apply(columns: tuple[int, ...], value: int) -> int:
    out, bit = 0, 0
    while value:
        if value & 1:
            out ^= columns[bit]
        value >>= 1
        bit += 1
    return out


__all__ = ["ContentChecks", "NUM_THREADS", "PIECE_BYTES", "block_crc32", "blocks_touched", "check_blocks",
           "crc32_combine", "file_digests"]
