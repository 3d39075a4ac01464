"""The one rule for a name that a file gives us: it names something inside its own tree, or nothing.

A store, a run directory or an export may come from elsewhere: copied from another machine, unpacked
from an archive, made by hand. What its files say is data, and so are the names in them: a commit
record's ``parquet`` and ``safetensors``, an input registration's ``sha256`` (its file's name), a
checkpoint directory of a run. peagle reads, rewrites and deletes what those names name, so a name
``../x``, ``/etc/x`` or one that runs through a symbolic link out of the tree would make it read,
overwrite or delete files that are not the tree's (docs/reliability.md, issue 58).

So every such name is joined to its tree's root here (:func:`contained`) and nowhere else, and only
once it is shown to stay inside: a relative name without ``..`` (:func:`name_problem`, pure) whose
path, resolved through every link that exists, lies under the resolved root. Anything else is
refused in one line naming the file that gave the name and the field, before anything is read,
written or deleted through it. The root itself is the user's choice (a link to a store elsewhere is
fine); what is inside it must stay inside it, so a store whose ``shards/`` is a link to another disk
is refused like any other name that leads out.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

from peagle.schemas.errors import UserError

REFUSED = "refused: nothing read, written or deleted"
"""How every refusal of this rule ends (tests look for it)."""

SHA256 = re.compile(r"[0-9a-f]{64}")


def name_problem(name: object) -> str | None:
    """Why ``name`` is no relative name inside a tree, from the name alone (no I/O), or None.

    Refused: a non-string, the empty name (or only ``.``), a NUL byte, an absolute path, a ``..``
    component. peagle writes names with ``/`` only, so a backslash is an ordinary character here.
    """
    if not isinstance(name, str):
        return f"is not a string (a JSON {type(name).__name__})"
    if "\0" in name:
        return "holds a NUL byte"
    path = PurePosixPath(name)
    if path.is_absolute():
        return "is an absolute path"
    if ".." in path.parts:
        return "has a '..' component"
    if not path.parts:
        return "names no file"
    return None


def escape_problem(root: str | os.PathLike, path: str | os.PathLike) -> str | None:
    """Why ``path`` (under ``root`` by its name) is not inside ``root`` on disk, or None: resolved
    through every symbolic link that exists, it must lie under ``root`` resolved (and not be it)."""
    try:
        base, resolved = Path(root).resolve(), Path(path).resolve()
    except (OSError, RuntimeError) as err:  # a link loop (RuntimeError before Python 3.13)
        return f"cannot be resolved ({type(err).__name__}: a loop of symbolic links?)"
    if resolved == base:
        return "is the tree itself"
    if not resolved.is_relative_to(base):
        return f"leads through a symbolic link to {resolved}"
    return None


def contained(root: str | os.PathLike, name: object, *, named_by: str | os.PathLike, field: str) -> Path:
    """``root / name``, once ``name`` is shown to name something inside ``root`` (module docstring).

    ``named_by`` is the file (or the thing) that gave the name and ``field`` where it said it: the
    refusal names both, so a user can find the line.

    Raises:
        UserError: one line naming ``named_by``, ``field`` and the name, ending with :data:`REFUSED`.
    """
    problem = name_problem(name)
    path = Path(root) / name if problem is None else None
    if path is not None:
        problem = escape_problem(root, path)
    if problem is not None:
        raise UserError(f"{named_by}: {field} {name!r} {problem}: peagle follows only names inside {root}; {REFUSED}")
    return path


def inside(root: str | os.PathLike, rel: str, *, tree: str = "store") -> Path:
    """``root / rel`` for a name peagle makes itself (a shard file, a commit record, a registration, a
    checkpoint directory), once on disk it stays inside ``root``: a directory of the tree that is a link
    to elsewhere (``shards/``, ``checkpoints/``) is refused, not read, written or deleted through.

    Raises:
        UserError: one line naming the ``tree`` and the name (:func:`contained`).
    """
    return contained(root, rel, named_by=f"{tree} {root}", field="path")


def checked_sha256(value: object, *, named_by: str | os.PathLike, field: str = "sha256") -> str:
    """``value``, once it is a sha256 as peagle writes one (64 lowercase hex digits): such a value
    becomes a file's name (an input registration's), so nothing else may.

    Raises:
        UserError: one line naming ``named_by`` and ``field``, ending with :data:`REFUSED`.
    """
    if not isinstance(value, str) or not SHA256.fullmatch(value):
        raise UserError(f"{named_by}: {field} {value!r} is not a sha256 (64 lowercase hex digits); {REFUSED}")
    return value


def checked_index(value: object, *, named_by: str | os.PathLike, field: str) -> int:
    """``value``, once it is a whole number >= 0 (a shard index, which names the shard's files).

    Raises:
        UserError: one line naming ``named_by`` and ``field``, ending with :data:`REFUSED`.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UserError(f"{named_by}: {field} {value!r} is not a shard index (a whole number >= 0); {REFUSED}")
    return value


__all__ = ["REFUSED", "checked_index", "checked_sha256", "contained", "escape_problem", "inside", "name_problem"]
