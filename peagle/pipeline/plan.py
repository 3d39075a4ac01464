"""Work planning for extract: which records form which shard, and which worker owns which shard.

The split is a pure function of the input (docs/store.md "Planning"): the records of each input file are
cut into runs of ``records_per_shard`` consecutive records, and each file owns a contiguous range of
global shard indices. The range is fixed the first time a file (identified by the sha256 of its
content, not its name) is registered in a store, under ``STORE/inputs/<sha256>.json``. Registration
runs under the store lock, so concurrent workers with the same inputs agree, a new file appended to
an existing store gets indices after every existing one, and a known file keeps its range.

Worker partitioning is World-style: worker ``shard_index`` of ``num_shards`` takes every global shard
``s`` with ``s % num_shards == shard_index``.

Everything except ``read_registrations`` and ``register_inputs`` is pure and does no I/O.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from peagle.pipeline.atomic import atomic_write_json, file_lock
from peagle.pipeline.store import LOCK_FILE
from peagle.schemas import store as S
from peagle.schemas.errors import UserError


@dataclass(frozen=True, kw_only=True)
class InputFile:
    """One input file as this run sees it."""

    path: str  # as given (this machine's path)
    sha256: str  # content hash: the file's identity in the store
    num_records: int


@dataclass(frozen=True, kw_only=True)
class InputRegistration:
    """A file's place in a store: global shards [first_shard, end_shard) hold its records in order."""

    sha256: str
    name: str  # basename at first registration (recorded in commit records)
    num_records: int
    records_per_shard: int
    first_shard: int
    end_shard: int


@dataclass(frozen=True, kw_only=True)
class PlannedShard:
    """One unit of work: records [first_record, end_record) of one input file -> shard ``index``."""

    index: int
    input_path: str
    input_name: str
    first_record: int
    end_record: int

    @property
    def num_records(self) -> int:
        return self.end_record - self.first_record


def record_ranges(num_records: int, records_per_shard: int) -> list[tuple[int, int]]:
    """``[first, end)`` record ranges of a file's shards: full runs of ``records_per_shard``, then the rest."""
    assert records_per_shard >= 1
    return [(first, min(first + records_per_shard, num_records))
            for first in range(0, num_records, records_per_shard)]


def num_shards_for(num_records: int, records_per_shard: int) -> int:
    return -(-num_records // records_per_shard)


def assign_registrations(existing: list[InputRegistration], files: list[InputFile],
                         records_per_shard: int) -> list[InputRegistration]:
    """The registrations that ``files`` need on top of ``existing`` (new files only, in order).

    A known file (same sha256) keeps its range; it must have been registered with the same
    ``records_per_shard``, or its shards would mean other records now.

    Raises:
        UserError: a known file was registered with another records-per-shard value.
    """
    by_hash = {r.sha256: r for r in existing}
    next_shard = max((r.end_shard for r in existing), default=0)
    new: list[InputRegistration] = []
    for f in files:
        known = by_hash.get(f.sha256)
        if known is not None:
            if known.records_per_shard != records_per_shard:
                raise UserError(f"{f.path} is already in the store with samples_per_shard="
                                f"{known.records_per_shard}, this run asks for samples_per_shard="
                                f"{records_per_shard}; use --samples-per-shard {known.records_per_shard}")
            assert known.num_records == f.num_records, (known, f)  # same content, same count
            continue
        reg = InputRegistration(sha256=f.sha256, name=Path(f.path).name, num_records=f.num_records,
                                records_per_shard=records_per_shard, first_shard=next_shard,
                                end_shard=next_shard + num_shards_for(f.num_records, records_per_shard))
        by_hash[f.sha256] = reg
        new.append(reg)
        next_shard = reg.end_shard
    return new


def plan_shards(files: list[InputFile], registrations: list[InputRegistration]) -> list[PlannedShard]:
    """Every shard of ``files`` (each file once, in order), given the store's registrations."""
    by_hash = {r.sha256: r for r in registrations}
    shards: list[PlannedShard] = []
    seen: set[str] = set()
    for f in files:
        if f.sha256 in seen:
            continue
        seen.add(f.sha256)
        reg = by_hash[f.sha256]
        for offset, (first, end) in enumerate(record_ranges(reg.num_records, reg.records_per_shard)):
            shards.append(PlannedShard(index=reg.first_shard + offset, input_path=f.path,
                                       input_name=reg.name, first_record=first, end_record=end))
    return shards


def shards_of_worker(shards: list[PlannedShard], shard_index: int, num_shards: int) -> list[PlannedShard]:
    """Worker ``shard_index`` of ``num_shards`` takes every global shard s with s % num_shards == shard_index."""
    assert 0 <= shard_index < num_shards
    return [s for s in shards if s.index % num_shards == shard_index]


# --------------------------------------------------------------------------------------------------
# The registry in the store (I/O)


def registration_path(root: str | os.PathLike, sha256: str) -> Path:
    return Path(root) / S.INPUTS_DIR / f"{sha256}.json"


def read_registrations(root: str | os.PathLike) -> list[InputRegistration]:
    """The store's registered input files (none when the store does not exist yet)."""
    regs = []
    for p in sorted((Path(root) / S.INPUTS_DIR).glob("[0-9a-f]*.json")):
        try:
            regs.append(InputRegistration(**json.loads(p.read_text())))
        except (OSError, json.JSONDecodeError, TypeError) as err:
            raise UserError(f"input registration {p} is unreadable ({err})") from err
    return sorted(regs, key=lambda r: r.first_shard)


def register_inputs(root: str | os.PathLike, files: list[InputFile],
                    records_per_shard: int) -> list[InputRegistration]:
    """Register ``files`` in the store (once, under the store lock); returns every registration.

    All files of one run are registered in one lock hold, so workers started with the same command
    agree on the ranges whichever of them comes first.
    """
    root = Path(root)
    (root / S.INPUTS_DIR).mkdir(parents=True, exist_ok=True)
    with file_lock(root / LOCK_FILE):
        existing = read_registrations(root)
        new = assign_registrations(existing, files, records_per_shard)
        for reg in new:
            atomic_write_json(registration_path(root, reg.sha256), asdict(reg))
    return existing + new
