"""The target's full identity: sha256 of every byte of its weight files, each file hashed once per
version of it (docs/reliability.md, "Nothing half-made is trusted").

Why: the content hash a store has always recorded (``target.content_hash``) reads a few byte samples
of each weight file, so a change confined to tensors between the samples (a fine-tune of a few
layers, a patched bias) passed as the same target, and a store would train a draft on states of
other weights. The full hash covers every tensor. Reading an 8B target's 16 GB on every run would
cost minutes, so each file's sha256 is cached by its resolved path, size, mtime and ctime
(:data:`CACHE_FILE` under :func:`cache_dir`): a rewritten file has a new mtime (or, when its mtime
was set back by hand, a new ctime) and is hashed again; an unchanged target costs a few ``stat``
calls. Cost measured by ``benchmarks/target_hash.py`` (``benchmarks/results/cpu/``).

The identity is the sha256 of ``config.json``'s bytes and, per weight file sorted by name, its name,
size and sha256. A cache that cannot be read or written is rebuilt or skipped, never an error: it
only saves time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from peagle.pipeline.atomic import atomic_write_json, file_lock

CACHE_FILE = "weight-file-sha256.json"
CACHE_VERSION = 1
SAY_ABOVE_BYTES = 1 << 30
"""Hashing more than this many uncached bytes says so on stderr first (it takes a while, once)."""


def cache_dir() -> Path:
    """``$PEAGLE_CACHE_DIR``, else ``$XDG_CACHE_HOME/peagle``, else ``~/.cache/peagle``."""
    if os.environ.get("PEAGLE_CACHE_DIR"):
        return Path(os.environ["PEAGLE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "peagle"


def _signature(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _read_cache(path: Path) -> dict[str, dict]:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        data = json.loads(path.read_text())
        if data.get("version") == CACHE_VERSION and isinstance(data.get("files"), dict):
            return data["files"]
    return {}


def file_sha256(path: Path, chunk: int = 16 << 20) -> str:
    """A file's sha256, read through a memory map: pages come straight from the page cache, not copied
    into a buffer (a third of the CPU time of a read loop went to the kernel's copies)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return h.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                for start in range(0, len(view), chunk):
                    h.update(view[start:start + chunk])  # releases the GIL: files hash in parallel
            finally:
                view.release()
    return h.hexdigest()


def files_sha256(files: list[Path], *, threads: int = 4) -> dict[Path, str]:
    """Each file's sha256, from the cache where its signature is unchanged, else read (on up to
    ``threads`` threads: sha256 releases the GIL), and the cache updated with what was read."""
    where = cache_dir() / CACHE_FILE
    cached = _read_cache(where)
    out: dict[Path, str] = {}
    todo: list[tuple[Path, str, list[int]]] = []
    for file in files:
        real = str(file.resolve())
        signature = _signature(os.stat(real))
        entry = cached.get(real)
        if isinstance(entry, dict) and entry.get("signature") == signature and isinstance(entry.get("sha256"), str):
            out[file] = entry["sha256"]
        else:
            todo.append((file, real, signature))
    if not todo:
        return out
    num_bytes = sum(signature[0] for _, _, signature in todo)
    if num_bytes > SAY_ABOVE_BYTES:
        print(f"peagle: hashing {len(todo)} weight files of the target once ({num_bytes / 2**30:.1f} GiB; "
              f"cached in {where} by path, size and mtime)", file=sys.stderr)
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(todo), os.cpu_count() or 1))) as pool:
        digests = list(pool.map(lambda item: file_sha256(Path(item[1])), todo))
    for (file, _, _), digest in zip(todo, digests):
        out[file] = digest
    _remember(where, {real: {"signature": signature, "sha256": digest}
                      for (_, real, signature), digest in zip(todo, digests)})
    return out


def _remember(where: Path, entries: dict[str, dict]) -> None:
    """Add ``entries`` to the cache file (read-modify-write under its lock); skipped where it cannot be written."""
    with contextlib.suppress(OSError):
        where.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(where.with_name(where.name + ".lock")):
            files = _read_cache(where)
            files.update(entries)
            atomic_write_json(where, {"version": CACHE_VERSION, "files": files})


def weights_sha256(root: str | os.PathLike, config_file: str, weight_files: list[Path]) -> str:
    """The target's full identity (module docstring) over ``config_file`` and ``weight_files`` of ``root``."""
    root = Path(root)
    h = hashlib.sha256((root / config_file).read_bytes())
    digests = files_sha256(sorted(weight_files, key=lambda p: p.name))
    for file in sorted(weight_files, key=lambda p: p.name):
        h.update(f"\n{file.name}\t{file.stat().st_size}\t{digests[file]}\n".encode())
    return h.hexdigest()
