"""The one exception type for mistakes a user can fix (bad flag, missing file, mismatched store), and the
one-line messages of the errors a user's environment causes (a read-only directory, a full disk, a
file that is not UTF-8), which the CLI prints the same way (docs/reliability.md)."""

from __future__ import annotations

import errno
import os
import re
from typing import Any, Callable, Iterator


class UserError(Exception):
    """A user-caused error: the CLI prints ``str(err)`` as one line on stderr and exits non-zero.

    Raise it with a message that names the thing and both values where two disagree, e.g.
    ``UserError("store hidden_size 4096 does not match target hidden_size 128 (store: /data/s)")``.
    """


def one_line(err: BaseException, limit: int = 240, with_type: bool = True) -> str:
    """``err`` as one line of at most ``limit`` characters of message, for a UserError or a record.

    Library errors (Inductor, vLLM, transformers) often span pages; a user-facing line keeps the
    start, where they name what failed, with every run of whitespace (newlines included) made one space.
    """
    text = " ".join(str(err).split())[:limit] or "no message"
    return f"{type(err).__name__}: {text}" if with_type else text


def show_value(value: object) -> str:
    """A setting's value as a user error names it: lists comma-joined (``2,15,27``, as flags take
    them), strings quoted (so an empty or spaced value stays visible), anything else as ``str``."""
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return repr(value) if isinstance(value, str) else str(value)


# --------------------------------------------------------------------------------------------------
# Errors of the operating system and of input decoding, as one line (the CLI's ``main`` prints them)

_OS_ADVICE = {
    errno.EACCES: "check the permissions of it and of its directory for this user, or use another path",
    errno.EPERM: "the system does not let this user change it (permissions, an immutable file, a mount "
                 "option): use another path",
    errno.EROFS: "write somewhere writable (another --out, or a copy of the store)",
    errno.ENAMETOOLONG: "a name in the path is too long for this file system: choose a shorter path",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a directory: check the path",
    errno.EISDIR: "it is a directory where a file was expected: check the path",
    errno.ELOOP: "the path runs through too many symbolic links: check them",
    errno.EMFILE: "too many files are open: raise the limit (ulimit -n) and re-run",
    errno.ENFILE: "too many files are open on this machine: re-run when fewer are",
    errno.EIO: "the disk or network file system failed to read or write: check it, then re-run the same "
               "command (finished work is kept)",
    errno.ESTALE: "the network file system lost track of it: re-run the same command",
}
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(tmp|deleted)-\d+(-[A-Za-z0-9_]+)?$")
_LIBRARY_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def at_least(name: str, value: int, low: int) -> None:
    """Refuse a flag's value below ``low``, naming the flag (``num_depths`` is ``--num-depths``).

    Raises:
        UserError: ``value < low``.
    """
    if value < low:
        raise UserError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def as_os_error(err: BaseException) -> OSError | None:
    """``err`` if it is an ``OSError``; for a library error that reports one in words only (safetensors
    and tokenizers, written in Rust, say ``... (os error 27)``), the ``OSError`` it stands for; else None."""
    if isinstance(err, OSError):
        return err
    found = _LIBRARY_OS_ERROR.search(str(err))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def shown_path(path: str | os.PathLike | bytes) -> str:
    """A path as an error names it: the file a temp name stands for (``.x.json.tmp-12-ab`` -> ``x.json``:
    temp names are peagle's business), and bytes that are not UTF-8 as ``\\xff``."""
    text = os.fsdecode(path)
    head, _, name = text.rpartition("/")
    match = _TEMP_NAME.match(name)
    if match:
        text = f"{head}/{match.group('name')}" if head or text.startswith("/") else match.group("name")
    return os.fsencode(text).decode("utf-8", "backslashreplace")


def os_error_line(err: OSError, path: str | os.PathLike | None = None) -> str:
    """One line for an error of the operating system: the path (``path``, else the error's own), what
    happened and what to do. Without an error number (an ``OSError`` raised with a message, or one
    re-raised from a DataLoader worker with its traceback folded into the message) its last line."""
    if err.errno is None:
        lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else type(err).__name__
        prefix = f"{type(err).__name__}: "
        return last[len(prefix):] if last.startswith(prefix) else last
    where = path if path is not None else err.filename
    name = errno.errorcode.get(err.errno, str(err.errno))
    what = err.strerror or os.strerror(err.errno)
    if err.errno in _NO_SPACE:
        target = f" {shown_path(where)}" if where is not None else " a file"
        return (f"no space left writing{target} ({what}, {name}); free space (or raise the file-size limit) and "
                "re-run the same command: finished work is kept")
    subject = f"{shown_path(where)}: " if where is not None else ""
    if err.filename2 is not None and path is None:
        subject = f"{shown_path(err.filename)} -> {shown_path(err.filename2)}: "
    advice = _OS_ADVICE.get(err.errno)
    return f"{subject}{what.lower()} ({name})" + (f"; {advice}" if advice else "")


def decode_error_line(err: UnicodeDecodeError, path: str | os.PathLike | None) -> str:
    """One line for input that is not UTF-8 text: the file (when known), the first bad byte, what to do."""
    bad = err.object[err.start:err.start + 1] if isinstance(err.object, (bytes, bytearray)) else b""
    byte = f"byte 0x{bad[0]:02x}" if bad else "a byte"
    subject = f"{shown_path(path)} is" if path is not None else "an input file is"
    return (f"{subject} not UTF-8 text ({byte} cannot start or continue a UTF-8 character: a binary file, or text "
            "in another encoding); peagle reads text as UTF-8: convert it (iconv -t UTF-8) or give the right file")


def encode_error_line(err: UnicodeEncodeError) -> str | None:
    """One line for a name holding bytes that are not UTF-8 (Python carries them as lone surrogates, which
    UTF-8 JSON and Parquet cannot hold), naming it; None for any other encoding error."""
    text = err.object if isinstance(err.object, str) else ""
    if "surrogates not allowed" not in str(err.reason) and not any("\udc80" <= c <= "\udcff" for c in text):
        return None
    start, end = max(0, err.start - 40), min(len(text), err.end + 40)
    shown = os.fsencode(text[start:end]).decode("utf-8", "backslashreplace") if text else "?"
    return (f"a name holds bytes that are not UTF-8 (…{shown}…); peagle writes names and paths into UTF-8 "
            "files (JSON, Parquet): rename it with UTF-8 characters only")


def non_utf8_argument(argv: list[str]) -> str | None:
    """One line for the first command-line value holding bytes that are not UTF-8 (a path from a system
    whose names are not UTF-8); None when every value is UTF-8. Checked before anything runs, so that
    such a path fails before any file is made, not halfway through a run."""
    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            return (f"{os.fsencode(arg).decode('utf-8', 'backslashreplace')} holds bytes that are not UTF-8; peagle "
                    "writes paths and names into UTF-8 files (JSON, Parquet): rename it with UTF-8 characters only")
    return None


_UNPICKLE_GLOBAL = re.compile(r"(?:unsupported global: GLOBAL|unsupported GLOBAL|unsupported class) ([^\s]+)",
                              re.IGNORECASE)


def not_weights_only_line(path: str | os.PathLike | None, err: BaseException) -> str:
    """One line for a file torch's weights-only unpickler refused (a pickle that would run code, or one
    that is no checkpoint at all): which file and why, in peagle's words. Never torch's own advice
    (re-run with ``weights_only=False``), which is the one thing that would run the code."""
    found = _UNPICKLE_GLOBAL.search(str(err))
    why = (f"it names {found.group(1)}, which is code" if found
           else "it holds more than tensors and plain containers")
    subject = shown_path(path) if path is not None else "a weights file"
    return (f"{subject} is not a weights-only file ({why}); peagle never unpickles code: use a file that holds "
            "tensors only (safetensors, or torch.save of tensors and plain containers) from a source you trust")



def innermost_local(tb: Any, wanted: Callable[[object], bool]) -> object | None:
    """The first local of the innermost traceback frame (of ``tb``) that holds one for which ``wanted``
    is true, or None: which file a library was reading when it raised, for errors that do not say
    (a UnicodeDecodeError, torch's refusal of a pickle)."""
    for frame in reversed(list(_frames(tb))):
        for value in frame.f_locals.values():
            if wanted(value):
                return value
    return None


def _frames(tb: Any) -> Iterator[Any]:
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next
