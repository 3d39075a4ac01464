"""One run directory: who owns it (``RUN_DIR/.lock``) and where a run in it resumes.

**One owner.** Two ``peagle train`` processes writing one ``--out`` would interleave checkpoints,
rotate each other's away and append to one ``metrics.jsonl``. So a run holds an exclusive lock on
``RUN_DIR/.lock`` for its whole life (rank 0 under torchrun: it writes everything in the directory,
and takes the lock before anything is written), and writes its pid and host into the file once it
holds it; a second run into the same ``--out`` is refused in one line naming them.

The lock is a POSIX record lock (``fcntl.lockf``), not ``flock``: it belongs to the process, so the
kernel releases it when the process dies, SIGKILL included, and a forked child (a DataLoader worker)
does not inherit it. A ``flock`` lock is shared with forked children, so workers still alive for a
few seconds after their trainer was killed would keep the directory locked against the resume. The
price of POSIX locks: closing *any* descriptor of the file drops the process's lock, so nothing but
:class:`RunLock` opens ``.lock`` in the training process. The file itself stays after the run (a
lock file is never unlinked: a process that opened it just before would lock an orphan).

**The resume point** is the newest checkpoint that checks out (damaged newer ones are warned about)
and whose run config matches this run's (:func:`peagle.schemas.train_resume.config_mismatch`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from peagle.pipeline.checkpoint_files import latest_valid_checkpoint, read_checkpoint_part
from peagle.pipeline.contained import inside
from peagle.schemas.checkpoint import CONFIG, TRAIN_CONFIG_KEY
from peagle.schemas.errors import UserError
from peagle.schemas.train_config import TrainConfig
from peagle.schemas.train_resume import config_mismatch

LOCK_FILE = ".lock"


class RunLock:
    """The held lock of one run directory; :meth:`release` (or the process's end) lets it go."""

    def __init__(self, fd: int, path: Path):
        self.fd: int | None = fd
        self.path = path

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def lock_run_dir(run_dir: Path, *, rank: int = 0, agree: Callable[[Any], Any] = lambda decided: decided
                 ) -> RunLock | None:
    """Rank 0 takes ``RUN_DIR/.lock`` (creating the directory) and writes its pid and host into it;
    the other ranks get None. Every rank hears (``agree``: rank 0's value on every rank) whether it
    did, so a refused run ends on every rank with the same line.

    Raises:
        UserError: another process holds the lock, in one line naming its pid and host.
    """
    lock, problem = None, None
    if rank == 0:
        try:
            lock = _take(run_dir)
        except UserError as err:
            problem = str(err)
    problem = agree(problem)
    if problem:
        raise UserError(problem)
    return lock


def _take(run_dir: Path) -> RunLock:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = inside(run_dir, LOCK_FILE, tree="run")  # written to below: a link out of the run is refused
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = _holder(os.pread(fd, 4096, 0))
        os.close(fd)
        if err.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        raise UserError(f"{run_dir} is in use by another `peagle train` ({holder}); wait for it to end, or "
                        "train into another --out") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n").encode(), 0)
    return RunLock(fd, path)


def _holder(content: bytes) -> str:
    try:
        record = json.loads(content)
        return f"pid {int(record['pid'])} on {record['host']}"
    except (ValueError, KeyError, TypeError):  # locked a moment ago, its owner not yet written
        return "its pid and host not yet written"


def find_resume_point(run_dir: Path, config: TrainConfig, *, rank: int, world_size: int) -> Path | None:
    """Rank 0 picks the newest valid checkpoint (warning about damaged ones) and checks its config;
    every rank gets the answer.

    Raises:
        UserError: the checkpoint's run config differs from this run's in a field that must not change.
    """
    found: list[Any] = [None]
    if rank == 0:
        path = latest_valid_checkpoint(run_dir)
        if path is not None:
            saved = read_checkpoint_part(path, CONFIG)[TRAIN_CONFIG_KEY]
            found = [(str(path), config_mismatch(saved, config))]
    if world_size > 1:
        dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        return None
    path, problem = found[0]
    if problem:
        raise UserError(f"cannot resume {run_dir}: {problem}")
    return Path(path)
