"""The warm CLI server of :mod:`peagle.testing.warm_cli`: import peagle, torch and transformers once,
then fork one child per `peagle ...` command line, so that a test's command costs its work and not
~4-6 s of imports.

Each child is a real process running the real entry point (``peagle.cli.main``, what the ``peagle``
console script calls) with its own argv, whole environment, working directory, stdout/stderr files
and, when asked, a file-size limit; it can be killed with SIGKILL like any other. Nothing in the
children is mocked: only the interpreter start is shared. What a cold start would read from the
environment at import time is set again in the child: torch's thread count (OpenMP read
``OMP_NUM_THREADS`` when the server loaded it).

Protocol (JSON lines): the client writes ``{"id", "args", "env", "cwd", "stdout", "stderr",
"fsize"}`` on our stdin (``env``: the child's whole environment); we answer ``{"id", "pid"}`` once the
child exists and ``{"pid", "returncode"}`` when it ends (negative signal number when killed, as
``subprocess`` reports it). We print ``{"ready": true}`` once the imports are done. The server is
single-threaded: forking from a process with other threads risks children that inherit a held lock.
Run as ``python -m peagle.testing.warm_cli_server``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import peagle.cli as cli  # noqa: E402
from peagle.testing.warm_cli import limit_file_size  # noqa: E402

cli._register()
# Modules the stages import lazily, imported here once (no torch op runs here: no thread pools).
import pyarrow.parquet  # noqa: E402,F401
import safetensors.torch  # noqa: E402,F401
import torch  # noqa: E402,F401
import tqdm  # noqa: E402,F401
import transformers  # noqa: E402

for _name in ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM", "PreTrainedTokenizerFast"):
    getattr(transformers, _name)
import peagle.model.target.hf_backend  # noqa: E402,F401
import peagle.stages.store.info  # noqa: E402,F401
import peagle.stages.extract.run  # noqa: E402,F401
import peagle.stages.train.loop  # noqa: E402,F401
import peagle.stages.train.vocab  # noqa: E402,F401
import peagle.stages.export.run  # noqa: E402,F401
import peagle.stages.eval.run  # noqa: E402,F401
import peagle.stages.store.check  # noqa: E402,F401
import peagle.stages.store.convert  # noqa: E402,F401

if "vllm" in sys.modules:  # a child must start as a cold process would: vLLM not yet imported
    raise SystemExit("warm_cli_server: preloading imported vllm")


def _send(obj: dict) -> None:
    os.write(1, (json.dumps(obj) + "\n").encode())


def _child(req: dict) -> None:
    """Become the command: fds, cwd, env, limits, argv; run the CLI; exit with its status."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        limit_file_size(req.get("fsize"))
        sys.argv = ["peagle", *req["args"]]
        try:
            cli.main(list(req["args"]))
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        _send({"pid": pid, "returncode": code})


def main() -> None:
    _send({"ready": True})
    buffer = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.02)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(req)
                _send({"id": req["id"], "pid": pid})
        _reap()
    # The client is gone: wait for the children still running (the client kills what it abandons).
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
    # Everything was written with os.write: skip the interpreter's teardown of torch and transformers,
    # which takes seconds and which the client waits for.
    os._exit(0)


if __name__ == "__main__":
    main()
