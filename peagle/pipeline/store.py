"""Reading and writing the shard store (docs/store.md): settings, shard commits, manifest, checks.

Writers: ``init_store`` (creates or checks ``store.json``) and ``rebuild_manifest``; a shard's files
and its commit record are written by :mod:`peagle.pipeline.shard_commit` only, all crash-safe. Readers: ``open_store`` sees
exactly the shards that have a commit record and checks sizes (fast) or sha256 (``verify=True``);
reading the samples of an opened store is :mod:`peagle.pipeline.raw_reader` (as stored) and
:mod:`peagle.pipeline.store_reader` (in training coordinates).

**Content is checked on read** (:mod:`peagle.pipeline.content_check`). Each shard file's crc32s (per
``CRC32_BLOCK_BYTES`` block) are recorded at commit, in the same pass as its sha256, and compared with
the bytes the first time a reader of the opened store reads them (``Store.check_content``):
``shard_parquet.read_shard_rows`` checks the whole Parquet file, ``shard_tensors.open_shard_tensors``
the whole tensor file, the training reader (``store_reader.ShardReader``) the blocks of each sample's rows as
it hands the sample out. A byte changed after the commit stops the reader in one line before
anything uses it. Records from before the checksums hold none: those shards are checked by size
only, and ``open_store`` says so once.

**Names stay inside the store** (:mod:`peagle.pipeline.contained`). A store may come from elsewhere, so
the names its commit records give (``parquet``, ``safetensors``, ``index``) are checked as each record
is read (``list_commits``), and every shard file, record, registration and lock file is read,
written or deleted only through ``shard_file`` and ``contained.inside``: a name that is absolute, has a
``..`` or leads out through a symbolic link is refused in one line before anything is touched.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from peagle.pipeline.atomic import (
    atomic_write_bytes,
    atomic_write_json,
    canonical_json,
    create_exclusive,
    file_lock,
    raise_if_disk_full,
    remove_stale_temps,
)
from peagle.pipeline.contained import checked_index, contained, inside
from peagle.pipeline.content_check import ContentChecks, blocks_touched, check_blocks, file_digests
from peagle.pipeline.failpoints import failpoint
from peagle.pipeline.plan import InputRegistration, replace_registrations, usability_problem
from peagle.schemas import store as S
from peagle.schemas.errors import UserError

log = logging.getLogger(__name__)

LOCK_FILE = S.STORE_LOCK_FILE
WRITERS_LOCK_FILE = f"{S.INPUTS_DIR}/.lock"
"""Held shared by every extract run while it may write (``WriterLock``); named ``.lock`` like the store
lock, so that tools comparing stores file by file leave both out."""


class WriterLock:
    """A shared ``flock`` that every `peagle extract` holds on the store for as long as it may write.

    Why: a store whose first run failed before its first commit must be started afresh by the mended
    command (``init_store(restart=True)``), but a store whose first worker is still loading its
    model must not be. Whoever holds this lock is a live writer; it goes with the process, however
    the process ends (as the store lock does, and on the filesystems where that one works).
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._fd: int | None = None

    def __enter__(self) -> "WriterLock":
        _make_dirs(self.root)
        self._fd = os.open(inside(self.root, WRITERS_LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def alone(self) -> bool:
        """Whether no other writer holds the lock; if none does, this one holds it exclusively until
        ``share``. (A failed try may have let go of the shared hold: it is taken again.)"""
        assert self._fd is not None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            return False
        return True

    def share(self) -> None:
        assert self._fd is not None
        fcntl.flock(self._fd, fcntl.LOCK_SH)


def _make_dirs(root: Path) -> None:
    for sub in ("", S.COMMITS_DIR, S.SHARDS_DIR, S.INPUTS_DIR):
        try:
            (root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise_if_disk_full(err, root / sub)
            raise UserError(f"cannot create store directory {root / sub}: {err.strerror}") from err


def init_store(root: str | os.PathLike, settings: S.StoreSettings, *, writers: WriterLock | None = None,
               restart: bool = False, plan: Iterable[InputRegistration] = ()) -> Path:
    """Create the store (or join an existing one) with these settings.

    A new store gets its plan (``plan``: the input registrations of the run that makes it) before
    its ``store.json``, under the store lock: a run killed in between leaves a directory that is no
    store (``read_settings`` says so) and that the same command makes whole; never a store that has
    settings but no plan, which a reader could not tell from a finished empty one.

    ``restart`` (``writers`` held): a store none of whose commit records holds a usable sample
    (``ShardRecord.usable``; none at all, or only empty shards) and that no other writer is using
    is started afresh with ``settings`` and ``plan`` (:func:`restart_unused`). So a first run that
    failed (a target without weights, a killed worker, a chat template that fails on every record)
    does not fix the store's settings or plan for good; a store with a usable shard is never restarted.

    Raises UserError naming both values when the store was made with other settings (and was not
    restarted), or when the directory holds commit records but no ``store.json``.
    """
    root = Path(root)
    _make_dirs(root)
    created = False
    if not (root / S.STORE_SETTINGS_FILE).exists():
        with file_lock(inside(root, LOCK_FILE)):
            if not (root / S.STORE_SETTINGS_FILE).exists():
                if list_commits(root):
                    raise UserError(f"{root} holds commit records but no {S.STORE_SETTINGS_FILE} (removed by hand?): "
                                    f"restore it, or extract into another --out")
                replace_registrations(root, plan)
                failpoint("store.before_settings")
                created = create_exclusive(root / S.STORE_SETTINGS_FILE, canonical_json(settings.to_dict()))
                failpoint("store.after_settings")
    if restart and not created and writers is not None:
        restart_unused(root, settings, writers, plan)
    existing = read_settings(root)
    check_same_settings(existing, settings, root)
    return root


def restart_unused(root: Path, settings: S.StoreSettings, writers: WriterLock,
                   plan: Iterable[InputRegistration] = ()) -> bool:
    """Start a store without a usable commit record afresh with ``settings`` and ``plan``
    (``init_store``); False, and nothing changed, when a shard is usable or another writer is live.

    Crash-safe in this order: commit records first (their shards leave every reader's view), then
    their shard files, the plan and the manifest, and ``store.json`` is replaced last (atomically),
    so a run killed half-way leaves a store that is still unused, and restarted again.
    """
    if any(r.usable for r in list_commits(root)) or not writers.alone():
        return False
    try:
        with file_lock(inside(root, LOCK_FILE)):
            records = list_commits(root)
            if any(r.usable for r in records):
                return False
            for r in records:
                inside(root, S.commit_name(r.index)).unlink(missing_ok=True)
            for r in records:
                shard_file(root, r, "parquet").unlink(missing_ok=True)
                shard_file(root, r, "safetensors").unlink(missing_ok=True)
            replace_registrations(root, plan)
            (root / S.MANIFEST_FILE).unlink(missing_ok=True)
            atomic_write_json(root / S.STORE_SETTINGS_FILE, settings.to_dict())
    finally:
        writers.share()
    return True


def read_settings(root: str | os.PathLike) -> S.StoreSettings:
    path = Path(root) / S.STORE_SETTINGS_FILE
    if not path.exists():
        raise UserError(f"{root} is not a peagle store (no {S.STORE_SETTINGS_FILE})")
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {path}: {err}") from err
    if d.get("schema_version") != S.SCHEMA_VERSION:
        raise UserError(f"store {root} has schema_version {d.get('schema_version')}, this peagle reads "
                        f"schema_version {S.SCHEMA_VERSION}")
    if d.get("hidden_dtype", S.HIDDEN_BF16) not in S.HIDDEN_DTYPES:
        raise UserError(f"store {root} holds hidden states as {d['hidden_dtype']!r}, this peagle reads "
                        f"{'|'.join(S.HIDDEN_DTYPES)}")
    return S.StoreSettings.from_dict(d)


def settings_difference(existing: S.StoreSettings, wanted: S.StoreSettings, root: Path) -> str | None:
    """The one line that says which setting differs (the first, with both values), or None.

    The target is known by its identity, not its path: the same model copied elsewhere (another
    machine, a local copy of a network file system) has the same content hash and joins the store,
    as `peagle train` accepts it (``check_store_matches_target``).
    """
    # hidden_dtype in full: to_dict leaves out the default (bf16)
    old = _flatten({**existing.to_dict(), "hidden_dtype": existing.hidden_dtype})
    new = _flatten({**wanted.to_dict(), "hidden_dtype": wanted.hidden_dtype})
    # The target's identity first: with another target everything differs. A store from before the full
    # weights hash records none: it is matched by its sampled content hash, as it always was.
    first = [f"target.{f}" for f in ("content_hash", "weights_sha256", "architecture", "dtype")]
    for key in first + sorted((set(old) | set(new)) - set(first) - {"target.path"}):
        if old.get(key) == new.get(key) or (key == "target.weights_sha256" and key not in old):
            continue
        if key in ("target.content_hash", "target.weights_sha256"):
            what = "content hash" if key == "target.content_hash" else "weights sha256"
            return (f"store {root} was extracted from target {existing.target.path} ({what} "
                    f"{str(old[key])[:12]}), --target {wanted.target.path} has other weights or config ({what} "
                    f"{str(new.get(key))[:12]}); use the store's target or another --out")
        hint = (f" (or convert it: `peagle store convert --store {root} --hidden-dtype {new[key]} --out NEW`)"
                if key == "hidden_dtype" else
                f" (--generation-dtype {old[key]}: the default became bfloat16 on CPUs with native bf16)"
                if key == "regenerate.generation_dtype" and old.get(key) else "")
        return (f"store {root} was made with {key}={old.get(key)!r}, this run asks for "
                f"{key}={new.get(key)!r}; use another --out or the store's settings{hint}")
    return None


def check_same_settings(existing: S.StoreSettings, wanted: S.StoreSettings, root: Path) -> None:
    """Raises UserError: one line naming the first field that differs, with both values
    (``settings_difference``)."""
    difference = settings_difference(existing, wanted, root)
    if difference is not None:
        raise UserError(difference)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def shard_file(root: str | os.PathLike, record: S.ShardRecord, field: str) -> Path:
    """The path of ``record``'s shard file ``field`` (``"parquet"`` or ``"safetensors"``) in the store at
    ``root``: the only way a name from a commit record becomes a path.

    Raises:
        UserError: the name leads outside the store (one line naming the record and the field).
    """
    return contained(root, getattr(record, field), named_by=Path(root) / S.commit_name(record.index), field=field)


def list_commits(root: str | os.PathLike) -> list[S.ShardRecord]:
    """Every committed shard, sorted by index. Temp files and stray shards are ignored.

    Raises:
        UserError: a record is unreadable, or names a file outside the store (``checked_record``).
    """
    records = []
    for p in sorted((Path(root) / S.COMMITS_DIR).glob("[0-9]*.json")):
        inside(root, f"{S.COMMITS_DIR}/{p.name}")  # a record that is a link to elsewhere is not read
        try:
            record = S.ShardRecord.from_dict(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError, TypeError) as err:
            raise UserError(f"commit record {p} is unreadable ({err}); delete it to redo that shard") from err
        records.append(checked_record(root, p, record))
    return records


def checked_record(root: str | os.PathLike, path: Path, record: S.ShardRecord) -> S.ShardRecord:
    """``record`` (read from ``path``), once the names it gives stay inside the store: its ``index``
    (which names its commit record and, in a plan, its files) and its two shard files.

    Raises:
        UserError: one line naming ``path`` and the field.
    """
    checked_index(record.index, named_by=f"commit record {path}", field="index")
    for field in ("parquet", "safetensors"):
        contained(root, getattr(record, field), named_by=f"commit record {path}", field=field)
    return record


def manifest_dict(settings: S.StoreSettings, records: list[S.ShardRecord]) -> dict[str, Any]:
    skipped: dict[str, int] = {}
    for r in records:
        for reason, n in r.skipped.items():
            skipped[reason] = skipped.get(reason, 0) + n
    return {
        **settings.to_dict(),
        "num_shards": len(records),
        "num_samples": sum(r.num_samples for r in records),
        "num_tokens": sum(r.num_tokens for r in records),
        "num_records": sum(r.num_records for r in records),
        "num_truncated": sum(r.num_truncated for r in records),
        "skipped": dict(sorted(skipped.items())),
        "shards": [r.to_dict() for r in records],
    }


def rebuild_manifest(root: str | os.PathLike) -> dict[str, Any]:
    """Derive manifest.json from the commit records, under the store lock (so no update is lost)."""
    root = Path(root)
    with file_lock(inside(root, LOCK_FILE)):
        manifest = manifest_dict(read_settings(root), list_commits(root))
        atomic_write_json(root / S.MANIFEST_FILE, manifest)
    return manifest


def manifest_hash(root: str | os.PathLike) -> str:
    """sha256 of the canonical manifest as derived now (provenance for checkpoints and exports)."""
    root = Path(root)
    return hashlib.sha256(canonical_json(manifest_dict(read_settings(root), list_commits(root)))).hexdigest()


# --------------------------------------------------------------------------------------------------
# Reading


@dataclass
class Store:
    """A store opened for reading: settings plus the committed shards (checked)."""

    root: Path
    settings: S.StoreSettings
    shards: list[S.ShardRecord]
    checks: ContentChecks | None = field(default=None, repr=False, compare=False)
    """Blocks whose content passed (``check_content``); shared by a ``dataclasses.replace`` copy."""

    def __post_init__(self) -> None:
        if self.checks is None:
            self.checks = ContentChecks.of(self.shards)

    def check_content(self, index: int, rel: str, data: Any,
                      ranges: Iterable[tuple[int, int]] | None = None) -> None:
        """Compare the blocks of shard ``index``'s file ``rel`` that byte ranges ``[start, stop)`` touch
        (all of them when None) with the crc32s its commit record holds, each unless a process of this
        opened store did so already (``peagle.pipeline.content_check``). ``data`` is the whole file as
        the reader maps it.

        Raises:
            UserError: one line naming the store, the shard and the file, and what to do.
        """
        want = self.shard(index).crc32_of(rel)
        if not want:  # committed before checksums: checked by size only (open_store said so)
            return
        blocks = None if ranges is None else blocks_touched(ranges)
        problem = check_blocks(self.checks, index, rel, want, data, blocks)
        if problem is not None:
            raise UserError(
                f"store {self.root} shard {S.shard_stem(index)}: {rel} is not the file that was committed ({problem}), "
                f"so nothing reads it; `peagle store verify --store {self.root}` lists every changed file; to "
                f"extract the shard again, delete {self.root / S.commit_name(index)} and run the command `peagle "
                f"store info --store {self.root}` prints")

    def mark_checked(self) -> None:
        """Every block is known good (``open_store(verify=True)`` compared each file's sha256)."""
        for record in self.shards:
            for rel in (record.parquet, record.safetensors):
                for b in range(len(record.crc32_of(rel))):
                    self.checks.mark(record.index, rel, b)

    @property
    def num_samples(self) -> int:
        return sum(r.num_samples for r in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.shards)

    def shard(self, index: int) -> S.ShardRecord:
        for r in self.shards:
            if r.index == index:
                return r
        raise KeyError(index)


def damaged(path: Path, err: Exception) -> UserError:
    """The one-line error for a shard file that exists with the right size but does not parse."""
    detail = str(err).strip().splitlines()[0][:120] if str(err).strip() else type(err).__name__
    return UserError(f"{path} is damaged ({detail}); run `peagle store verify --store {path.parent.parent}`")


def open_store(root: str | os.PathLike, *, verify: bool = False) -> Store:
    """Open a store for reading: settings, committed shards, size check (sha256 with ``verify``)."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"store {root} does not exist")
    settings = read_settings(root)
    records = list_commits(root)
    problems = check_shards(root, records, verify=verify)
    if problems:
        more = f" (and {len(problems) - 1} more; run `peagle store verify --store {root}`)" if len(problems) > 1 else ""
        raise UserError(f"store {root} is damaged: {problems[0]}{more}")
    unusable = usability_problem(root, records)
    if unusable is not None:
        raise UserError(unusable)
    store = Store(root=root, settings=settings, shards=records)
    if verify:
        store.mark_checked()
    _say_once_if_unchecked(store)
    return store


_SAID_UNCHECKED: set[str] = set()


def _say_once_if_unchecked(store: Store) -> None:
    """A store committed (in part) before checksums reads as before, by size only: said once per
    store and process, not per epoch or shard."""
    old = sum(not (r.parquet_crc32 and r.safetensors_crc32) for r in store.shards)
    key = str(store.root.resolve())
    if old and key not in _SAID_UNCHECKED:
        _SAID_UNCHECKED.add(key)
        log.warning("store %s: %d of %d shards were committed without content checksums (by an older peagle), "
                    "so only their sizes are checked when read; `peagle store verify --store %s` checks their "
                    "sha256", store.root, old, len(store.shards), store.root)


def check_shards(root: Path, records: list[S.ShardRecord], *, verify: bool) -> list[str]:
    """Problems with the committed shards' files: missing, wrong size, or (verify) wrong sha256 or
    crc32 (both from one read)."""
    problems = []
    for r in records:
        for field, size, digest in (("parquet", r.parquet_bytes, r.parquet_sha256),
                                    ("safetensors", r.safetensors_bytes, r.safetensors_sha256)):
            rel, path = getattr(r, field), shard_file(root, r, field)
            if not path.exists():
                problems.append(f"{rel} is missing")
            elif path.stat().st_size != size:
                problems.append(f"{rel} has {path.stat().st_size} bytes, its commit record says {size}")
            elif verify:
                sha, crc = file_digests(path)
                if sha != digest:
                    problems.append(f"{rel} sha256 does not match its commit record")
                elif r.crc32_of(rel) and crc != r.crc32_of(rel):
                    problems.append(f"{rel} crc32 does not match its commit record")
    return problems


def write_bytes_atomic(root: Path, rel: str, data: bytes) -> None:
    """Small store files (vocab, inputs registry) go through the same atomic path (and the same rule:
    ``contained.inside``)."""
    path = inside(root, rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, data)


def remove_stale_store_temps(root: str | os.PathLike) -> None:
    """Delete the temp files killed writers left in the store's directories (``atomic.remove_stale_temps``),
    each directory inside the store (``contained.inside``)."""
    root = Path(root)
    for sub in (S.SHARDS_DIR, S.COMMITS_DIR, S.INPUTS_DIR):
        remove_stale_temps(inside(root, sub))
    remove_stale_temps(root)
