"""prefetch: same items, same order, the generator's exception at the same point, and a consumer
that stops early stops the background thread."""

from __future__ import annotations

import threading

import pytest

from peagle.pipeline.prefetch import prefetch


def test_items_in_order_and_the_error_where_it_was_raised():
    def items():
        yield from range(5)
        raise ValueError("bad record at 5")

    seen = []
    with pytest.raises(ValueError, match="bad record at 5"):
        for x in prefetch(items(), depth=2):
            seen.append(x)
    assert seen == [0, 1, 2, 3, 4]


def test_the_producer_runs_ahead_by_at_most_depth():
    produced = []

    def items():
        for i in range(100):
            produced.append(i)
            yield i

    it = prefetch(items(), depth=2)
    assert next(it) == 0
    threading.Event().wait(0.2)
    assert len(produced) <= 1 + 2 + 1  # the consumed one, the queue, one blocked in put
    it.close()  # an early stop joins the thread
    assert not any(t.name == "peagle-prefetch" for t in threading.enumerate())


def test_empty_input():
    assert list(prefetch(iter([]))) == []
