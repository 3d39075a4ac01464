"""Reading and writing the shard store (docs/store.md): settings, shard commits, manifest, checks.

Writers: ``init_store`` (creates or checks ``store.json``), ``commit_shard`` (two files, then the
commit record, then the manifest), all crash-safe. Readers: ``open_store`` sees exactly the shards
that have a commit record and checks sizes (fast) or sha256 (``verify=True``); reading the samples
of an opened store is :mod:`peagle.pipeline.raw_reader` (as stored) and
:mod:`peagle.pipeline.store_reader` (in training coordinates).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peagle.pipeline.atomic import (
    atomic_write_bytes,
    atomic_write_json,
    canonical_json,
    create_exclusive,
    file_lock,
    publish,
    raise_if_disk_full,
    temp_path_for,
)
from peagle.pipeline.failpoints import failpoint
from peagle.schemas import store as S
from peagle.schemas.errors import UserError

LOCK_FILE = ".lock"


def init_store(root: str | os.PathLike, settings: S.StoreSettings) -> Path:
    """Create the store (or join an existing one) with these settings.

    Raises UserError naming both values when the store was made with other settings.
    """
    root = Path(root)
    for sub in ("", S.COMMITS_DIR, S.SHARDS_DIR, S.INPUTS_DIR):
        try:
            (root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise_if_disk_full(err, root / sub)
            raise UserError(f"cannot create store directory {root / sub}: {err.strerror}") from err
    create_exclusive(root / S.STORE_SETTINGS_FILE, canonical_json(settings.to_dict()))
    existing = read_settings(root)
    check_same_settings(existing, settings, root)
    return root


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


def check_same_settings(existing: S.StoreSettings, wanted: S.StoreSettings, root: Path) -> None:
    """One line naming the first field that differs, with both values."""
    # hidden_dtype in full: to_dict leaves out the default (bf16)
    old = _flatten({**existing.to_dict(), "hidden_dtype": existing.hidden_dtype})
    new = _flatten({**wanted.to_dict(), "hidden_dtype": wanted.hidden_dtype})
    # The target's identity first: with another target everything differs, and its path is the
    # value a user recognises.
    first = [f"target.{f}" for f in ("path", "content_hash", "architecture", "dtype")]
    for key in first + sorted((set(old) | set(new)) - set(first)):
        if old.get(key) != new.get(key):
            hint = (f" (or convert it: `peagle store convert --store {root} --hidden-dtype {new[key]} --out NEW`)"
                    if key == "hidden_dtype" else "")
            raise UserError(f"store {root} was made with {key}={old.get(key)!r}, this run asks for "
                            f"{key}={new.get(key)!r}; use another --out or the store's settings{hint}")


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


def write_shard_file(root: Path, rel: str, write) -> tuple[int, str]:
    """Write one shard file via ``write(tmp_path)``, publish it atomically; returns (bytes, sha256)."""
    final = root / rel
    tmp = temp_path_for(final)
    try:
        write(tmp)
        failpoint("extract.write")
        size, digest = tmp.stat().st_size, sha256_file(tmp)
        publish(tmp, final)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise_if_disk_full(err, final)
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size, digest


def commit_shard(root: str | os.PathLike, record: S.ShardRecord) -> None:
    """Make a shard visible: write its commit record atomically, then refresh the manifest.

    The shard's two files must already be in place (``write_shard_file``). A crash before the
    commit record leaves files that no reader sees; the re-run rewrites them identically.
    """
    root = Path(root)
    failpoint("extract.before_commit")
    atomic_write_json(root / S.commit_name(record.index), record.to_dict())
    failpoint("extract.after_commit")
    rebuild_manifest(root)


def list_commits(root: str | os.PathLike) -> list[S.ShardRecord]:
    """Every committed shard, sorted by index. Temp files and stray shards are ignored."""
    records = []
    for p in sorted((Path(root) / S.COMMITS_DIR).glob("[0-9]*.json")):
        try:
            records.append(S.ShardRecord.from_dict(json.loads(p.read_text())))
        except (OSError, json.JSONDecodeError, TypeError) as err:
            raise UserError(f"commit record {p} is unreadable ({err}); delete it to redo that shard") from err
    return records


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
    with file_lock(root / LOCK_FILE):
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

    def read_rows(self, index: int, columns: list[str] | None = None):
        """The shard's Parquet table (pyarrow), optionally only some columns."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = self.root / self.shard(index).parquet
        try:
            return pq.read_table(path, columns=columns)
        except (OSError, pa.ArrowException) as err:
            raise damaged(path, err) from err


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
    return Store(root=root, settings=settings, shards=records)


def check_shards(root: Path, records: list[S.ShardRecord], *, verify: bool) -> list[str]:
    """Problems with the committed shards' files: missing, wrong size, or (verify) wrong sha256."""
    problems = []
    for r in records:
        for rel, size, digest in ((r.parquet, r.parquet_bytes, r.parquet_sha256),
                                  (r.safetensors, r.safetensors_bytes, r.safetensors_sha256)):
            path = root / rel
            if not path.exists():
                problems.append(f"{rel} is missing")
            elif path.stat().st_size != size:
                problems.append(f"{rel} has {path.stat().st_size} bytes, its commit record says {size}")
            elif verify and sha256_file(path) != digest:
                problems.append(f"{rel} sha256 does not match its commit record")
    return problems


def write_bytes_atomic(root: Path, rel: str, data: bytes) -> None:
    """Small store files (vocab, inputs registry) go through the same atomic path."""
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(root / rel, data)
