"""Run a generator ahead of its consumer on a background thread (bounded), errors included.

Extract prepares shard s+1 (read, template, tokenize: CPU work) while the accelerator computes shard
s. Items come out in the generator's order and an exception comes out at the point where the
generator raised it, so the consumer sees exactly what a plain ``for`` loop would.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


class _Raised:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def prefetch(items: Iterable[T], depth: int = 1) -> Iterator[T]:
    """Yield ``items`` while a thread computes up to ``depth`` items ahead.

    If the consumer stops early (an exception, ``close``), the thread stops at its next item.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(value) -> bool:
        while not stop.is_set():
            try:
                q.put(value, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
        except BaseException as err:  # handed over to the consumer, raised there
            put(_Raised(err))
            return
        put(_DONE)

    thread = threading.Thread(target=produce, name="peagle-prefetch", daemon=True)
    thread.start()
    try:
        while (value := q.get()) is not _DONE:
            if isinstance(value, _Raised):
                raise value.error
            yield value
    finally:
        stop.set()
        thread.join()
