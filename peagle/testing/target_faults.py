"""A target changed where its sampled content hash does not look (tests of the full weights hash).

``content_hash`` reads ``NUM_SAMPLES`` windows of ``SAMPLE_BYTES`` per weight file; a change between
them passed as the same target until stores recorded ``weights_sha256`` (docs/reliability.md).
"""

from __future__ import annotations

import struct
from pathlib import Path

from peagle.model.target.directory import NUM_SAMPLES, SAMPLE_BYTES, _sample_offset


def flip_an_unsampled_byte(weights_file: str | Path) -> int:
    """Flip the lowest bit of a tensor byte of a safetensors file that no content-hash sample covers
    (the middle of the widest gap after the header); returns its offset.

    Raises:
        AssertionError: the file is small enough for the samples to cover every byte.
    """
    path = Path(weights_file)
    data = bytearray(path.read_bytes())
    header_end = 8 + struct.unpack("<Q", bytes(data[:8]))[0]
    windows = sorted((_sample_offset(i, len(data)), _sample_offset(i, len(data)) + SAMPLE_BYTES)
                     for i in range(NUM_SAMPLES))
    gaps = [(max(a_end, header_end), b_start) for (_, a_end), (b_start, _) in zip(windows, windows[1:])]
    start, stop = max(gaps, key=lambda gap: gap[1] - gap[0])
    assert stop > start, f"{path}: the content-hash samples cover every byte ({len(data):,} bytes)"
    offset = (start + stop) // 2
    data[offset] ^= 1
    path.write_bytes(bytes(data))
    return offset
