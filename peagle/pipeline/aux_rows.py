"""A batch's aux rows in their stored encoding: in memory (:class:`StoredAux`) and on disk
(:class:`AuxSource`, byte ranges that the trainer process reads straight into pinned memory).

Shared by the readers (:mod:`peagle.pipeline.raw_reader`, :mod:`peagle.pipeline.store_reader`, which
re-exports both) and the tensor file (:mod:`peagle.pipeline.shard_tensors`, where the shard layout is
known). An fp8 store's rows stay fp8 codes
plus float32 scales from the file to the training device, and are dequantised only there
(:mod:`peagle.pipeline.fp8`): half the bytes of a bf16 store on every hop.

Shape letters: T rows, A aux layers, H hidden size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from peagle.pipeline import fp8

ByteRange = tuple[str, int, int]
"""(safetensors path, byte offset, byte count)"""


@dataclass(frozen=True)
class StoredAux:
    """Aux rows as the store holds them: bf16 states (``scale_TA`` None), or fp8 codes with one float32
    scale per (row, layer). Slicing rows keeps the encoding; :meth:`states` decodes."""

    values_TAH: Tensor
    scale_TA: Tensor | None = None

    def __getitem__(self, rows: slice | Tensor) -> "StoredAux":
        values = self.values_TAH
        if isinstance(rows, Tensor) and values.dtype == fp8.FP8_DTYPE:
            # Gather fp8 codes as bytes: index kernels are not registered for float8 on every device.
            values = values.view(torch.uint8)[rows].view(fp8.FP8_DTYPE)
        else:
            values = values[rows]
        return StoredAux(values, None if self.scale_TA is None else self.scale_TA[rows])

    @property
    def num_rows(self) -> int:
        return int(self.values_TAH.shape[0])

    def states(self) -> Tensor:
        """The aux states ``[T, A, H]`` in bf16 (a view, for a bf16 store)."""
        if self.scale_TA is None:
            return self.values_TAH
        return fp8.dequantize(self.values_TAH, self.scale_TA)


def _read_ranges(reads: tuple[ByteRange, ...], out: Tensor) -> Tensor:
    """Fill contiguous CPU ``out`` with the byte ranges, in order; the GIL is released while the kernel copies."""
    assert out.is_contiguous()
    buffer = memoryview(out.view(-1).view(torch.uint8).numpy())
    pos = 0
    for path, offset, nbytes in reads:
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < nbytes:
                got = os.preadv(fd, [buffer[pos + done:pos + nbytes]], offset + done)
                if got <= 0:
                    raise OSError(f"{path}: file ended at byte {offset + done}, expected {offset + nbytes}")
                done += got
        finally:
            os.close(fd)
        pos += nbytes
    assert pos == buffer.nbytes, "aux reads do not cover the batch"
    return out


@dataclass(frozen=True)
class AuxSource:
    """Where a batch's aux rows lie on disk: one contiguous byte range per sample, in row order (and, for
    an fp8 store, one per sample of its ``aux_scale`` rows).

    A DataLoader worker hands this over instead of the rows (peagle.stages.train.batch explains
    why); :meth:`read` reads them in the trainer process straight into (pinned) memory, encoded as
    stored: an fp8 batch moves half the bytes from disk to the device.
    """

    shape: tuple[int, ...]  # (T, A, H)
    dtype: torch.dtype  # as stored: bf16 or float8_e4m3fn
    reads: tuple[ByteRange, ...]
    scale_reads: tuple[ByteRange, ...] | None = None  # fp8: the [T, A] float32 scales

    def new_buffer(self, *, pin: bool = False) -> Tensor:
        return torch.empty(self.shape, dtype=self.dtype, pin_memory=pin)

    def read_into(self, out_TAH: Tensor, out_scale_TA: Tensor | None = None) -> StoredAux:
        """Fill ``out_TAH`` (contiguous, CPU) with the stored rows, and for an fp8 batch ``out_scale_TA``
        with their scales (fresh memory when None)."""
        assert tuple(out_TAH.shape) == tuple(self.shape) and out_TAH.dtype == self.dtype
        values_TAH = _read_ranges(self.reads, out_TAH)
        if self.scale_reads is None:
            return StoredAux(values_TAH)
        if out_scale_TA is None:
            out_scale_TA = torch.empty(self.shape[:2], dtype=fp8.SCALE_DTYPE)
        return StoredAux(values_TAH, _read_ranges(self.scale_reads, out_scale_TA))

    def read(self, *, pin: bool = False) -> StoredAux:
        """The batch's rows as stored, in fresh (pinned) memory."""
        scale_TA = None if self.scale_reads is None else torch.empty(self.shape[:2], dtype=fp8.SCALE_DTYPE,
                                                                       pin_memory=pin)
        return self.read_into(self.new_buffer(pin=pin), scale_TA)

    @property
    def num_bytes(self) -> int:
        """Bytes this batch reads (rows, and scales for fp8)."""
        return sum(n for _, _, n in self.reads) + sum(n for _, _, n in self.scale_reads or ())

__all__ = ["AuxSource", "ByteRange", "StoredAux"]
