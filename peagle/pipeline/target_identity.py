"""Which target weights a store was made from: the content hash extract records and train checks.

A store's hidden states and top-k are only right for the exact target that produced them. Names
and shapes are not enough: a fine-tune, or the same architecture trained from another seed, has the
same config and weight files of the same sizes. Hashing every byte would read the whole target
(16 GB for an 8B model) on every run, so the hash covers ``config.json``, each weight file's name
and size, and a few evenly spaced samples of its bytes: other weights differ in practically every
tensor, so the samples catch them, and reading them costs a few MiB.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
NUM_SAMPLES = 16
"""Samples per weight file, evenly spaced from its first to its last byte."""
SAMPLE_BYTES = 1 << 16


def target_content_hash(root: str | os.PathLike) -> str:
    """sha256 over config.json and, per weight file (sorted by name), its name, size and byte samples."""
    root = Path(root)
    h = hashlib.sha256((root / "config.json").read_bytes())
    for p in sorted(root.iterdir()):
        if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES):
            size = p.stat().st_size
            h.update(f"\n{p.name}\t{size}\n".encode())
            with open(p, "rb") as f:
                for i in range(NUM_SAMPLES):
                    h.update(os.pread(f.fileno(), SAMPLE_BYTES, _sample_offset(i, size)))
    return h.hexdigest()


def _sample_offset(i: int, size: int) -> int:
    """Start of sample ``i``: the first begins at byte 0, the last ends at the file's end."""
    return (max(size - SAMPLE_BYTES, 0) * i) // (NUM_SAMPLES - 1)
