"""One owner per run directory (run_dir.py): RUN_DIR/.lock is held by one process, names it, and is free
again the moment that process dies, SIGKILL included, even while its forked children live on.
(The real CLI, two runs and a kill -9: tests/faults/test_fault_run_lock.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from peagle.schemas.errors import UserError
from peagle.stages.train.run_dir import LOCK_FILE, lock_run_dir

HOLDER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from peagle.stages.train.run_dir import lock_run_dir
    lock = lock_run_dir(Path(sys.argv[1]))
    child = os.fork()
    if child == 0:  # a child that outlives its parent, as a DataLoader worker may
        time.sleep(60)
        os._exit(0)
    print("locked", child, flush=True)
    time.sleep(60)
""")


class Holder:
    """A process holding the lock, with a forked child of its own (killed by :meth:`kill`)."""

    def __init__(self, run_dir):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
        word, child = self.proc.stdout.readline().split()
        assert word == "locked"
        self.pid, self.child = self.proc.pid, int(child)

    def kill(self, *, child: bool = True) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child, signal.SIGKILL)


def test_a_second_owner_is_refused_naming_the_holder_and_a_killed_holder_frees_it(tmp_path):
    run = tmp_path / "run"
    holder = Holder(run)
    try:
        assert json.loads((run / LOCK_FILE).read_text()) == {"pid": holder.pid, "host": socket.gethostname()}
        with pytest.raises(UserError) as refused:
            lock_run_dir(run)
        assert str(refused.value) == (f"{run} is in use by another `peagle train` (pid {holder.pid} on "
                                      f"{socket.gethostname()}); wait for it to end, or train into another --out")
        holder.kill(child=False)
        os.kill(holder.child, 0)  # its forked child still runs: the lock was the killed process's alone
        lock = lock_run_dir(run)
        assert lock is not None and json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
        lock.release()
    finally:
        holder.kill()


def test_only_rank_0_locks_and_every_rank_hears_a_refusal(tmp_path):
    run = tmp_path / "run"
    assert lock_run_dir(run, rank=1) is None and not run.exists()  # rank 1 writes nothing
    holder = Holder(run)
    try:
        heard = []
        with pytest.raises(UserError, match=f"pid {holder.pid}"):
            lock_run_dir(run, rank=1, agree=lambda decided: heard.append(decided) or "rank 0's refusal, pid "
                         f"{holder.pid}")
        assert heard == [None]  # rank 1 offers nothing and raises rank 0's line
    finally:
        holder.kill()
