"""The safetensors file format, read and written without copying: the one parser of its header.

A safetensors file is a u64 little-endian header length, a JSON header (per tensor: dtype, shape,
byte offsets from the end of the header), then the raw little-endian tensor bytes. The shard store
writes its tensor files through :func:`encode_header` (streaming rows, no concatenated copy) and
reads them through :func:`read_header` / :func:`map_tensors` (memory-mapped, no read); the files
stay loadable by the ``safetensors`` library itself.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
    "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


def encode_header(layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> bytes:
    """The safetensors header (u64 length + JSON, padded to 8 bytes) for tensors laid out in order."""
    header, offset = {}, 0
    for name, (shape, dtype) in layout.items():
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are (absolute file offset)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0


def read_header(path: str | os.PathLike) -> dict[str, TensorEntry]:
    """Parse a safetensors header: u64 little-endian length, JSON, then the data (offsets from its start)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        size = os.fstat(f.fileno()).st_size
        if header_len > size - 8:
            raise ValueError(f"header length {header_len} exceeds the file's {size} bytes")
        return _entries(header_len, f.read(header_len), size)


def _header_of(data: Any) -> dict[str, TensorEntry]:
    """:func:`read_header` of a whole file in memory (a map of it)."""
    (header_len,) = struct.unpack_from("<Q", data, 0)
    if header_len > len(data) - 8:
        raise ValueError(f"header length {header_len} exceeds the file's {len(data)} bytes")
    return _entries(header_len, data[8:8 + header_len], len(data))


def _entries(header_len: int, text: bytes, size: int) -> dict[str, TensorEntry]:
    header = json.loads(text)
    base = 8 + header_len
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        entries[name] = TensorEntry(DTYPES[meta["dtype"]], tuple(meta["shape"]), base + start, end - start)
        if base + end > size:
            raise ValueError(f"tensor {name} ends at byte {base + end}, past the file's {size} bytes")
    return entries


@dataclass(frozen=True)
class MappedFile:
    """A safetensors file mapped: the map, where each tensor lies in it, and the tensors (views of it)."""

    data: mmap.mmap
    entries: dict[str, TensorEntry]
    tensors: dict[str, Tensor]


def map_file(path: str | os.PathLike, check: Callable[[mmap.mmap], None] | None = None) -> MappedFile:
    """Map a safetensors file into tensors without reading it: pages load on first touch.

    ``safetensors.torch.load_file`` copies every tensor into RAM; a loader over an 8B-shaped store
    (~24 KiB/token) cannot afford that per shard. The mapping is private copy-on-write. ``check``
    (a shard's content check) sees the whole mapping before its header is parsed, so that changed
    bytes are reported as such rather than as whatever they break.
    """
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if check is not None:
        check(mm)
    entries = _header_of(mm)
    out = {}
    for name, e in entries.items():
        count = e.nbytes // e.dtype.itemsize
        t = torch.frombuffer(mm, dtype=e.dtype, count=count, offset=e.offset) if count else torch.empty(0, dtype=e.dtype)
        out[name] = t.view(e.shape)
    return MappedFile(mm, entries, out)


def map_tensors(path: str | os.PathLike, check: Callable[[mmap.mmap], None] | None = None) -> dict[str, Tensor]:
    """The tensors of :func:`map_file`."""
    return map_file(path, check).tensors
