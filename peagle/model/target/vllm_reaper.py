"""vLLM engine processes that do not outlive the process that started them.

A ``vllm.LLM`` runs its engine core in a child process (and the model in a grandchild). When the
driver is killed (``kill -9``, the OOM killer, a pre-empted job), nothing tells the engine core: it
idles on, holding the model and its KV cache, and on a GPU the re-run that docs/reliability.md promises then
finds no memory free. ``EngineReaper`` starts a small watchdog process before the engine starts. It
learns the driver's ``VLLM::*`` descendants once a second and waits on a pipe whose only write end
the driver holds: EOF without a goodbye means the driver is gone, however it went, and the watchdog
stops those processes (SIGTERM, then SIGKILL after a grace period). Only processes vLLM has named
``VLLM::...`` are touched: multiprocessing's resource tracker must live on to unlink the shared
memory the engines leave behind.
"""

from __future__ import annotations

import os
import subprocess
import sys

_GRACE_S = 5.0
_GOODBYE = b"q"

# argv: read fd, owner pid, grace seconds. psutil.Process remembers each process's start time, so
# a recycled pid is never signalled.
_WATCHDOG = """
import os, select, sys, psutil
fd, owner_pid, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
engines = {}
def learn():
    try:
        for proc in psutil.Process(owner_pid).children(recursive=True):
            if proc.pid not in engines and " ".join(proc.cmdline()).startswith("VLLM::"):
                engines[proc.pid] = proc
    except psutil.Error:
        pass
while True:
    learn()
    if select.select([fd], [], [], 1.0)[0]:
        break
if os.read(fd, 1):
    sys.exit(0)  # goodbye: the owner shut its engine down itself
for proc in engines.values():
    try:
        proc.terminate()
    except psutil.Error:
        pass
_, alive = psutil.wait_procs(list(engines.values()), timeout=grace)
for proc in alive:
    try:
        proc.kill()
    except psutil.Error:
        pass
"""


class EngineReaper:
    """Stops this process's ``VLLM::*`` descendants if it exits without calling ``close``."""

    def __init__(self) -> None:
        read_fd, self._write_fd = os.pipe()  # non-inheritable: the engines spawned later lack them
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(read_fd), str(os.getpid()), str(_GRACE_S)],
            pass_fds=(read_fd,), stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to our process group must not stop the watchdog first
        )
        os.close(read_fd)

    def close(self) -> None:
        """Release the watchdog without stopping anything (call after shutting the engine down)."""
        if self._write_fd is not None:
            os.write(self._write_fd, _GOODBYE)
            os.close(self._write_fd)
            self._write_fd = None
            self._proc.wait()
