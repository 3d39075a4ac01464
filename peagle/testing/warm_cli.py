"""Running the real ``peagle`` CLI from tests, warm or cold: ``Runner.start(args)`` starts one command
and returns a ``Job`` (pid, ``kill()``, ``wait()``); ``Runner.run(args)`` runs one to the end;
``Runner.completed(args)`` does the same and answers as ``subprocess.run`` would.

Why warm: a cold ``peagle`` command spends ~4-6 s of CPU importing torch, transformers and pyarrow
before it does anything (2026-12-02, 2 AMD EPYC cores), and the test suite runs hundreds of them. The
warm runner forks each command from ``warm_cli_server.py``, which imported them once. A child is still
the real CLI in a process of its own (its argv, environment, working directory, stdout/stderr files,
exit status; SIGKILL kills it like any other), so a test cannot tell the two apart except by the
clock. ``cold=True`` (per runner or per command) starts the ``peagle`` console script instead: the
fidelity check (``PEAGLE_TESTS_COLD=1`` runs every test's commands cold) and the route for commands
that start vLLM, whose spawned engine processes re-import their parent's main module (here the server).
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SERVER_MODULE = "peagle.testing.warm_cli_server"
BASE_ENV: dict[str, str | None] = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PEAGLE_FAILPOINT": None}
"""What every command's environment gets on top of the caller's (None: removed): one torch thread, as
tests run beside each other on 2 cores; no failpoint unless a test asks for one."""


def peagle_bin() -> list[str]:
    """The real ``peagle`` console script of this interpreter's environment."""
    exe = Path(sys.executable).with_name("peagle")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "peagle"]


def limit_file_size(fsize: int | None) -> None:
    """In a command's own process, before it runs: writes past ``fsize`` bytes fail with EFBIG (as on
    a full disk) instead of killing it with SIGXFSZ. None: no limit."""
    if fsize is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))


def command_env(env: dict[str, str | None] | None) -> dict[str, str]:
    """The whole environment of one command: the caller's now, then BASE_ENV, then ``env``."""
    merged: dict[str, str | None] = {**os.environ, **BASE_ENV, **(env or {})}
    return {k: v for k, v in merged.items() if v is not None}


@dataclass
class Result:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    wall_s: float

    def describe(self) -> str:
        return (f"peagle {' '.join(self.args)}\nrc {self.returncode} after {self.wall_s:.1f}s\n"
                f"--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-6000:]}")


class Job:
    """One running command."""

    def __init__(self, runner: "Runner", args: list[str], stdout: Path, stderr: Path):
        self.runner, self.args, self.stdout, self.stderr = runner, args, stdout, stderr
        self.started = time.monotonic()
        self.pid: int = -1
        self._done = threading.Event()
        self._returncode: int | None = None
        self._popen: subprocess.Popen | None = None

    def _finish(self, returncode: int) -> None:
        self._returncode = returncode
        self._done.set()

    @property
    def running(self) -> bool:
        if self._popen is not None:
            return self._popen.poll() is None
        return not self._done.is_set()

    def kill(self) -> bool:
        """SIGKILL the command if it still runs; True if the signal was sent."""
        if not self.running:
            return False
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    def wait(self, timeout: float) -> Result:
        """Wait for the end; over ``timeout`` the command is killed and TimeoutError raised."""
        if self._popen is not None:
            try:
                self._popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                self._popen.wait()
                raise TimeoutError(f"peagle {' '.join(self.args)} ran over {timeout}s")
            self._returncode = self._popen.returncode
        elif not self._done.wait(timeout):
            self.kill()
            self._done.wait(30)
            raise TimeoutError(f"peagle {' '.join(self.args)} ran over {timeout}s")
        assert self._returncode is not None
        return Result(self.args, self._returncode, self.stdout.read_text(errors="replace"),
                      self.stderr.read_text(errors="replace"), time.monotonic() - self.started)


class Runner:
    """Starts ``peagle`` commands; ``cold`` ones as fresh interpreters, else from the fork server
    (started on the first warm command). ``logs``: where each command's stdout/stderr files go."""

    def __init__(self, logs: Path, *, cold: bool = False):
        self.logs, self.cold = logs, cold
        self.logs.mkdir(parents=True, exist_ok=True)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._jobs_by_id: dict[int, Job] = {}
        self._jobs_by_pid: dict[int, Job] = {}
        self._exits: dict[int, int] = {}
        self._pid_events: dict[int, threading.Event] = {}
        self._server: subprocess.Popen | None = None

    # ------------------------------------------------------------------------------ fork server

    def _start_server(self) -> None:
        env = command_env(None)
        self._server = subprocess.Popen([sys.executable, "-m", SERVER_MODULE], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env, cwd=self.logs)
        ready = self._server.stdout.readline()
        if json.loads(ready or b"{}").get("ready") is not True:
            raise RuntimeError(f"the warm CLI server did not start: {ready!r}")
        threading.Thread(target=self._read_server, name="warm-cli-reader", daemon=True).start()

    def _read_server(self) -> None:
        for line in self._server.stdout:
            msg = json.loads(line)
            with self._lock:
                if "id" in msg:
                    job = self._jobs_by_id.pop(msg["id"])
                    job.pid = msg["pid"]
                    self._jobs_by_pid[job.pid] = job
                    self._pid_events.pop(msg["id"]).set()
                    if job.pid in self._exits:  # cannot happen (pid is sent before any reap), kept safe
                        job._finish(self._exits.pop(job.pid))
                else:
                    job = self._jobs_by_pid.pop(msg["pid"], None)
                    if job is None:
                        self._exits[msg["pid"]] = msg["returncode"]
                    else:
                        job._finish(msg["returncode"])

    def close(self) -> None:
        if self._server is not None:
            with self._lock:
                running = list(self._jobs_by_pid.values())
            for job in running:
                job.kill()
            self._server.stdin.close()
            try:
                self._server.wait(60)
            except subprocess.TimeoutExpired:
                self._server.kill()
            self._server = None

    # ------------------------------------------------------------------------------ commands

    def start(self, *args: str | os.PathLike, env: dict[str, str | None] | None = None,
              fsize: int | None = None, cwd: Path | None = None, cold: bool | None = None) -> Job:
        """Start ``peagle ARGS``; ``env`` adds to (None: removes from) the caller's environment;
        ``fsize`` sets RLIMIT_FSIZE (writes past it fail with EFBIG, as on a full disk); ``cwd``
        defaults to the logs folder."""
        args = [str(a) for a in args]
        n = next(self._ids)
        job = Job(self, args, self.logs / f"{n:05d}.out", self.logs / f"{n:05d}.err")
        environ = command_env(env)
        cwd = cwd or self.logs
        if cold or (cold is None and self.cold):
            with open(job.stdout, "wb") as out, open(job.stderr, "wb") as err:
                job._popen = subprocess.Popen([*peagle_bin(), *args], stdout=out, stderr=err,
                                              stdin=subprocess.DEVNULL, env=environ, cwd=cwd,
                                              preexec_fn=lambda: limit_file_size(fsize))
            job.pid = job._popen.pid
            return job
        event = threading.Event()
        req = {"id": n, "args": args, "env": environ, "cwd": str(cwd), "stdout": str(job.stdout),
               "stderr": str(job.stderr), "fsize": fsize}
        with self._lock:
            if self._server is None:
                self._start_server()
            self._jobs_by_id[n] = job
            self._pid_events[n] = event
            self._server.stdin.write((json.dumps(req) + "\n").encode())
            self._server.stdin.flush()
        if not event.wait(60):
            raise RuntimeError("the warm CLI server did not answer")
        return job

    def run(self, *args: str | os.PathLike, timeout: float = 300, **kw) -> Result:
        return self.start(*args, **kw).wait(timeout)

    def completed(self, *args: str | os.PathLike, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
        """``run`` answered as ``subprocess.run(..., capture_output=True, text=True)`` answers (raising
        ``subprocess.TimeoutExpired`` over ``timeout``), for tests written against it."""
        try:
            result = self.run(*args, timeout=timeout, **kw)
        except TimeoutError:
            raise subprocess.TimeoutExpired(["peagle", *map(str, args)], timeout) from None
        return subprocess.CompletedProcess(["peagle", *result.args], result.returncode, result.stdout, result.stderr)
