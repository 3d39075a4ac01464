"""peagle/pipeline/failpoints.py: a hit kills the process, or holds it while PEAGLE_FAILPOINT_HOLD's file exists."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

CODE = ("from peagle.pipeline.failpoints import failpoint\n"
        "for i in range(3):\n    failpoint('x.y')\n    print(i, flush=True)\n")


def _start(**env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CODE], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **env})


def test_the_nth_hit_kills():
    proc = _start(PEAGLE_FAILPOINT="x.y:2")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and out.split() == ["0"]


def test_a_hold_file_holds_the_process_at_the_hit_until_it_is_gone(tmp_path):
    hold = tmp_path / "hold"
    hold.touch()
    proc = _start(PEAGLE_FAILPOINT="x.y:2", PEAGLE_FAILPOINT_HOLD=str(hold))
    assert proc.stdout.readline().split() == ["0"]  # the first hit passes; the second holds
    time.sleep(0.5)
    assert proc.poll() is None
    hold.unlink()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.split() == ["1", "2"]
