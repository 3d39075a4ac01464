"""The held-out split: a stable fraction of sample ids, decided by the id alone."""

from __future__ import annotations

import hashlib

from peagle.pipeline.split import is_heldout


def test_a_stable_fraction_is_held_out():
    ids = [f"sample-{i}" for i in range(4000)]
    held = [s for s in ids if is_heldout(s, 0.25)]
    assert 0.22 < len(held) / len(ids) < 0.28
    assert held == [s for s in ids if is_heldout(s, 0.25)]  # the same on every call
    assert not any(is_heldout(s, 0.0) for s in ids) and all(is_heldout(s, 1.0) for s in ids)


def test_a_larger_fraction_holds_out_a_superset():
    ids = [f"id-{i}" for i in range(2000)]
    small = {s for s in ids if is_heldout(s, 0.1)}
    assert small < {s for s in ids if is_heldout(s, 0.3)}


def test_the_rule_is_the_sha256_of_the_id():
    """The split is part of the run's contract (eval re-derives it): pin the rule itself."""
    for sample_id in ("a", "sample-17", "ü"):
        value = int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "little") / 2.0 ** 64
        assert is_heldout(sample_id, value + 1e-6) and not is_heldout(sample_id, value - 1e-6)
