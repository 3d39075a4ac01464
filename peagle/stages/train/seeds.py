"""Seeds derived from keys: the one recipe every seed of a training run that is not the run's own
``--seed`` comes from (a sample's COD draw, a rank's own stream).

sha256 over a JSON encoding of the key (unambiguous, unlike string concatenation; stable across
processes and machines, unlike Python's salted ``hash()``), truncated to 63 bits (a non-negative
int64, which every seeding API takes).
"""

from __future__ import annotations

import hashlib
import json


def stable_seed(*key: int | str) -> int:
    """A 63-bit seed that depends on ``key`` and on nothing else."""
    return int.from_bytes(hashlib.sha256(json.dumps(list(key)).encode()).digest()[:8], "little") >> 1
