"""Crash-safe file writes: temp name, fsync, rename, fsync the directory (docs/reliability.md).

Nothing written through here is ever visible half-written: a reader sees the old file, no file, or
the whole new file (a directory: the old one or the new one, swapped in one step). Temp files and
directories are named ``.<name>.tmp-<pid>-<random>`` in the target's directory (same filesystem, so
``os.replace`` is atomic) and are ignored by every reader; what a killed writer left is removed by
the next writer of the same name, by name and dead pid only (``clean_dead_dirs``,
``remove_stale_temps``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import json
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from peagle.pipeline.failpoints import failpoint
from peagle.schemas.errors import UserError, as_os_error, os_error_line, shown_path


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path_for(path: str | os.PathLike) -> Path:
    """A fresh temp file beside ``path`` (created empty, so names never collide across writers)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)
    try:
        # mkstemp makes 0600 files; published files get the usual umask-based mode so that a store
        # written by one user can be read by a training job running as another.
        os.fchmod(fd, 0o666 & ~_umask())
    finally:
        os.close(fd)
    return Path(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def publish(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """fsync ``tmp``, rename it onto ``path``, fsync the directory."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    tmp = temp_path_for(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        publish(tmp, path)
    except OSError as err:
        _discard(tmp)
        raise_if_disk_full(err, path)
        raise
    except BaseException:
        _discard(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Build a directory under a temp name beside ``final`` and publish it whole, or not at all.

    Yields the temp directory (``.<name>.tmp-<pid>-<random>``). When the block ends normally every
    file in it is fsynced, files and directory get the umask's modes (``mkdtemp`` makes 0700: a
    server running as another user must read them), the directory is fsynced and takes ``final``'s
    place (:func:`publish_dir`): an existing ``final`` is swapped with it in one step, so a reader
    sees the old directory or the new one, never a mix and never none. When the block raises, the
    temp directory is removed; a full disk becomes the one-line UserError of :func:`raise_if_disk_full`
    (also when a library, safetensors, reports it).

    A process killed on the way leaves only hidden directories named after ``final`` and its pid;
    the next ``atomic_dir(final)`` removes them (:func:`clean_dead_dirs`) before it starts.
    """
    final = Path(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        clean_dead_dirs(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
    except OSError as err:
        raise_if_disk_full(err, final)
        raise
    try:
        yield tmp
        for file in tmp.iterdir():
            if file.is_file():
                os.chmod(file, 0o666 & ~_umask())  # some writers (safetensors) create 0600 files
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        os.chmod(tmp, 0o777 & ~_umask())
        fsync_dir(tmp)
        failpoint("dir.before_publish")
        publish_dir(tmp, final)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        # also a library's report of one (safetensors: "... File too large (os error 27)")
        os_error = as_os_error(err) if isinstance(err, Exception) else None
        if os_error is not None:
            raise_if_disk_full(os_error, final)
        raise
    failpoint("dir.after_publish")
    shutil.rmtree(tmp, ignore_errors=True)  # after a swap it holds the old directory


def publish_dir(tmp: Path, final: Path) -> None:
    """Put the whole directory ``tmp`` in ``final``'s place and fsync the parent.

    A new ``final`` is a rename. An existing one is swapped with ``tmp`` in one step (Linux's
    ``renameat2(RENAME_EXCHANGE)``), so ``final`` is never missing, and ``tmp`` then holds the old
    directory for the caller to delete. Where the file system cannot swap, the old directory is
    renamed to ``.<name>.replaced-<pid>`` first and deleted after: a kill between those two renames
    leaves ``final`` missing until the next :func:`clean_dead_dirs` (any ``atomic_dir(final)``) puts
    the old one back.
    """
    if not final.exists():
        os.replace(tmp, final)
    elif not exchange(tmp, final):
        replace_in_two_renames(tmp, final)
    fsync_dir(final.parent)


def replace_in_two_renames(tmp: Path, final: Path) -> None:
    """Where no swap is possible: the old ``final`` renamed to ``.<name>.replaced-<pid>``, ``tmp`` onto
    ``final``, the old one deleted (:func:`clean_dead_dirs` puts it back after a kill in between)."""
    old = final.with_name(f".{final.name}.replaced-{os.getpid()}")
    os.replace(final, old)
    failpoint("dir.between_renames")
    try:
        os.replace(tmp, final)
    except BaseException:
        os.replace(old, final)  # the rename onto final failed: put the old one back
        raise
    shutil.rmtree(old, ignore_errors=True)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


@functools.cache
def _renameat2() -> Any:
    """libc's ``renameat2`` (glibc 2.28+), or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two existing paths in one atomic step; False, and nothing changed, where the system or
    the file system cannot (no ``renameat2``, or EINVAL: NFS, some FUSE file systems).

    Raises:
        OSError: any other failure of the swap.
    """
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def clean_dead_dirs(final: str | os.PathLike) -> list[Path]:
    """Remove what killed writers of ``final`` left beside it, and put back one it lacks; returns
    what was removed.

    Only entries named after ``final`` by this module (``.<name>.tmp-<pid>-*``: a half-built or an
    unused whole directory, or an old one swapped out; ``.<name>.deleted-<pid>``;
    ``.<name>.replaced-<pid>``: the old directory renamed away) whose pid runs no process here.
    A ``replaced`` one is renamed back when ``final`` is missing (its writer died between the two
    renames of :func:`publish_dir`), else removed.
    """
    final = Path(final)
    pattern = re.compile(rf"^\.{re.escape(final.name)}\.(?:tmp-(\d+)-[^/]+|deleted-(\d+)|replaced-(\d+))$")
    removed = []
    if not final.parent.is_dir():
        return removed
    for entry in sorted(final.parent.iterdir()):
        match = pattern.match(entry.name)
        if match is None:
            continue
        pid = int(next(g for g in match.groups() if g is not None))
        if pid == os.getpid() or pid_alive(pid):
            continue
        if match.group(3) is not None and not final.exists() and entry.is_dir():
            os.replace(entry, final)
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def remove_dir(path: str | os.PathLike) -> None:
    """Delete a directory, renaming it away first: a crash mid-delete never leaves it half there."""
    path = Path(path)
    doomed = path.with_name(f".{path.name}.deleted-{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, fixed separators, trailing newline: equal content gives equal bytes."""
    return (json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False) + "\n").encode()


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, canonical_json(obj))


def create_exclusive(path: str | os.PathLike, data: bytes) -> bool:
    """Publish ``data`` at ``path`` only if nothing is there yet; True if this call created it.

    A hard link of a complete temp file fails with EEXIST when another writer won the race, so
    exactly one complete version ever appears.
    """
    tmp = temp_path_for(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        fsync_dir(Path(path).parent)
        return True
    except OSError as err:
        raise_if_disk_full(err, path)
        raise
    finally:
        _discard(tmp)


LOCK_NOTE_S = 5.0
"""How long a wait for a :func:`file_lock` goes on in silence; then one line names who holds it."""
LOCK_NOTE_EVERY_S = 60.0
"""How often that line comes again while the wait goes on (it goes on as long as the holder holds)."""
_LOCK_POLL_S = (0.002, 0.1)
"""First and longest pause between two tries of a held lock."""


def _say_waiting(line: str) -> None:
    print(f"peagle: {line}", file=sys.stderr, flush=True)


def lock_holder(fd: int) -> str:
    """Who holds the lock file open as ``fd``, as its holder recorded it (pid, host, since when)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        record = {}
    if not isinstance(record, dict) or "pid" not in record:
        return "a process that records nothing in it (an older peagle, or another program)"
    pid, host = record.get("pid"), record.get("host") or "?"
    here = host == socket.gethostname()
    alive = "" if not here or not isinstance(pid, int) else (
        "" if pid_alive(pid) else ", which no longer runs: a process it started holds the lock on")
    return f"pid {pid} on {host} since {record.get('since', '?')}{alive}"


def _take_lock(fd: int, path: str | os.PathLike, say: Callable[[str], None]) -> None:
    """``flock(fd, LOCK_EX)``, saying after :data:`LOCK_NOTE_S` (and every :data:`LOCK_NOTE_EVERY_S`) who
    holds it: a wait on a suspended or stuck holder is told from work, and goes on."""
    pause, started = _LOCK_POLL_S[0], time.monotonic()
    note_at = started + LOCK_NOTE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        now = time.monotonic()
        if now >= note_at:
            say(f"waiting {now - started:.0f} s for the lock {shown_path(path)}, held by {lock_holder(fd)}; still "
                "waiting (a suspended or stuck holder: resume or end it, and this goes on)")
            note_at = now + LOCK_NOTE_EVERY_S
        time.sleep(pause)
        pause = min(pause * 2, _LOCK_POLL_S[1])


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, *, say: Callable[[str], None] = _say_waiting) -> Iterator[None]:
    """An exclusive advisory lock (flock) held for the block; serialises writers of one store.

    The holder writes its pid, host and start time into the file (emptied when it lets go), so a
    process that waits longer than :data:`LOCK_NOTE_S` says who it waits for (:func:`_take_lock`).
    Since the file is written, it must be the lock file itself: a symbolic link there is refused, and
    a file with other hard links (a store from elsewhere could link its lock to a record) is locked
    but never written.

    Raises:
        UserError: ``path`` is a symbolic link.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UserError(f"{shown_path(path)} is a symbolic link; a lock file is a plain file: remove the "
                            "link and re-run") from None
        raise
    recorded = False
    try:
        _take_lock(fd, path, say)
        with contextlib.suppress(OSError):  # the record is for people; a lock without it still locks
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
                os.ftruncate(fd, 0)
                recorded = True
                os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                          "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode() + b"\n", 0)
        yield
    finally:
        if recorded:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def writable_problem(directory: str | os.PathLike) -> OSError | None:
    """Whether a new file can be published in ``directory`` (created when missing), found by making and
    removing a temp file there: a command whose result goes there asks before its work, not after.
    Returns the error that says why not, or None."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        _discard(temp_path_for(Path(directory) / "probe"))
    except OSError as err:
        return err
    return None


def raise_if_disk_full(err: OSError, path: str | os.PathLike) -> None:
    """A full disk or quota, or a file-size limit, as the one line naming ``path`` (the file that was to
    be published, not its temp name); any other error is left to the caller."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        raise UserError(os_error_line(err, path)) from err


def remove_stale_temps(directory: str | os.PathLike) -> int:
    """Delete temp files left by killed writers (``.*.tmp-*``); returns how many were removed.

    Safe while other writers run only for temp files of dead processes: the pid in the name is
    checked, and files of live processes are left alone.
    """
    removed = 0
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    for p in directory.glob(".*.tmp-*"):
        try:
            pid = int(p.name.split(".tmp-")[1].split("-")[0])
        except (IndexError, ValueError):
            continue
        if pid_alive(pid):
            continue
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed += 1
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this machine (temp files name their writer's pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _discard(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
