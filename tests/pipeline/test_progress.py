"""Progress output: tqdm's bar on a real pseudo-terminal, plain lines every 10% on a pipe or file."""

from __future__ import annotations

import fcntl
import io
import os
import struct
import subprocess
import sys
import termios
import textwrap

from peagle.pipeline.progress import Progress, is_terminal, library_bars_enabled, track


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_not_a_terminal_prints_one_line_per_ten_percent_and_no_carriage_return():
    stream = io.StringIO()
    clock = FakeClock()
    with Progress(40, desc="extract", unit="rec", stream=stream, clock=clock) as bar:
        for i in range(40):
            clock.now += 0.5
            if i == 19:
                bar.set_postfix("shard 3 committed")
            bar.update(1)
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 10, text
    assert lines[0] == "extract: 4/40 rec (10%), 0:00:02 elapsed, 2 rec/s"
    assert lines[4] == "extract: 20/40 rec (50%), 0:00:10 elapsed, 2 rec/s, shard 3 committed"
    assert lines[-1] == "extract: 40/40 rec (100%), 0:00:20 elapsed, 2 rec/s, shard 3 committed"


def test_a_written_line_stands_alone_between_progress_lines():
    stream = io.StringIO()
    clock = FakeClock()
    with Progress(10, desc="extract", unit="rec", stream=stream, clock=clock) as bar:
        bar.write("regenerated shard 0, round 1 of 1: 10 answers")
        clock.now += 1
        bar.update(10)
    assert stream.getvalue().splitlines() == ["regenerated shard 0, round 1 of 1: 10 answers",
                                              "extract: 10/10 rec (100%), 0:00:01 elapsed, 10 rec/s"]
    quiet = io.StringIO()
    Progress(10, desc="extract", stream=quiet, enabled=False).write("not shown")
    assert quiet.getvalue() == ""


def test_big_updates_print_one_line_each_and_close_adds_the_unfinished_end():
    stream = io.StringIO()
    bar = Progress(300, desc="train", unit="step", initial=100, stream=stream, clock=FakeClock())
    bar.update(100)  # 33% -> 66%: several marks passed, one line
    bar.update(5)
    bar.close()
    bar.close()  # idempotent
    assert stream.getvalue().splitlines() == [
        "train: 200/300 step (66%), 0:00:00 elapsed, 0 step/s",  # floored: 100% only when done
        "train: 205/300 step (68%), 0:00:00 elapsed, 0 step/s",
    ]


def test_counts_are_written_out_whole():
    stream = io.StringIO()
    with Progress(2_000_000, desc="tokens", unit="tok", stream=stream, clock=FakeClock()) as bar:
        bar.update(1_234_567)
    assert stream.getvalue().startswith("tokens: 1234567/2000000 tok (61%)")


def test_unknown_total_prints_a_line_per_interval_and_at_the_end():
    stream = io.StringIO()
    clock = FakeClock()
    with Progress(None, desc="offline chains", unit="sample", stream=stream, every_seconds=30, clock=clock) as bar:
        for _ in range(10):
            clock.now += 10
            bar.update(1)
    assert stream.getvalue().splitlines() == [
        "offline chains: 3 sample, 0:00:30 elapsed, 0.1 sample/s",
        "offline chains: 6 sample, 0:01:00 elapsed, 0.1 sample/s",
        "offline chains: 9 sample, 0:01:30 elapsed, 0.1 sample/s",
        "offline chains: 10 sample, 0:01:40 elapsed, 0.1 sample/s",
    ]


def test_disabled_prints_nothing_and_track_yields_everything():
    stream = io.StringIO()
    assert list(track(range(7), desc="x", enabled=False, stream=stream)) == list(range(7))
    assert stream.getvalue() == ""
    assert list(track(iter(range(3)), desc="y", stream=stream)) == [0, 1, 2]  # no len: one line at the end
    assert stream.getvalue().startswith("y: 3 it, ")


def test_a_terminal_gets_tqdms_bar_even_when_tqdm_disable_is_set():
    """On a real pseudo-terminal the bar redraws with carriage returns; TQDM_DISABLE (set by `peagle`
    for libraries' bars) does not switch ours off."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            assert is_terminal(tty)
            code = textwrap.dedent("""
                import os, sys
                from peagle.pipeline.progress import Progress
                tty = os.fdopen(int(sys.argv[1]), "w")
                with Progress(50, desc="counting", unit="shard", stream=tty) as bar:
                    for i in range(50):
                        bar.update(1)
                        if i == 25:
                            bar.write("a line of its own")
            """)
            env = {**os.environ, "TQDM_DISABLE": "1"}
            subprocess.run([sys.executable, "-c", code, str(follower)], check=True, env=env, pass_fds=(follower,),
                           timeout=120)
        os.set_blocking(leader, False)
        out = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # nothing more to read (EAGAIN), or the terminal is gone (EIO)
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(leader)
        os.close(follower)
    text = out.decode(errors="replace")
    assert "\rcounting" in text and "50/50" in text  # tqdm's frames ("\n" alone would read "\r\n" here)
    assert "a line of its own\r\n" in text  # its own line, the bar redrawn after it


def test_library_bars_follow_tqdm_disable(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert library_bars_enabled()
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert not library_bars_enabled()
