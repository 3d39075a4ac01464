"""The held-out split of a store: which samples training leaves out for evaluation.

The split is a pure function of the sample's ``sample_id`` (docs/store.md: a hash of the source record
and its position, stable across re-extractions), not of its place in the store. So the same samples
are held out on every rank, worker count, resume and shard layout; a store extended with more data
keeps its earlier split; and ``peagle eval`` picks out exactly the samples a training run held out
from the store and the fraction alone, with no list of ids passed between the stages.
"""

from __future__ import annotations

import hashlib


def is_heldout(sample_id: str, fraction: float) -> bool:
    """True for a stable ``fraction`` of sample ids: the first 8 bytes of sha256(id) below ``fraction · 2⁶⁴``."""
    if fraction <= 0:
        return False
    return int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "little") < fraction * 2.0 ** 64
