"""Progress output of every long loop: a live bar on a terminal, a plain line now and then otherwise.

A tqdm bar redraws itself with carriage returns several times a second. On a terminal that is what a
person wants; in a log file (a batch job, `peagle demo > log`, CI) it is hundreds of frames glued into
one line. So the choice is made per stream: when it is a terminal, tqdm draws; when it is not, one
line is printed each time another ``every_percent`` of the total is done (or every
``every_seconds`` when the total is unknown), and one at the end. Lines carry the same numbers the
bar shows (done/total, percent, elapsed, rate) and the caller's postfix (loss, shard, ...).

Progress goes to stderr by default, like tqdm's: stdout stays for results a script may parse.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO, TypeVar

T = TypeVar("T")

EVERY_PERCENT = 10
"""Non-terminal streams: a line each time another this many percent of the total is done."""
EVERY_SECONDS = 60.0
"""Non-terminal streams, unknown total: a line at most this often."""


def library_bars_enabled() -> bool:
    """Whether libraries' own progress bars should draw: not when ``TQDM_DISABLE`` is set.

    ``TQDM_DISABLE`` is tqdm's own switch (``peagle`` sets it unless ``--verbose``), but it cannot reach
    a bar created with an explicit ``disable=``, such as vLLM's weight-loading bar; pass this to
    vLLM's ``use_tqdm_on_load`` instead.
    """
    return os.environ.get("TQDM_DISABLE", "").lower() not in ("1", "true", "yes")


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is an interactive terminal (closed or odd streams count as not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.4g}"


def _clock_text(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class Progress:
    """One progress display for a loop of ``total`` units (``None``: unknown).

    Use ``update(n)`` after each piece of work, ``set_postfix(text)`` for live figures, and
    ``close()`` at the end (or use it as a context manager). ``enabled=False`` prints nothing.
    """

    def __init__(self, total: float | None = None, *, desc: str, unit: str = "it", initial: int = 0,
                 enabled: bool = True, stream: TextIO | None = None, every_percent: float = EVERY_PERCENT,
                 every_seconds: float = EVERY_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total if total else None
        self.desc, self.unit, self.n = desc, unit, initial
        self.enabled = enabled
        self.postfix = ""
        self._stream = stream if stream is not None else sys.stderr
        self._every_percent, self._every_seconds, self._clock = every_percent, every_seconds, clock
        self._start = self._last_line_time = clock()
        self._start_n = initial
        self._last_line_n = initial
        self._mark = self._mark_of(initial)
        self._bar = None
        if enabled and is_terminal(self._stream):
            from tqdm import tqdm

            # disable=False explicitly: the peagle command sets TQDM_DISABLE for libraries' own bars
            self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=self._stream,
                             dynamic_ncols=True, disable=False)

    def _mark_of(self, n: float) -> int:
        """How many whole ``every_percent`` steps of the total ``n`` has passed."""
        if self.total is None:
            return 0
        return int(100 * min(n, self.total) / self.total // self._every_percent)

    def update(self, n: float = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled:
            mark = self._mark_of(self.n)
            if self.total is not None and mark > self._mark:
                self._mark = mark
                self._line()
            elif self.total is None and self._clock() - self._last_line_time >= self._every_seconds:
                self._line()

    def write(self, line: str) -> None:
        """A line of its own: above a live bar (which redraws below it), or plain when there is none."""
        if self._bar is not None:
            self._bar.write(line, file=self._stream)
        elif self.enabled:
            print(line, file=self._stream, flush=True)

    def set_postfix(self, text: str) -> None:
        """Figures shown after the counts (the bar's postfix; the next line's tail)."""
        self.postfix = text
        if self._bar is not None:
            self._bar.set_postfix_str(text)

    def _line(self) -> None:
        now = self._clock()
        elapsed = now - self._start
        rate = (self.n - self._start_n) / elapsed if elapsed > 0 else 0.0
        count = f"{_number(self.n)}/{_number(self.total)} {self.unit} ({int(100 * self.n / self.total)}%)" \
            if self.total is not None else f"{_number(self.n)} {self.unit}"
        tail = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {count}, {_clock_text(elapsed)} elapsed, {rate:.3g} {self.unit}/s{tail}",
              file=self._stream, flush=True)
        self._last_line_time, self._last_line_n = now, self.n

    def close(self) -> None:
        """End the display: the bar's last frame, or a last line unless the newest one says it all."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and self.n != self._last_line_n:
            self._line()
        self.enabled = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def track(iterable: Iterable[T], *, desc: str, unit: str = "it", total: float | None = None,
          enabled: bool = True, stream: TextIO | None = None) -> Iterator[T]:
    """Yield from ``iterable`` with a ``Progress`` over it (``total`` defaults to its ``len``)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    with Progress(total, desc=desc, unit=unit, enabled=enabled, stream=stream) as progress:
        for item in iterable:
            yield item
            progress.update(1)
