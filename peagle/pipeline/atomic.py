"""Crash-safe file writes: temp name, fsync, rename, fsync the directory (docs/reliability.md).

Nothing written through here is ever visible half-written: a reader sees the old file, no file, or
the whole new file. Temp files are named ``.<name>.tmp-<pid>-<random>`` in the target's directory
(same filesystem, so ``os.replace`` is atomic) and are ignored by every reader.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from peagle.schemas.errors import UserError, as_os_error, os_error_line


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
    server running as another user must read them), the directory is fsynced, and is renamed onto ``final``; an existing
    ``final`` is renamed away first and deleted after, so a reader sees the old directory or the
    new one, never a mix. When the block raises, the temp directory is removed; a full disk becomes
    the one-line UserError of :func:`raise_if_disk_full` (also when a library, safetensors, reports it).
    """
    final = Path(final)
    old = final.with_name(f".{final.name}.deleted-{os.getpid()}")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
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
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():  # the rename onto final failed: put the old one back
            os.replace(old, final)
        # also a library's report of one (safetensors: "... File too large (os error 27)")
        os_error = as_os_error(err) if isinstance(err, Exception) else None
        if os_error is not None:
            raise_if_disk_full(os_error, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


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


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """An exclusive advisory lock (flock) held for the block; serialises writers of one store."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
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
